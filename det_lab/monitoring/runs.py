"""The runs source: det_lab runs on the volume by state, template and scheduler, and how long
each running run has been silent.

Reads each run's ``run.json`` once (no Slurm query per run: ``det-lab runs list`` corrects a
Slurm run's status from Slurm, this does not; a job that died without its driver saying so
shows as a running run whose last metric keeps ageing, which the silent-run alert names). A
local run records no status while it trains; one whose trainer lock is there counts as running.
The age of a run's last metric is the age of its ``metrics.jsonl`` (its ``run.json`` before the
first report).
"""

from __future__ import annotations

import pwd
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client.core import Metric

from det_lab.monitoring.collector import Families, VolumeReader
from det_lab.trials import record as records
from det_lab.trials.record import METRICS_FILE, RUN_FILE, read_run_file
from det_lab.trials.run_guard import LOCK_NAME
from det_lab.volume import VolumeLayout

LIVE = {"running"}


def run_files(layout: VolumeLayout, project: str) -> Iterator[tuple[str, Path]]:
    """``(kind, run.json)`` of every local-style run of ``project``, any registered kind, without
    opening each record or sorting by age (:func:`det_lab.trials.record.run_dirs`)."""
    for directory, cls in sorted(records.run_dirs(layout, project).items(), key=lambda item: (item[1].kind, item[0])):
        yield cls.kind, directory / RUN_FILE


def run_status(state: dict, run_dir: Path) -> str:
    status = state.get("status")
    if status:
        return str(status)
    return "running" if (run_dir / LOCK_NAME).exists() else "created"


def _owner(path: Path, cache: dict[int, str]) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return ""
    if uid not in cache:
        try:
            cache[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            cache[uid] = str(uid)
    return cache[uid]


class RunsSource(VolumeReader):
    """Every run of every project of ``settings``."""

    name = "runs"

    def collect(self) -> Iterable[Metric]:
        self.mounted_root()
        out = Families()
        counts: Counter[tuple[str, str, str, str]] = Counter()
        owners: dict[int, str] = {}
        now = time.time()
        out.gauge("run_last_metric_age_seconds", "seconds since each running run last reported a metric",
                  ["project", "run", "kind", "template", "user"])
        for project in sorted(self.settings.projects):
            for kind, path in run_files(self.layout, project):
                try:
                    state = read_run_file(path)
                except (OSError, ValueError):
                    counts[(project, kind, "", "damaged")] += 1
                    continue
                template = str(state.get("template") or "")
                status = run_status(state, path.parent)
                counts[(project, kind, template, status)] += 1
                if status in LIVE:
                    try:
                        last = (path.parent / METRICS_FILE).stat().st_mtime
                    except FileNotFoundError:
                        last = path.stat().st_mtime
                    out.add("run_last_metric_age_seconds", "", {
                        "project": project, "run": path.parent.name, "kind": kind, "template": template,
                        "user": _owner(path.parent, owners)}, max(now - last, 0.0))
        out.gauge("runs", "det_lab runs by project, scheduler (kind), template and status",
                  ["project", "kind", "template", "status"])
        for (project, kind, template, status), n in sorted(counts.items()):
            out.add("runs", "", {"project": project, "kind": kind, "template": template, "status": status}, n)
        return list(out)
