"""Fencing: only the current attempt of a run writes its checkpoints, its latest pointer, its record
and its metrics.

Why: a scheduler may start a run's job again while the first copy still lives. Slurm requeues the
job of a node that stops answering (``SlurmdTimeout``) and starts it elsewhere, while the cut-off
node's copy trains on until the node re-registers and slurmctld kills it ("Registered JobId … on
wrong node"), 1 to 60 s after the link heals (docs/admin/slurm.md, "A node cut off"). Both copies
see the volume.

How:

- **An attempt epoch on the volume.** Each start of the run's job takes the next epoch under a
  volume lock (``attempt.lock``, flufl's hard-link lock that NFS honours) and writes it with a
  fresh token to ``attempt.json`` beside ``run.json`` (write, then rename: a reader sees the old
  or the new file, never half of one). The token reaches the trial in ``$DET_LAB_ATTEMPT``.
- **Checked before every write.** The trial checks that ``attempt.json`` still holds its token
  before each metric report, checkpoint, pointer switch and record update
  (:mod:`det_lab.trials.session`), and a watcher thread checks every ``$DET_LAB_FENCE_POLL``
  seconds (default 5) in between.
- **A stale copy stops itself**: one log line, its trainer lock released (so the current attempt,
  which waits for that lock before it trains, starts at once), then ``os._exit``: no ``finally``,
  ``atexit`` or mirror flush runs that could still write. Its exit code is
  :data:`STALE_EXIT_CODE`; the Slurm driver then records nothing.
- **A check that fails is not fatal.** When ``attempt.json`` cannot be read (a volume hiccup) even
  after :data:`READ_TRIES` tries, the write goes ahead ("fail open") and a warning is logged:
  training never dies because of the fence itself. What keeps that safe: a checkpoint is a new
  directory that nothing points to until the pointer switch, the pointer only moves to a higher
  step (:meth:`det_lab.runs.record.RunRecord.add_checkpoint`), metrics are kept once per step
  (``metrics.jsonl`` and the tracking journal drop a step already written), and the watcher keeps
  checking, so a stale copy stops at the first read that works.

A trial started without ``$DET_LAB_ATTEMPT`` (``det-lab run --local``, a cluster trial) gets the
:class:`NullFence` twin: every check passes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from det_lab.data.lock import LockTimeout, VolumeLock
from det_lab.ondisk import RUN_ATTEMPT, check, stamped
from det_lab.volume import atomic_write_text

log = logging.getLogger("det_lab.trials")

ATTEMPT_FILE = "attempt.json"
ATTEMPT_LOCK = "attempt.lock"
#: ``<epoch>:<token>`` of the attempt a trial process belongs to
ATTEMPT_ENV = "DET_LAB_ATTEMPT"
#: seconds between the watcher's checks
POLL_ENV = "DET_LAB_FENCE_POLL"
DEFAULT_POLL_S = 5.0
#: how a stale copy's trial exits (sysexits' EX_PROTOCOL): its driver records nothing
STALE_EXIT_CODE = 76
#: reads of attempt.json before a check counts as "unknown" (and the write goes ahead)
READ_TRIES = 3


class StaleAttempt(RuntimeError):
    """This attempt is not the run's current one (a newer start of its job took over)."""


@dataclass(frozen=True)
class Attempt:
    """One start of a run's job: ``attempt.json``."""

    epoch: int
    token: str
    job_id: str = ""
    restart: int = 0
    node: str = ""
    started: str = ""

    @property
    def env_value(self) -> str:
        return f"{self.epoch}:{self.token}"


def attempt_file(run_dir: Path) -> Path:
    return run_dir / ATTEMPT_FILE


def read_attempt(run_dir: Path) -> Attempt | None:
    """The run's current attempt; None when no attempt was ever taken. ``OSError`` or
    ``ValueError`` when the file cannot be read or parsed (:class:`~det_lab.ondisk.NewerFormat`
    when a newer det_lab wrote it)."""
    try:
        data = json.loads(attempt_file(run_dir).read_bytes())
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{attempt_file(run_dir)}: not a JSON object")
    check(data, RUN_ATTEMPT, attempt_file(run_dir))  # a newer det_lab's run: NewerFormat, a ValueError
    return Attempt(**{k: data[k] for k in Attempt.__dataclass_fields__ if k in data})


