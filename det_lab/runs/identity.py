"""Who the running trial is, read once where it starts.

Twins: a trial run by a Determined master (``det.get_cluster_info()``), a local-style run
started by det_lab (``$DET_LAB_LOCAL_RUN`` names its ``run.json``: ``det-lab run --local``,
Slurm), or a bare ``det_lab.core.init(exp_conf=...)`` outside either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.tracking import RunInfo
from det_lab.runs.expconf import project_of
from det_lab.runs.harness import trial_config
from det_lab.runs.record import open_record

LOCAL_RUN_ENV = "DET_LAB_LOCAL_RUN"


@dataclass(frozen=True)
class TrialIdentity:
    """Who this trial is: its tracker run, project, config and where it resumes from."""

    run: RunInfo  # .key: the run key every record of this trial carries
    project: str
    on_cluster: bool
    exp_conf: dict[str, Any]
    hparams: dict[str, Any]
    latest_checkpoint: str | None
    seed: int | None = None  # local-style runs: seeds python, numpy and torch as Determined does on a cluster
    record_dir: Path | None = None  # local-style runs: the run's directory


def tracker_experiment(project: str) -> str:
    """The MLflow/Aim experiment a project's runs go to."""
    return f"det_lab/{project}"


def read_identity(exp_conf: dict[str, Any] | None = None, hparams: dict[str, Any] | None = None) -> TrialIdentity:
    """The identity of the running trial (see the module docstring)."""
    import determined as det

    info = det.get_cluster_info()
    if info is not None and info.task_type == "TRIAL":
        trial = info.trial
        exp, tid = trial.experiment_id, trial.trial_id
        url = f"{info.master_url}/det/experiments/{exp}/trials/{tid}"
        conf = trial_config(info)
        name = conf.get("name") or f"experiment {exp}"
        tags = {"det.experiment_id": str(exp), "det.trial_id": str(tid), "det.trial_url": url,
                "det.cluster_id": info.cluster_id, "det.master_url": info.master_url}
        for key in ("workspace", "project"):
            if conf.get(key):
                tags[f"det.{key}"] = str(conf[key])
        project = project_of(conf)
        run = RunInfo(key=f"det-{info.cluster_id}-e{exp}-t{tid}", name=f"{name} (trial {tid})",
                      experiment=tracker_experiment(project), tags=tags)
        return TrialIdentity(run, project, True, conf, dict(trial.hparams), info.latest_checkpoint)
    run_file = os.environ.get(LOCAL_RUN_ENV)
    if run_file:
        record = open_record(Path(run_file).parent)
        state = record.state()
        conf = state["exp_conf"]
        project = project_of(conf)
        run = RunInfo(key=state["run_key"], name=state["name"], experiment=tracker_experiment(project),
                      tags=record.tracker_tags())
        return TrialIdentity(run, project, False, conf, state["hparams"], state.get("latest_checkpoint"),
                             state.get("seed"), record.dir)
    if exp_conf is None:
        raise RuntimeError(
            "not running on a Determined cluster nor under 'det-lab run --local': start it with "
            "'det-lab run <template> --local' or pass exp_conf/hparams"
        )
    name = exp_conf.get("name", "local")
    project = project_of(exp_conf)
    return TrialIdentity(RunInfo(key=f"local-{name}", name=name, experiment=tracker_experiment(project)),
                         project, False, exp_conf, dict(hparams or {}), None)
