"""Delivery of one backend's events from a journal: the sender process, and ``tracking sync``.

    python -m det_lab.tracking.delivery JOURNAL_DIR --backend mlflow --writer TOKEN

The trial's :class:`~det_lab.tracking.mirror.Mirror` starts one such process per backend
(in the idle CPU class, in its own session) and talks to it over its stdin/stdout:

* ``w``: events were appended; ``f ID SEQ``: answer ``ID`` once everything up to ``SEQ`` is
  delivered (or the backend is down: a tracker that is down is never waited for);
  ``c ID SEQ``: the same, once the run is also marked ended (``end.json``) in the tracker;
* the process answers ``ready`` once its backend is built and has tried to open the run, then
  ``ID`` per request;
* end of input means the trial has gone (closed the mirror, exited or was killed). The sender
  then delivers what is journaled and exits, keeps trying a down tracker for ``--linger``
  seconds before leaving the rest to ``det-lab tracking sync``, and hands over at once to the
  sender of a newer writer of the same journal (a resumed trial).

Delivery is at-least-once per batch and idempotent per point, so nothing is lost or doubled
when a sender is killed anywhere: the cursor moves only after the tracker acknowledged a batch;
a batch sent again after a crash is absorbed by the tracker (MLflow keeps one row per identical
point; Aim keeps one value per step); the MLflow run is found again by its key tag, the Aim run
by its hash derived from the key. One sender per backend and journal at a time: ``sender-<backend>.lock``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from det_lab.errors import UserError
from det_lab.tracking.backend import TrackerBackend
from det_lab.tracking.journal import Cursor, Journal, JournalReader

log = logging.getLogger("det_lab.tracking")

MAX_VALUES = 5000  # metric values per delivered batch (MLflow's backend splits it in requests of 1000)
MAX_BACKOFF = 15.0
IDLE_INTERVAL = 1.0
EXIT_GRACE = 30.0  # seconds the exit handlers (Aim's storage close) get


def backend_for(name: str, target: str) -> TrackerBackend:
    """The backend that delivers to ``target`` (imports MLflow or Aim: sender processes only)."""
    if name == "mlflow":
        from det_lab.tracking.mlflow_backend import MlflowBackend

        return MlflowBackend(target)
    if name == "aim":
        from det_lab.tracking.aim_backend import AimBackend

        return AimBackend(target)
    raise ValueError(f"unknown tracking backend {name!r}")


class Busy(UserError):
    """Another sender holds this journal's lock for this backend."""


