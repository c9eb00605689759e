"""Submitting, watching and cancelling Slurm jobs with Slurm's own commands.

Before anything is created det_lab asks Slurm (``sinfo``) what the partition has, so a missing
``sbatch``, an unknown partition or more GPUs than the partition's nodes hold is one line with
the fix. A job whose submission fails leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from det_lab.errors import UserError

#: Slurm job states after which a job will not run again
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}
_GPU = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")


class SlurmError(UserError, RuntimeError):
    """Slurm is missing or refused; phrased as one line with the fix."""


@dataclass(frozen=True)
class Partition:
    """A partition as ``sinfo`` reports it: its nodes and the GPUs each has."""

    name: str
    default: bool
    gpus_per_node: list[int]
    #: node name -> the NodeAddr Slurm has for it (the name itself where slurm.conf gives none)
    addrs: dict[str, str] = field(default_factory=dict)

    @property
    def max_gpus(self) -> int:
        return max(self.gpus_per_node, default=0)


def require(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found on PATH: run this on a Slurm login node, or install Slurm's "
                         f"client (apt-get install slurm-client) and set SLURM_CONF to the cluster's slurm.conf")
    return path


def _slurm(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([require(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer in {timeout:.0f} s: is slurmctld running? (check 'sinfo')") from None


def partitions() -> dict[str, Partition]:
    """Every partition and its nodes' GPU counts."""
    proc = _slurm("sinfo", "-h", "-N", "-o", "%P|%N|%G|%o")
    if proc.returncode != 0:
        raise SlurmError(f"sinfo failed: {proc.stderr.strip() or proc.stdout.strip()} "
                         f"(is slurmctld running and SLURM_CONF right?)")
    nodes: dict[str, dict[str, int]] = {}
    addrs: dict[str, dict[str, str]] = {}
    defaults: set[str] = set()
    for line in proc.stdout.splitlines():
        part, node, gres, addr = (line.split("|") + ["", "", ""])[:4]
        if part.endswith("*"):
            part = part[:-1]
            defaults.add(part)
        m = _GPU.search(gres)
        nodes.setdefault(part, {})[node] = int(m.group(1)) if m else 0
        addrs.setdefault(part, {})[node] = addr or node
    return {p: Partition(p, p in defaults, list(n.values()), addrs[p]) for p, n in nodes.items()}


def plan_resources(partition: str | None, slots: int) -> tuple[str, int, int]:
    """The partition to use, the nodes and the GPUs per node for ``slots`` GPUs; SlurmError if it cannot fit."""
    parts = partitions()
    if partition is None:
        partition = next((p.name for p in parts.values() if p.default), None)
        if partition is None:
            raise SlurmError("Slurm has no default partition: pass --partition (partitions: "
                             f"{', '.join(sorted(parts))})")
    if partition not in parts:
        raise SlurmError(f"--partition {partition}: no such Slurm partition (partitions: {', '.join(sorted(parts))})")
    part = parts[partition]
    if slots == 0:  # slots_per_trial: 0 trains on CPUs, on any partition
        return partition, 1, 0
    if part.max_gpus == 0:
        if slots > 1:
            raise SlurmError(f"resources.slots_per_trial={slots}, but partition {partition} has no GPUs: "
                             f"pick a GPU partition with --partition, or --set resources.slots_per_trial=1")
        return partition, 1, 0
    per_node = min(slots, part.max_gpus)
    nodes = math.ceil(slots / per_node)
    able = sum(1 for g in part.gpus_per_node if g >= per_node)
    if nodes > able or slots % per_node:
        fits = part.max_gpus * able
        need = f" ({slots} would take {nodes} nodes)" if nodes > able and not slots % per_node else ""
        raise SlurmError(f"resources.slots_per_trial={slots}: partition {partition} has {len(part.gpus_per_node)} "
                         f"node(s) with at most {part.max_gpus} GPUs each, so a trial fits {part.max_gpus} or fewer "
                         f"GPUs on one node, or a multiple of {part.max_gpus} up to {fits} across nodes{need} "
                         f"(e.g. --set resources.slots_per_trial={part.max_gpus}), or pick another --partition")
    if nodes > 1:
        check_addresses(part)
    return partition, nodes, per_node


