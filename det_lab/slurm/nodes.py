"""How the nodes of a multi-node trial reach each other: a node's name where it resolves, else the
address Slurm has for it (slurm.conf's ``NodeAddr``, which ``det-lab slurm config`` renders from
slurm.yaml's ``nodes[].addr``).

Why it matters: torchrun's static rendezvous, the process group's store and Determined's chief
broadcast all connect to the job's first node by address. A node whose name does not resolve is
common in small labs (machines known to Slurm by an IP in slurm.conf, no DNS): the job then
connects to its ``NodeAddr``. A node with neither is refused at submission, before ``sbatch``,
since a multi-node trial landing on it could never start.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Mapping

from det_lab.errors import UserError


class NodeAddressError(UserError, RuntimeError):
    """A node of a multi-node trial cannot be reached by name or by its configured address."""


def resolves(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) resolves to an address here."""
    if not host:
        return False
    try:
        return bool(socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return False


def reachable(name: str, node_addr: str | None) -> str | None:
    """The address to connect to node ``name``: its name when it resolves, else ``node_addr`` (Slurm's
    NodeAddr) when that resolves; None when neither does."""
    if resolves(name):
        return name
    if node_addr and node_addr != name and resolves(node_addr):
        return node_addr
    return None


def unreachable_message(name: str, where: str) -> str:
    return (f"node {name}: its name does not resolve {where} and slurm.conf gives it no NodeAddr that does, so "
            f"the nodes of a multi-node trial could not reach it: set nodes[].addr for {name} in slurm.yaml and "
            f"render slurm.conf again ('det-lab slurm config'), or add {name} to DNS or /etc/hosts")


def job_nodes(environ: Mapping[str, str]) -> list[str]:
    """The job's nodes in Slurm's order (``SLURM_NODEID`` 0 first): ``scontrol show hostnames``."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return proc.stdout.split()


def slurm_node_addr(name: str) -> str | None:
    """The NodeAddr Slurm has for node ``name`` (``scontrol show node``); None when it does not answer."""
    proc = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    return fields.get("NodeAddr")


def first_node_address(environ: Mapping[str, str]) -> tuple[str, str]:
    """Inside a job: its first node (where global rank 0 runs) and the address to connect to it."""
    nodes = job_nodes(environ)
    if not nodes:
        raise NodeAddressError("SLURM_JOB_NODELIST is not set: a multi-node trial runs inside its Slurm job")
    addr = reachable(nodes[0], None)
    if addr is None:
        addr = reachable(nodes[0], slurm_node_addr(nodes[0]))
    if addr is None:
        raise NodeAddressError(unreachable_message(nodes[0], f"on {socket.gethostname()}"))
    return nodes[0], addr
