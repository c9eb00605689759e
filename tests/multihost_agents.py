"""Hosts for Determined agents: the network part of tests/multihost.py's test bed (namespace "hosts" on
a bridge, each with its own hostname, /etc/hosts, private /tmp and /run, the lab's directory at the
same path) without Slurm, for the master stand-in's agents (tests/standin/agents.py) to run their
containers on, one agent per host (tests/test_determined_multiagent.py).

The master stand-in listens in the root namespace on the bridge's address; an agent's address is its
host's, the address the master sees its connection come from (agent.go:366-371).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost import Host, _net_down, _net_up, in_host
from tests.standin.task_run import Machine


@dataclass
class AgentHosts:
    """``hosts`` on ``bridge`` (``subnet``, this side at ``login_addr``), their files under ``dir``."""

    dir: Path
    hosts: list[Host] = field(default_factory=list)
    bridge: str = ""
    subnet: str = ""

    @property
    def login_addr(self) -> str:
        return self.subnet.rsplit(".", 1)[0] + ".254"

    @property
    def hosts_file(self) -> Path:
        return self.dir / "etc" / "hosts"

    def argv(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` as a root process of ``host`` (tests/multihost.py's in_host), ``dir`` at the same path."""
        return in_host(host, self.hosts_file, self.dir, self.dir / "host-tmp", argv)

    def machine(self, host: Host) -> Machine:
        """``host`` as the task stand-in's Machine (tests/standin/task_run.py)."""
        tmp = self.dir / "agent-tmp" / host.name
        tmp.mkdir(parents=True, exist_ok=True)
        tmp.chmod(0o755)
        return Machine(host.name, self.hosts_file, lambda argv: self.argv(host, argv), tmp)

    def on_host(self, host: Host, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, ["sh", "-c", command]), capture_output=True, text=True, timeout=timeout)


def start_hosts(base: Path, count: int = 2) -> AgentHosts:
    """``count`` hosts on a bridge under ``base`` (outside /tmp: the hosts' /tmp is their own)."""
    n = os.getpid()
    net = f"10.214.{n % 250}"
    hosts = [Host(i, f"dl{n}ag{i}", f"dl{n}agent{i}", f"{net}.{i + 1}", f"dl{n}w{i}") for i in range(count)]
    bed = AgentHosts(base, hosts, bridge=f"dl{n}abr", subnet=f"{net}.0/24")
    for sub in ("etc", "host-tmp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    bed.hosts_file.write_text("127.0.0.1 localhost\n" + f"{bed.login_addr} dl{n}login\n" +
                              "".join(f"{h.addr} {h.name}\n" for h in hosts))
    try:
        _net_up(bed, base)  # the range black-holed first, then the bridge and one veth per host
    except BaseException:
        stop_hosts(bed)
        raise
    return bed


def stop_hosts(bed: AgentHosts) -> None:
    """Every process left in the hosts' namespaces (by pid), then the namespaces, bridge and black hole."""
    for h in bed.hosts:
        if Path(f"/run/netns/{h.netns}").exists():
            pids = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    _net_down(bed, bed.dir)
