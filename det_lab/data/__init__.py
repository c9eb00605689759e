"""Datasets on the shared volume, pulled once and read by every trial on every machine.

The verbs, in the spirit of ``dvc.api``::

    from det_lab import data
    ds = data.pull("vla-demo")            # or data.pull(DatasetSpec(...))
    ds.path, ds.identity                  # read-only directory, lineage for trackers/checkpoints
    data.register("scenes", DatasetSpec(project="3dgs", repo=..., path="data/garden", rev="v2"))
    data.status("vla-demo"); data.list_volume()
"""

from __future__ import annotations

from det_lab.data.errors import DataError
from det_lab.data.pull import DatasetIdentity, DatasetSpec, PulledDataset
from det_lab.data.pull import pull as _pull
from det_lab.data.registry import load_registry, lookup, require_writable
from det_lab.data.registry import register as _register
from det_lab.data.status import DatasetStatus, ProjectListing, resolve
from det_lab.data.status import list_volume as _list_volume
from det_lab.data.status import status as _status
from det_lab.settings import LabSettings, load_settings

__all__ = [
    "DataError", "DatasetIdentity", "DatasetSpec", "DatasetStatus", "ProjectListing", "PulledDataset",
    "list_volume", "load_registry", "pull", "register", "register_plan", "resolve", "status",
]


def _spec(dataset: str | DatasetSpec, settings: LabSettings) -> DatasetSpec:
    return lookup(settings, dataset) if isinstance(dataset, str) else dataset


def pull(dataset: str | DatasetSpec, settings: LabSettings | None = None, *, progress: bool | None = None) -> PulledDataset:
    """Make a registered name or a spec ready to read; see :func:`det_lab.data.pull.pull`."""
    settings = settings or load_settings()
    return _pull(_spec(dataset, settings), settings, progress=progress)


def register(name: str, spec: DatasetSpec, settings: LabSettings | None = None, *, replace: bool = False) -> DatasetIdentity:
    """Check that ``spec`` resolves (repo, revision, DVC path), then record it as ``name``."""
    settings = settings or load_settings()
    settings.project(spec.project)
    load_registry(settings)  # a damaged registry or a read-only volume: refused before any work
    require_writable(settings)
    identity = resolve(spec)
    _register(settings, name, spec, replace=replace)
    return identity


def register_plan(name: str, spec: DatasetSpec, settings: LabSettings | None = None, *,
                  replace: bool = False) -> tuple[DatasetIdentity, DatasetSpec | None]:
    """What :func:`register` would record, refused as it would refuse it: the identity ``spec``
    resolves to now and the registration of ``name`` it replaces (None: none); writes nothing."""
    settings = settings or load_settings()
    settings.project(spec.project)
    load_registry(settings)
    require_writable(settings)
    identity = resolve(spec)
    return identity, _register(settings, name, spec, replace=replace, dry_run=True)


def status(dataset: str | DatasetSpec, settings: LabSettings | None = None) -> DatasetStatus:
    settings = settings or load_settings()
    return _status(_spec(dataset, settings), settings)


def list_volume(settings: LabSettings | None = None) -> list[ProjectListing]:
    return _list_volume(settings or load_settings())
