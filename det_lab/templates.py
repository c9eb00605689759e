"""The experiment templates and notebooks shipped with det_lab, found the same way in a git
checkout and in an installed wheel; and ``--set KEY=VALUE`` overrides of an experiment config.

A checkout keeps them at the repository root (``experiment_templates/``, ``notebooks/``), where
``det experiment create <config> experiment_templates/vla`` uses them as they are; a wheel
carries the same files as package data under ``det_lab/_templates/`` and ``det_lab/_notebooks/``
(see ``setup.py``). ``DET_LAB_TEMPLATES`` points at another templates directory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.errors import UserError

TEMPLATES_ENV = "DET_LAB_TEMPLATES"
#: the names templates are known by (help, errors, listings), and their directories
NAMES = {"vla": "vla", "3dgs": "gaussian_splatting", "isaac": "isaac_lab"}
NOTEBOOKS = "notebooks"
#: the file `copy` leaves in a copy: the directory name of the template it came from
ORIGIN_FILE = ".det-lab-template"
#: what `copy` leaves out: interpreter caches
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")

_PACKAGE = Path(__file__).resolve().parent


class TemplateError(UserError, ValueError):
    """An unknown template, or a copy that cannot be made; one line naming the fix."""


@dataclass(frozen=True)
class Template:
    """A template directory and the name det_lab knows it by."""

    name: str
    path: Path

    @property
    def summary(self) -> str:
        """The first sentence-ish line of the template's README (its title), or ''."""
        readme = self.path / "README.md"
        try:
            lines = readme.read_text().splitlines()
        except OSError:
            return ""
        return next((line.lstrip("# ").strip() for line in lines if line.strip()), "")


def _first_dir(*candidates: Path) -> Path | None:
    return next((c for c in candidates if c.is_dir()), None)


def templates_root() -> Path:
    """The directory holding the templates: $DET_LAB_TEMPLATES, the wheel's copy, or the checkout's."""
    env = os.environ.get(TEMPLATES_ENV)
    if env:
        return Path(env).expanduser()
    found = _first_dir(_PACKAGE / "_templates", _PACKAGE.parent / "experiment_templates")
    if found is None:
        raise TemplateError(f"no experiment templates next to {_PACKAGE}: reinstall det-lab, "
                            f"or set {TEMPLATES_ENV} to a directory of templates")
    return found


def notebooks_dir() -> Path:
    """The directory holding the notebooks (the wheel's copy, or the checkout's)."""
    found = _first_dir(_PACKAGE / "_notebooks", _PACKAGE.parent / "notebooks")
    if found is None:
        raise TemplateError(f"no notebooks next to {_PACKAGE}: reinstall det-lab")
    return found


def available() -> list[Template]:
    """The shipped templates under their names (``vla``, ``3dgs``, ``isaac``) and any other
    template directories in :func:`templates_root`, under their directory names."""
    root = templates_root()
    if not root.is_dir():
        return []
    return sorted((Template(name_of(p), p.resolve())
                   for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))),
                  key=lambda t: (list(NAMES).index(t.name) if t.name in NAMES else len(NAMES), t.name))


def names_hint() -> str:
    """``vla, 3dgs, isaac``: the names to offer in help texts and errors."""
    return ", ".join(t.name for t in available()) or ", ".join(NAMES)


def resolve(name: str) -> Path:
    """A template name (``vla``, ``3dgs``, ``isaac``; directory names work too) or a directory
    holding an experiment config, as an absolute path."""
    as_path = Path(name).expanduser()
    if as_path.is_dir():
        return as_path.resolve()
    for t in available():
        if name in (t.name, t.path.name):
            return t.path
    raise TemplateError(f"no template or directory {name!r} (templates: {names_hint()}; "
                        f"'det-lab templates list' shows them)")


def name_of(path: Path) -> str:
    """The name a template directory is known by: ``3dgs`` for ``gaussian_splatting``."""
    return {v: k for k, v in NAMES.items()}.get(path.name, path.name)


def run_argument(path: Path) -> str:
    """What to give ``det-lab run`` for the template directory ``path``: its name where that finds
    it (``vla``), else the path itself."""
    name = name_of(path)
    try:
        if resolve(name) == path.resolve():
            return name
    except TemplateError:
        pass
    return str(path)


def copy(name: str, dest: Path) -> Path:
    """Copy template ``name`` (or ``notebooks``) to the new directory ``dest``, to edit and submit.

    The copy appears whole or not at all: it is made beside ``dest`` and renamed into place.
    """
    source = notebooks_dir() if name == NOTEBOOKS else resolve(name)
    dest = dest.expanduser().absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise TemplateError(f"{dest} already exists; name a new directory")
    if not dest.parent.is_dir():
        raise TemplateError(f"{dest.parent} does not exist; create it first")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        shutil.copytree(source, staging / "t", ignore=_IGNORE)
        if name != NOTEBOOKS:
            (staging / "t" / ORIGIN_FILE).write_text(origin(source) + "\n")
        if dest.exists():
            dest.rmdir()  # empty, checked above
        (staging / "t").rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class Requirement:
    """An optional package a template needs with some hyperparameters, and how to install it."""

    module: str
    install: str
    needed: Callable[[dict[str, Any]], bool]


#: where Isaac Lab's rsl_rl trainer lies in its checkout, and the checkout in Isaac Lab's image
ISAACLAB_TRAIN = Path("scripts/reinforcement_learning/rsl_rl/train.py")
ISAACLAB_DEFAULT = "/workspace/isaaclab"  # DOCKER_ISAACLAB_PATH in Isaac Lab's docker/.env.base


