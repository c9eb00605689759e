"""The runs source: det_lab runs on the volume by state, template and scheduler, and how long
each running run has been silent.

Reads each run's ``run.json`` (no Slurm query per run: ``det-lab runs list`` corrects a Slurm
run's status from Slurm, this does not; a job that died without its driver saying so shows as a
running run whose last metric keeps ageing, which the silent-run alert names). A local run's
"running" holds while a live trainer holds its lock, as in ``runs list``
(:func:`det_lab.runs.run_guard.training_status`). The exporter keeps what it read of each
run.json under the file's inode, size and time, so a refresh reads again only the runs that
changed (one ``stat`` for each of the others). The age of a run's last metric is the age of its
``metrics.jsonl`` (its ``run.json`` before the first report). A run's user is run.json's (a Slurm
run's submitter), else the owner of its run.json, as ``runs list`` says.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from det_lab.monitoring.collector import Families, VolumeReader
from det_lab.ondisk import NewerFormat
from det_lab.settings import LabSettings
from det_lab.runs import record as records
from det_lab.runs.listing import read_signed, stat_signature, user_name
from det_lab.runs.record import METRICS_FILE, RUN_FILE
from det_lab.runs.run_guard import training_status
from det_lab.runs.run_state import LIVE, RunStatus
from det_lab.volume import VolumeLayout

#: a local run whose trainer vanished without recording an end (run_guard.training_status)
DIED = RunStatus.DIED.value


def run_files(layout: VolumeLayout, project: str) -> Iterator[tuple[str, Path]]:
    """``(kind, run directory)`` of every local-style run of ``project``, any registered kind, in
    no order, without opening each record (:func:`det_lab.runs.record.run_dirs`)."""
    for directory, cls in records.run_dirs(layout, project):
        yield cls.kind, directory


@dataclass(frozen=True)
class _Seen:
    """What a refresh keeps of one run.json, under its signature."""

    signature: list[int]
    template: str
    status: str  # run.json's; "damaged", "unreadable" or "newer" (a newer det_lab's) when it cannot be read
    user: str
    gpus: tuple[tuple[str, float | None, int], ...] = ()  # (index, mean utilization %, peak bytes) of gpu_efficiency


def _efficiency(state: dict) -> tuple[tuple[str, float | None, int], ...]:
    """``(gpu index, mean utilization %, peak memory bytes)`` of a run.json's ``gpu_efficiency``."""
    eff = state.get("gpu_efficiency")
    gpus = eff.get("gpus") if isinstance(eff, dict) else None
    out = []
    for g in gpus if isinstance(gpus, list) else []:
        try:
            util = g.get("utilization_mean")
            out.append((str(g["index"]), float(util) if util is not None else None, int(g["memory_peak_bytes"])))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return tuple(out)


class RunsSource(VolumeReader):
    """Every run of every project of ``settings``."""

    name = "runs"

    def __init__(self, settings: LabSettings, ttl: float = 15.0) -> None:
        super().__init__(settings, ttl)
        self._seen: dict[str, _Seen] = {}
        self._users: dict[int, str] = {}

    def _state(self, path: str) -> _Seen | None:
        """The run.json at ``path``, read again only when it changed; None when it is gone."""
        signature = stat_signature(path)
        known = self._seen.get(path)
        if known is not None and known.signature == signature:
            return known
        if signature is None:
            return None
        try:
            read = read_signed(path)
        except OSError:  # another member's run.json this exporter may not read: counted, not a failed source
            return _Seen(signature, "", "unreadable", user_name(signature[3], self._users))
        if read is None:
            return None
        data, signature = read
        try:
            state = records.parse_run_file(data, path)  # whole: its gpu_efficiency too
            seen = _Seen(signature, str(state.get("template") or ""), str(state.get("status") or ""),
                         str(state.get("user") or user_name(signature[3], self._users)), _efficiency(state))
        except ValueError as exc:  # a newer det_lab's run is counted as such, not as damaged
            seen = _Seen(signature, "", "newer" if isinstance(exc, NewerFormat) else "damaged",
                         user_name(signature[3], self._users))
        self._seen[path] = seen
        return seen

    def collect(self) -> Iterable[Metric]:
        self.mounted_root()
        out = Families()
        counts: Counter[tuple[str, str, str, str]] = Counter()
        now = time.time()
        listed: set[str] = set()
        labels = ["project", "run", "kind", "template", "user"]
        out.gauge("run_last_metric_age_seconds", "seconds since each running run last reported a metric", labels)
        out.gauge("run_died_seconds", "each local run whose trainer and det-lab run vanished without recording an "
                  "end: seconds since its last metric", labels)
        out.gauge("run_gpu_utilization_ratio", "", [*labels, "gpu"])
        out.gauge("run_gpu_memory_peak_bytes", "", [*labels, "gpu"])
        for project in sorted(self.settings.projects):
            for kind, directory in run_files(self.layout, project):
                key = os.path.join(directory, RUN_FILE)
                seen = self._state(key)
                if seen is None:
                    continue
                listed.add(key)
                status = seen.status
                if kind == "local" and status not in ("damaged", "unreadable", "newer"):
                    status = training_status({"status": status}, directory)
                status = status or "created"
                counts[(project, kind, seen.template, status)] += 1
                run_labels = {"project": project, "run": directory.name, "kind": kind, "template": seen.template,
                              "user": seen.user}
                for gpu, util, peak in seen.gpus:
                    if util is not None:
                        out.add("run_gpu_utilization_ratio", "", {**run_labels, "gpu": gpu}, util / 100.0)
                    out.add("run_gpu_memory_peak_bytes", "", {**run_labels, "gpu": gpu}, peak)
                if status in LIVE or status == DIED:
                    try:
                        last = (directory / METRICS_FILE).stat().st_mtime
                    except FileNotFoundError:
                        last = seen.signature[2] / 1e9
                    out.add("run_last_metric_age_seconds" if status in LIVE else "run_died_seconds", "", {
                        "project": project, "run": directory.name, "kind": kind, "template": seen.template,
                        "user": seen.user}, max(now - last, 0.0))
        self._seen = {k: v for k, v in self._seen.items() if k in listed}  # runs deleted since: forgotten
        out.gauge("runs", "det_lab runs by project, scheduler (kind), template and status",
                  ["project", "kind", "template", "status"])
        for (project, kind, template, status), n in sorted(counts.items()):
            out.add("runs", "", {"project": project, "kind": kind, "template": template, "status": status}, n)
        return list(out)
