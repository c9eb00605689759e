"""Who trains a local-style run: one trainer at a time, across machines, and none on its own.

**One trainer.** ``<run dir>/trainer.lock`` is a :class:`~det_lab.data.lock.VolumeLock`
(flufl.lock's hard-link lock, which NFS honours across clients) held by the trial process while
it trains. Its claim names the trainer's host and pid; a heartbeat thread in the trainer keeps
it fresh. ``det-lab run --resume`` refuses a run whose lock a live trainer holds. A lock left by
a trainer that died is stale and is broken with a warning: its pid is gone (same host), or its
heartbeat stopped longer ago than the lock's lifetime (any host: a machine that crashed or lost
the volume).

**None on its own.** ``det-lab run`` starts the trial with :func:`die_with_parent` (Linux
``PR_SET_PDEATHSIG``: the kernel sends the trial SIGTERM when ``det-lab run`` dies, even by
SIGKILL), and the trial also watches its parent (:func:`watch_parent`, for where that is
unavailable). SIGTERM asks the trial to checkpoint and stop, like a cluster preemption.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flufl.lock import NotLockedError

from det_lab.errors import UserError
from det_lab.data.lock import DEFAULT_LIFETIME_S, HostLock, LockTimeout, VolumeLock, pid_alive
from det_lab.settings import env_value
from det_lab.runs.run_state import RunStatus

LOCK_NAME = "trainer.lock"
PARENT_ENV = "DET_LAB_RUN_PID"  # det-lab run's pid, set in the trial's environment
# flufl.lock breaks an expired lock only this long after its expiry (its CLOCK_SLOP, allowing for
# clocks that differ between machines): a lock counts as stale from then on, not before.
CLOCK_SLOP = dt.timedelta(seconds=10)
_PR_SET_PDEATHSIG = 1


# The exit code of a trial that found its run already trained by another process (sysexits'
# EX_TEMPFAIL): whoever started it must leave the run's record to that trainer.
BUSY_EXIT_CODE = 75


class RunBusy(UserError, RuntimeError):
    """A live process is training the run."""


@dataclass(frozen=True)
class Trainer:
    """The holder of a run's lock."""

    host: str
    pid: int
    stale: str | None  # why the holder is taken for dead; None while it lives
    here: bool = False  # it holds the lock from this machine (the lock's own notion of the host)

    def busy(self, run_name: str) -> RunBusy:
        return RunBusy(f"run {run_name} is still training as pid {self.pid} on host {self.host}")


def trainer(run_dir: Path) -> Trainer | None:
    """Who holds ``run_dir``'s lock (read from the lock file), or None when nobody does."""
    lock = HostLock(str(run_dir / LOCK_NAME), separator="|")  # for reading only: never locked
    try:
        host, pid, _ = lock.details
        expires = lock.expiration
    except (NotLockedError, OSError):
        return None
    here = host == lock.hostname
    if here and not pid_alive(pid):
        return Trainer(host, pid, f"pid {pid} on host {host} is gone", here)
    if expires + CLOCK_SLOP < dt.datetime.now():
        return Trainer(host, pid, f"pid {pid} on host {host} stopped renewing it (expired {expires:%Y-%m-%d %H:%M:%S})",
                       here)
    return Trainer(host, pid, None, here)


def training_status(state: Mapping[str, Any], run_dir: Path) -> str:
    """A local run's status: run.json's, except that "running" (and no status yet, as runs made
    before det_lab recorded "running" show) holds only while a live trainer holds the lock;
    "died" when the trainer and its ``det-lab run`` both ended without recording how."""
    status = str(state.get("status") or RunStatus.CREATED)
    if status not in (RunStatus.RUNNING, RunStatus.CREATED):
        return status
    holder = trainer(run_dir)  # one small file read, only for runs that say they train
    if holder is not None and holder.stale is None:
        return RunStatus.RUNNING.value
    return RunStatus.DIED.value if status == RunStatus.RUNNING else RunStatus.CREATED.value


def break_stale(run_dir: Path, run_name: str) -> str | None:
    """Refuse a run a live trainer holds (:class:`RunBusy`); break a stale lock, returning a warning."""
    holder = trainer(run_dir)
    if holder is None:
        return None
    if holder.stale is None:
        raise holder.busy(run_name)
    try:  # VolumeLock breaks exactly what is stale (a dead pid here; expired anywhere) as it acquires
        with VolumeLock(run_dir / LOCK_NAME, timeout=0):
            pass
    except LockTimeout:
        raise (trainer(run_dir) or holder).busy(run_name) from None
    return f"run {run_name}: broke a stale lock: {holder.stale}"


def hold(run_dir: Path, run_name: str, wait: float = 0.0) -> VolumeLock:
    """Take ``run_dir``'s lock for this process until ``.__exit__``; :class:`RunBusy` when a live trainer
    has it (still has it after ``wait`` seconds: a scheduler's new attempt waits for a stale copy to stop)."""
    lock = VolumeLock(run_dir / LOCK_NAME, timeout=wait)
    try:
        lock.__enter__()
    except LockTimeout:
        holder = trainer(run_dir)
        raise (holder.busy(run_name) if holder else RunBusy(f"run {run_name} is still training")) from None
    return lock


def lock_lifetime_s() -> float:
    """The trainer lock's lifetime in seconds (``$DET_LAB_LOCK_LIFETIME``): a dead holder's lock expires after it."""
    return float(env_value("DET_LAB_LOCK_LIFETIME", DEFAULT_LIFETIME_S))


def die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when ``parent`` dies (Linux; elsewhere a no-op)."""

    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _parent() -> int | None:
    """``det-lab run``'s pid when it started this process (``$DET_LAB_RUN_PID``)."""
    return env_value(PARENT_ENV)


def parent_gone() -> bool:
    """Whether ``det-lab run`` started this process and has since died (we were re-parented)."""
    parent = _parent()
    return parent is not None and os.getppid() != parent


def watch_parent(on_gone: Callable[[int], None], period_s: float = 1.0) -> threading.Thread | None:
    """Call ``on_gone(pid)`` once ``det-lab run`` is no longer our parent (None: not started by it)."""
    parent = _parent()
    if parent is None:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        on_gone(parent)

    thread = threading.Thread(target=watch, name="det-lab-parent-watch", daemon=True)
    thread.start()
    return thread
