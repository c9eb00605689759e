"""The Slurm twin of a run record: a local-style run whose trial runs inside a Slurm job.

Its directory ``<data root>/outputs/<project>/slurm-runs/<name>/`` holds what a local run's holds
(``run.json``, ``train.log``, ``metrics.jsonl``, the tracking journal) plus the job script
(``job.sbatch``, resubmittable as is) and Slurm's own output (``slurm-<job id>.out``). ``run.json``
gains a ``slurm`` entry: the job id, and one attempt per start of the job (node, restart count),
so a requeued job's history stays readable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar

from det_lab.trials.record import LocalRunRecord, register

JOB_SCRIPT = "job.sbatch"


@register
class SlurmRunRecord(LocalRunRecord):
    """A ``det-lab run --slurm`` run (see the module docstring)."""

    kind = "slurm"
    runs_dirname: ClassVar[str] = "slurm-runs"

    @property
    def job_script(self) -> Path:
        return self.dir / JOB_SCRIPT

    def slurm(self) -> dict[str, Any]:
        return self.state().get("slurm") or {}

    def job_id(self) -> str | None:
        return self.slurm().get("job_id")

    def set_job(self, job_id: str, **details: Any) -> None:
        self.update(slurm={**self.slurm(), "job_id": job_id, **details})

    def start_attempt(self) -> dict[str, Any]:
        """Record this start of the job (inside it): node, restart count, time."""
        attempt = {"node": os.environ.get("SLURMD_NODENAME", ""), "job_id": os.environ.get("SLURM_JOB_ID", ""),
                   "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        slurm = self.slurm()
        slurm["attempts"] = [*slurm.get("attempts", []), attempt]
        self.update(slurm=slurm)
        return attempt

    def _last_attempt(self) -> dict[str, Any]:
        attempts = self.slurm().get("attempts") or [{}]
        return attempts[-1]

    def tracker_tags(self) -> dict[str, str]:
        last = self._last_attempt()
        return {**super().tracker_tags(), "slurm.job_id": str(self.job_id() or last.get("job_id", "")),
                "slurm.node": str(last.get("node", ""))}

    def lineage_extras(self) -> dict[str, Any]:
        last = self._last_attempt()
        return {"slurm_job_id": self.job_id() or last.get("job_id"), "slurm_node": last.get("node"),
                "slurm_restart": last.get("restart", 0)}
