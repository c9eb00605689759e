"""A trial's det_lab session: dataset pulled, metrics mirrored, checkpoints with lineage.

One hook point serves every kind of trial: the Determined Core API context. PyTorchTrials get
it from ``det.pytorch.init``; Core API loops from :func:`det_lab.core.init`. The session wraps
four of its methods, calling the original first so Determined always gets what it did before:

- ``train._report_trial_metrics``: every training, validation and custom metric group is
  mirrored (and, in local runs, written to the run's progress file);
- ``checkpoint.store_path``: checkpoint metadata gains a ``det_lab`` lineage record;
- ``checkpoint._report_checkpoint``: each completed checkpoint is mirrored and, locally,
  becomes the run's latest only now, so a crash mid-write leaves the previous one latest;
- ``preempt.should_preempt``: off-cluster, SIGTERM asks the trial to checkpoint and stop,
  as a cluster preemption would; the mirror is flushed before the trial exits.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import determined as det

from det_lab import __version__
from det_lab.compat import DETERMINED_VERSION
from det_lab.data import DatasetIdentity, PulledDataset, lookup
from det_lab.data import pull as pull_dataset
from det_lab.data.git import describe_commit
from det_lab.settings import LabSettings
from det_lab.tracking import DeliverySummary, Mirror, RunInfo, open_mirror
from det_lab.tracking.null_mirror import NullMirror
from det_lab.tracking.events import flatten, numeric
from det_lab.trials.expconf import LabTrialConfig, Length, lab_section, training_length
from det_lab.volume import VolumeLayout, atomic_write_text

log = logging.getLogger("det_lab.trials")

LOCAL_RUN_ENV = "DET_LAB_LOCAL_RUN"


@dataclass
class TrialIdentity:
    """Who this trial is, on a cluster or in a local run."""

    run: RunInfo
    on_cluster: bool
    exp_conf: dict[str, Any]
    hparams: dict[str, Any]
    latest_checkpoint: str | None
    run_dir: Path | None = None  # local runs: outputs/<project>/local-runs/<name>
    max_length: int | None = None  # for progress reporting
    seed: int | None = None  # local runs: seeds python, numpy and torch as Determined does on a cluster


def current_trial(exp_conf: dict[str, Any] | None = None, hparams: dict[str, Any] | None = None) -> TrialIdentity:
    """The identity of the running trial, from Determined or from ``det-lab run --local``."""
    info = det.get_cluster_info()
    if info is not None and info.task_type == "TRIAL":
        trial = info.trial
        exp, tid = trial.experiment_id, trial.trial_id
        url = f"{info.master_url}/det/experiments/{exp}/trials/{tid}"
        conf = trial._config
        name = conf.get("name") or f"experiment {exp}"
        tags = {"det.experiment_id": str(exp), "det.trial_id": str(tid), "det.trial_url": url,
                "det.cluster_id": info.cluster_id, "det.master_url": info.master_url}
        for key in ("workspace", "project"):
            if conf.get(key):
                tags[f"det.{key}"] = str(conf[key])
        run = RunInfo(key=f"det-{info.cluster_id}-e{exp}-t{tid}", name=f"{name} (trial {tid})",
                      experiment=tracker_experiment(_conf_project(conf)), tags=tags)
        return TrialIdentity(run, True, conf, dict(trial.hparams), info.latest_checkpoint)
    run_file = os.environ.get(LOCAL_RUN_ENV)
    if run_file:
        state = json.loads(Path(run_file).read_text())
        conf = state["exp_conf"]
        run = RunInfo(key=state["run_key"], name=state["name"], experiment=tracker_experiment(_conf_project(conf)),
                      tags={"det.local_run": state["name"], "det.local_run_dir": str(Path(run_file).parent)})
        return TrialIdentity(run, False, conf, state["hparams"], state.get("latest_checkpoint"),
                             Path(run_file).parent, state.get("max_length"), state.get("seed"))
    if exp_conf is None:
        raise RuntimeError(
            "not running on a Determined cluster nor under 'det-lab run --local': start it with "
            "'det-lab run <template> --local' or pass exp_conf/hparams"
        )
    name = exp_conf.get("name", "local")
    return TrialIdentity(RunInfo(key=f"local-{name}", name=name, experiment=tracker_experiment(_conf_project(exp_conf))),
                         False, exp_conf, dict(hparams or {}), None)


def tracker_experiment(project: str) -> str:
    """The MLflow/Aim experiment a project's runs go to."""
    return f"det_lab/{project}"


def _conf_project(conf: dict[str, Any]) -> str:
    return ((conf.get("data") or {}).get("det_lab") or {}).get("project", "default")


