"""Who holds this machine's GPUs: Slurm jobs, det_lab runs, Determined tasks and local leases.

The holders are the ones the exporter labels its GPU series with. A Slurm job holds the GPUs Slurm
gave it on this node (``scontrol -d show job``: ``GRES=gpu:1(IDX:0)``, Slurm's index taken as NVML's,
as with det_lab's gres.conf, which lists ``/dev/nvidia0..`` in order), whether or not anything runs on
them (a forgotten ``salloc``). A process on a GPU outside Slurm is a det_lab run's trial
(``DET_LAB_LOCAL_RUN`` in its environment) or a Determined task's (``DET_TASK_ID``, ``DET_TASK_TYPE``,
``DET_USER``: master/pkg/tasks/task.go and master/internal/api_notebook.go). Reading another user's
``/proc/<pid>/environ`` needs root: the watchdog's unit runs as root.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from det_lab.nvml import GpuReading

HolderKind = Literal["slurm", "run", "determined", "lease"]
_IDX = re.compile(r"gpu[^(,]*\(IDX:([0-9,-]+)\)")
COMMAND_TIMEOUT = 30.0


@dataclass(frozen=True)
class Holder:
    """One holder of GPUs on this machine (``gpus``: NVML indices)."""

    key: str  # "slurm:<job id>", "run:<run name>", "determined:<task id>", "lease:<id>"
    kind: HolderKind
    user: str
    name: str
    gpus: tuple[int, ...]
    partition: str = ""
    interactive: bool = False  # a Slurm job from salloc or srun (BatchFlag=0)
    job_id: str = ""
    run_dir: str = ""  # a det_lab run's directory
    task_type: str = ""  # a Determined task's DET_TASK_TYPE (NOTEBOOK, SHELL, TRIAL, ...)
    pids: tuple[int, ...] = field(default=(), compare=False)
    #: a Slurm job's GPUs on each of its nodes, in Slurm's order (its first node first), when it has
    #: GPUs on more than one node: the job's watchdog-wide decision is the first node's
    nodes: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def first_node(self) -> str:
        """The node whose watchdog judges a job on several nodes ('' for a holder of one machine)."""
        return self.nodes[0][0] if self.nodes else ""

    @property
    def aliases(self) -> set[str]:
        """What a user may call it (``det-lab watchdog snooze``): its key, job id, run or task name."""
        return {a for a in (self.key, self.job_id, self.name) if a}

    @property
    def what(self) -> str:
        """The holder in words: ``salloc job 123``, ``run vla-...``, ``Determined notebook abc``."""
        if self.kind == "slurm":
            return f"{'interactive' if self.interactive else 'batch'} Slurm job {self.job_id} ({self.name})"
        if self.kind == "run":
            return f"det_lab run {self.name}"
        if self.kind == "determined":
            return f"Determined {self.task_type.lower() or 'task'} {self.name}"
        return f"GPU lease {self.name}"


def process_env(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    """The environment of ``pid`` ({} where it cannot be read)."""
    try:
        data = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in data.decode(errors="replace").split("\0") if "=" in item)


def _user_of(pid: int) -> str:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _indices(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_scontrol_jobs(text: str, node: str) -> list[Holder]:
    """The running jobs of ``scontrol -d -o show job`` output that hold GPUs on ``node``."""
    out = []
    for line in text.splitlines():
        fields = dict(m.groups() for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", line))
        if fields.get("JobState") != "RUNNING":
            continue
        per_node: dict[str, set[int]] = {}
        # one-line form: "Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=gpu:1(IDX:0)" per group of nodes alike
        for m in re.finditer(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)", line):
            idx = [i for text in _IDX.findall(m.group(2)) for i in _indices(text)]
            for name in expand_nodes(m.group(1)):
                if idx:
                    per_node.setdefault(name, set()).update(idx)
        gpus = sorted(per_node.get(node, ()))
        if not gpus:
            continue
        order = expand_nodes(fields.get("NodeList", ""))
        names = sorted(per_node, key=lambda n: (order.index(n) if n in order else len(order), n))
        nodes = tuple((n, tuple(sorted(per_node[n]))) for n in names) if len(names) > 1 else ()
        user = fields.get("UserId", "").split("(")[0]
        job_id = fields.get("JobId", "")
        out.append(Holder(key=f"slurm:{job_id}", kind="slurm", user=user, name=fields.get("JobName", ""),
                          gpus=tuple(sorted(set(gpus))), partition=fields.get("Partition", ""),
                          interactive=fields.get("BatchFlag") == "0", job_id=job_id, nodes=nodes))
    return out


def expand_nodes(text: str) -> list[str]:
    """A Slurm hostlist such as ``n[1-3,5],gpu7`` (one bracket a name), as names in its order (a
    zero-padded range keeps its width: ``n[01-02]``)."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\])?[^,\[]*", text):
        m = re.fullmatch(r"([^\[]*)\[([0-9,-]+)\](.*)", part)
        if not m:
            if part:
                out.append(part)
            continue
        for piece in m.group(2).split(","):
            lo, _, hi = piece.partition("-")
            if lo.isdigit() and (hi or lo).isdigit():
                out.extend(f"{m.group(1)}{i:0{len(lo)}d}{m.group(3)}" for i in range(int(lo), int(hi or lo) + 1))
    return out


