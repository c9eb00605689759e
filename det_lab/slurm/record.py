"""The Slurm twin of a run record: a local-style run whose trial runs inside a Slurm job.

Its directory ``<data root>/outputs/<project>/slurm-runs/<name>/`` holds what a local run's holds
(``run.json``, ``train.log``, ``metrics.jsonl``, the tracking journal) plus the job script
(``job.sbatch``, resubmittable as is) and Slurm's own output (``slurm-<job id>.out``). ``run.json``
gains a ``slurm`` entry: the job id, and one attempt per start of the job (node, restart count,
attempt epoch, every node of a multi-node job, and how it ended), so a requeued job's history
stays readable: a start that follows one that never recorded its end says where it moved from and
why (``moved_from``, ``why``: the previous start's state in Slurm's accounting, such as NODE_FAIL).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar

from det_lab.runs.record import VolumeRunRecord, register
from det_lab.runs.run_state import ENDED

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

    def start_attempt(self, epoch: int | None = None, nodes: list[str] | None = None) -> dict[str, Any]:
        """Record this start of the job (inside it): node, restart count, time, attempt epoch, every
        node of a multi-node job (``nodes``, the first one running global rank 0), and where and why
        it moved when the previous start never recorded its end."""
        attempt: dict[str, Any] = {
            "node": os.environ.get("SLURMD_NODENAME", ""), "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if epoch is not None:
            attempt["epoch"] = epoch
        if nodes and len(nodes) > 1:
            attempt["nodes"] = list(nodes)
        slurm = self.slurm()
        previous = (slurm.get("attempts") or [None])[-1]
        if previous and "ended" not in previous:  # it died (or was cut off) without recording its end
            if previous.get("node") != attempt["node"]:
                attempt["moved_from"] = previous.get("node")
            attempt["why"] = _why_restarted(previous, attempt)
        slurm["attempts"] = [*slurm.get("attempts", []), attempt]
        self.update(slurm=slurm)
        return attempt

    def end_attempt(self, epoch: int, code: int) -> None:
        """Record how the start with ``epoch`` ended (its trial's exit code), before the run's outcome."""
        slurm = self.slurm()
        for attempt in reversed(slurm.get("attempts") or []):
            if attempt.get("epoch") == epoch:
                attempt.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S"), exit_code=code)
                self.update(slurm=slurm)
                return

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


def _why_restarted(previous: dict[str, Any], attempt: dict[str, Any]) -> str:
    """Why the job started again after ``previous`` ended unrecorded: its state in Slurm's accounting
    (``sacct --duplicates`` lists each start of a requeued job, sacct(1)), else what is known."""
    from det_lab.slurm import submit

    node = previous.get("node") or "?"
    state = submit.previous_start_state(str(attempt.get("job_id") or ""))
    cause = {"NODE_FAIL": f"node {node} stopped answering Slurm (NODE_FAIL)",
             "REQUEUED": f"Slurm requeued it from node {node}",
             "PREEMPTED": f"it was preempted on node {node}"}.get(state or "", f"its start on {node} ended "
                                                                        f"without recording its end"
                                                                        + (f" (Slurm: {state})" if state else ""))
    return f"{cause}; Slurm started the job again (restart {attempt.get('restart')}) on {attempt.get('node')}"
