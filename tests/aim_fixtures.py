"""A real ``aim server`` (Aim's remote tracking server) on 127.0.0.1, as a pytest fixture."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from det_lab.tracking.mlflow_server import free_port

AIM = Path(sys.executable).parent / "aim"


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class AimServer:
    """``aim server`` serving the local repo ``repo``; stop() and start() keep its data."""

    repo: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"aim://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> AimServer:
        self.repo.mkdir(parents=True, exist_ok=True)
        log_path = self.repo.parent / f"{self.repo.name}-server.log"
        with open(log_path, "ab") as log:
            # New session: `aim server` execs uvicorn as a child that outlives a SIGTERM to the
            # parent, so stop() signals the whole process group.
            self.proc = subprocess.Popen(
                [str(AIM), "server", "--repo", str(self.repo), "--host", "127.0.0.1", "--port", str(self.port), "-y"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not port_open(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"aim server exited {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"aim server did not listen within {timeout} s: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Kill the server and its uvicorn child at once (an outage, not a graceful shutdown)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
        deadline = time.monotonic() + 10
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.fixture
def aim_server(tmp_path: Path) -> Iterator[AimServer]:
    """A running ``aim server`` on a free port with its repo under ``tmp_path``."""
    server = AimServer(repo=tmp_path / "aim-server-repo", port=free_port()).start()
    try:
        yield server
    finally:
        server.stop()
