"""Start an ``mlflow server`` the way det_lab expects it: SQLite on local disk (never on NFS),
artifacts in a directory you choose (the volume's ``outputs/mlflow-artifacts`` on a cluster),
bound to one address, killed with its workers as one process group."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from det_lab.errors import UserError
from det_lab.net import http_answers


class MlflowServerError(UserError, RuntimeError):
    """An MLflow server that exited or did not answer while it started; the message names its log."""


#: ports :func:`free_port` chooses from lie below the kernel's ephemeral range, this many of them
_PORT_SPAN = 12000
#: torch.distributed's default ports (static rendezvous 29500, det_lab's RENDEZVOUS_PORT; c10d 29400)
_KEEP_CLEAR = range(29400, 29600)
_pick = random.SystemRandom()  # not the random module's state, which a test may seed alike in two processes


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a server started a moment later. Chosen at random
    below the kernel's ephemeral range: a port from ``bind(0)`` comes from that range, where any
    outgoing connection may take it before the server binds it (seen: six tests lost their MLflow
    server to "address already in use" on a busy machine)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _pick.randrange(max(1024, low - _PORT_SPAN), low)
        if port not in _KEEP_CLEAR and not port_in_use(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound (another server listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class StopRequest:
    """A stop asked for by a signal handler: a plain flag. (Raised from the handler, an exit can be
    swallowed by the code it interrupts; a ``threading.Event`` set there can deadlock on its own
    lock, held by the code it interrupts.)"""

    def __init__(self) -> None:
        self._asked = False

    def set(self) -> None:
        self._asked = True

    def is_set(self) -> bool:
        return self._asked


@dataclass
class MlflowServer:
    """``mlflow server`` with its store under ``root``; ``stop()`` then ``start()`` keeps the data."""

    root: Path
    port: int
    host: str = "127.0.0.1"
    artifacts: Path | None = None
    store_uri: str | None = None  # default: SQLite in root/mlflow.db
    #: the names clients reach it by (cluster tasks: the host of tracking.mlflow_uri). MLflow 3 refuses any
    #: other Host header than localhost and private IP addresses ("Invalid Host header - possible DNS
    #: rebinding attack detected"), so a task that names the server by host name loses its metrics.
    allowed_hosts: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        argv = [exe, "server", "--host", self.host, "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", self.store_uri or f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination", str(self.artifacts or self.root / "artifacts")]
        if self.allowed_hosts:
            from mlflow.server.security_utils import get_default_allowed_hosts

            names = [n for host in dict.fromkeys(self.allowed_hosts) for n in (host, f"{host}:*")]
            argv += ["--allowed-hosts", ",".join(get_default_allowed_hosts() + names)]  # MLflow's own, and ours
        return argv

    def start(self, timeout: float = 180.0, cancel: StopRequest | None = None) -> MlflowServer:
        """Start the server and return once it answers; once ``cancel`` is set, stop it and return."""
        cancel = cancel or StopRequest()
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, start_new_session=True,
                                     env={**os.environ, "MLFLOW_TRACKING_URI": "",
                                          # MLflow's job runner (GenAI jobs) starts a huey worker
                                          # pool with the server: det_lab runs no MLflow jobs
                                          "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not cancel.is_set():
            if self.proc.poll() is not None:
                raise MlflowServerError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            if http_answers(f"{self.uri}/health", timeout=2)[0]:
                return self
            time.sleep(0.3)
        self.stop()
        if cancel.is_set():
            return self
        raise MlflowServerError(f"mlflow server did not answer within {timeout} s (log: {self.root / 'server.log'})")

    def serve(self, stop: StopRequest) -> None:
        """Start the server and keep it until ``stop`` is set (by a signal handler: a stop asked for
        at any moment, start-up included, is never lost) or it exits; then stop it."""
        try:
            self.start(cancel=stop)
            while self.proc is not None and self.proc.poll() is None and not stop.is_set():
                time.sleep(0.3)
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the server and its workers at once (an outage, not a graceful shutdown)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            _wait_group_gone(self.proc.pid, timeout=30)  # its worker too: it holds the port until it is gone
        self.proc = None


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
