"""``det-lab data verify``: hash every snapshot file and shared-cache object, and repair.

The full check reads every byte (DVC's md5), so it finds what the cheap per-pull check cannot:
content changed with its size and mtime restored. ``repair`` restores damaged snapshot files from
the DVC remote (see :func:`det_lab.data.pull.repair_snapshot`) and removes damaged cache objects
no snapshot uses (the next pull that needs one fetches it again).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.data.errors import DataError
from det_lab.data.integrity import SNAPSHOT_MARKER, cache_objects, changed_files, hash_mismatches, read_marker
from det_lab.data.pull import DatasetIdentity, _Out, expected_files, repair_snapshot
from det_lab.data.registry import lookup
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout


@dataclass
class VerifyReport:
    """What was checked, what was found damaged, and what was repaired."""

    snapshots: int = 0
    files: int = 0
    objects: int = 0
    damaged: list[Path] = field(default_factory=list)
    repaired: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # damage that could not be repaired, one line each
    damaged_objects: list[Path] = field(default_factory=list)  # damaged shared-cache objects no damaged file links
    # damaged cache objects that are one inode with a damaged snapshot file: restored with it
    linked_objects: list[Path] = field(default_factory=list)
    _bad_inodes: set[tuple[int, int]] = field(default_factory=set, repr=False)

    @property
    def ok(self) -> bool:
        return not self.errors and set(self.damaged) <= set(self.repaired)

    @property
    def to_restore(self) -> list[Path]:
        """Damaged snapshot files (or whole snapshots) not yet repaired: what a repair restores
        from the DVC remote, overwriting them."""
        objects = set(self.damaged_objects) | set(self.linked_objects)
        return [p for p in self.damaged if p not in objects and p not in self.repaired]

    @property
    def to_delete(self) -> list[Path]:
        """Damaged shared-cache objects not yet repaired: what a repair deletes (the next pull that
        needs one fetches it again)."""
        return [p for p in self.damaged_objects if p not in self.repaired]

    def as_dict(self) -> dict[str, Any]:
        """What ``det-lab data verify --json`` prints: the counts, each path, and what a repair
        would still restore and delete."""
        return {"snapshots": self.snapshots, "files": self.files, "objects": self.objects,
                "damaged": [str(p) for p in self.damaged], "repaired": [str(p) for p in self.repaired],
                "errors": self.errors, "ok": self.ok, "to_restore": [str(p) for p in self.to_restore],
                "to_delete": [str(p) for p in self.to_delete]}


def verify(settings: LabSettings, name: str | None = None, *, repair: bool = False, show: bool = False) -> VerifyReport:
    """Verify the snapshots of dataset ``name`` (every revision pulled), or of every dataset and
    every shared-cache object of every project when ``name`` is None."""
    layout = VolumeLayout.from_settings(settings)
    spec = lookup(settings, name) if name else None
    projects = [spec.project] if spec else sorted(settings.projects)
    report = VerifyReport()
    seen: dict[tuple[int, int], bool] = {}  # inode -> intact: a snapshot file and its cache object are one
    for project in projects:
        snaps = layout.snapshots(project)
        for marker_file in sorted(snaps.glob(f"*/{SNAPSHOT_MARKER}")) if snaps.is_dir() else []:
            snap = marker_file.parent
            marker = read_marker(snap)
            try:
                identity = DatasetIdentity(**marker["identity"])  # type: ignore[index]
            except (TypeError, KeyError):
                report.errors.append(f"{marker_file}: unreadable snapshot marker")
                continue
            if spec and (identity.repo, identity.path) != (spec.repo, spec.path):
                continue
            _verify_snapshot(layout, snap, identity, marker, report, seen, repair, show)
        if spec is None:
            _verify_cache(layout.dvc_cache(project), report, seen, repair)
    return report


def _verify_snapshot(layout: VolumeLayout, snap: Path, identity: DatasetIdentity, marker: dict,
                     report: VerifyReport, seen: dict, repair: bool, show: bool) -> None:
    report.snapshots += 1
    cache = layout.dvc_cache(identity.project)
    try:
        expected = expected_files(cache, _Out(identity.md5, identity.size, identity.nfiles), Path(identity.path).name)
    except DataError as exc:
        expected, suspects = None, None  # repair fetches the manifest again and hashes every file
        report.damaged.append(snap)
        if not repair:
            report.errors.append(f"{snap}: {exc}")
            return
    if expected is not None:
        report.files += len(expected)
        bad = [rel for rel, md5 in expected.items() if not _good(snap / rel, md5, seen)]
        report.damaged += [snap / rel for rel in bad]
        report._bad_inodes |= {key for rel in bad if (key := _inode(snap / rel))}
        changed = changed_files(snap, marker)
        suspects = sorted(set(bad) | set(expected if changed is None else changed))
        if not suspects:
            return
    if not repair:
        return
    try:
        fixed = repair_snapshot(layout, snap, identity, suspects, show)
    except DataError as exc:
        report.errors.append(str(exc))
        return
    report.repaired += [snap / rel for rel in fixed]
    report.repaired += [p for p in report.damaged if p == snap]
    report.damaged += [snap / rel for rel in fixed if snap / rel not in report.damaged]


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _good(path: Path, md5: str, seen: dict[tuple[int, int], bool]) -> bool:
    """Whether ``path`` hashes to ``md5``; each inode (a snapshot file and its cache object are
    one) is read once."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (st.st_dev, st.st_ino)
    if key not in seen:
        seen[key] = not hash_mismatches([(path, md5)])
    return seen[key]


def _verify_cache(cache: Path, report: VerifyReport, seen: dict, repair: bool) -> None:
    for obj, md5 in cache_objects(cache):
        report.objects += 1
        if _good(obj, md5, seen):
            continue
        report.damaged.append(obj)
        if _inode(obj) in report._bad_inodes:  # (not after a repair: that fetched it again)
            report.linked_objects.append(obj)
            continue
        report.damaged_objects.append(obj)
        if repair:  # used by no intact snapshot (those were repaired above): the next pull refetches
            obj.unlink(missing_ok=True)
            report.repaired.append(obj)