def isaaclab_root(hint: str | None = None) -> Path | None:
    """Isaac Lab's checkout if its rsl_rl ``train.py`` is there: ``hint``, ``$ISAACLAB_PATH``, /workspace/isaaclab."""
    for cand in (hint, os.environ.get("ISAACLAB_PATH"), ISAACLAB_DEFAULT):
        if cand and (Path(cand) / "isaaclab.sh").is_file() and (Path(cand) / ISAACLAB_TRAIN).is_file():
            return Path(cand)
    return None


def _runs_standin(hparams: dict[str, Any]) -> bool:
    return not hparams.get("require_isaaclab") and isaaclab_root(hparams.get("isaaclab_path")) is None


RSL_RL_INSTALL = "pip install 'tensordict>=0.15,<0.16' && pip install --no-deps 'rsl-rl-lib>=5.5,<6'"
#: LeRobot 0.4's pi0/pi0.5 build only on its transformers fork (its ``pi`` extra; modeling_pi05.py:577-584
#: imports transformers.models.siglip.check, absent from PyPI's transformers, and fails with "An incorrect
#: transformer version is used" after building 4 B parameters)
PI_TRANSFORMERS = ("LeRobot's transformers fork that LeRobot 0.4's pi0/pi0.5 need (PyPI's transformers lacks it): "
                   "pip install 'transformers @ git+https://github.com/huggingface/transformers.git@fix/lerobot_openpi' "
                   "(LeRobot's pi extra), or, on Python 3.12+, LeRobot 0.5 or newer, whose pi0/pi0.5 run on "
                   "PyPI's transformers (docs/researchers/smolvla.md, 'pi0 and pi0.5': how it installs beside "
                   "Determined)")


def _lerobot_pi(hparams: dict[str, Any]) -> bool:
    policy = hparams.get("policy")
    if not isinstance(policy, dict) or policy.get("name", policy.get("type")) not in ("pi0", "pi05"):
        return False
    try:
        version = importlib.metadata.version("lerobot")
    except importlib.metadata.PackageNotFoundError:
        return False
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    return major_minor < (0, 5)


#: by template directory: what its trials import only in some configurations
REQUIREMENTS: dict[str, tuple[Requirement, ...]] = {
    "isaac_lab": (Requirement("rsl_rl", RSL_RL_INSTALL, _runs_standin),),
    "vla": (Requirement("transformers.models.siglip.check", PI_TRANSFORMERS, _lerobot_pi),),
    "gaussian_splatting": (Requirement("gsplat", "pip install gsplat (CUDA; see the template's README)",
                                       lambda hp: hp.get("backend") == "gsplat"),),
}


def origin(template: Path) -> str:
    """The directory name of the shipped template ``template`` is, or was copied from ('' for
    neither): the name itself, the file :func:`copy` leaves in a copy, or (a copy made before copies
    named it) a ``train.py`` byte-equal to a shipped template's."""
    if template.name in NAMES.values():
        return template.name
    try:
        recorded = (template / ORIGIN_FILE).read_text().strip()
    except OSError:
        recorded = ""
    if recorded in NAMES.values():
        return recorded
    try:
        train = (template / "train.py").read_bytes()
    except OSError:
        return ""
    for t in available():
        with contextlib.suppress(OSError):
            if (t.path / "train.py").read_bytes() == train:
                return t.path.name
    return ""


def missing_requirements(template: Path, hparams: dict[str, Any]) -> list[str]:
    """One line per optional package the run needs and this interpreter lacks, with its install
    command; checked before a run starts, so it does not fail after minutes of setup. A copy of a
    template (``det-lab templates copy``) is checked as the template it came from."""
    name = name_of(template)
    return [f"template {name} needs {r.module} with these hyperparameters; install it: {r.install}"
            for r in REQUIREMENTS.get(origin(template), ())
            if r.needed(hparams) and not _importable(r.module)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def apply_overrides(conf: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Apply ``KEY=VALUE`` assignments with dotted keys to an experiment config, in place.

    Values are parsed as YAML (``50`` is a number, ``[a, b]`` a list, ``null`` None); missing
    mappings on the way are created. ``data.det_lab.max_length.batches=50`` sets
    ``conf["data"]["det_lab"]["max_length"]["batches"] = 50``, and with it ASHA's
    ``searcher.max_time`` (which sets a trial's length when present) unless that is set too.
    """
    import yaml

    keys = [item.partition("=")[0].strip() for item in assignments]
    for item in assignments:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise TemplateError(f"--set {item!r}: expected KEY=VALUE with a dotted KEY, "
                                f"e.g. data.det_lab.max_length.batches=50")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise TemplateError(f"--set {key}: the value is not valid YAML ({exc.problem}); quote it") from None
        node = conf
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise TemplateError(f"--set {key}: {where} is a {type(child).__name__}, not a mapping")
            node = child
        node[parts[-1]] = value
    _length_follows(conf, keys)
    return conf


def _length_follows(conf: dict[str, Any], keys: list[str]) -> None:
    """A new ``data.det_lab.max_length`` also becomes ASHA's ``max_time`` (same unit)."""
    searcher = conf.get("searcher")
    if "searcher.max_time" in keys or not isinstance(searcher, dict) or not searcher.get("max_time"):
        return
    if not any(k.startswith("data.det_lab.max_length") for k in keys):
        return
    length = ((conf.get("data") or {}).get("det_lab") or {}).get("max_length")
    if isinstance(length, dict) and isinstance(length.get(searcher.get("time_metric")), int):
        searcher["max_time"] = length[searcher["time_metric"]]
