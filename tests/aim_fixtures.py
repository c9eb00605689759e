"""Tracker servers for the tests: a real ``aim server`` (Aim's remote tracking server) on
127.0.0.1 as a pytest fixture, and a relay that cuts a real tracker off its clients (an outage
that costs no server restart)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
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


class Relay:
    """A TCP relay on ``port`` to ``upstream_port``: the address a client is given for a server.

    ``stop()`` is an outage as the client sees a dead server: open connections are reset, new ones
    refused. ``start()`` ends it at once, the server behind it having kept all its data.
    """

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Relay:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            with contextlib.suppress(OSError):  # linger 0: close resets, as a dead server's kernel does
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close(), upstream.close()
                    return
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open -= {src, dst}
        src.close(), dst.close()  # one side hung up: so does the other (HTTP does not half-close)


@pytest.fixture(scope="module")
def aim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AimServer]:
    """A running ``aim server`` on a free port, one per test module (tests use their own run keys)."""
    server = AimServer(repo=tmp_path_factory.mktemp("aim") / "aim-server-repo", port=free_port()).start()
    try:
        yield server
    finally:
        server.stop()
