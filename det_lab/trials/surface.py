"""What a trial's code sees of det_lab: one surface for ``LabPyTorchTrial`` and ``det_lab.core.init()``.

Both :class:`det_lab.trials.pytorch.LabPyTorchTrial` (``self.<name>``) and
:class:`det_lab.core.LabContext` (``ctx.<name>``) inherit :class:`TrialSurface`, so a template
uses the same names whichever way it trains:

=====================  ==============================================================
``dataset``            the pulled dataset (``.path``, ``.identity``), or None
``dataset_path``       its read-only snapshot directory (error when the config names none)
``hparams``            this trial's hyperparameters
``training_length``    ``Length``: ``.batches`` or ``.epochs``, ``.value`` (searcher's max_time wins)
``lab``                the config's ``data.det_lab`` section (``reporting_batches``...)
``outputs_dir``        this trial's directory for renders, logs and exports (created)
``work_dir``           where an RL training command runs (its ``logs/`` tree lives there; not created)
``mirror``             MLflow/Aim mirror for custom metrics and images (does nothing off-chief)
``lineage``            what each checkpoint records: versions, host, code commit, dataset
``latest_checkpoint``  the checkpoint to resume from, or None
``identity``           who this trial is: run key, tracker run name, project, cluster or not
``volume``             the shared volume's layout (``volume.outputs(lab.project)``: caches shared by trials)
=====================  ==============================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_lab.volume import VolumeLayout

if TYPE_CHECKING:
    from det_lab.data import PulledDataset
    from det_lab.tracking import Mirror
    from det_lab.tracking.null_mirror import NullMirror
    from det_lab.runs.expconf import LabTrialConfig, Length
    from det_lab.runs.identity import TrialIdentity
    from det_lab.trials.session import LabSession


class TrialSurface:
    """The det_lab names of a trial (see the module docstring); reads ``self.session``."""

    session: LabSession

    @property
    def dataset(self) -> PulledDataset | None:
        return self.session.dataset

    @property
    def dataset_path(self) -> Path:
        if self.session.dataset is None:
            raise RuntimeError("this experiment config names no dataset (data.det_lab.dataset)")
        return self.session.dataset.path

    @property
    def hparams(self) -> dict[str, Any]:
        return self.session.identity.hparams

    @property
    def training_length(self) -> Length:
        return self.session.training_length

    @property
    def lab(self) -> LabTrialConfig:
        return self.session.lab

    @property
    def outputs_dir(self) -> Path:
        path = self.session.outputs_dir
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def work_dir(self) -> Path:
        return self.session.record.rl_work_dir

    @property
    def mirror(self) -> Mirror | NullMirror:
        return self.session.mirror

    @property
    def lineage(self) -> dict[str, Any]:
        return self.session.lineage

    @property
    def latest_checkpoint(self) -> str | None:
        return self.session.identity.latest_checkpoint

    @property
    def identity(self) -> TrialIdentity:
        return self.session.identity

    @property
    def volume(self) -> VolumeLayout:
        return VolumeLayout.from_settings(self.session.settings)
