"""The mirror: everything a trial reports, delivered to MLflow and/or Aim without slowing it.

The training thread only appends to an in-memory queue. A background sender moves the queue
into the durable :class:`~det_lab.tracking.journal.Journal`, then delivers from the journal to
each backend in batches, advancing that backend's cursor after each acknowledged batch. A
tracker that is down is retried with backoff while events wait in the journal (on disk, so
memory stays bounded); when it answers again the backlog is delivered in order. A process that
restarts with the same journal directory replays what was never delivered.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.tracking.backend import RunStatus, TrackerBackend
from det_lab.tracking.events import Artifact, Checkpoint, Event, Metrics, Params, RunInfo, Tags, flatten, numeric
from det_lab.tracking.journal import Cursor, Journal

log = logging.getLogger("det_lab.tracking")

MAX_BATCH = 1000  # MLflow's log_batch limit for metrics
MAX_QUEUED = 10_000  # events held in memory before the caller writes them to the journal itself
MAX_BACKOFF = 15.0


@dataclass
class BackendSummary:
    backend: str
    delivered: int  # events this process delivered
    pending: int  # events still only in the journal
    run_id: str | None
    error: str | None


@dataclass
class DeliverySummary:
    journal: Path
    backends: list[BackendSummary] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(b.pending == 0 for b in self.backends)

    def __str__(self) -> str:
        parts = []
        for b in self.backends:
            s = f"{b.backend}: {b.delivered} events delivered to run {b.run_id}"
            if b.pending:
                s += f", {b.pending} pending in {self.journal} ({b.error}); they are sent on the next run with this journal"
            parts.append(s)
        return "tracking summary: " + ("; ".join(parts) if parts else "no tracker configured")


@dataclass
class _State:
    backend: TrackerBackend
    cursor: Cursor
    opened: bool = False
    delivered: int = 0
    down_since: float | None = None
    next_try: float = 0.0
    backoff: float = 1.0
    error: str | None = None


class Mirror:
    """Mirror a run's metrics, params, tags and checkpoints to ``backends``.

    Every public method is safe to call from the training loop: none does network I/O, none
    raises because a tracker failed.
    """

    def __init__(self, run: RunInfo, backends: Sequence[TrackerBackend], journal_dir: Path,
                 *, interval: float = 1.0) -> None:
        self.run = run
        self.journal = Journal(journal_dir)
        self.journal.describe_run(run, [b.name for b in backends])
        self._states = [_State(b, self.journal.cursor(b.name)) for b in backends]
        self._interval = interval
        self._queue: deque[Event] = deque()
        self._lock = threading.Lock()  # guards the queue and journal appends
        self._wake = threading.Event()
        self._passes = 0  # delivery passes completed by the sender
        self._passed = threading.Condition()
        self._stop = threading.Event()
        self._recent: deque[tuple[int, Event]] = deque(maxlen=MAX_QUEUED)
        backlog = {s.backend.name: self.journal.pending(s.backend.name) for s in self._states}
        if any(backlog.values()):
            log.info("tracking: replaying undelivered events from %s: %s", journal_dir, backlog)
        self._thread = threading.Thread(target=self._run, name="det-lab-mirror", daemon=True)
        if self._states:
            self._thread.start()
        self.set_tags({"det_lab.run_key": run.key, **run.tags})

    # --- the training thread's side ------------------------------------------------------------

    def log_metrics(self, group: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Record a metric group at ``step``. Non-numeric values are skipped."""
        values = {k: v for k, v in numeric(metrics).items() if not math.isnan(v)}
        if values:
            self._put(Metrics(group, int(step), values))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record hyperparameters (nested dicts become dotted keys)."""
        self._put(Params(flatten(dict(params))))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put(Tags({str(k): str(v) for k, v in tags.items()}))

    def log_checkpoint(self, uuid: str, step: int, metadata: Mapping[str, Any] | None = None) -> None:
        """Record that checkpoint ``uuid`` was written at ``step``."""
        self._put(Checkpoint(uuid, int(step), dict(metadata or {})))

    def log_artifact(self, path: str | Path, name: str, step: int, media: str = "file") -> None:
        """Attach a file (``media="image"`` for renders) that stays at ``path`` until delivered."""
        self._put(Artifact(str(path), name, int(step), media))

    def _put(self, event: Event) -> None:
        if not self._states:
            return
        with self._lock:
            self._queue.append(event)
            if len(self._queue) >= MAX_QUEUED:  # sender is behind: make room on disk, not in RAM
                self._journal_queue()

    # --- control ---------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Journal everything recorded so far and give the sender one pass to deliver it.

        Returns True when every backend has everything. Call it before a checkpoint or on
        preemption: events are durable once this returns, delivered or not. A tracker that is
        down is not waited for: its events stay in the journal.
        """
        with self._lock:
            self._journal_queue()
        if not self._states or not self._thread.is_alive():
            return not self._states
        with self._passed:
            target = self._passes + 2  # the next pass may have started before our events were journaled
            self._wake.set()
            self._passed.wait_for(lambda: self._passes >= target, timeout)
        return all(self.journal.pending(s.backend.name) == 0 for s in self._states)

    def close(self, status: RunStatus = "FINISHED", timeout: float = 10.0) -> DeliverySummary:
        """Deliver what can be delivered within ``timeout``, end the runs, and summarise."""
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        summary = DeliverySummary(self.journal.directory)
        for s in self._states:
            pending = self.journal.pending(s.backend.name)
            if s.opened and pending == 0:
                try:
                    s.backend.close(status)
                except Exception as exc:  # the record is complete; only the end status is missing
                    log.warning("tracking: could not mark the %s run %s: %s", s.backend.describe(), status, exc)
            summary.backends.append(BackendSummary(s.backend.name, s.delivered, pending, s.cursor.run_id, s.error))
        log.info("%s", summary)
        return summary

    # --- the sender thread -----------------------------------------------------------------------

    def _journal_queue(self) -> None:
        """Move queued events into the journal. Caller holds ``self._lock``."""
        if not self._queue:
            return
        events = list(self._queue)
        self._queue.clear()
        last = self.journal.append(events)
        first = last - len(events) + 1
        self._recent.extend(zip(range(first, last + 1), events))

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                with self._lock:
                    self._journal_queue()
                for s in self._states:
                    self._deliver(s, force=stopping)
                self.journal.compact(s.backend.name for s in self._states)
            except Exception:  # never let the sender die: the journal keeps everything
                log.exception("tracking: sender error (events stay in %s)", self.journal.directory)
            with self._passed:
                self._passes += 1
                self._passed.notify_all()
            if stopping:
                return

    def _deliver(self, s: _State, force: bool = False) -> None:
        now = time.monotonic()
        if now < s.next_try and not force:
            return
        try:
            if not s.opened:
                run_id = s.backend.open(self.run, s.cursor.run_id)
                s.cursor = Cursor(s.cursor.seq, run_id)
                self.journal.advance(s.backend.name, s.cursor)
                s.opened = True
            while True:
                batch = self._pending(s.cursor.seq)
                if not batch:
                    break
                s.backend.deliver([e for _, e in batch])
                s.cursor = Cursor(batch[-1][0], s.cursor.run_id)
                self.journal.advance(s.backend.name, s.cursor)
                s.delivered += len(batch)
        except Exception as exc:
            s.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            if s.down_since is None:
                s.down_since = now
                log.warning("tracking: %s unreachable (%s); events are kept in %s and sent when it returns",
                            s.backend.describe(), s.error, self.journal.directory)
            s.next_try = now + s.backoff
            s.backoff = min(s.backoff * 2, MAX_BACKOFF)
            return
        if s.down_since is not None:
            log.warning("tracking: %s is back; caught up after %.0f s down (%d events delivered so far)",
                        s.backend.describe(), now - s.down_since, s.delivered)
        s.down_since, s.backoff, s.error = None, 1.0, None

    def _pending(self, after: int) -> list[tuple[int, Event]]:
        """The next batch after ``after``: from memory when recent, else from the journal."""
        with self._lock:
            if self._recent and self._recent[0][0] <= after + 1:
                return _cut([(q, e) for q, e in self._recent if q > after])
        return _cut(self.journal.read_after(after, MAX_BATCH))


def _cut(batch: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """At most MAX_BATCH metric values per batch (a Metrics event may hold several)."""
    out, values = [], 0
    for q, e in batch:
        n = len(e.values) if isinstance(e, Metrics) else 1
        if out and values + n > MAX_BATCH:
            break
        out.append((q, e))
        values += n
    return out