def check_addresses(part: Partition) -> None:
    """Every node a multi-node trial may be given must be reachable by name or by its NodeAddr (as
    seen from here, the submitting machine): SlurmError naming the first that is not."""
    from det_lab.slurm.nodes import reachable, unreachable_message

    for node, addr in part.addrs.items():
        if reachable(node, addr) is None:
            raise SlurmError(f"partition {part.name}: " + unreachable_message(node, "here")
                             + " (a trial on one node needs neither)")


def sbatch(script: str) -> str:
    """Submit a script file; its job id (for an array, the array's id)."""
    proc = _slurm("sbatch", "--parsable", script)
    if proc.returncode != 0:
        msg = " ".join(line.removeprefix("sbatch: error: ") for line in proc.stderr.strip().splitlines())
        raise SlurmError(f"sbatch refused the job: {msg or 'no reason given'}")
    return proc.stdout.strip().split(";")[0]


#: within :func:`one_listing`: every job Slurm knows, id -> state, from a single squeue
_LISTING: dict[str, str] | None = None


@contextlib.contextmanager
def one_listing() -> Iterator[None]:
    """Within the block :func:`job_state` answers from one ``squeue`` of every job Slurm knows:
    a plan over thousands of runs asks Slurm once, not once per run. Where squeue fails, each
    question goes to Slurm as usual (and says why)."""
    global _LISTING
    listing: dict[str, str] | None = None
    try:
        proc = _slurm("squeue", "-h", "--states=all", "-r", "-o", "%i|%T")
        if proc.returncode == 0:
            listing = {}
            for line in proc.stdout.splitlines():
                job, _, state = line.strip().partition("|")
                listing.setdefault(job, state)
                listing.setdefault(job.split("_", 1)[0], state)  # an array's id answers for its first task
    except SlurmError:
        pass
    previous, _LISTING = _LISTING, listing
    try:
        yield
    finally:
        _LISTING = previous


def job_state(job_id: str) -> dict[str, str] | None:
    """``scontrol show job`` as a dict (an array gives its first task), or None once Slurm forgot the job.
    Inside :func:`one_listing` only ``JobState`` is given."""
    if _LISTING is not None:
        state = _LISTING.get(str(job_id))
        return None if state is None else {"JobId": str(job_id), "JobState": state}
    proc = _slurm("scontrol", "show", "job", "-o", job_id)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    first = proc.stdout.strip().splitlines()[0]
    return dict(kv.split("=", 1) for kv in first.split() if "=" in kv)


def previous_start_state(job_id: str) -> str | None:
    """The state Slurm's accounting gives the start of ``job_id`` before its current one (NODE_FAIL,
    REQUEUED, ...): ``sacct --duplicates`` lists every start of a requeued job (sacct(1)). None without
    accounting, or when sacct does not answer."""
    if not job_id or shutil.which("sacct") is None:
        return None
    try:
        proc = _slurm("sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", "State", timeout=10)
    except SlurmError:
        return None
    states = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return states[-2] if proc.returncode == 0 and len(states) >= 2 else None


def array_states(job_id: str) -> dict[str, str]:
    """Array task id -> state, for the tasks Slurm still knows."""
    proc = _slurm("squeue", "-h", "--states=all", "-r", "-j", job_id, "-o", "%K|%T")
    out = {}
    for line in proc.stdout.splitlines():
        task, _, st = line.partition("|")
        out[task] = st
    return out


def cancel(job_id: str) -> None:
    proc = _slurm("scancel", job_id)
    if proc.returncode != 0:
        raise SlurmError(f"scancel {job_id}: {proc.stderr.strip()}")


def wait(job_id: str, on_change: Callable[[dict[str, str]], None] | None = None, poll: float = 0.5,
         tick: Callable[[], None] | None = None) -> dict[str, str] | None:
    """Wait until the job has ended for good (requeues included); its last known state."""
    last: dict[str, str] | None = None
    seen = None
    while True:
        st = job_state(job_id)
        if st is None:
            return last
        key = (st.get("JobState"), st.get("NodeList"), st.get("Restarts"))
        if key != seen and on_change:
            on_change(st)
        seen, last = key, st
        if st.get("JobState") in FINAL_STATES:
            return st
        if tick:
            tick()
        time.sleep(poll)


def wait_array(job_id: str, poll: float = 1.0) -> dict[str, str]:
    """Wait until every task of a job array has ended for good; their last states."""
    last: dict[str, str] = {}
    while True:
        states = array_states(job_id)
        last.update(states)
        if all(st in FINAL_STATES for st in states.values()):
            return last
        time.sleep(poll)
