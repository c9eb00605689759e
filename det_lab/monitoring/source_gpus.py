"""The GPU source: per GPU utilisation and memory, and who holds it, from NVML (nvidia-ml-py).

Without a driver (no libnvidia-ml, or nvmlInit failing with "driver not loaded") there are no GPU
series and no error: a CPU machine is not broken. NVML gives each compute process's host pid; its
owner, Slurm job and det_lab run come from ``/proc/<pid>`` (the exporter runs as root to read
another user's environment; otherwise those labels are empty). A container's id comes from the
pid's cgroup, which the recording rules join to Determined's ``det_container_id_runtime_container_id``.
"""

from __future__ import annotations

import pwd
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric

from det_lab.gpus.leases import HostBook
from det_lab.monitoring.collector import Families
from det_lab.nvml import GpuReading, read_gpus

_CONTAINER = re.compile(r"(?:docker-|/docker/|cri-containerd-|/containerd/)([0-9a-f]{64})")
#: environment variables that name what a process belongs to
SLURM_JOB_ENV = "SLURM_JOB_ID"
LOCAL_RUN_ENV = "DET_LAB_LOCAL_RUN"  # det_lab.runs.identity.LOCAL_RUN_ENV: the run's run.json
DET_TASK_ENV = "DET_TASK_ID"


def process_owner(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    """``user``, ``slurm_job``, ``run`` and ``container`` of a host pid ('' where unknown)."""
    out = {"user": "", "slurm_job": "", "run": "", "container": ""}
    base = proc / str(pid)
    try:
        uid = base.stat().st_uid
        out["user"] = pwd.getpwuid(uid).pw_name
    except KeyError:
        out["user"] = str(uid)
    except OSError:
        return out
    try:
        env = dict(item.split("=", 1) for item in (base / "environ").read_bytes().decode(errors="replace").split("\0")
                   if "=" in item)
    except OSError:
        env = {}
    out["slurm_job"] = env.get(SLURM_JOB_ENV, "")
    run_file = env.get(LOCAL_RUN_ENV, "")
    out["run"] = Path(run_file).parent.name if run_file else env.get(DET_TASK_ENV, "")
    try:
        match = _CONTAINER.search((base / "cgroup").read_text())
        out["container"] = match.group(1) if match else ""
    except OSError:
        pass
    return out


class GpuSource:
    """Every GPU of this machine that NVML sees."""

    name = "gpus"

    def __init__(self, ttl: float = 0.0, host: str | None = None) -> None:
        self.ttl = ttl
        self.host = host or socket.gethostname().split(".")[0]

    def collect(self) -> Iterable[Metric]:
        out = Families()
        readings = read_gpus()
        for reading in readings:
            self._device(out, reading)
        if readings:
            self._leases(out, readings)
        return list(out)

    def _leases(self, out: Families, readings: list[GpuReading]) -> None:
        """Each leased GPU's holder (det_lab.gpus: user, run, lease), and this machine's line for GPUs."""
        book = HostBook()
        live, _ = book.leases()
        index = {r.uuid: r.index for r in readings}
        for held in live:
            for lease in held.leases():
                out.add("gpu_lease_info", "", {"host": self.host, "gpu": str(index.get(lease.gpu_uuid, lease.gpu_index)),
                                               "uuid": lease.gpu_uuid, "user": lease.user, "run": lease.run,
                                               "project": lease.project, "lease": lease.lease_id,
                                               "pid": str(lease.pid)}, 1)
        waiting = [float(h.data["enqueued"]) for h in book.queue()]
        out.add("gpu_queue_length", "", {"host": self.host}, len(waiting))
        out.add("gpu_queue_oldest_wait_seconds", "", {"host": self.host},
                max(0.0, time.time() - min(waiting)) if waiting else 0.0)

    def _device(self, out: Families, reading: GpuReading) -> None:
        gpu = {"host": self.host, "gpu": str(reading.index), "uuid": reading.uuid}
        out.add("gpu_info", "1 per GPU NVML sees", {**gpu, "model": reading.name}, 1)
        if reading.utilization is not None:
            out.add("gpu_utilization_ratio", "fraction of the last sample period a kernel ran", gpu,
                    reading.utilization / 100.0)
        out.add("gpu_memory_used_bytes", "GPU memory in use", gpu, reading.memory_used)
        out.add("gpu_memory_total_bytes", "GPU memory in all", gpu, reading.memory_total)
        for pid, used in reading.processes:
            owner = process_owner(pid)
            out.add("gpu_process_memory_bytes", "GPU memory of each process, with its user, Slurm job, det_lab run "
                    "and container", {**gpu, "pid": str(pid), **owner}, used)
