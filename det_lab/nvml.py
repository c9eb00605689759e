"""This machine's GPUs as NVML (nvidia-ml-py) sees them: one reading per GPU, with its processes.

A leaf module (it imports nothing of det_lab): the exporter's GPU source, the local GPU leases and the
idle-GPU watchdog all read the GPUs through it. Without a driver (no libnvidia-ml, or nvmlInit failing
with "driver not loaded") there are no GPUs and no error: a CPU machine is not broken. A driver that
fails otherwise (the library and the kernel module differ after an upgrade without a reboot, an
"unknown error") raises ``pynvml.NVMLError``: a broken driver must never read as a machine without GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuReading:
    """One GPU, now: its NVML index and UUID, model, memory (bytes), utilisation and power, and the
    compute processes on it as ``(host pid, used bytes)`` (0 bytes where NVML cannot tell)."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: float | None  # percent of the last sample period a kernel ran; None: not supported
    power_w: float | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)


def nvml_module() -> Any:
    """pynvml, initialised (the caller calls ``nvmlShutdown``); None where there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return None
    return pynvml


def compute_processes(nvml: Any, handle: Any) -> list[Any]:
    """The GPU's compute processes; a driver before R510 has the ``_v2`` call (same struct), not the ``_v3``
    nvidia-ml-py calls."""
    older: tuple[type[BaseException], ...] = (nvml.NVMLError_FunctionNotFound,
                                               *((nvml.NVMLLibraryMismatchError,)
                                                 if hasattr(nvml, "NVMLLibraryMismatchError") else ()))
    try:
        return list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except older:
        return list(nvml.nvmlDeviceGetComputeRunningProcesses_v2(handle))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional(nvml: Any, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None where this GPU or driver does not support it."""
    try:
        return call(*args)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
        return None


def read_device(nvml: Any, index: int) -> GpuReading:
    """GPU ``index`` read through an initialised ``nvml``."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    util = _optional(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    milliwatts = _optional(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
    processes: list[tuple[int, int]] = []
    seen: set[int] = set()
    for p in compute_processes(nvml, handle):
        if p.pid in seen:
            continue
        seen.add(p.pid)
        # pynvml turns NVML_VALUE_NOT_AVAILABLE into None
        processes.append((int(p.pid), p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0))
    return GpuReading(index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)), name=_text(nvml.nvmlDeviceGetName(handle)),
                      memory_total=int(mem.total), memory_used=int(mem.used),
                      utilization=float(util.gpu) if util is not None else None,
                      power_w=milliwatts / 1000.0 if milliwatts is not None else None, processes=processes)


def read_gpus() -> list[GpuReading]:
    """Every GPU NVML sees, in index order; empty without a driver; raises ``pynvml.NVMLError`` when the
    driver fails."""
    nvml = nvml_module()
    if nvml is None:
        return []
    try:
        return [read_device(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
    finally:
        nvml.nvmlShutdown()
