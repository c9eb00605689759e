"""The trial's side of a sender process: start it, wake it, ask it to catch up, restart it.

The sender (:mod:`det_lab.tracking.delivery`) runs in its own session, so it outlives the trial
(a SIGKILL, or a signal to the trial's process group) and finishes delivering on its own. Its
stdin is the trial's: when the trial goes away for any reason the sender reads end of input.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import det_lab

log = logging.getLogger("det_lab.tracking")

STARTUP_GRACE = 60.0  # seconds a new sender may take to import its tracker's client at close
RESTART_BACKOFF_MAX = 60.0


class SenderProcess:
    """One backend's sender for one journal, started by the trial's mirror."""

    def __init__(self, journal_dir: Path, backend: str, writer: str, linger: float, stage: Path | None = None) -> None:
        self.journal_dir = journal_dir
        self.stage = stage
        self.backend = backend
        self.writer = writer
        self.linger = linger
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.started_at = 0.0
        self.restarts = 0
        self._next_restart = 0.0
        self._ids = 0
        self._answers: set[str] = set()
        self._buffer = b""

    @property
    def log_path(self) -> Path:
        return self.journal_dir / f"sender-{self.backend}.log"

    def start(self) -> None:
        env = dict(os.environ)
        # the sender imports det_lab from where this process did, installed or not
        package_root = str(Path(det_lab.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "det_lab.tracking.delivery", str(self.journal_dir), "--backend", self.backend,
                 "--writer", self.writer, "--linger", str(self.linger),
                 *(["--stage", str(self.stage)] if self.stage is not None else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
            )
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.ready, self.started_at, self._buffer = False, time.monotonic(), b""
        self._answers.clear()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def supervise(self, now: bool = False) -> None:
        """Restart the sender if it died (with backoff if it keeps dying, unless ``now``)."""
        if self.alive() or (not now and time.monotonic() < self._next_restart):
            return
        code = self.proc.returncode if self.proc else None
        tail = _tail(self.log_path)
        log.warning("tracking: the %s sender exited (%s); restarting it. Its log ends: %s", self.backend, code, tail)
        self._close_pipes()
        self.restarts += 1
        self._next_restart = time.monotonic() + min(2.0 ** self.restarts, RESTART_BACKOFF_MAX)
        self.start()

    def wake(self) -> None:
        self._send("w")

    def request(self, seq: int, closing: bool = False) -> str:
        """Ask the sender to say when everything up to ``seq`` is delivered (and, ``closing``, the run ended)."""
        self._ids += 1
        rid = str(self._ids)
        self._send(f"{'c' if closing else 'f'} {rid} {seq}")
        return rid

    def wait_ready(self, deadline: float) -> None:
        """Wait until the sender has built its tracker client (imports take seconds)."""
        while not self.ready and self.alive() and time.monotonic() < deadline:
            select.select([self.proc.stdout], [], [], min(max(deadline - time.monotonic(), 0), 0.5))
            self._read()

    def wait(self, rid: str, deadline: float) -> bool:
        """Whether the sender answered ``rid`` before ``deadline``: delivered, or the backend is down."""
        while rid not in self._answers:
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive():
                return False
            select.select([self.proc.stdout], [], [], min(left, 0.5))
            self._read()
        self._answers.discard(rid)
        return True

    def detach(self, wait: float) -> None:
        """Tell the sender the trial is done (end of input); wait up to ``wait`` s for it to exit."""
        self._close_pipes()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass  # it goes on delivering (or lingering) on its own

    def _send(self, line: str) -> None:
        if not self.alive():
            return
        try:
            os.write(self.proc.stdin.fileno(), f"{line}\n".encode())
        except (BlockingIOError, BrokenPipeError, ValueError):
            pass  # full (it is busy and will find the events anyway) or gone (supervise restarts it)

    def _read(self) -> None:
        try:
            data = os.read(self.proc.stdout.fileno(), 65536)
        except (BlockingIOError, ValueError):
            return
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            word = line.decode(errors="replace").strip()
            if word == "ready":
                self.ready = True
            elif word:
                self._answers.add(word)

    def _close_pipes(self) -> None:
        if self.proc is None:
            return
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"
