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
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric

from det_lab.monitoring.collector import Families

_CONTAINER = re.compile(r"(?:docker-|/docker/|cri-containerd-|/containerd/)([0-9a-f]{64})")
#: environment variables that name what a process belongs to
SLURM_JOB_ENV = "SLURM_JOB_ID"
LOCAL_RUN_ENV = "DET_LAB_LOCAL_RUN"  # det_lab.trials.identity.LOCAL_RUN_ENV: the run's run.json
DET_TASK_ENV = "DET_TASK_ID"


def _nvml():
    """pynvml, initialised; None where there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return None
    return pynvml


def _compute_processes(nvml, handle) -> list:
    """The GPU's compute processes; a driver before R510 has the ``_v2`` call (same struct), not the ``_v3``
    nvidia-ml-py calls."""
    try:
        return nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except (nvml.NVMLError_FunctionNotFound, getattr(nvml, "NVMLLibraryMismatchError", ())):
        return nvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)


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
        nvml = _nvml()
        if nvml is None:
            return []
        out = Families()
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                self._device(out, nvml, index)
        finally:
            nvml.nvmlShutdown()
        return list(out)

    def _device(self, out: Families, nvml, index: int) -> None:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        model = nvml.nvmlDeviceGetName(handle)
        gpu = {"host": self.host, "gpu": str(index), "uuid": uuid}
        out.add("gpu_info", "1 per GPU NVML sees", {**gpu, "model": model.decode() if isinstance(model, bytes) else model}, 1)
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        out.add("gpu_utilization_ratio", "fraction of the last sample period a kernel ran", gpu, util.gpu / 100.0)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        out.add("gpu_memory_used_bytes", "GPU memory in use", gpu, mem.used)
        out.add("gpu_memory_total_bytes", "GPU memory in all", gpu, mem.total)
        seen: set[int] = set()
        for p in _compute_processes(nvml, handle):
            if p.pid in seen:
                continue
            seen.add(p.pid)
            owner = process_owner(p.pid)
            used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
            out.add("gpu_process_memory_bytes", "GPU memory of each process, with its user, Slurm job, det_lab run "
                    "and container", {**gpu, "pid": str(p.pid), **owner}, used)