class LabSession:
    """What det_lab adds to one trial process. Use :meth:`start` then :meth:`close`."""

    def __init__(self, settings: LabSettings, identity: TrialIdentity, core_context: Any,
                 lab: LabTrialConfig | None = None) -> None:
        self.settings = settings
        self.identity = identity
        self.lab = lab or lab_section(identity.exp_conf)
        self.core = core_context
        self.dataset: PulledDataset | None = None
        self.mirror: Mirror | NullMirror = NullMirror(identity.run)
        self.checkpoints: list[str] = []
        self.lineage: dict[str, Any] = {}
        self.preempted = False
        self._preempt_requested = False

    @property
    def is_chief(self) -> bool:
        return self.core.distributed.rank == 0

    # --- start -----------------------------------------------------------------------------------

    def start(self) -> LabSession:
        if not self.identity.on_cluster and not logging.getLogger().handlers:
            # Determined's harness configures logging on a cluster; locally train.log would stay empty
            logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
        if self.identity.seed is not None:
            _seed_everything(self.identity.seed)
        self.dataset = self._pull_dataset()
        self.lineage = self._lineage()
        if self.is_chief:
            journal = self._journal_dir()
            self.mirror = open_mirror(self.settings, self.identity.run, journal, self.lab.tracking)
            self.mirror.log_params(self.identity.hparams)
            self.mirror.set_tags(flatten(self.lineage))
        self._instrument()
        if not self.identity.on_cluster:
            signal.signal(signal.SIGTERM, self._request_preempt)
        return self

    def _pull_dataset(self) -> PulledDataset | None:
        """Pull once per node (local rank 0); the node's other ranks wait for the result."""
        spec = self.lab.dataset_spec(lambda name: lookup(self.settings, name))
        if spec is None:
            return None
        dist = self.core.distributed
        if dist.local_rank == 0:
            pulled = pull_dataset(spec, self.settings)
            dist.broadcast_local((str(pulled.path), asdict(pulled.identity), pulled.fetched))
            return pulled
        path, ident, fetched = dist.broadcast_local(None)
        return PulledDataset(Path(path), DatasetIdentity(**ident), fetched)

    def _lineage(self) -> dict[str, Any]:
        lineage: dict[str, Any] = {
            "det_lab_version": __version__,
            "determined_version": DETERMINED_VERSION,
            "host": socket.gethostname(),
            "python": platform.python_version(),
            "code_commit": os.environ.get("DET_LAB_CODE_COMMIT") or describe_commit(Path.cwd()),
            "run_key": self.identity.run.key,
        }
        if self.dataset is not None:
            lineage["dataset"] = asdict(self.dataset.identity)
        return {k: v for k, v in lineage.items() if v is not None}

    @property
    def training_length(self) -> Length:
        return training_length(self.identity.exp_conf, self.lab)

    @property
    def outputs_dir(self) -> Path:
        """Where this trial writes anything besides checkpoints (renders, exported policies)."""
        if self.identity.run_dir is not None:
            return self.identity.run_dir
        return VolumeLayout.from_settings(self.settings).outputs(self.lab.project) / self.identity.run.key

    def _journal_dir(self) -> Path:
        if self.identity.run_dir is not None:
            return self.identity.run_dir / "tracking-journal"
        # on a cluster: on the volume, so a restarted trial on any machine finds the backlog
        return VolumeLayout.from_settings(self.settings).outputs(self.lab.project) / "tracking-journal" / self.identity.run.key

    # --- instrumentation -------------------------------------------------------------------------

    def _instrument(self) -> None:
        train, ckpt, preempt = self.core.train, self.core.checkpoint, self.core.preempt
        report_metrics, store_path = train._report_trial_metrics, ckpt.store_path
        report_checkpoint, should_preempt = ckpt._report_checkpoint, preempt.should_preempt

        def _report_trial_metrics(group, steps_completed, metrics, batch_metrics=None):
            result = report_metrics(group, steps_completed, metrics, batch_metrics)
            self._on_metrics(group, steps_completed, metrics)
            return result

        def _store_path(metadata=None, *args, **kwargs):
            return store_path({**(metadata or {}), "det_lab": self.lineage}, *args, **kwargs)

        def _report_checkpoint(storage_id, resources=None, metadata=None):
            result = report_checkpoint(storage_id, resources, metadata)
            self._on_checkpoint(storage_id, metadata or {})
            return result

        def _should_preempt(*args, **kwargs):
            answer = should_preempt(*args, **kwargs) or self._preempt_requested
            if answer and not self.preempted:
                self.preempted = True
                log.warning("det_lab: preemption requested: checkpointing and stopping")
                self.mirror.flush(timeout=5)
            return answer

        train._report_trial_metrics = _report_trial_metrics
        ckpt.store_path = _store_path
        ckpt._report_checkpoint = _report_checkpoint
        preempt.should_preempt = _should_preempt

    def _on_metrics(self, group: str, step: int, metrics: dict[str, Any]) -> None:
        self.mirror.log_metrics(group, step, metrics)
        if self.identity.run_dir is not None and self.is_chief:
            line = {"group": group, "step": int(step), "metrics": numeric(metrics)}
            with open(self.identity.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def _on_checkpoint(self, storage_id: str, metadata: dict[str, Any]) -> None:
        self.checkpoints.append(storage_id)
        step = int(metadata.get("steps_completed", 0))
        self.mirror.log_checkpoint(storage_id, step, {"dataset.md5": self.lineage.get("dataset", {}).get("md5", "")})
        self.mirror.flush(timeout=2)
        if self.identity.run_dir is not None and self.is_chief:
            state_file = self.identity.run_dir / "run.json"
            state = json.loads(state_file.read_text())
            state.update(latest_checkpoint=storage_id, latest_checkpoint_step=step)
            state.setdefault("checkpoints", []).append({"uuid": storage_id, "step": step})
            atomic_write_text(state_file, json.dumps(state, indent=2) + "\n")

    def _request_preempt(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self._preempt_requested = True

    # --- close -----------------------------------------------------------------------------------

    def close(self, status: str) -> DeliverySummary | None:
        if status == "FINISHED" and self.preempted:
            status = "KILLED"
        summary = self.mirror.close(status)  # type: ignore[arg-type]
        if summary is None:  # a rank that does not mirror
            return None
        if self.identity.run_dir is not None:
            atomic_write_text(self.identity.run_dir / "tracking-summary.json",
                              json.dumps({**asdict(summary), "journal": str(summary.journal),
                                          "status": status}, indent=2, default=str) + "\n")
        return summary


def _seed_everything(seed: int) -> None:
    """What Determined does for a trial on a cluster (its local mode seeds nothing)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass
