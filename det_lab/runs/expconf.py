"""det_lab's part of a Determined experiment config, and the training lengths in it.

A template's config carries det_lab's settings under ``data.det_lab`` (Determined passes
``data`` through untouched)::

    data:
      det_lab:
        project: vla
        dataset: vla-demo                  # a registered name, {repo:, path:, rev:}, or {dir:}
        tracking: mlflow                   # optional: overrides the lab config's backend
        max_length: {batches: 600}         # training length (ASHA's max_time wins when set)
        base_model: lerobot/smolvla_base   # optional: hub ids the run loads from the volume's model store
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError, field_validator, model_validator

from det_lab.errors import UserError
from det_lab.data import DatasetSpec
from det_lab.data.directory import DirectorySpec
from det_lab.models import check_name
from det_lab.settings import StrictModel



class DatasetRef(StrictModel):
    repo: str
    path: str
    rev: str = "HEAD"


class DatasetDir(StrictModel):
    """A directory on the volume read in place (det_lab.data.directory); relative to the data root."""

    dir: str


class Length(StrictModel):
    batches: int | None = None
    epochs: int | None = None

    @model_validator(mode="after")
    def _one(self) -> Length:
        if (self.batches is None) == (self.epochs is None):
            raise ValueError("give exactly one of batches or epochs")
        if (self.batches or self.epochs or 0) <= 0:
            raise ValueError("must be positive")
        return self

    def unit(self):
        from determined import pytorch

        return pytorch.Batch(self.batches) if self.batches else pytorch.Epoch(self.epochs)

    @property
    def value(self) -> int:
        return self.batches or self.epochs or 0


class LabTrialConfig(StrictModel):
    project: str
    dataset: str | DatasetRef | DatasetDir | None = None
    tracking: Literal["mlflow", "aim", "both", "none"] | None = None
    max_length: Length | None = None
    reporting_batches: int | None = None  # how often training metrics are reported (default 100)
    base_model: str | list[str] | None = None  # hub ids in det_lab.models' store; the lineage names their revisions

    @field_validator("base_model")
    @classmethod
    def _hub_ids(cls, v: str | list[str] | None) -> str | list[str] | None:
        for name in [v] if isinstance(v, str) else v or []:
            check_name(name)
        return v

    @property
    def base_models(self) -> list[str]:
        """The hub ids ``base_model`` names (none, one or several)."""
        return [self.base_model] if isinstance(self.base_model, str) else list(self.base_model or [])

    def dataset_spec(self, lookup) -> DatasetSpec | DirectorySpec | None:
        """The spec to pull: a registered name is resolved through ``lookup(name)``."""
        if self.dataset is None:
            return None
        if isinstance(self.dataset, str):
            return lookup(self.dataset)
        if isinstance(self.dataset, DatasetDir):
            return DirectorySpec(self.project, self.dataset.dir)
        return DatasetSpec(self.project, self.dataset.repo, self.dataset.path, self.dataset.rev)


class ExpConfError(UserError, ValueError):
    """A problem in an experiment config, as one line naming the key."""


def lab_section(exp_conf: dict[str, Any], source: str = "experiment config") -> LabTrialConfig:
    section = ((exp_conf.get("data") or {}).get("det_lab"))
    if section is None:
        raise ExpConfError(f"{source}: data.det_lab is missing (it names the project and dataset)")
    try:
        return LabTrialConfig.model_validate(section)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(["data", "det_lab", *(str(p) for p in err["loc"])])
        raise ExpConfError(f"{source}: {key}: {err['msg'].removeprefix('Value error, ')}") from None


def micro_batch_size(global_batch: int, slots: int, accumulation: int = 1) -> int:
    """The batch of one forward: Determined's per-slot batch (``global_batch / slots``) cut into
    ``accumulation`` micro-batches, whose gradients add up to one optimizer step on ``global_batch``.

    Raises:
        ExpConfError: a global batch that ``slots * accumulation`` does not divide (one line).
    """
    if accumulation < 1 or slots < 1:
        raise ExpConfError(f"hyperparameters.grad_accumulation must be at least 1, got {accumulation}")
    if global_batch % (slots * accumulation):
        raise ExpConfError(f"hyperparameters.global_batch_size {global_batch} must be a multiple of slots_per_trial "
                           f"x grad_accumulation = {slots} x {accumulation} = {slots * accumulation} (each slot "
                           "trains global / slots samples per step, in grad_accumulation equal micro-batches)")
    return global_batch // (slots * accumulation)


def base_models_of(exp_conf: dict[str, Any]) -> list[str]:
    """The base models an experiment config names (``data.det_lab.base_model``); none without one."""
    section = (exp_conf.get("data") or {}).get("det_lab") or {}
    return lab_section(exp_conf).base_models if isinstance(section, dict) and section.get("base_model") else []


def project_of(exp_conf: dict[str, Any]) -> str:
    """The det_lab project an experiment config names (``default`` when it names none)."""
    return ((exp_conf.get("data") or {}).get("det_lab") or {}).get("project", "default")


def training_length(exp_conf: dict[str, Any], lab: LabTrialConfig) -> Length:
    """How long to train: the searcher's ``max_time``/``time_metric`` (ASHA) or ``max_length``."""
    searcher = exp_conf.get("searcher") or {}
    if searcher.get("time_metric") in ("batches", "epochs") and searcher.get("max_time"):
        return Length(**{searcher["time_metric"]: int(searcher["max_time"])})
    if lab.max_length is None:
        raise ExpConfError("experiment config: data.det_lab.max_length is missing (e.g. {batches: 1000})")
    return lab.max_length


def period(exp_conf: dict[str, Any], key: str):
    """``min_validation_period`` / ``min_checkpoint_period`` as a Trainer unit, or None."""
    value = exp_conf.get(key) or {}
    return Length(**value).unit() if value else None


def searcher_metric(exp_conf: dict[str, Any]) -> tuple[str | None, bool]:
    """The searcher's metric name and whether smaller is better."""
    searcher = exp_conf.get("searcher") or {}
    return searcher.get("metric"), bool(searcher.get("smaller_is_better", True))
