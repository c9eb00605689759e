"""A trial's own GPU efficiency: its chief samples its GPUs through NVML on a thread of its own.

Which GPUs: those ``CUDA_VISIBLE_DEVICES`` names (indices or UUIDs), else those NVML lists this
process on. Each sample (utilization, memory used, power) goes to the tracker run as a ``system``
metric (its step: Unix seconds, so a resumed run's samples follow its first run's), and into a
summary kept in ``run.json`` at the end (``gpu_efficiency``): mean utilization, mean and peak
memory, mean power per GPU, with notes in the manner of Princeton's jobstats. SM activity needs
DCGM's profiling metrics (not NVML's), which GeForce cards before Blackwell do not report: it is
not sampled. Any NVML error ends sampling, never the trial.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from det_lab.nvml import GpuReading, nvml_module, read_device

log = logging.getLogger("det_lab.trials")
DEFAULT_INTERVAL_S = 10.0
#: under this mean utilization a run's note says its GPU waited (for data, most often)
LOW_UTILIZATION = 50.0
#: under this fraction of a GPU's memory at peak, the note says how little it used
LOW_MEMORY = 0.5
GB = 1e9


@dataclass
class _Gpu:
    index: int
    uuid: str
    name: str
    total: int
    samples: int = 0
    util_sum: float = 0.0
    util_n: int = 0
    mem_sum: float = 0.0
    mem_peak: int = 0
    power_sum: float = 0.0
    power_n: int = 0

    def add(self, r: GpuReading) -> None:
        self.samples += 1
        if r.utilization is not None:
            self.util_sum += r.utilization
            self.util_n += 1
        self.mem_sum += r.memory_used
        self.mem_peak = max(self.mem_peak, r.memory_used)
        if r.power_w is not None:
            self.power_sum += r.power_w
            self.power_n += 1

    def summary(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "samples": self.samples,
                "utilization_mean": self.util_sum / self.util_n if self.util_n else None,
                "memory_mean_bytes": self.mem_sum / self.samples if self.samples else 0,
                "memory_peak_bytes": self.mem_peak, "memory_total_bytes": self.total,
                "power_mean_w": self.power_sum / self.power_n if self.power_n else None,
                "sm_activity_mean": None}


def _visible(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


class GpuSampler:
    """Samples this process's GPUs every ``interval`` s until :meth:`stop`; ``on_sample(step, metrics)``
    gets each sample (the tracker's system metrics)."""

    def __init__(self, interval: float = DEFAULT_INTERVAL_S,
                 on_sample: Callable[[int, dict[str, float]], None] | None = None,
                 visible: str | None = None, pid: int | None = None) -> None:
        self.interval = interval
        self.on_sample = on_sample
        self.visible = _visible(visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.pid = pid or os.getpid()
        self.gpus: dict[str, _Gpu] = {}
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling; False (nothing started) where there is no NVIDIA driver."""
        try:
            nvml = nvml_module()
        except Exception as exc:  # noqa: BLE001 (a broken driver: no sampling, the trial goes on)
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        if nvml is None:
            return False
        self._thread = threading.Thread(target=self._run, args=(nvml,), name="det-lab-gpu-sampler", daemon=True)
        self._thread.start()
        return True

    def _mine(self, r: GpuReading) -> bool:
        if self.visible is not None:
            return str(r.index) in self.visible or any(r.uuid.startswith(v) for v in self.visible if v.startswith("GPU-"))
        return any(pid == self.pid for pid, _ in r.processes)

    def _run(self, nvml: Any) -> None:
        try:
            while True:
                self.sample(nvml)
                if self._stop.wait(self.interval):
                    break
        except Exception as exc:  # noqa: BLE001 (any NVML error stops sampling, not the trial)
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("det_lab: GPU sampling stopped: %s", self.error)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:  # noqa: BLE001 (a driver gone mid-run: nothing to shut down)
                log.debug("det_lab: nvmlShutdown: %s", exc)

    def sample(self, nvml: Any) -> None:
        """One sample of this process's GPUs."""
        metrics: dict[str, float] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            r = read_device(nvml, index)
            if not self._mine(r):
                continue
            gpu = self.gpus.setdefault(r.uuid, _Gpu(r.index, r.uuid, r.name, r.memory_total))
            gpu.add(r)
            if r.utilization is not None:
                metrics[f"gpu{r.index}.utilization"] = r.utilization
            metrics[f"gpu{r.index}.memory_used_gb"] = r.memory_used / GB
            if r.power_w is not None:
                metrics[f"gpu{r.index}.power_w"] = r.power_w
        if metrics and self.on_sample is not None:
            try:
                self.on_sample(int(time.time()), metrics)
            except Exception as exc:  # noqa: BLE001 (a tracker problem is not the sampler's end)
                log.warning("det_lab: GPU sample not mirrored: %s", exc)

    def stop(self, hints: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Stop sampling; the summary (None when nothing was sampled). ``hints``: ``num_workers``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        if not self.gpus:
            return None
        gpus = [g.summary() for g in sorted(self.gpus.values(), key=lambda g: g.index)]
        return {"interval_s": self.interval, "gpus": gpus, "notes": notes(gpus, hints or {}), "hints": hints or {},
                **({"error": self.error} if self.error else {})}


def notes(gpus: list[dict[str, Any]], hints: dict[str, Any]) -> list[str]:
    """Short notes on a run's GPU use, in the manner of jobstats."""
    out = []
    for g in gpus:
        name = f"GPU {g['index']}" if len(gpus) > 1 else "GPU"
        util = g["utilization_mean"]
        if util is not None and util < 1:
            out.append(f"{name} unused: utilization {util:.1f} %; does the code put its model and data on it?")
        elif util is not None and util < LOW_UTILIZATION:
            workers = hints.get("num_workers")
            why = f" (num_workers={workers})" if workers is not None else ""
            out.append(f"{name} busy {util:.0f} % of the time: the data loader may be the bottleneck{why}")
        total = g["memory_total_bytes"]
        if total and g["memory_peak_bytes"] < LOW_MEMORY * total:
            out.append(f"{name} peak memory {g['memory_peak_bytes'] / GB:.0f} of {total / GB:.0f} GB")
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """A run's efficiency summary as lines for ``runs show``."""
    lines = []
    for g in summary.get("gpus", []):
        util = g["utilization_mean"]
        power = g["power_mean_w"]
        lines.append(f"GPU {g['index']} ({g['name']}): utilization {'-' if util is None else f'{util:.1f} %'}, "
                     f"memory peak {g['memory_peak_bytes'] / GB:.1f} of {g['memory_total_bytes'] / GB:.1f} GB, "
                     f"power {'-' if power is None else f'{power:.0f} W'}; {g['samples']} samples")
    return lines + list(summary.get("notes", []))


def _weighted(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    """``key``'s mean over both summaries' samples (one without it counts for nothing)."""
    vals = [(s[key], s["samples"]) for s in (a, b) if s[key] is not None]
    return sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None


def merge(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """A resumed run's summary: each GPU's means over both attempts' samples, the higher peak."""
    if not before or not isinstance(before.get("gpus"), list):
        return after
    old = {g["uuid"]: g for g in before["gpus"]}
    gpus = []
    for g in after["gpus"]:
        p = old.pop(g["uuid"], None)
        if p is None:
            gpus.append(g)
            continue
        gpus.append({**g, "samples": p["samples"] + g["samples"],
                     **{key: _weighted(p, g, key) for key in ("utilization_mean", "memory_mean_bytes", "power_mean_w")},
                     "memory_peak_bytes": max(p["memory_peak_bytes"], g["memory_peak_bytes"])})
    gpus += list(old.values())
    gpus.sort(key=lambda g: g["index"])
    return {**after, "gpus": gpus, "notes": notes(gpus, after.get("hints", {}))}
