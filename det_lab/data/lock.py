"""A lock that works across machines on NFS, and recovers from a holder killed with -9.

It is a hardlink lock (``flufl.lock``, which DVC itself ships with), not ``flock``: NFSv3 and
some NFS servers do not honour ``flock`` across clients. The holder refreshes it from a
background thread; a holder that dies stops refreshing and its lock expires after ``lifetime``,
or at once when the holder was a dead process on this very host.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
from pathlib import Path

from flufl.lock import Lock, NotLockedError, TimeOutError

from det_lab.errors import UserError
from det_lab.settings import env_value

DEFAULT_LIFETIME_S = 60


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` lives on this host (another user's process counts as alive; a
    zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # a zombie (dead, not yet reaped: its parent died too and nobody reaps) holds nothing
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: what kill said


class HostLock(Lock):
    """flufl's lock, naming its holder by ``socket.gethostname()``.

    flufl uses ``socket.getfqdn()``, which is ``localhost`` on machines whose /etc/hosts maps their
    own name to 127.0.0.1: two such machines would each take the other's live lock for one of
    their own dead processes and break it.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._hostname = socket.gethostname()
        self._set_claimfile()  # the claim file's name carries the host


class LockTimeout(UserError, TimeoutError):
    """Raised when the lock was held by a live process for longer than we would wait."""


class VolumeLock:
    """``with VolumeLock(path): ...`` holds ``path`` exclusively across processes and machines."""

    def __init__(self, path: Path, lifetime: dt.timedelta | None = None, timeout: float = 6 * 3600) -> None:
        if lifetime is None:
            lifetime = dt.timedelta(seconds=env_value("DET_LAB_LOCK_LIFETIME", DEFAULT_LIFETIME_S))
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.timeout = timeout
        self._lock = HostLock(str(path), lifetime=lifetime, separator="|")
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def holder(self) -> str | None:
        """``host:pid`` of the current holder, or None."""
        try:
            host, pid, _ = self._lock.details
        except (NotLockedError, ValueError, OSError):
            return None
        return f"{host}:{pid}"

    def __enter__(self) -> VolumeLock:
        deadline = time.monotonic() + self.timeout
        while True:
            self._break_if_holder_died()
            try:
                self._lock.lock(timeout=dt.timedelta(seconds=2))
                break
            except TimeOutError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"{self.path} is held by {self.holder()} for over {self.timeout:.0f} s") from None
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh, name="det-lab-lock-refresh", daemon=True)
        self._refresher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        try:
            self._lock.unlock(unconditionally=True)
        except OSError:
            pass  # a lock we can no longer remove expires by itself

    def _refresh(self) -> None:
        period = self._lock.lifetime.total_seconds() / 3
        while not self._stop.wait(period):
            try:
                self._lock.refresh()
            except (NotLockedError, OSError):
                return

    def _break_if_holder_died(self) -> None:
        try:
            host, pid, _ = self._lock.details
        except (NotLockedError, ValueError, OSError):
            return
        if host != self._lock.hostname or pid == os.getpid():
            return
        if not pid_alive(pid):
            # the holder was killed on this host: no need to wait for the lifetime to run out
            self._lock._break()  # flufl's own breaking routine, as used for expired locks
