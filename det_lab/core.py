"""``det_lab.core.init``: Determined's Core API context, with det_lab's session around it.

    import det_lab.core
    with det_lab.core.init() as ctx:
        data_dir = ctx.dataset_path
        for step in range(start, ctx.training_length.value):
            ...
            ctx.train.report_training_metrics(step, {"loss": loss})
            if ctx.preempt.should_preempt(): ...

Everything of ``det.core.Context`` is there (``train``, ``checkpoint``, ``preempt``,
``distributed``, ``searcher``), instrumented; plus the names every det_lab trial has
(:class:`~det_lab.trials.surface.TrialSurface`: ``dataset_path``, ``hparams``,
``training_length``, ``outputs_dir``, ``mirror``, ``lineage``, ``latest_checkpoint``...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from determined import core as det_core

from det_lab.settings import LabSettings, load_settings
from det_lab.runs.expconf import lab_section
from det_lab.trials.distributed import off_cluster_distributed
from det_lab.runs.harness import harness_shims, tensorboard_available
from det_lab.runs.identity import read_identity
from det_lab.trials.session import LabSession, local_checkpoint_dir  # noqa: F401  (det_lab.core.local_checkpoint_dir)
from det_lab.trials.surface import TrialSurface


@dataclass
class LabContext(TrialSurface):
    """``det.core.Context`` plus what det_lab prepared for the trial (:class:`TrialSurface`)."""

    core: Any
    session: LabSession

    def __getattr__(self, name: str) -> Any:
        # train, checkpoint, preempt, distributed, searcher: the instrumented det.core.Context's own
        if name in ("core", "session"):  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.core, name)


@contextlib.contextmanager
def init(*, settings: LabSettings | None = None, exp_conf: dict[str, Any] | None = None,
         hparams: dict[str, Any] | None = None, distributed: Any = None,
         checkpoint_storage: str | None = None) -> Iterator[LabContext]:
    """Mirror of ``det.core.init`` for det_lab trials; see the module docstring."""
    settings = settings or load_settings()
    identity = read_identity(exp_conf, hparams)
    lab = lab_section(identity.exp_conf)
    ckpt = None if identity.on_cluster else Path(checkpoint_storage or local_checkpoint_dir(settings, lab.project, identity.exp_conf))
    with harness_shims(ckpt, [settings.data_root]):
        kwargs: dict[str, Any] = {"distributed": distributed or off_cluster_distributed(identity.on_cluster)}
        if identity.on_cluster and not tensorboard_available():
            # shim 2 for Core API trials: on a cluster AUTO builds TensorBoard's writer, which imports
            # tensorboard (or tensorflow) and ends a trial whose image has neither
            kwargs["tensorboard_mode"] = det_core.TensorboardMode.MANUAL
        if ckpt is not None:
            kwargs["checkpoint_storage"] = str(ckpt)
        elif checkpoint_storage is not None:
            kwargs["checkpoint_storage"] = checkpoint_storage
        with det_core.init(**kwargs) as core_context:
            session = LabSession(settings, identity, core_context, lab, checkpoint_dir=ckpt).start()
            status = "FAILED"
            try:
                yield LabContext(core_context, session)
                status = "FINISHED"
            finally:
                session.close(status)
