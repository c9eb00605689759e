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
- **Checked again at the last moment, because a check can be old news.** On a network volume a
  copy cut off from the network is cut off from the volume too: what it sent after its last
  check, or was about to send, is held up and lands when the link heals, after the current
  attempt may have finished. So every write is arranged so that what can still land late is
  refused by the file server or harmless:

  - *Replaced files* (``run.json``, ``tracking-summary.json``, the tracking journal's ``marks.json``
    and ``end.json``; by the trial and the Slurm driver): written whole in the attempt's own
    directory ``.attempt-<epoch>/`` beside ``run.json``, checked, then renamed over the file
    (:meth:`Fence.publish`). :func:`begin_attempt` removes every older attempt's directory before
    the new attempt writes anything, so a rename the old copy sent late names a directory that is
    gone, and the file server refuses it: the new record can never be replaced by an old copy's,
    whenever its request arrives. (A copy that finds its directory gone stops, as when stale.)
  - *Appended files* (``metrics.jsonl``, the tracking journal's events): opened first,
    then checked, then written in one call; the journal's writer thread checks before each batch.
    What can still land late is one write sent within microseconds of a check that read the
    file server's current attempt.
  - *Checkpoints*: their files are written after a check, and their ``metadata.json`` (what makes a
    directory a checkpoint: resume, retention and the record go by it) only after another check.
    A checkpoint becomes the run's only when the record names it, through a published
    ``run.json``; files a stale copy left without one are no checkpoint to det_lab, and the next
    attempt removes a complete one that it left (its ``metadata.json`` names the attempt that wrote
    it: :func:`sweep_unrecorded`) once it holds the run's trainer lock.
  - *The tracking sender* (a process of its own, :mod:`det_lab.tracking.delivery`): it writes no
    delivery cursor once a newer trial writes the journal, and never moves one backwards.
- **A stale copy stops itself**: one log line, its trainer lock released (so the current attempt,
  which waits for that lock before it trains, starts at once), then ``os._exit``: no ``finally``,
  ``atexit`` or mirror flush runs that could still write. Its exit code is
  :data:`STALE_EXIT_CODE`; the Slurm driver then records nothing.
- **A check that cannot read is not fatal.** When ``attempt.json`` cannot be read (a volume
  hiccup), the check keeps reading for up to :data:`UNKNOWN_WAIT_S` seconds; then the write goes
  ahead ("fail open") and a warning is logged: training never dies because of the fence itself.
  The wait matters after a partition heals: a network volume's client may reconnect first (sshfs
  fails what it had under way, NFS retries it), and a stale copy's reads fail meanwhile; it reads
  its attempt once the volume answers and stops. What keeps the rest safe: the record is only
  ever renamed from the attempt's directory, a checkpoint is a new directory that nothing points
  to until the pointer switch, the pointer only moves to a higher step
  (:meth:`det_lab.runs.record.RunRecord.add_checkpoint`), metrics are kept once per step
  (``metrics.jsonl`` and the tracking journal drop a step already written), and the watcher keeps
  checking, so a stale copy stops at the first read that works.

A trial started without ``$DET_LAB_ATTEMPT`` (``det-lab run --local``, a cluster trial) gets the
:class:`NullFence` twin: every check passes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from det_lab.data.lock import LockTimeout, VolumeLock
from det_lab.ondisk import RUN_ATTEMPT, check, stamped
from det_lab.volume import atomic_write_text, write_synced

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
#: seconds a check keeps reading an attempt.json it cannot read before the write goes ahead
UNKNOWN_WAIT_S = 30.0


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


#: an attempt's own directory beside run.json (``.attempt-<epoch>``): what it publishes is staged there
STAGE_PREFIX = ".attempt-"


def attempt_file(run_dir: Path) -> Path:
    return run_dir / ATTEMPT_FILE


def stage_dir(run_dir: Path, epoch: int) -> Path:
    """Attempt ``epoch``'s directory: it exists from :func:`begin_attempt` until the next attempt begins."""
    return run_dir / f"{STAGE_PREFIX}{epoch}"


