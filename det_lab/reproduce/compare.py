"""Comparing two runs' metrics step by step, and the one-line verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

RTOL = 1e-5
ATOL = 1e-8


@dataclass
class MetricDiff:
    """One metric (``<group>/<name>``) over the steps both runs should have."""

    key: str
    steps: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    first_beyond: int | None = None  # first step beyond tolerance (or missing from the new run)
    exact: bool = True


@dataclass
class Comparison:
    metrics: list[MetricDiff] = field(default_factory=list)
    rtol: float = RTOL
    atol: float = ATOL
    from_step: int = 0

    @property
    def diverged_at(self) -> int | None:
        steps = [m.first_beyond for m in self.metrics if m.first_beyond is not None]
        return min(steps) if steps else None

    @property
    def verdict(self) -> str:
        if not any(m.steps for m in self.metrics):  # e.g. continued from the original's last checkpoint
            after = f" after step {self.from_step}" if self.from_step else ""
            return f"nothing to compare: the original run recorded no metrics{after}"
        if self.diverged_at is not None:
            which = sorted(m.key for m in self.metrics if m.first_beyond == self.diverged_at)
            return f"diverged at step {self.diverged_at} ({', '.join(which)})"
        if all(m.exact for m in self.metrics):
            return "reproduced exactly"
        return f"reproduced within tolerance (rtol={self.rtol:g}, atol={self.atol:g})"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "diverged_at": self.diverged_at, "from_step": self.from_step,
                "rtol": self.rtol, "atol": self.atol,
                "metrics": [vars(m) for m in self.metrics]}


def series(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """``{"<group>/<name>": {step: value}}`` from a run's metrics records."""
    out: dict[str, dict[int, float]] = {}
    for rec in records:
        for key, value in rec["metrics"].items():
            out.setdefault(f"{rec['group']}/{key}", {})[int(rec["step"])] = float(value)
    return out


def compare(original: list[dict[str, Any]], new: list[dict[str, Any]], from_step: int = 0,
            rtol: float = RTOL, atol: float = ATOL) -> Comparison:
    """Every metric of ``original`` after ``from_step`` against ``new``, step by step."""
    a, b = series(original), series(new)
    result = Comparison(rtol=rtol, atol=atol, from_step=from_step)
    for key in sorted(a):
        diff = MetricDiff(key)
        for step in sorted(s for s in a[key] if s > from_step):
            diff.steps += 1
            x, y = a[key][step], b.get(key, {}).get(step)
            if y is None:
                diff.exact = False
                diff.first_beyond = step if diff.first_beyond is None else diff.first_beyond
                continue
            if x == y or (math.isnan(x) and math.isnan(y)):
                continue
            diff.exact = False
            d = abs(x - y)
            diff.max_abs = max(diff.max_abs, d)
            diff.max_rel = max(diff.max_rel, d / abs(x) if x else math.inf)
            # a NaN or infinity against anything else is beyond any tolerance (d > ... is False for NaN)
            beyond = not math.isfinite(d) or d > atol + rtol * abs(x)
            if beyond and diff.first_beyond is None:
                diff.first_beyond = step
        result.metrics.append(diff)
    return result
