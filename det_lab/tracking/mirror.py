"""The mirror: everything a trial reports, delivered to MLflow and/or Aim at almost no cost to it.

The training process only appends events to the durable
:class:`~det_lab.tracking.journal.Journal`: a call encodes its event into a line (metric values
packed as doubles in hex: formatting floats as text would cost more than everything else) and
queues it; a small writer
thread appends the queued lines in batches, fsyncs them and wakes the senders. Delivery runs in
one sender process per backend (:mod:`det_lab.tracking.delivery`), in the idle CPU class, in its own session, so
neither the tracker's client nor the network ever competes with the training loop, and a
killed trial's events are still delivered. The writer thread checks every few seconds that the
senders live, and restarts one that died; it picks up at its cursor.

A metric is journaled once per step: a point whose step is not above the highest step already
journaled for that group and key (a resumed trial replaying the steps after its last
checkpoint) is dropped, across restarts too (the marks are kept in the journal).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from det_lab.ondisk import warn_once
from det_lab.tracking.backend import RunStatus
from det_lab.tracking.events import Artifact, Checkpoint, Event, Params, RunInfo, Tags, flatten, numeric
from det_lab.tracking.journal import Journal, encode
from det_lab.tracking.sender_control import STARTUP_GRACE, SenderProcess

log = logging.getLogger("det_lab.tracking")

WRITE_INTERVAL = 0.2  # seconds between the writer thread's batches
SUPERVISE_INTERVAL = 2.0  # seconds between checks that the senders live
MARKS_EVERY = 1000  # events between saves of the metric marks (and at every flush)
MAX_QUEUED = 20_000  # lines queued before a call wakes the writer early
LINGER = 120.0  # seconds a sender keeps trying a down tracker after the trial is gone
_KEYS_CACHE_MAX = 1024


@dataclass
class BackendSummary:
    backend: str
    delivered: int  # events delivered since this mirror opened (a replayed backlog included)
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
                s += (f", {b.pending} pending in {self.journal} ({b.error or 'not delivered yet'}); its sender "
                      "keeps delivering them for a while, then `det-lab tracking sync` does")
            parts.append(s)
        return "tracking summary: " + ("; ".join(parts) if parts else "no tracker configured")


class WriteFence(Protocol):
    """What a trial's fence offers the journal writer (:class:`det_lab.runs.fence.Fence`)."""

    def check(self, what: str) -> None: ...

    def publish(self, path: Path, text: str, what: str) -> None: ...

    @property
    def stage(self) -> Path:
        """The attempt's directory, which the next attempt removes (its senders rename cursors from it)."""
        ...


