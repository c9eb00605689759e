"""Named datasets: ``det-lab data register vla-demo --project vla --repo ... --path ...``.

The registry is one YAML file on the volume (``.det-lab/datasets.yaml``), so a name registered
on one machine resolves on every machine. Writes are atomic and serialised by a volume lock.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import yaml

from det_lab.data.errors import DataError
from det_lab.data.lock import VolumeLock
from det_lab.data.pull import DatasetSpec
from det_lab.settings import LabConfigError, LabSettings, check_writable, read_yaml_mapping
from det_lab.volume import VolumeLayout, atomic_write_text


def registry_file(settings: LabSettings) -> Path:
    return VolumeLayout.from_settings(settings).state / "datasets.yaml"


def load_registry(settings: LabSettings) -> dict[str, DatasetSpec]:
    """Every registered dataset by name; a damaged file is one :class:`DataError` naming it."""
    path = registry_file(settings)
    if not path.exists():
        return {}
    try:
        raw = read_yaml_mapping(path, DataError)
        return {str(name): DatasetSpec(**entry) for name, entry in raw.items()}
    except (DataError, TypeError) as exc:
        problem = str(exc).removeprefix(f"{path}: ").removeprefix(str(path))
        if isinstance(exc, TypeError):
            problem = "each entry must be {project, repo, path, rev}"
        raise DataError(f"{path}: damaged dataset registry ({problem.strip(': ')}): restore it from a backup, "
                        "or move it aside and register the datasets again with 'det-lab data register'") from None


def require_writable(settings: LabSettings) -> None:
    """Refuse, before any work, to register on a volume whose registry cannot be written."""
    path = registry_file(settings)
    try:
        check_writable(path.parent)
    except LabConfigError as exc:
        raise DataError(f"cannot register a dataset: {exc}") from None


def lookup(settings: LabSettings, name: str) -> DatasetSpec:
    """The spec registered as ``name``; a clear error listing the known names otherwise."""
    registry = load_registry(settings)
    if name not in registry:
        known = ", ".join(sorted(registry)) or "none yet: 'det-lab data register' or 'det-lab init --demo'"
        raise DataError(f"no dataset named {name!r} (registered: {known})")
    return registry[name]


def register(settings: LabSettings, name: str, spec: DatasetSpec, *, replace: bool = False,
             dry_run: bool = False) -> DatasetSpec | None:
    """Record ``spec`` under ``name`` (``dry_run``: check only, write nothing); returns the
    registration it replaces (None: ``name`` was new or held ``spec``). The caller validates the
    spec (see ``data.inspect``)."""
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise DataError(f"dataset name {name!r} may only hold letters, digits, '-', '_' and '.'")
    settings.project(spec.project)
    path = registry_file(settings)
    if not path.parent.is_dir():
        raise DataError(f"{path.parent} does not exist: run 'det-lab init' first")
    with nullcontext() if dry_run else VolumeLock(path.with_suffix(".lock")):
        registry = load_registry(settings)
        if name in registry and registry[name] != spec and not replace:
            raise DataError(f"dataset {name!r} is already registered as {registry[name]}; pass --replace")
        before = registry.get(name)
        if not dry_run:
            registry[name] = spec
            text = yaml.safe_dump({n: asdict(s) for n, s in sorted(registry.items())}, sort_keys=False)
            atomic_write_text(path, text)
    return None if before == spec else before
