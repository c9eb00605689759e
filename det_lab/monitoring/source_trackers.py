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
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

from prometheus_client.core import Metric

from det_lab.monitoring.collector import Families, VolumeReader
from det_lab.net import http_answers
from det_lab.ondisk import TRACKING_JOURNAL, check
from det_lab.tracking.journal import JournalReader
from det_lab.runs.record import JOURNAL_DIR, RUN_FILE, find_journals
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
    run = check(_json(directory / RUN_FILE), TRACKING_JOURNAL, directory / RUN_FILE)  # newer: NewerFormat, counted damaged
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


def _local_store(target: str) -> bool:
    """A tracker that is a file or directory on this machine (SQLite, a file store, a local Aim repo)."""
    return urlparse(target).scheme in ("sqlite", "file", "")


#: default ports of the database servers an MLflow tracking URI may name
DB_PORTS = {"postgresql": 5432, "mysql": 3306}


def answers(target: str, timeout: float = 2.0) -> bool | None:
    """Whether a tracker answers: a server's health endpoint or port, a local store's file or directory
    (readable); None only for a target det_lab cannot check."""
    parsed = urlparse(target)
    if parsed.scheme in ("http", "https"):
        return http_answers(target.rstrip("/") + "/health", timeout)[0]
    scheme = parsed.scheme.split("+")[0]
    if (scheme == "aim" or scheme in DB_PORTS) and parsed.hostname:
        try:
            with socket.create_connection((parsed.hostname, parsed.port or DB_PORTS.get(scheme, 0)), timeout=timeout):
                return True
        except OSError:
            return False
    if scheme == "sqlite":
        path = Path(target.removeprefix("sqlite:///"))  # sqlite:////abs/path: /abs/path
        return path.is_file() and os.access(path, os.R_OK)
    if scheme in ("file", ""):
        path = Path(parsed.path if scheme == "file" else target)
        return path.is_dir() and os.access(path, os.R_OK | os.X_OK)
    return None


class TrackersSource(VolumeReader):
    """Backlogs of every journal of ``settings``'s volume, and its tracker servers."""

    name = "trackers"

    def configured_targets(self) -> set[tuple[str, str]]:
        """``(backend, target)`` the lab config names (a local default is each user's own store: the
        journals say which ones runs deliver to)."""
        tracking = self.settings.tracking
        return {(b, t) for b, t in (("mlflow", tracking.mlflow_uri if tracking.uses_mlflow else None),
                                    ("aim", tracking.aim_repo if tracking.uses_aim else None)) if t}

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
        targets = self.configured_targets()
        for project, d in journals(self.layout, sorted(self.settings.projects)):
            recorded = _json(d / RUN_FILE)
            recorded = recorded.get("targets") if isinstance(recorded, dict) else None
            if isinstance(recorded, dict):  # the local stores runs deliver to (a server is the config's)
                targets |= {(b, t) for b, t in recorded.items() if isinstance(t, str) and _local_store(t)}
            try:
                per_backend = backlog(d)
            except (OSError, ValueError):
                damaged += 1
                continue
            run = d.parent.name if d.name == JOURNAL_DIR else d.name
            for backend, (pending, oldest) in per_backend.items():
                totals[backend] = totals.get(backend, 0) + pending
                labels = {"project": project, "run": run, "backend": backend}
                # a zero for each known run and backend: a panel tells "all delivered" from "no data"
                out.add("tracker_undelivered_events", "", labels, pending)
                if pending:
                    out.add("tracker_oldest_undelivered_seconds", "", labels, max(now - (oldest or now), 0.0))
        out.gauge("tracker_backlog_events", "undelivered events of all runs, per backend", ["backend"])
        for backend, _ in targets:
            totals.setdefault(backend, 0)
        for backend, n in sorted(totals.items()):
            out.add("tracker_backlog_events", "", {"backend": backend}, n)
        out.add("tracker_damaged_journals", "journals whose run.json cannot be read", {}, damaged)
        out.gauge("tracker_up", "1 when the lab's tracker server answers", ["backend", "target"])
        for backend, target in sorted(targets):
            ok = answers(target)
            if ok is not None:
                out.add("tracker_up", "", {"backend": backend, "target": target}, 1 if ok else 0)
        return list(out)
