"""The idle rule over a sliding window of samples: means, not "every sample 0".

A holder is idle when, on each of its GPUs, the mean utilization over the last ``window`` seconds is
under ``utilization_below`` and the mean memory in use under ``memory_below`` (percent of the
GPU's). A job that used its GPU for a minute and then sat idle is caught once the window's mean
falls under the threshold, which "every sample exactly 0" since the job started never does. A
holder is judged only once its samples cover the whole window (a new job is never idle by default).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from det_lab.watchdog_settings import IdleRule

Sample = tuple[float, float, float]  # (time, utilization %, memory in use %)


@dataclass(frozen=True)
class Verdict:
    """A holder's window: whether it is idle, and the figures it was judged on."""

    covered: bool  # the samples span the whole window
    idle: bool
    mean_utilization: float
    mean_memory: float
    max_utilization: float
    samples: int

    def figures(self) -> dict[str, float | int]:
        return {"mean_utilization": round(self.mean_utilization, 2), "mean_memory": round(self.mean_memory, 2),
                "max_utilization": round(self.max_utilization, 2), "samples": self.samples}


def trim(samples: list[Sample], window: float, now: float) -> list[Sample]:
    """The samples of the last ``window`` seconds."""
    return [s for s in samples if s[0] >= now - window]


def judge(per_gpu: Mapping[Hashable, list[Sample]], rule: IdleRule, now: float, interval: float) -> Verdict:
    """The verdict on a holder from each of its GPUs' samples (``interval``: the time between two; a GPU
    is named by its index, or by its node and index for a job on several nodes)."""
    means_u, means_m, peak, count, covered = [], [], 0.0, 0, bool(per_gpu)
    for samples in per_gpu.values():
        kept = trim(samples, rule.window, now)
        # covered: the oldest kept sample is within one and a half intervals of the window's start
        if not kept or kept[0][0] > now - rule.window + 1.5 * interval:
            covered = False
        if not kept:
            continue
        means_u.append(sum(s[1] for s in kept) / len(kept))
        means_m.append(sum(s[2] for s in kept) / len(kept))
        peak = max(peak, max(s[1] for s in kept))
        count += len(kept)
    if not means_u:
        return Verdict(False, False, 0.0, 0.0, 0.0, 0)
    idle = covered and all(u < rule.utilization_below for u in means_u) and \
        all(m < rule.memory_below for m in means_m)
    return Verdict(covered, idle, max(means_u), max(means_m), peak, count)
