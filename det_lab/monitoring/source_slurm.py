"""The Slurm source: the queue (``squeue``), nodes and GPUs (``sinfo``), fair-share (``sshare``).

Jobs in a final state are left out, so a finished job's series are gone at the next scrape even
while Slurm still lists it (``MinJobAge``). Pending jobs carry how long they have waited so far
(from the submit time, ``%V``) and Slurm's reason. A command that fails (missing, slurmctld down)
raises: the collector turns that into ``det_lab_scrape_error{source="slurm"} 1`` and exports no
queue at all, never an empty one. ``sshare`` is read only where accounting answers; a cluster
without it has no fair-share series and no error.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.core import Metric

from det_lab.errors import UserError
from det_lab.monitoring.collector import Families

#: states after which a job holds nothing and waits for nothing (SchedMD squeue "JOB STATE CODES")
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"}
#: node states in which a node's GPUs cannot be given out
UNAVAILABLE = ("down", "drain", "drained", "draining", "fail", "failing", "maint", "not_responding",
               "power_down", "powered_down", "reboot", "unknown", "future", "inval")
# %j (the name, which may hold the separator) goes last
SQUEUE_FORMAT = "%i|%u|%a|%P|%T|%r|%V|%S|%b|%D|%j"
SINFO_FORMAT = "NodeHost:|,Partition:|,StateLong:|,Gres:|,GresUsed:|"
_GPU_COUNT = re.compile(r"gpu(?::[A-Za-z0-9_.-]+)?:(\d+)")
COMMAND_TIMEOUT = 30.0


class SlurmSourceError(UserError, RuntimeError):
    """A Slurm command that did not answer."""


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    account: str
    partition: str
    state: str
    reason: str
    submitted: dt.datetime | None
    gpus: int
    name: str


def gpu_count(gres: str) -> int:
    """GPUs in a gres string as squeue/sinfo print it (``gres:gpu:2``, ``gres/gpu:a100:1``, ``gpu:fake:2(IDX:0-1)``)."""
    return sum(int(n) for n in _GPU_COUNT.findall(gres.split("(")[0] if "(IDX" in gres else gres))


def _null(text: str) -> str:
    return "" if text in ("(null)", "N/A") else text


def _time(text: str) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(text)  # squeue prints local time without a zone
    except ValueError:
        return None


def parse_squeue(text: str) -> list[Job]:
    """Jobs from ``squeue -h -o SQUEUE_FORMAT``, final states left out."""
    jobs = []
    for line in text.splitlines():
        parts = line.split("|", 10)
        if len(parts) != 11:
            continue
        job_id, user, account, partition, state, reason, submit, _start, gres, nodes, name = parts
        state = state.split()[0].upper()
        if state in FINAL_STATES:
            continue
        per_node = gpu_count(gres)
        jobs.append(Job(job_id, user, _null(account), partition, state, "" if reason == "None" else reason,
                        _time(submit), per_node * max(int(nodes) if nodes.isdigit() else 1, 1), name))
    return jobs


def run_command(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A Slurm command's output; :class:`SlurmSourceError` naming it when it is missing or fails."""
    if shutil.which(argv[0], path=(env or os.environ).get("PATH")) is None:
        raise SlurmSourceError(f"{argv[0]} is not on PATH")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        raise SlurmSourceError(f"{argv[0]} did not answer in {COMMAND_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        raise SlurmSourceError(f"{argv[0]} exited {proc.returncode}: {last}")
    return proc.stdout


class SlurmSource:
    """Queue, nodes and fair-share of the Slurm cluster that ``SLURM_CONF`` (or /etc/slurm) selects."""

    name = "slurm"

    def __init__(self, ttl: float = 5.0, env: Mapping[str, str] | None = None, now=None) -> None:
        self.ttl = ttl
        self.env = env
        self._now = now or dt.datetime.now

    def collect(self) -> Iterable[Metric]:
        jobs = parse_squeue(run_command(["squeue", "-h", "-a", "-r", "--states=all", "-o", SQUEUE_FORMAT], self.env))
        nodes = run_command(["sinfo", "-h", "-N", "-O", SINFO_FORMAT], self.env)
        out = Families()
        self._jobs(out, jobs)
        self._nodes(out, nodes)
        self._fairshare(out)
        return list(out)

    def _jobs(self, out: Families, jobs: list[Job]) -> None:
        counts = Counter((j.user, j.account, j.partition, j.state) for j in jobs)
        out.gauge("slurm_jobs", "Slurm jobs by user, account, partition and state",
                  ["user", "account", "partition", "state"])
        for (user, account, partition, state), n in sorted(counts.items()):
            out.add("slurm_jobs", "", {"user": user, "account": account, "partition": partition, "state": state}, n)
        held: dict[tuple[str, str, str], int] = defaultdict(int)
        out.gauge("slurm_job_gpus", "GPUs of each live job (allocated when running, asked for when pending)",
                  ["job_id", "user", "account", "partition", "state", "name"])
        for j in jobs:
            out.add("slurm_job_gpus", "", {"job_id": j.job_id, "user": j.user, "account": j.account,
                                           "partition": j.partition, "state": j.state, "name": j.name}, j.gpus)
            if j.state in ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING"):
                held[(j.user, j.account, j.partition)] += j.gpus
        out.gauge("slurm_user_gpus_allocated", "GPUs allocated to each user's jobs", ["user", "account", "partition"])
        for (user, account, partition), n in sorted(held.items()):
            out.add("slurm_user_gpus_allocated", "", {"user": user, "account": account, "partition": partition}, n)
        now = self._now()
        out.gauge("slurm_job_pending_seconds", "how long each pending job has waited so far, with Slurm's reason",
                  ["job_id", "user", "account", "partition", "reason"])
        for j in jobs:
            if j.state == "PENDING" and j.submitted is not None:
                out.add("slurm_job_pending_seconds", "", {"job_id": j.job_id, "user": j.user, "account": j.account,
                                                          "partition": j.partition, "reason": j.reason},
                        max((now - j.submitted).total_seconds(), 0.0))

    def _nodes(self, out: Families, text: str) -> None:
        nodes: Counter[tuple[str, str]] = Counter()
        gpus: Counter[tuple[str, str]] = Counter()
        for line in text.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) < 5:
                continue
            _host, partition, state, gres, used = parts[:5]
            partition, state = partition.rstrip("*"), state.rstrip("*~#!%$@^-+").lower()
            nodes[(partition, state)] += 1
            total, busy = gpu_count(gres), gpu_count(used)
            if state.startswith(UNAVAILABLE):
                gpus[(partition, "unavailable")] += total
            else:
                gpus[(partition, "allocated")] += busy
                gpus[(partition, "idle")] += max(total - busy, 0)
        out.gauge("slurm_nodes", "nodes by partition and state", ["partition", "state"])
        for (partition, state), n in sorted(nodes.items()):
            out.add("slurm_nodes", "", {"partition": partition, "state": state}, n)
        out.gauge("slurm_gpus", "GPUs by partition and state (allocated, idle, unavailable)", ["partition", "state"])
        for (partition, state), n in sorted(gpus.items()):
            out.add("slurm_gpus", "", {"partition": partition, "state": state}, n)

    def _fairshare(self, out: Families) -> None:
        try:
            text = run_command(["sshare", "-a", "-P", "-h", "-o", "Account,User,FairShare"], self.env)
        except SlurmSourceError:
            return  # no accounting here: fair-share is absent, not an error
        for line in text.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 3 or not parts[1]:
                continue
            try:
                value = float(parts[2])
            except ValueError:
                continue
            out.add("slurm_fairshare", "each user's fair-share factor (1: under-served, 0: over-served)",
                    {"account": parts[0], "user": parts[1]}, value)
