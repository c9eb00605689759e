"""The shape of a run's ``run.json`` and the statuses it can hold: one definition for every reader.

``run.json`` is written by ``det-lab run`` (:func:`det_lab.runs.local.prepare`), by the trial
(:class:`det_lab.trials.session.LabSession`), by the GPU line (:mod:`det_lab.gpus`) and by the Slurm
driver (:mod:`det_lab.slurm`); :meth:`det_lab.runs.record.RunRecord.state` returns it as a
:class:`RunState`. The statuses are :class:`RunStatus` values (``str``: they compare equal to the
strings run.json holds, so a record written before this module reads the same).
"""

from __future__ import annotations

import enum
from typing import Any, TypedDict


class RunStatus(str, enum.Enum):
    """A run's ``status`` in run.json; ``died`` is derived (a local run whose trainer is gone)."""

    CREATED = "created"  #: prepared, not training yet (a record without a status reads as this)
    WAITING = "waiting"  #: in this machine's line for GPUs (``det-lab run --local --queue``)
    QUEUED = "queued"  #: its Slurm job is submitted
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"  #: stopped early (preempted, cancelled by its trial), resumable
    FAILED = "failed"
    CANCELLED = "cancelled"
    PRUNED = "pruned"  #: a search's trial that Optuna pruned
    DELETING = "deleting"  #: a ``det-lab runs delete`` under way
    DIED = "died"  #: never written: what a "running" local run reads as once its trainer is gone

    def __str__(self) -> str:
        return self.value


#: statuses after which a run's trial will not run again on its own
ENDED: frozenset[str] = frozenset(s.value for s in (RunStatus.FINISHED, RunStatus.FAILED, RunStatus.STOPPED,
                                                    RunStatus.CANCELLED, RunStatus.PRUNED))
#: statuses of a run whose trial trains now (the metrics age alerts watch these)
LIVE: frozenset[str] = frozenset({RunStatus.RUNNING.value})


class SlurmState(TypedDict, total=False):
    """``run.json``'s ``slurm`` section (:class:`det_lab.slurm.record.SlurmRunRecord`)."""

    job_id: str
    partition: str
    nodes: int
    gpus_per_node: int
    script: str
    attempts: list[dict[str, Any]]


class CheckpointEntry(TypedDict):
    """One complete checkpoint of the run."""

    uuid: str
    step: int


class RunState(TypedDict, total=False):
    """A run's ``run.json``. Every key may be missing (records written by older versions, a run
    still being prepared); read with ``.get`` where it may be."""

    format: dict[str, Any]  #: the stamp of its on-disk format (:data:`det_lab.ondisk.RUN_RECORD`)
    kind: str  #: the record class (:func:`det_lab.runs.record.open_record`)
    name: str
    run_key: str
    template: str
    config: str
    cwd: str
    command: str
    exp_conf: dict[str, Any]
    hparams: dict[str, Any]
    max_length: int
    max_length_unit: str  #: "batches" or "epochs"
    seed: int | None
    created: str
    status: str  #: a :class:`RunStatus` value
    trial_status: str | None  #: what the trial itself reported: FINISHED, KILLED, FAILED
    exit_code: int
    user: str
    host: str
    resumed: int
    latest_checkpoint: str | None
    latest_checkpoint_step: int
    checkpoints: list[CheckpointEntry]
    lineage: dict[str, Any]
    gpu_efficiency: dict[str, Any]
    slurm: SlurmState
    search: dict[str, Any]
    reproduces: dict[str, Any]
    progress: dict[str, Any]
    waiting_for_gpus: dict[str, Any] | None
    deleting: dict[str, Any]
