"""``det-lab data import DIR NAME``: version a directory already on disk as a DVC dataset.

One command does what the README's by-hand recipe does: a git + DVC repository for the dataset
on the volume (``datasets/<project>/git/<NAME>.git``), the files pushed to the project's DVC
remote, and ``NAME`` registered, so trials and ``det-lab data pull NAME`` use it like any other
dataset. Importing again adds a new revision of the same repository.
"""

from __future__ import annotations

import re
from pathlib import Path

from det_lab.data.errors import DataError
from det_lab.data.publish import publish_directory
from det_lab.data.pull import DatasetIdentity, DatasetSpec
from det_lab.data.registry import load_registry, register, require_writable
from det_lab.data.status import resolve
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout

__all__ = ["import_directory"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


def import_directory(settings: LabSettings, src: Path, name: str, project: str, *, replace: bool = False,
                     message: str | None = None) -> tuple[DatasetSpec, DatasetIdentity]:
    """Version ``src`` as dataset ``name`` of ``project``, register it, and return what it resolves to.

    Everything is checked before anything is written: the directory (a non-empty directory),
    the name, the project, and that the registry can be written. An existing ``name`` is kept
    unless ``replace`` (then the import is its new revision).

    Raises:
        DataError: one line naming what is wrong.
    """
    src = Path(src).expanduser()
    if not src.is_dir():
        raise DataError(f"{src}: no such directory")
    if not _NAME.fullmatch(name):
        raise DataError(f"dataset name {name!r} may only hold letters, digits, '-', '_' and '.'")
    settings.project(project)
    layout = VolumeLayout.from_settings(settings)
    if not layout.state.is_dir():
        raise DataError(f"{layout.state} does not exist: run 'det-lab init' first")
    registry = load_registry(settings)
    if name in registry and not replace:
        raise DataError(f"dataset {name!r} is already registered as {registry[name]}; pass --replace to "
                        "import this directory as its new revision")
    require_writable(settings)
    if not any(p.is_file() for p in src.rglob("*")):
        raise DataError(f"{src}: the directory holds no files")
    spec = publish_directory(settings, project, name, src, message or f"{name}: imported from {src.resolve()}")
    if load_registry(settings).get(name) != spec:
        register(settings, name, spec, replace=True)
    return spec, resolve(spec)
