"""``det-lab data import DIR NAME``: version a directory already on disk as a DVC dataset.

One command does what the README's by-hand recipe does: a git + DVC repository for the dataset
on the volume (``datasets/<project>/git/<NAME>.git``), the files pushed to the project's DVC
remote, and ``NAME`` registered, so trials and ``det-lab data pull NAME`` use it like any other
dataset. Importing again adds a new revision of the same repository.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from det_lab.data.errors import DataError
from det_lab.data.publish import dataset_repo, publish_directory
from det_lab.data.pull import DatasetIdentity, DatasetSpec
from det_lab.data.registry import load_registry, register, require_writable
from det_lab.data.status import resolve
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout

__all__ = ["ImportPlan", "import_directory", "import_plan"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ImportPlan:
    """What ``det-lab data import`` would write: the repository it creates or commits a new
    revision to, the files it copies and pushes, and the registration it adds or replaces."""

    src: Path
    name: str
    spec: DatasetSpec  # the registration NAME gets
    new_repository: bool  # False: a new revision on top of the repository's 'main'
    files: int
    size: int  # bytes
    replaces: DatasetSpec | None  # NAME's registration now, overwritten (None: NAME is new)

    def lines(self) -> list[str]:
        """The plan as text, one thing written per line."""
        how = "create" if self.new_repository else "commit a new revision on 'main' of"
        out = [f"would {how} {self.spec.repo} with {self.files} files ({self.size} bytes) copied from {self.src}, "
               f"pushed to the project's DVC remote"]
        if self.replaces is None:
            out.append(f"would register {self.name}: {self.spec.repo} {self.spec.path}@{self.spec.rev}")
        elif self.replaces != self.spec:
            out.append(f"would replace the registration of {self.name} ({self.replaces.repo} {self.replaces.path}"
                       f"@{self.replaces.rev}) with {self.spec.repo} {self.spec.path}@{self.spec.rev}")
        else:
            out.append(f"{self.name} stays registered at {self.spec.path}@{self.spec.rev}: it then resolves to the "
                       "new revision")
        return out

    def as_dict(self) -> dict[str, Any]:
        """The plan as ``data import --dry-run --json`` prints it."""
        return {"src": str(self.src), "name": self.name, "registers": asdict(self.spec),
                "new_repository": self.new_repository, "files": self.files, "bytes": self.size,
                "replaces": asdict(self.replaces) if self.replaces else None}


def import_plan(settings: LabSettings, src: Path, name: str, project: str, *, replace: bool = False) -> ImportPlan:
    """Check everything ``import_directory`` needs and return what it would write; writes nothing.

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
    files = [p for p in src.rglob("*") if p.is_file()]
    if not files:
        raise DataError(f"{src}: the directory holds no files")
    bare = dataset_repo(settings, project, name)
    return ImportPlan(src=src.resolve(), name=name, spec=DatasetSpec(project=project, repo=str(bare), path=f"data/{name}",
                                                                     rev="main"),
                      new_repository=not bare.exists(), files=len(files), size=sum(p.stat().st_size for p in files),
                      replaces=registry.get(name))


def import_directory(settings: LabSettings, src: Path, name: str, project: str, *, replace: bool = False,
                     message: str | None = None) -> tuple[DatasetSpec, DatasetIdentity]:
    """Version ``src`` as dataset ``name`` of ``project``, register it, and return what it resolves to.

    Everything is checked before anything is written (:func:`import_plan`): the directory (a
    non-empty directory), the name, the project, and that the registry can be written. An
    existing ``name`` is kept unless ``replace`` (then the import is its new revision).

    Raises:
        DataError: one line naming what is wrong.
    """
    plan = import_plan(settings, src, name, project, replace=replace)
    src = plan.src
    spec = publish_directory(settings, project, name, src, message or f"{name}: imported from {src}")
    if load_registry(settings).get(name) != spec:
        register(settings, name, spec, replace=True)
    return spec, resolve(spec)
