"""det_lab's public surface as data (what :mod:`det_lab.public` declares, read off the code), and the
rules by which a later surface is compatible with a released one.

    python -m tests.surface --write     # at a release: tests/fixtures/surface/<version>.json

A release records its surface; ``tests/test_public_surface.py`` then holds every later commit to it:
nothing recorded may disappear or change incompatibly unless :data:`det_lab.public.DEPRECATED` names it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "surface"


def _params(obj: Any) -> list[list[Any]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in sig.parameters.values()]


def python_surface() -> dict[str, dict[str, Any]]:
    """``module.name`` -> its kind, parameters (callables) and public members (classes)."""
    from det_lab.public import PYTHON

    out: dict[str, dict[str, Any]] = {}
    for module_name, names in PYTHON.items():
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            entry: dict[str, Any] = {"kind": "class" if inspect.isclass(obj) else
                                     "function" if callable(obj) else "value"}
            if callable(obj):
                entry["params"] = _params(obj)
            if inspect.isclass(obj):
                entry["members"] = sorted(m for m in dir(obj) if not m.startswith("_"))
            out[f"{module_name}.{name}"] = entry
    return out


def cli_surface() -> dict[str, list[str]]:
    """``det-lab <command ...>`` -> its parameters (option spellings, and arguments by name)."""
    import typer.main

    from det_lab.cli.app import app

    out: dict[str, list[str]] = {}

    def walk(command: Any, path: list[str]) -> None:
        params: list[str] = []
        for p in command.params:
            params += list(p.opts) + list(getattr(p, "secondary_opts", []) or []) if p.param_type_name == "option" \
                else [f"<{p.name}>"]
        out[" ".join(path)] = sorted(params)
        for name, sub in sorted((getattr(command, "commands", {}) or {}).items()):
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), ["det-lab"])
    return out


def config_surface() -> dict[str, list[str]]:
    """Each config file's keys, dotted (the lab config, cluster.yaml, slurm.yaml)."""
    from pydantic import BaseModel

    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings
    from det_lab.slurm.settings import SlurmSettings

    def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
        found = []
        for name, field in model.model_fields.items():
            found.append(prefix + name)
            annotation = field.annotation
            if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
                found += keys(annotation, f"{prefix}{name}.")
        return found

    return {"lab": keys(LabSettings), "cluster": keys(ClusterSettings), "slurm": keys(SlurmSettings)}


def current() -> dict[str, Any]:
    """The surface of the code as it is now."""
    import det_lab
    from det_lab.settings import ENV_VARS

    return {"version": det_lab.__version__, "python": python_surface(), "cli": cli_surface(),
            "env": sorted(ENV_VARS), "config": config_surface()}


def _compatible_params(old: list[list[Any]], new: list[list[Any]]) -> str | None:
    """Why a call that worked with ``old`` parameters may fail with ``new`` ones (None: it cannot)."""
    now = {p[0]: p for p in new}
    for name, kind, had_default in old:
        if name not in now:
            return f"parameter {name!r} is gone"
        if now[name][1] != kind:
            return f"parameter {name!r} changed from {kind} to {now[name][1]}"
        if had_default and not now[name][2]:
            return f"parameter {name!r} lost its default"
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    if [p[0] for p in old if p[1] in positional] != [p[0] for p in new if p[1] in positional][
            :len([p for p in old if p[1] in positional])]:
        return "its positional parameters changed order"
    names = {p[0] for p in old}
    for name, kind, has_default in new:
        if name not in names and not has_default and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            return f"new parameter {name!r} has no default"
    return None


def breaks(released: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What ``now`` removed or changed incompatibly from ``released``, unless deprecated."""
    from det_lab.public import DEPRECATED

    def deprecated(spelling: str) -> bool:
        return any(spelling == old or spelling.startswith(old + ".") for old in DEPRECATED)

    problems = []
    for name, entry in released["python"].items():
        if deprecated(name):
            continue
        cur = now["python"].get(name)
        if cur is None:
            problems.append(f"{name}: removed")
            continue
        if entry.get("params") is not None and cur.get("params") is not None:
            why = _compatible_params(entry["params"], cur["params"])
            if why:
                problems.append(f"{name}: {why}")
        for member in set(entry.get("members", [])) - set(cur.get("members", [])):
            problems.append(f"{name}.{member}: removed")
    for command, params in released["cli"].items():
        if command not in now["cli"]:
            problems.append(f"{command}: command removed")
            continue
        for p in set(params) - set(now["cli"][command]):
            if not deprecated(f"{command} {p}"):
                problems.append(f"{command} {p}: removed")
    problems += [f"environment variable {v}: no longer read" for v in set(released["env"]) - set(now["env"])]
    for file, keys in released["config"].items():
        problems += [f"{file} config key {k}: no longer accepted" for k in set(keys) - set(now["config"][file])]
    return sorted(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the surface of this release")
    args = parser.parse_args(argv)
    surface = current()
    if args.write:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path = FIXTURES / f"{surface['version']}.json"
        path.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
        print(path)
    else:
        print(json.dumps(surface, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
