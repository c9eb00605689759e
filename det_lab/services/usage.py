"""``det-lab usage``: Slurm accounting's jobs (and local runs' GPU leases) joined with the run
records on the volume, summed by user, project or template, with the idle GPU-hours the watchdog saw.

A service over three packages that do not know each other: :mod:`det_lab.accounting.usage` (the
jobs), :mod:`det_lab.runs.listing` (the runs), :mod:`det_lab.watchdog` (the idle hours).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from det_lab.accounting.usage import JobRecord, all_jobs, join, parse_since, summarize
from det_lab.settings import LabSettings
from det_lab.runs.expconf import project_of
from det_lab.runs.listing import all_runs
from det_lab.runs.record import RunRecordError
from det_lab.volume import VolumeLayout


@dataclass
class UsageReport:
    """What ``det-lab usage`` prints: the period's start, the grouping, one summary row per group
    (with ``idle_gpu_hours`` when by user), every job joined with its run."""

    since: dt.datetime
    by: str
    summary: list[dict[str, Any]]
    jobs: list[JobRecord]
    idle_gpu_hours: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The report as ``det-lab usage --json`` prints it."""
        return {"since": self.since.isoformat(timespec="seconds"), "by": self.by, "summary": self.summary,
                "idle_gpu_hours": {u: round(h, 6) for u, h in sorted(self.idle_gpu_hours.items())},
                "jobs": [j.as_dict() for j in self.jobs]}


def _records(settings: LabSettings, warn: Callable[[str], None]) -> Iterator[tuple[dict[str, Any], Path | None]]:
    """Each run's state and its checkpoints' directory, each run.json read once, in no order."""
    layout = VolumeLayout.from_settings(settings)
    for run in all_runs(settings, ordered=False):
        try:
            st = run.state()
        except RunRecordError as exc:  # one damaged run.json: its jobs go unjoined, said once
            warn(str(exc))
            continue
        conf = st.get("exp_conf") or {}
        yield cast(dict[str, Any], st), layout.experiment_checkpoints(project_of(conf), conf)


def usage_report(settings: LabSettings, since: str, by: str, warn: Callable[[str], None]) -> UsageReport:
    """The GPU use since ``since`` (30d, 12h, a date) grouped ``by`` user, project or template;
    ``warn`` gets one line per problem that leaves a job or run out (:class:`UsageError` for bad input)."""
    from det_lab.watchdog import idle_gpu_hours

    start = parse_since(since)
    summarize([], by)  # checks --by before sacct runs
    jobs = join(all_jobs(settings, start, warn), _records(settings, warn))
    summary = summarize(jobs, by)
    idle = idle_gpu_hours(settings.data_root, start.date())  # what the watchdog saw held and idle
    if by == "user":
        summary = [{**r, "idle_gpu_hours": round(idle.get(r["user"], 0.0), 6)} for r in summary]
    return UsageReport(start, by, summary, jobs, idle)