@contextlib.contextmanager
def sender_lock(journal_dir: Path, backend: str, timeout: float | None,
                give_up: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Hold ``sender-<backend>.lock``, waiting up to ``timeout`` s (None: until ``give_up()``)."""
    path = journal_dir / f"sender-{backend}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if give_up() or (deadline is not None and time.monotonic() > deadline):
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise Busy(f"a sender (pid {holder}) is delivering {journal_dir} to {backend}") from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


class Sender:
    """Delivers the events of ``journal_dir`` to one backend, from its cursor on."""

    def __init__(self, journal_dir: Path, backend: str, make_backend: Callable[[str, str], TrackerBackend] = backend_for):
        self.journal = Journal(journal_dir)
        self.run, targets = self.journal.run()
        self.name = backend
        self.backend = make_backend(backend, targets[backend])
        self.cursor = self.journal.cursor(backend)
        self.started_at = self.cursor.seq
        self.reader = JournalReader(journal_dir)
        self.opened = False
        self.closed_at: int | None = None  # the end marker this sender has closed the run for
        self.down_since: float | None = None
        self.next_try = 0.0
        self.backoff = 1.0
        self.more = True  # the last step delivered a batch: there may be more right away
        self.at_end = False  # the last step found no event after the cursor
        #: the token of the trial that started this sender (None: ``tracking sync``), and whether a
        #: newer trial's sender has taken the journal over from it
        self.writer: str | None = None
        self.handed_over = False
        #: the trial's attempt directory (``--stage``): cursors are renamed from there (Journal.advance)
        self.stage: Path | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def delivered(self) -> int:
        return self.cursor.seq - self.started_at

    def step(self) -> None:
        """Deliver one batch (opening the run first if needed), or close the run at its end marker."""
        now = time.monotonic()
        if self.down and now < self.next_try:
            self.more = False
            return
        try:
            batch = self.reader.read(self.cursor.seq, max_events=MAX_VALUES, max_values=MAX_VALUES)
            end = None if batch else self.journal.end()
            closing = end is not None and end.seq == self.cursor.seq and self.closed_at != end.seq
            if (batch or closing) and not self.opened:
                run_id = self.backend.open(self.run, self.cursor.run_id)
                self.cursor = Cursor(self.cursor.seq, run_id, self.cursor.error)
                self.opened = True
            if batch:
                self.backend.deliver([e for _, e in batch])
                self.cursor = Cursor(batch[-1][0], self.cursor.run_id)
                self._advance()
            elif closing:
                self.backend.close(end.status)  # type: ignore[arg-type,union-attr]
                self.closed_at, self.opened = end.seq, False  # type: ignore[union-attr]
            if self.cursor.error is not None:
                self.cursor = Cursor(self.cursor.seq, self.cursor.run_id)
                self._advance()
            self.more, self.at_end = bool(batch), not batch
        except Exception as exc:
            self._failed(exc, now)
            return
        if self.down:
            log.warning("tracking: %s is back; caught up after %.0f s down", self.backend.describe(), now - self.down_since)
        self.down_since, self.backoff = None, 1.0

    def _failed(self, exc: Exception, now: float) -> None:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        self.opened, self.more, self.at_end = False, False, False  # reopen (continuing the same run) on the next try
        self.reader = JournalReader(self.journal.directory)
        if not self.down:
            self.down_since = now
            log.warning("tracking: %s unreachable (%s); events wait in %s", self.backend.describe(), error,
                        self.journal.directory)
            self.cursor = Cursor(self.cursor.seq, self.cursor.run_id, error)
            self._advance()
        self.next_try = now + self.backoff
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)

    def _advance(self) -> None:
        """Record the cursor, unless a newer trial's sender has taken over or another sender has
        delivered further: a sender of a copy cut off from the volume comes back after the heal
        with an old cursor, and must not move the journal's back (each read just before the write)."""
        if self.writer is not None and self.journal.writer() not in (None, self.writer):
            self.handed_over = True
            return
        theirs = self.journal.cursor(self.name).seq
        if theirs > self.cursor.seq:  # delivered further already: go on from there
            self.cursor = Cursor(theirs, self.cursor.run_id, self.cursor.error)
            return
        try:
            self.journal.advance(self.name, self.cursor, self.stage)
        except FileNotFoundError:
            if self.stage is None or self.stage.exists():
                raise
            self.handed_over = True  # a newer attempt removed this one's directory: its sender delivers

    def caught_up(self) -> bool:
        """Everything journaled is delivered, and the run is marked ended if the trial ended it."""
        if not self.at_end or self.down:
            return False
        end = self.journal.end()
        return end is None or end.seq != self.cursor.seq or self.closed_at == end.seq

    def compact(self) -> None:
        _, targets = self.journal.run()
        self.journal.compact(targets)

    def drain(self, timeout: float) -> None:
        """Deliver until everything is (run ended included), or the backend fails, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if self.down or self.caught_up():
                break
        self.compact()


class Control:
    """The sender's side of its pipes to the trial."""

    def __init__(self) -> None:
        self.eof = False
        self._buffer = b""
        os.set_blocking(0, False)

    def poll(self, timeout: float) -> list[list[str]]:
        """Requests that arrived within ``timeout`` s, as split lines."""
        if self.eof:
            time.sleep(timeout)
            return []
        ready, _, _ = select.select([0], [], [], timeout)
        if not ready:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(0, 65536)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            chunks.append(chunk)
        data = self._buffer + b"".join(chunks)
        *lines, self._buffer = data.split(b"\n")
        return [line.decode().split() for line in lines if line.strip()]

    @staticmethod
    def say(line: str) -> None:
        try:
            os.write(1, f"{line}\n".encode())
        except OSError:  # the trial is gone: nobody is waiting for the answer
            pass


def serve(sender: Sender, control: Control, writer: str, linger: float) -> None:
    """The sender process's loop (see the module docstring)."""
    waiting: list[tuple[str, str, int]] = []  # (kind, id, seq)
    gone_since: float | None = None
    last_compact = 0.0
    while True:
        for request in control.poll(0 if sender.more else IDLE_INTERVAL):
            if request[0] in ("f", "c") and len(request) == 3:
                waiting.append((request[0], request[1], int(request[2])))
        now = time.monotonic()
        if control.eof and gone_since is None:
            gone_since = now
        if gone_since is not None and sender.journal.writer() != writer:
            log.info("tracking: a newer trial writes %s; its sender takes over", sender.journal.directory)
            return
        sender.step()
        if sender.handed_over:
            log.info("tracking: a newer trial writes %s; its sender takes over", sender.journal.directory)
            return
        for request in list(waiting):
            kind, rid, seq = request
            if sender.down or (sender.cursor.seq >= seq and (kind == "f" or (sender.closed_at or 0) >= seq)):
                control.say(rid)
                waiting.remove(request)
        if not sender.more and now - last_compact > 5:
            sender.compact()
            last_compact = now
        if gone_since is not None:
            if sender.caught_up():
                sender.compact()
                return
            if now - gone_since > linger:
                log.warning("tracking: %s still unreachable; %d events left in %s for `det-lab tracking sync`",
                            sender.backend.describe(), Journal(sender.journal.directory).last_seq - sender.cursor.seq,
                            sender.journal.directory)
                return


def yield_the_cpu(tid: int = 0) -> None:
    """Keep to one CPU of the trial's, and run there only on time nothing else wants.

    Plain niceness lets a waking sender preempt the training loop; an idle-class (SCHED_IDLE)
    process never does, but the scheduler still hands it whole time slices on the loop's CPU
    when both share one (measured on 2 CPUs: the loop waited ~0.6 ms a step on the run queue).
    So the sender also keeps to the last CPU the trial may use, when it may use more than one.
    Threads it starts later (Aim's storage threads included) inherit both. ``tid``: another
    thread to place so (0: the calling one).
    """
    cpus = sorted(os.sched_getaffinity(0))  # the trial's: a Slurm or container cpuset included
    if len(cpus) > 1:
        os.sched_setaffinity(tid, {cpus[-1]})
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Deliver a det_lab tracking journal to one backend.")
    ap.add_argument("journal", type=Path)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--writer", required=True, help="the token of the trial that started this sender")
    ap.add_argument("--linger", type=float, default=120.0)
    ap.add_argument("--stage", type=Path, default=None, help="the trial's attempt directory (a fenced run)")
    args = ap.parse_args(argv)
    yield_the_cpu()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s sender[{args.backend} {os.getpid()}] %(levelname)s %(message)s")
    control = Control()

    def trial_gone() -> bool:
        control.poll(0)
        return control.eof

    code = 0
    try:
        with sender_lock(args.journal, args.backend, None, give_up=trial_gone):
            sender = Sender(args.journal, args.backend)
            sender.writer = args.writer
            sender.stage = args.stage
            sender.step()  # open the run (and deliver a first batch) before the trial's close waits on us
            control.say("ready")
            serve(sender, control, args.writer, args.linger)
    except Busy:
        log.info("tracking: the trial went away while another sender held %s", args.journal)
    except Exception:
        log.exception("tracking: the sender failed")
        code = 1
    return code


def exit_bounded(grace: float, code: int) -> None:
    """Run the exit handlers for at most ``grace`` s, then exit.

    Aim closes its storage in an exit handler that waits, without a bound, for a cleanup thread;
    when a finalizer in that thread fails (its repository went away, a damaged chunk), the wait
    never ends and the sender would live on for ever, holding its lock.
    """
    handlers = threading.Thread(target=atexit._run_exitfuncs, daemon=True)  # what a normal exit runs
    handlers.start()
    handlers.join(grace)
    if handlers.is_alive():
        log.warning("tracking: exit handlers still busy after %.0f s; exiting without them", grace)
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_bounded(EXIT_GRACE, main())
