"""PyTorchTrial base class and its script entrypoint.

    class MyTrial(LabPyTorchTrial):
        def __init__(self, context):
            super().__init__(context)          # dataset pulled, session started
            self.data_dir = self.dataset_path  # read-only snapshot of the revision in the config
        ...

    if __name__ == "__main__":
        run(MyTrial)                           # entrypoint: python3 train.py

The legacy ``entrypoint: model_def:MyTrial`` form works too: the harness builds the trial and
``LabPyTorchTrial.__init__`` starts the session itself.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from typing import Any

from determined import pytorch

from det_lab.settings import LabSettings, load_settings
from det_lab.runs.expconf import lab_section, period
from det_lab.trials.distributed import off_cluster_distributed
from det_lab.runs.harness import (
    allow_harness_unpickling,
    core_context_of,
    harness_shims,
    seeding_shuffle,
    tensorboard_available,
)
from det_lab.runs.identity import read_identity
from det_lab.trials.session import LabSession, local_checkpoint_dir
from det_lab.trials.surface import TrialSurface

log = logging.getLogger("det_lab.trials")

_current: LabSession | None = None  # the session run() started for the trial it is building


#: the methods Determined's harness calls on a trial
_TRIAL_METHODS = ("build_training_data_loader", "build_validation_data_loader", "train_batch", "evaluate_batch")


def _noting_exit(method: Callable[..., Any], session: LabSession) -> Callable[..., Any]:
    """``method``, noting the code of a ``SystemExit`` it raises on ``session`` (then re-raising)."""

    @functools.wraps(method)
    def noted(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except SystemExit as exc:
            session.exit_code = exc.code
            raise

    return noted


class LabPyTorchTrial(TrialSurface, pytorch.PyTorchTrial):
    """A ``det.pytorch.PyTorchTrial`` with det_lab's session and :class:`TrialSurface`'s names."""

    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        global _current
        core = core_context_of(context)
        if _current is not None and _current.core is core:
            self.session = _current
        else:  # built by Determined's own harness (module:Class entrypoint): no harness_shims here
            allow_harness_unpickling()
            identity = read_identity(context.get_experiment_config(), context.get_hparams())
            self.session = LabSession(load_settings(), identity, core).start()
            _current = self.session
            atexit.register(self.session.close_at_exit)
            self.build_training_data_loader = seeding_shuffle(self.build_training_data_loader)
            for name in _TRIAL_METHODS:
                if callable(getattr(self, name, None)):
                    setattr(self, name, _noting_exit(getattr(self, name), self.session))
        self.context = context



def run(trial_cls: type[LabPyTorchTrial], *, settings: LabSettings | None = None,
        exp_conf: dict[str, Any] | None = None, hparams: dict[str, Any] | None = None) -> LabSession:
    """Train ``trial_cls`` with ``det.pytorch.Trainer`` on a cluster or in a local run.

    Training length, validation and checkpoint periods come from the experiment config;
    ``latest_checkpoint`` from Determined (cluster) or the local run's state (``--resume``).
    """
    global _current
    settings = settings or load_settings()
    identity = read_identity(exp_conf, hparams)
    conf = identity.exp_conf
    lab = lab_section(conf)
    ckpt = None if identity.on_cluster else local_checkpoint_dir(settings, lab.project, conf)
    status = "FAILED"
    with harness_shims(ckpt, [settings.data_root]):
        with pytorch.init(hparams=identity.hparams, exp_conf=conf,
                          distributed=off_cluster_distributed(identity.on_cluster),
                          enable_tensorboard_logging=tensorboard_available()) as ctx:
            session = LabSession(settings, identity, core_context_of(ctx), lab, checkpoint_dir=ckpt).start()
            _current = session
            try:
                trial = trial_cls(ctx)
                fit_args: dict[str, Any] = dict(
                    max_length=session.training_length.unit(),
                    validation_period=period(conf, "min_validation_period"),
                    checkpoint_period=period(conf, "min_checkpoint_period"),
                    latest_checkpoint=identity.latest_checkpoint,
                    checkpoint_policy=conf.get("checkpoint_policy", "best"),
                )
                if not identity.on_cluster:
                    # "best" is unsupported locally and Determined falls back to "all", a checkpoint
                    # at every validation; "none" keeps to min_checkpoint_period (and the end)
                    fit_args["checkpoint_policy"] = "none"
                if lab.reporting_batches:
                    fit_args["reporting_period"] = pytorch.Batch(lab.reporting_batches)
                pytorch.Trainer(trial, ctx).fit(**fit_args)
                status = "FINISHED"
            finally:
                session.close(status)
                _current = None
    return session

