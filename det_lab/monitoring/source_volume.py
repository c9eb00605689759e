"""The volume source: bytes per project against its quota, free space, snapshots, cache, checkpoints.

The project figures come from one walk of each project's directories (the quota's own figure,
:func:`det_lab.volume.project_usage`, hard links counted once), split by area: a file
hard-linked from the shared DVC cache into a snapshot counts in ``dvc-cache``, where it was first
seen. A walk of a volume with thousands of runs takes seconds, so this source is refreshed at
most every ``ttl`` seconds (five minutes by default) and every scrape in between answers from
that sample; ``det_lab_volume_sample_time_seconds`` says when it was taken. Free space (one statvfs)
is read with it, and so are the bytes each user owns and what ``data gc --days 30`` and ``runs prune
--older-than 30d`` would free per project (:mod:`det_lab.lifecycle.space`, whose walk keeps the
figures of complete checkpoints, so a refresh stats one directory per checkpoint).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric

from det_lab.data.integrity import SNAPSHOT_MARKER
from det_lab.monitoring.collector import Families, VolumeReader
from det_lab.settings import LabSettings
from det_lab.lifecycle.space import volume_space
from det_lab.volume import VolumeLayout, disk_usage

#: what the reclaimable figures assume: ``data gc --days 30``, ``runs prune --older-than 30d``
RECLAIM_DAYS = 30.0
RECLAIMERS = ("data gc", "runs prune")

#: the areas of a project, in the order a hard-linked file is attributed (cache before snapshots)
AREAS = ("dvc-cache", "snapshots", "datasets", "checkpoints", "outputs")


def area_dir(layout: VolumeLayout, project: str, area: str) -> Path:
    return {"dvc-cache": layout.dvc_cache, "snapshots": layout.snapshots, "datasets": layout.datasets,
            "checkpoints": layout.project_checkpoints, "outputs": layout.outputs}[area](project)


class VolumeSource(VolumeReader):
    """The shared volume of ``settings``."""

    name = "volume"

    def __init__(self, settings: LabSettings, ttl: float = 300.0) -> None:
        super().__init__(settings, ttl)

    def collect(self) -> Iterable[Metric]:
        root = self.mounted_root()
        out = Families()
        fs = os.statvfs(root)
        out.add("volume_size_bytes", "size of the file system holding the data root", {}, fs.f_blocks * fs.f_frsize)
        out.add("volume_free_bytes", "space left for unprivileged users on it", {}, fs.f_bavail * fs.f_frsize)
        for project in sorted(self.settings.projects):
            seen: set[tuple[int, int]] = set()
            total = 0
            for area in AREAS:
                used = disk_usage(area_dir(self.layout, project, area), seen=seen)
                total += used
                out.add("volume_area_bytes", "bytes of each project's area (dvc-cache is the shared cache; "
                        "checkpoints its checkpoints)", {"project": project, "area": area}, used)
            out.add("volume_project_bytes", "bytes counted against each project's quota", {"project": project}, total)
            out.add("volume_project_quota_bytes", "each project's quota", {"project": project},
                    int(self.settings.project(project).quota))
            snaps = self.layout.snapshots(project)
            count = sum(1 for _ in snaps.glob(f"*/{SNAPSHOT_MARKER}")) if snaps.is_dir() else 0
            out.add("volume_snapshots", "published dataset snapshots of each project", {"project": project}, count)
        self._space(out)
        out.add("volume_sample_time_seconds", "when these figures were taken (Unix time)", {}, time.time())
        return list(out)

    def _space(self, out: Families) -> None:
        """Bytes per user and what ``data gc`` and ``runs prune`` would free per project, from
        :func:`det_lab.lifecycle.space.volume_space` (its walk keeps complete checkpoints' figures)."""
        if not self.layout.state.is_dir():
            return  # not initialised: no runs, no datasets (the figures above say it is empty)
        report = volume_space(self.settings, days=RECLAIM_DAYS)
        for user, n in report.by("user"):
            out.add("volume_user_bytes", "bytes on the volume each user owns (hard links once)", {"user": user}, n)
        for project, ps in sorted(report.projects.items()):
            for by in RECLAIMERS:
                out.add("volume_reclaimable_bytes", "bytes each clean-up would free per project",
                        {"project": project, "by": by.replace(" ", "_")}, ps.reclaimable.get(by, 0))
