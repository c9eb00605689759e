"""Pinned dataset revisions: ``det-lab data pin NAME`` keeps a revision's objects in the shared
cache whatever ``det-lab data gc`` finds (a paper's dataset, a baseline's).

The pins are one YAML file on the volume (``.det-lab/data-pins.yaml``), keyed by a label, each
entry the revision's identity (project, repository, commit, path, DVC hash). Writes are atomic
and serialised by a volume lock, as the registry's are.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import yaml

from det_lab.data.errors import DataError
from det_lab.data.lock import VolumeLock
from det_lab.data.pull import DatasetIdentity
from det_lab.settings import LabSettings, read_yaml_mapping
from det_lab.volume import VolumeLayout, atomic_write_text


def pins_file(settings: LabSettings) -> Path:
    return VolumeLayout.from_settings(settings).state / "data-pins.yaml"


def load_pins(settings: LabSettings) -> dict[str, DatasetIdentity]:
    """Every pin by label; a damaged file is one :class:`DataError` naming it."""
    path = pins_file(settings)
    if not path.exists():
        return {}
    try:
        raw = read_yaml_mapping(path, DataError)
        return {str(label): DatasetIdentity(**entry) for label, entry in raw.items()}
    except (DataError, TypeError):
        raise DataError(f"{path}: damaged pins file (each entry must be a dataset identity: project, repo, rev, "
                        "commit, path, md5, size, nfiles): restore it from a backup, or fix it by hand") from None


def pin(settings: LabSettings, label: str, identity: DatasetIdentity) -> None:
    """Keep ``identity``'s objects in the cache under ``label`` (replacing an earlier pin of it)."""
    _change(settings, lambda pins: pins.update({label: identity}))


def unpin(settings: LabSettings, label: str) -> None:
    """Drop the pin ``label``; a :class:`DataError` listing the pins when there is none."""
    def drop(pins: dict[str, DatasetIdentity]) -> None:
        if label not in pins:
            raise DataError(f"no pin named {label!r} (pinned: {', '.join(sorted(pins)) or 'none'})")
        del pins[label]

    _change(settings, drop)


def _change(settings: LabSettings, edit) -> None:
    path = pins_file(settings)
    if not path.parent.is_dir():
        raise DataError(f"{path.parent} does not exist: run 'det-lab init' first")
    with VolumeLock(path.with_suffix(".lock")):
        pins = load_pins(settings)
        edit(pins)
        atomic_write_text(path, yaml.safe_dump({k: asdict(v) for k, v in sorted(pins.items())}, sort_keys=False))


def pin_dataset(settings: LabSettings, name: str, *, remove: bool = False) -> DatasetIdentity | None:
    """Pin the revision registered dataset ``name`` resolves to now, under the label ``name``
    (``remove``: drop that pin; returns None)."""
    from det_lab.data.registry import lookup
    from det_lab.data.status import resolve

    if remove:
        unpin(settings, name)
        return None
    identity = resolve(lookup(settings, name))
    pin(settings, name, identity)
    return identity