#: where scontrol finds slurm.conf without SLURM_CONF (a configless node keeps slurmd's copy in /run)
SLURM_CONFS = (Path("/etc/slurm/slurm.conf"), Path("/run/slurm/conf/slurm.conf"))


def slurm_configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether this machine has a Slurm config scontrol would read (without one it retries for a minute)."""
    given = ({**os.environ, **env} if env is not None else os.environ).get("SLURM_CONF")
    return shutil.which("scontrol") is not None and any(p.is_file() for p in ((Path(given),) if given else SLURM_CONFS))


def slurm_holders(node: str, env: Mapping[str, str] | None = None) -> list[Holder]:
    """The running Slurm jobs holding GPUs on ``node``; [] where Slurm is not installed or does not answer."""
    if not slurm_configured(env):
        return []
    try:
        proc = subprocess.run(["scontrol", "-d", "-o", "show", "job"], capture_output=True, text=True, check=False,
                              timeout=COMMAND_TIMEOUT, env=None if env is None else {**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    return parse_scontrol_jobs(proc.stdout, node)


def process_holders(readings: Iterable[GpuReading], slurm_jobs: set[str]) -> list[Holder]:
    """det_lab runs and Determined tasks owning processes on the GPUs (those inside a Slurm job belong to it)."""
    found: dict[str, dict] = {}
    for gpu in readings:
        for pid, _used in gpu.processes:
            env = process_env(pid)
            if env.get("SLURM_JOB_ID") in slurm_jobs:
                continue
            run_file = env.get("DET_LAB_LOCAL_RUN")
            if run_file:
                run_dir = Path(run_file).parent
                h = found.setdefault(f"run:{run_dir.name}", {
                    "kind": "run", "user": _user_of(pid), "name": run_dir.name, "run_dir": str(run_dir),
                    "gpus": set(), "pids": set()})
            elif env.get("DET_TASK_ID"):
                task = env["DET_TASK_ID"]
                h = found.setdefault(f"determined:{task}", {
                    "kind": "determined", "user": env.get("DET_USER") or _user_of(pid), "name": task,
                    "task_type": env.get("DET_TASK_TYPE", ""), "gpus": set(), "pids": set()})
            else:
                continue
            h["gpus"].add(gpu.index)
            h["pids"].add(pid)
    return [Holder(key=key, **{**h, "gpus": tuple(sorted(h["gpus"])), "pids": tuple(sorted(h["pids"]))})
            for key, h in sorted(found.items())]


def lease_holders(settings, host: str) -> list[Holder]:
    """This machine's GPU leases (``det-lab run --local`` takes one per run), as holders: a run's lease
    is that run, with its GPUs whether or not its process is on them yet."""
    from det_lab.gpus import active_leases
    from det_lab.runs.record import LocalRunRecord
    from det_lab.volume import VolumeLayout

    layout = VolumeLayout.from_settings(settings)
    grouped: dict[str, dict] = {}
    for lease in active_leases(settings):
        if lease.host != host:
            continue
        h = grouped.setdefault(lease.lease_id, {"lease": lease, "gpus": set()})
        h["gpus"].add(lease.gpu_index)
    out = []
    for ident, h in sorted(grouped.items()):
        lease = h["lease"]
        if lease.run and lease.project:
            run_dir = LocalRunRecord.runs_root(layout, lease.project) / lease.run
            out.append(Holder(key=f"run:{lease.run}", kind="run", user=lease.user, name=lease.run,
                              gpus=tuple(sorted(h["gpus"])), run_dir=str(run_dir), pids=(lease.pid,)))
        else:
            out.append(Holder(key=f"lease:{ident}", kind="lease", user=lease.user, name=lease.run or ident,
                              gpus=tuple(sorted(h["gpus"])), pids=(lease.pid,)))
    return out


def discover(readings: list[GpuReading], node: str, host: str, settings=None,
             slurm_env: Mapping[str, str] | None = None) -> list[Holder]:
    """Every holder of this machine's GPUs now, once each (a run on a lease and on its GPUs is one run,
    on the GPUs of both)."""
    slurm = slurm_holders(node, slurm_env)
    found: dict[str, Holder] = {h.key: h for h in slurm}
    for h in process_holders(readings, {h.job_id for h in slurm}) + \
            (lease_holders(settings, host) if settings is not None else []):
        seen = found.get(h.key)
        found[h.key] = h if seen is None else replace(seen, gpus=tuple(sorted(set(seen.gpus) | set(h.gpus))))
    known = {g.index for g in readings}
    return [h for h in found.values() if set(h.gpus) & known]
