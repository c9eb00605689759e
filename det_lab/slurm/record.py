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

from det_lab.trials.record import VolumeRunRecord, register
from det_lab.trials.run_state import ENDED

JOB_SCRIPT = "job.sbatch"


@register
class SlurmRunRecord(VolumeRunRecord):
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

    @classmethod
    def scheduler_listing(cls) -> Any:
        from det_lab.slurm import submit

        return submit.one_listing()

    def scheduled(self, state: dict[str, Any]) -> str | None:
        """The run's Slurm job while Slurm still runs or queues it (a requeued job too, whatever
        run.json says). A job Slurm cannot be asked about counts as scheduled unless run.json
        recorded an end."""
        from det_lab.slurm import submit

        job_id = (state.get("slurm") or {}).get("job_id")
        if not job_id:
            return None
        try:
            job = submit.job_state(job_id)
        except submit.SlurmError as exc:
            if state.get("status") in ENDED:  # the job will not start the trial again
                return None
            return f"Slurm does not answer about its job {job_id} ({exc})"
        if job is None or job.get("JobState") in submit.FINAL_STATES:
            return None
        return f"its Slurm job {job_id} is {job.get('JobState', '?').lower()}"

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
