"""What is where: one dataset's state, and the whole volume's datasets with their sizes."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any
from pathlib import Path

from det_lab.data.git import clone_at, resolve_revision
from det_lab.data.pull import (
    SNAPSHOT_MARKER, DatasetIdentity, DatasetSpec, _Out, _manifest, _read_out, cache_object,
)
from det_lab.data.registry import load_registry
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout, disk_usage


def resolve(spec: DatasetSpec) -> DatasetIdentity:
    """The identity ``spec`` names right now (commit and DVC hash), checking repo, rev and path."""
    commit = resolve_revision(spec.repo, spec.rev)
    with tempfile.TemporaryDirectory(prefix="det-lab-resolve-") as tmp:
        ws = Path(tmp) / "ws"
        clone_at(spec.repo, commit, ws)
        out = _read_out(ws, spec)
    return DatasetIdentity(spec.project, spec.repo, spec.rev, commit, spec.path, out.md5, out.size, out.nfiles)


@dataclass(frozen=True)
class DatasetStatus:
    identity: DatasetIdentity
    snapshot: Path | None  # set when a complete snapshot exists
    cached_files: int  # objects of this revision already in the shared cache
    total_files: int

    def as_dict(self) -> dict[str, Any]:
        """What ``det-lab data status --json`` prints: the identity, the cache and the snapshot."""
        return {"identity": asdict(self.identity), "cached_files": self.cached_files, "total_files": self.total_files,
                "snapshot": str(self.snapshot) if self.snapshot else None}


def status(spec: DatasetSpec, settings: LabSettings) -> DatasetStatus:
    identity = resolve(spec)
    layout = VolumeLayout.from_settings(settings)
    out = _Out(identity.md5, identity.size, identity.nfiles)
    snap = layout.snapshots(spec.project) / out.stem
    cache = layout.dvc_cache(spec.project)
    entries = _manifest(cache, out) if out.is_dir else [{"md5": out.md5}]
    cached = sum(cache_object(cache, e["md5"]).is_file() for e in entries or [])
    return DatasetStatus(identity, snap if (snap / SNAPSHOT_MARKER).is_file() else None, cached, out.nfiles)


@dataclass
class ProjectListing:
    project: str
    remote_bytes: int
    cache_bytes: int
    snapshot_bytes: int  # beyond the cache: hard links into it count zero
    registered: dict[str, DatasetSpec] = field(default_factory=dict)
    snapshots: list[DatasetIdentity] = field(default_factory=list)
    quota_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """What ``det-lab data list --json`` prints for the project: sizes in bytes, its registered
        datasets and the revisions snapshotted on the volume."""
        return {"project": self.project, "remote_bytes": self.remote_bytes, "cache_bytes": self.cache_bytes,
                "snapshot_bytes": self.snapshot_bytes, "quota_bytes": self.quota_bytes,
                "registered": {n: asdict(s) for n, s in sorted(self.registered.items())},
                "snapshots": [asdict(i) for i in self.snapshots]}


def list_volume(settings: LabSettings) -> list[ProjectListing]:
    """Per project: sizes of its DVC remote, cache and snapshots, its datasets and revisions."""
    layout = VolumeLayout.from_settings(settings)
    registry = load_registry(settings)
    listings = []
    for project in sorted(settings.projects):
        cache_plus_snaps = disk_usage(layout.dvc_cache(project), layout.snapshots(project))
        cache = disk_usage(layout.dvc_cache(project))
        listing = ProjectListing(
            project, disk_usage(layout.datasets(project)), cache, cache_plus_snaps - cache,
            {n: s for n, s in registry.items() if s.project == project}, quota_bytes=int(settings.projects[project].quota),
        )
        snaps = layout.snapshots(project)
        for marker in sorted(snaps.glob(f"*/{SNAPSHOT_MARKER}")) if snaps.is_dir() else []:
            try:
                listing.snapshots.append(DatasetIdentity(**json.loads(marker.read_text())["identity"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        listings.append(listing)
    return listings
