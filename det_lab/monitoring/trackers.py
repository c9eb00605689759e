"""The trackers source: events journaled but not yet delivered, per backend, and whether the
MLflow server / Aim server answers.

For each journal on the volume (cluster trials' and local-style runs'), each backend's backlog is
its last journaled event minus its cursor (:mod:`det_lab.tracking.journal`), and the age of the
oldest undelivered event is that event's own timestamp (the journal's ``run.json`` time for events
without one). A journal whose run ended and whose every backend delivered to the end
(``end.json`` and the cursors) is passed over without opening a segment; otherwise only the tail
of the last segment and the first undelivered event are read.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

from prometheus_client.core import Metric

from det_lab.monitoring.collector import Families, VolumeReader
from det_lab.net import http_answers
from det_lab.tracking.journal import JournalReader
from det_lab.trials.record import JOURNAL_DIR, RUN_FILE, find_journals
from det_lab.volume import VolumeLayout

TAIL_BYTES = 64 * 1024


def journals(layout: VolumeLayout, projects: list[str]) -> Iterator[tuple[str, Path]]:
    """``(project, journal dir)`` of every journal on the volume (:func:`find_journals`'s, by project)."""
    for project in sorted(projects):
        for d in find_journals(layout, [project]):
            yield project, d


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_seq(directory: Path) -> int:
    """The last complete event's seq, from the tail of the last segment only."""
    segments = sorted(directory.glob("seg-*.jsonl"))
    if not segments:
        return 0
    with open(segments[-1], "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(size - TAIL_BYTES, 0))
        data = f.read()
    lines = data[:data.rfind(b"\n") + 1].splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["seq"])
        except (ValueError, KeyError, TypeError):
            continue  # the first line of a tail read may be cut
    return int(segments[-1].stem.removeprefix("seg-")) - 1


def backlog(directory: Path) -> dict[str, tuple[int, float | None]]:
    """Per backend of the journal: undelivered events and the timestamp of the oldest of them."""
    run = _json(directory / RUN_FILE)
    backends = run.get("backends") if isinstance(run, dict) else None
    if not isinstance(backends, list):
        raise ValueError(f"{directory / RUN_FILE} is missing or damaged")
    cursors = {}
    for b in backends:
        c = _json(directory / f"cursor-{b}.json")
        cursors[b] = int(c["seq"]) if isinstance(c, dict) and "seq" in c else 0
    end = _json(directory / "end.json")
    if isinstance(end, dict) and "seq" in end and all(s >= int(end["seq"]) for s in cursors.values()):
        return {b: (0, None) for b in backends}
    last = last_seq(directory)
    out: dict[str, tuple[int, float | None]] = {}
    for b, seq in cursors.items():
        pending = max(last - seq, 0)
        oldest = None
        if pending:
            first = JournalReader(directory).read(seq, max_events=1)
            stamp = getattr(first[0][1], "timestamp", None) if first else None
            oldest = float(stamp) if stamp is not None else (directory / RUN_FILE).stat().st_mtime
        out[b] = (pending, oldest)
    return out


def answers(target: str, timeout: float = 2.0) -> bool | None:
    """Whether a tracker server answers; None for a target that is a file or database (nothing to ask)."""
    parsed = urlparse(target)
    if parsed.scheme in ("http", "https"):
        return http_answers(target.rstrip("/") + "/health", timeout)[0]
    if parsed.scheme == "aim" and parsed.hostname and parsed.port:
        try:
            with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
                return True
        except OSError:
            return False
    return None


class TrackersSource(VolumeReader):
    """Backlogs of every journal of ``settings``'s volume, and its tracker servers."""

    name = "trackers"

    def collect(self) -> Iterable[Metric]:
        self.mounted_root()
        out = Families()
        now = time.time()
        totals: dict[str, int] = {}
        out.gauge("tracker_undelivered_events", "events journaled and not yet delivered, per run and backend",
                  ["project", "run", "backend"])
        out.gauge("tracker_oldest_undelivered_seconds", "age of each run's oldest undelivered event, per backend",
                  ["project", "run", "backend"])
        damaged = 0
        for project, d in journals(self.layout, sorted(self.settings.projects)):
            try:
                per_backend = backlog(d)
            except (OSError, ValueError):
                damaged += 1
                continue
            run = d.parent.name if d.name == JOURNAL_DIR else d.name
            for backend, (pending, oldest) in per_backend.items():
                totals[backend] = totals.get(backend, 0) + pending
                if pending:
                    labels = {"project": project, "run": run, "backend": backend}
                    out.add("tracker_undelivered_events", "", labels, pending)
                    out.add("tracker_oldest_undelivered_seconds", "", labels, max(now - (oldest or now), 0.0))
        out.gauge("tracker_backlog_events", "undelivered events of all runs, per backend", ["backend"])
        for backend, n in sorted(totals.items()):
            out.add("tracker_backlog_events", "", {"backend": backend}, n)
        out.add("tracker_damaged_journals", "journals whose run.json cannot be read", {}, damaged)
        tracking = self.settings.tracking
        out.gauge("tracker_up", "1 when the lab's tracker server answers", ["backend", "target"])
        for backend, target in (("mlflow", tracking.mlflow_uri if tracking.uses_mlflow else None),
                                ("aim", tracking.aim_repo if tracking.uses_aim else None)):
            ok = answers(target) if target else None
            if ok is not None:
                out.add("tracker_up", "", {"backend": backend, "target": target}, 1 if ok else 0)
        return list(out)