class Mirror:
    """Mirror a run's metrics, params, tags and checkpoints to ``targets`` (``{backend: URI or repo}``).

    Every public method is safe to call from the training loop: none does network I/O, none
    raises because a tracker failed.
    """

    def __init__(self, run: RunInfo, targets: Mapping[str, str], journal_dir: Path, *,
                 interval: float = WRITE_INTERVAL, linger: float = LINGER,
                 fence: WriteFence | None = None) -> None:
        self.run = run
        #: the trial's fence (det_lab.runs.fence): checked just before each journal write, and what
        #: publishes the journal's marks and end; a stale copy of the run stops there
        self._fence = fence
        self.targets = dict(targets)
        self.journal = Journal(journal_dir)
        if fence is not None:
            self.journal.replace = lambda path, text: fence.publish(path, text, f"the tracking journal's {path.name}")
        if self.journal.newer is not None:  # a newer det_lab's journal: left alone, and training goes on
            warn_once(self.journal.newer, "this trial's metrics are not mirrored to its trackers (training goes on)")
            self.targets = {}
        else:
            self.journal.describe_run(run, self.targets)
        self._interval = interval
        self._lock = threading.Lock()  # guards the queue, the sequence number and the marks
        self._write_lock = threading.Lock()  # one batch append at a time
        self._lines: list[str] = []
        self._marks: dict[str, dict[str, int]] = {}  # group -> key -> highest step journaled
        self._recent: dict[str, dict[tuple, int]] = {}  # group -> keys -> step, not yet in _marks
        self._group_max: dict[str, int] = {}
        self._keys: dict[tuple, tuple[str, struct.Struct]] = {}
        self._groups: dict[str, str] = {}
        self._senders: list[SenderProcess] = []
        self._closed = threading.Event()
        self._wake = threading.Event()
        if not self.targets:
            return
        token = uuid.uuid4().hex
        self.journal.claim(token)
        self._marks = self.journal.load_marks()
        self._group_max = {g: max(m.values()) for g, m in self._marks.items() if m}
        self._seq = self._marks_saved = self.journal.last_seq
        self._opened_at = {b: self.journal.cursor(b).seq for b in self.targets}
        backlog = {b: self.journal.pending(b) for b in self.targets}
        if any(backlog.values()):
            log.info("tracking: undelivered events in %s are sent first: %s", journal_dir, backlog)
        stage = fence.stage if fence is not None and fence.stage.is_dir() else None  # made when the attempt began
        self._senders = [SenderProcess(journal_dir, b, token, linger, stage) for b in self.targets]
        for s in self._senders:
            s.start()
        self._thread = threading.Thread(target=self._run, name="det-lab-journal", daemon=True)
        self._thread.start()
        self.set_tags({"det_lab.run_key": run.key, **run.tags})

    # --- the training thread's side ------------------------------------------------------------

    def log_metrics(self, group: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Record a metric group at ``step``. Non-numeric values are skipped, NaN too; a key
        already journaled at this step or a later one is dropped (one value per key and step)."""
        if not self._senders:
            return
        step = int(step)
        try:  # the fast way: keys seen before, plain numbers
            keys = tuple(metrics)
            keys_json, packer = self._keys.get(keys) or self._remember(keys)
            packed = packer.pack(*metrics.values(), time.time())
        except Exception:  # a value that is not a plain number: the slow, careful way
            values = numeric(metrics)
            keys = tuple(values)
            keys_json, packer = self._keys.get(keys) or self._remember(keys)
            packed = packer.pack(*values.values(), time.time())
        if not keys:
            return
        with self._lock:
            top = self._group_max.get(group)
            if top is None or step > top:
                self._group_max[group] = step
                self._recent.setdefault(group, {})[keys] = step
            else:  # a step at or below one already journaled: keep only keys not yet at it
                marks = self._fold(group)
                keep = [i for i, k in enumerate(keys) if marks.get(k, -math.inf) < step]
                if not keep:
                    return
                if len(keep) < len(keys):
                    unpacked = packer.unpack(packed)
                    keys = tuple(keys[i] for i in keep)
                    keys_json, packer = self._keys.get(keys) or self._remember(keys)
                    packed = packer.pack(*(unpacked[i] for i in keep), unpacked[-1])
                marks.update(dict.fromkeys(keys, step))
            self._seq += 1
            self._lines.append(f'{{"seq":{self._seq},"kind":"metrics","group":{self._group_json(group)},'
                               f'"step":{step},"keys":{keys_json},"f64t":"{packed.hex()}"}}\n')
            if len(self._lines) >= MAX_QUEUED:
                self._wake.set()

    def _remember(self, keys: tuple) -> tuple[str, struct.Struct]:
        """How lines encode a set of keys: their JSON, and a packer for their values and the time."""
        if len(self._keys) >= _KEYS_CACHE_MAX:
            self._keys.clear()
        entry = self._keys[keys] = (json.dumps([str(k) for k in keys]), struct.Struct(f"{len(keys) + 1}d"))
        return entry

    def _group_json(self, group: str) -> str:
        encoded = self._groups.get(group)
        if encoded is None:
            encoded = self._groups[group] = json.dumps(str(group))
        return encoded

    def _fold(self, group: str) -> dict[str, int]:
        """The group's marks, with the steps recorded since the last fold merged in. Caller holds the lock."""
        marks = self._marks.setdefault(group, {})
        for keys, step in self._recent.pop(group, {}).items():
            for key in keys:
                if marks.get(key, -math.inf) < step:
                    marks[key] = step
        return marks

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
        if not self._senders:
            return
        with self._lock:
            self._seq += 1
            self._lines.append(encode(self._seq, event))

    # --- control ---------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Journal everything recorded so far and give the senders up to ``timeout`` s to deliver it.

        Returns True when every backend has everything. Call it before a checkpoint or on
        preemption: events are durable once this returns, delivered or not. A tracker that is
        down is not waited for: its events stay in the journal.
        """
        if not self._senders:
            return True
        self._write(save_marks=True)
        return self._catch_up(time.monotonic() + timeout, closing=False)

    def close(self, status: RunStatus = "FINISHED", timeout: float = 10.0) -> DeliverySummary:
        """Journal the rest, mark the run ended, give the senders ``timeout`` s to deliver it
        (plus the time a sender needs to start), and summarise."""
        summary = DeliverySummary(self.journal.directory)
        if not self._senders:
            return summary
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._write(save_marks=True)
        self.journal.mark_end(status)
        self.journal.close()
        self._catch_up(time.monotonic() + timeout, closing=True)
        for s in self._senders:
            s.detach(wait=5 if self.journal.pending(s.backend) == 0 else 0)
        for name in self.targets:
            cursor = self.journal.cursor(name)
            summary.backends.append(BackendSummary(name, cursor.seq - self._opened_at[name],
                                                   self.journal.pending(name), cursor.run_id, cursor.error))
        log.info("%s", summary)
        return summary

    def _catch_up(self, deadline: float, closing: bool) -> bool:
        for s in self._senders:
            s.supervise(now=closing)  # the trial is ending: no backoff, or its last points wait for sync
        if closing:  # the time a sender needs to start does not count against the close timeout
            started = time.monotonic()
            for s in self._senders:
                s.wait_ready(started + STARTUP_GRACE)
            deadline += time.monotonic() - started
        requests = [(s, s.request(self.journal.last_seq, closing)) for s in self._senders]
        for s, rid in requests:
            s.wait(rid, deadline)
        return all(self.journal.pending(b) == 0 for b in self.targets)

    # --- the writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._closed.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self._write(save_marks=False)
            if time.monotonic() - last_check >= SUPERVISE_INTERVAL:
                last_check = time.monotonic()
                for s in self._senders:
                    s.supervise()

    def _write(self, save_marks: bool) -> None:
        """Append the queued lines to the journal, save the marks now and then, wake the senders."""
        with self._write_lock:
            with self._lock:
                lines, self._lines = self._lines, []
                seq = self._seq
                marks = None
                if save_marks or seq - self._marks_saved >= MARKS_EVERY:
                    marks = {g: dict(self._fold(g)) for g in list(self._group_max)}
            if not lines and marks is None:
                return
            try:
                if self._fence is not None:
                    self._fence.check("tracking events")
                if lines:
                    self.journal.write_lines(lines)
                if marks is not None and seq != self._marks_saved:
                    self.journal.save_marks(seq, marks)
                    self._marks_saved = seq
            except OSError as exc:  # a full or lost volume: keep the lines and try again
                log.warning("tracking: cannot write the journal in %s (%s); retrying", self.journal.directory, exc)
                with self._lock:
                    self._lines[:0] = lines
                return
            for s in self._senders:
                s.wake()
