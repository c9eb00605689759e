"""What runs keep on the volume: the dataset revisions their lineage records and the snapshots
running trials read; and ``det-lab data gc``, which must keep both.

A local-style run (``det-lab run --local``, Slurm) records its dataset in ``run.json``'s
``lineage.dataset``; that revision's objects stay in the shared cache as long as the run is on
the volume. A run that trains now (a live trainer holds its lock,
:func:`det_lab.trials.run_guard.training_status`) keeps its snapshot whatever its last use says.
A run whose ``run.json`` cannot be read keeps its whole project's cache: what it needs is unknown.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.data.directory import DIRECTORY_REV
from det_lab.data.gc import GcPlan, GcReport, Keep, collect
from det_lab.jsonload import loads
from det_lab.settings import LabSettings
from det_lab.trials.record import RUN_FILE, run_dirs
from det_lab.trials.run_guard import training_status
from det_lab.volume import VolumeLayout

__all__ = ["RunDataUse", "data_gc", "dataset_keep", "run_states"]


def run_states(layout: VolumeLayout, project: str) -> Iterator[tuple[Path, dict[str, Any] | None, os.stat_result | None]]:
    """``(run directory, run.json as a dict, its stat)`` of every local-style run of ``project``;
    ``None, None`` for a run.json that cannot be read or parsed (a run deleted meanwhile is left out)."""
    for directory, _cls in run_dirs(layout, project, probe=False):
        path = os.path.join(directory, RUN_FILE)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                state = loads(f.read())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            yield directory, None, None
            continue
        yield directory, state if isinstance(state, dict) else None, st


@dataclass
class RunDataUse:
    """What the runs of the volume keep, and the runs that could not be read."""

    keep: Keep = field(default_factory=Keep)
    unreadable: dict[str, list[Path]] = field(default_factory=dict)  # project -> run.json files


def dataset_keep(settings: LabSettings) -> RunDataUse:
    """The dataset revisions runs' lineage records, and the snapshots running trials read."""
    layout = VolumeLayout.from_settings(settings)
    use = RunDataUse()
    for project in sorted(settings.projects):
        for directory, state, _st in run_states(layout, project):
            if state is None:
                use.unreadable.setdefault(project, []).append(directory / RUN_FILE)
                continue
            lineage = state.get("lineage")
            ds = lineage.get("dataset") if isinstance(lineage, dict) else None
            if not isinstance(ds, dict) or ds.get("rev") == DIRECTORY_REV or not ds.get("md5"):
                continue
            owner = str(ds.get("project") or project)
            use.keep.lineage.setdefault(owner, set()).add(str(ds["md5"]))
            if ds.get("repo"):
                use.keep.repositories.setdefault(owner, set()).add(str(ds["repo"]))
            if str(state.get("status") or "created") in ("running", "created") and \
                    training_status(state, directory) == "running":
                use.keep.in_use.setdefault(owner, set()).add(str(ds["md5"]).removesuffix(".dir"))
    return use


def data_gc(settings: LabSettings, days: float, *, yes: bool = False) -> tuple[GcPlan, GcReport | None]:
    """``det-lab data gc``: the plan (``yes``: carried out) of evicting snapshots unused for
    ``days`` and removing the cache objects nothing keeps (:mod:`det_lab.data.gc`). A project
    with a run whose record cannot be read is left alone, with the reason."""
    use = dataset_keep(settings)
    made, report = _collect(settings, use, days, yes)
    return made, report


def _collect(settings: LabSettings, use: RunDataUse, days: float, yes: bool) -> tuple[GcPlan, GcReport | None]:
    if not use.unreadable:
        return collect(settings, use.keep, days, yes=yes)
    # a project with an unreadable run keeps everything: collect the others only
    blocked = set(use.unreadable)
    kept = settings.model_copy(update={"projects": {k: v for k, v in settings.projects.items() if k not in blocked}})
    made, report = collect(kept, use.keep, days, yes=yes)
    from det_lab.data.gc import ProjectGc

    for project in sorted(blocked):
        files = use.unreadable[project]
        made.projects.append(ProjectGc(project, skipped=f"{files[0]}{f' and {len(files) - 1} more' if len(files) > 1 else ''}"
                                       " cannot be read: the dataset it needs is unknown, so nothing of this "
                                       "project is collected; fix or remove that run record"))
    made.projects.sort(key=lambda p: p.project)
    return made, report