def begin_attempt(run_dir: Path, job_id: str = "", restart: int = 0, node: str = "",
                  lock_timeout: float = 120.0) -> Attempt:
    """Take the run's next attempt epoch (under ``attempt.lock``) and make it the current one.

    :class:`StaleAttempt` when the current attempt is a later restart of the same job: this start
    is older than what already runs (a copy whose start was delayed must not take over)."""
    try:
        with VolumeLock(run_dir / ATTEMPT_LOCK, timeout=lock_timeout):
            current = read_attempt(run_dir)
            if current is not None and job_id and current.job_id == job_id and current.restart > restart:
                raise StaleAttempt(f"restart {current.restart} of job {job_id} already runs on {current.node}")
            new = Attempt(epoch=(current.epoch if current else 0) + 1, token=uuid.uuid4().hex, job_id=job_id,
                          restart=restart, node=node, started=time.strftime("%Y-%m-%dT%H:%M:%S"))
            atomic_write_text(attempt_file(run_dir), json.dumps(stamped(asdict(new), RUN_ATTEMPT), indent=2) + "\n")
    except LockTimeout as exc:
        raise StaleAttempt(f"the run's attempt lock stayed taken: {exc}") from None
    return new


class Fence:
    """The checks of one trial process that belongs to attempt ``epoch`` / ``token`` of the run in
    ``run_dir`` (see the module docstring)."""

    def __init__(self, run_dir: Path, epoch: int, token: str, poll_s: float = DEFAULT_POLL_S) -> None:
        self.run_dir = run_dir
        self.epoch = epoch
        self.token = token
        self.poll_s = poll_s
        #: called (in order) just before a stale copy exits: release what others wait for
        self.on_stale: list[Callable[[], None]] = []
        self._poller: threading.Thread | None = None
        self._unknown_logged = 0.0

    @classmethod
    def from_env(cls, run_dir: Path | None, environ: Mapping[str, str] | None = None) -> Fence:
        """The fence of this process's attempt (``$DET_LAB_ATTEMPT``); a :class:`NullFence` without one."""
        environ = os.environ if environ is None else environ
        value = environ.get(ATTEMPT_ENV, "")
        epoch, _, token = value.partition(":")
        if run_dir is None or not epoch.isdigit() or not token:
            return NullFence()
        try:
            poll = float(environ.get(POLL_ENV) or DEFAULT_POLL_S)
        except ValueError:
            poll = DEFAULT_POLL_S
        return cls(Path(run_dir), int(epoch), token, poll)

    @property
    def active(self) -> bool:
        return True

    def current(self) -> bool | None:
        """True while this attempt is the run's current one, False once another took over, None when
        ``attempt.json`` could not be read (:data:`READ_TRIES` tries, a short wait between them)."""
        for i in range(READ_TRIES):
            try:
                now = read_attempt(self.run_dir)
            except (OSError, ValueError):
                time.sleep(0.2 * (i + 1))
                continue
            # no file at all: someone removed it; the epoch that started us cannot be disproved
            return now is None or now.token == self.token
        return None

    def check(self, what: str) -> None:
        """Before a write of ``what``: return if this attempt is current (or that cannot be known
        now); stop this process if it is stale."""
        answer = self.current()
        if answer is False:
            self.stop(what)
        if answer is None and time.monotonic() - self._unknown_logged > 60:
            self._unknown_logged = time.monotonic()
            log.warning("det_lab: cannot read %s to check this attempt before writing %s; writing anyway "
                        "(a failed check never stops training)", attempt_file(self.run_dir), what)

    def stop(self, what: str) -> None:
        """Stop this stale copy: one line, release what the current attempt waits for, exit."""
        try:
            now = read_attempt(self.run_dir)
            by = f"attempt {now.epoch} (job {now.job_id}, restart {now.restart}) on {now.node}" if now else "?"
        except (OSError, ValueError):
            by = "a newer attempt"
        log.warning("det_lab: attempt %d of this run is stale: %s took over; stopping before %s, writing nothing",
                    self.epoch, by, what)
        for release in self.on_stale:
            try:
                release()
            except Exception:  # noqa: BLE001 (nothing may keep a stale copy alive)
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(STALE_EXIT_CODE)  # no finally/atexit: they would write the run's files

    def watch(self) -> threading.Thread | None:
        """Check every ``poll_s`` seconds from a daemon thread, stopping this copy once stale."""
        if self._poller is not None:
            return self._poller

        def loop() -> None:
            while True:
                time.sleep(self.poll_s)
                if self.current() is False:
                    self.stop("its next write")

        self._poller = threading.Thread(target=loop, name="det-lab-fence", daemon=True)
        self._poller.start()
        return self._poller

    def lock_wait_s(self, lifetime_s: float) -> float:
        """How long a new attempt waits for the run's trainer lock: a stale holder releases it
        within a poll, a dead one's lock expires after its lifetime (+ flufl's 10 s clock slop)."""
        return lifetime_s + 10 + 2 * self.poll_s + 5


class NullFence(Fence):
    """No attempt to fence (a run that no scheduler may start twice): every check passes."""

    def __init__(self) -> None:
        super().__init__(Path("."), 0, "")

    @property
    def active(self) -> bool:
        return False

    def current(self) -> bool | None:
        return True

    def check(self, what: str) -> None:
        return None

    def watch(self) -> threading.Thread | None:
        return None

    def lock_wait_s(self, lifetime_s: float) -> float:
        return 0.0