def _revoke_older(run_dir: Path, epoch: int) -> None:
    """Remove the directories of the attempts before ``epoch``: their late renames find no source."""
    for old in run_dir.glob(f"{STAGE_PREFIX}*"):
        number = old.name[len(STAGE_PREFIX):]
        if number.isdigit() and int(number) < epoch:
            shutil.rmtree(old, ignore_errors=True)


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
            stage_dir(run_dir, new.epoch).mkdir(exist_ok=True)
            _revoke_older(run_dir, new.epoch)  # before the new attempt writes anything
            atomic_write_text(attempt_file(run_dir), json.dumps(stamped(asdict(new), RUN_ATTEMPT), indent=2) + "\n")
    except LockTimeout as exc:
        raise StaleAttempt(f"the run's attempt lock stayed taken: {exc}") from None
    return new


#: the key of a checkpoint's ``metadata.json`` (under ``det_lab``) that names the attempt that wrote it
CHECKPOINT_ATTEMPT_KEY = "attempt"


def sweep_unrecorded(root: Path, run_key: str, epoch: int, recorded: Iterable[str]) -> list[tuple[str, object]]:
    """Remove the checkpoints under ``root`` that an older attempt of run ``run_key`` completed but
    never recorded, and return their ``(uuid, step)``.

    Why: a copy found stale between its checkpoint's ``metadata.json`` and the pointer switch
    stops, leaving a complete checkpoint that nothing names; nothing can take it up any more (an
    older attempt's publishes are refused) and it may hold gigabytes. The current attempt calls
    this once it holds the run's trainer lock, so the older copy has stopped (or its lock expired).
    Only checkpoints that name this run and an older attempt in their own metadata are touched:
    another run's, this attempt's, and those of a det_lab that did not record attempts stay."""
    from det_lab.runs.retention import remove_checkpoint

    keep, removed = set(recorded), []
    if epoch <= 1 or not root.is_dir():
        return removed
    for path in root.iterdir():
        if path.name in keep or path.is_symlink():
            continue
        try:
            meta = json.loads((path / "metadata.json").read_bytes())
            lab = meta["det_lab"]
            older = lab["run_key"] == run_key and int(lab[CHECKPOINT_ATTEMPT_KEY]) < epoch
        except (OSError, ValueError, TypeError, KeyError):
            continue  # not a complete checkpoint, or not one of a fenced attempt
        if older:
            remove_checkpoint(path)
            removed.append((path.name, meta.get("steps_completed")))
    return removed


class Fence:
    """The checks of one trial process that belongs to attempt ``epoch`` / ``token`` of the run in
    ``run_dir`` (see the module docstring)."""

    def __init__(self, run_dir: Path, epoch: int, token: str, poll_s: float = DEFAULT_POLL_S,
                 unknown_wait_s: float = UNKNOWN_WAIT_S) -> None:
        self.run_dir = run_dir
        self.epoch = epoch
        self.token = token
        self.poll_s = poll_s
        self.unknown_wait_s = unknown_wait_s
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
        ``attempt.json`` could not be read for :attr:`unknown_wait_s` seconds."""
        deadline = time.monotonic() + self.unknown_wait_s
        delay = 0.2
        while True:
            try:
                now = read_attempt(self.run_dir)
            except (OSError, ValueError):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                time.sleep(min(delay, left))
                delay = min(2 * delay, 2.0)
                continue
            # no file at all: someone removed it; the epoch that started us cannot be disproved
            return now is None or now.token == self.token

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

    @property
    def stage(self) -> Path:
        return stage_dir(self.run_dir, self.epoch)

    def publish(self, path: Path, text: str, what: str, mode: int = 0o664) -> None:
        """Replace ``path`` with ``text`` as this attempt: written in its directory, checked, renamed
        from there (see the module docstring). A copy whose directory is gone stops once its
        attempt reads stale; a current one without it (begun by an older det_lab) makes it."""
        tmp = self.stage / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        for retry in (False, True):
            try:
                write_synced(tmp, text, mode)
                self.check(what)
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                now = self.current()
                if now is False:
                    self.stop(what)  # the next attempt removed this one's directory
                if retry or now is None or not path.parent.is_dir():
                    raise
                self.stage.mkdir(exist_ok=True)
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()

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

    def publish(self, path: Path, text: str, what: str, mode: int = 0o664) -> None:
        atomic_write_text(path, text, mode)

    def lock_wait_s(self, lifetime_s: float) -> float:
        return 0.0
