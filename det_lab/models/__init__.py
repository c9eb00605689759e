"""Base models on the volume: imported once, versioned, read offline by every run and task.

The verbs::

    from det_lab import models
    models.import_model(settings, Path("~/smolvla_base"), "lerobot/smolvla_base")   # or dry_run=True
    models.list_models(settings); models.show_model(settings, "lerobot/smolvla_base")
    models.require_model(settings, "lerobot/smolvla_base", files=["config.json", "model.safetensors"])
    models.run_environment(settings.data_root)   # HF_HOME, HF_HUB_CACHE, TORCH_HOME, HF_HUB_OFFLINE=1

The store is huggingface_hub's own cache layout under ``<data root>/models/hf`` (HF_HOME), so
``from_pretrained("org/name")`` and ``snapshot_download("org/name")`` resolve to it offline;
torch hub weights sit under ``<data root>/models/torch`` (TORCH_HOME). Layout:
:mod:`det_lab.models.layout`; how an import stays whole: :mod:`det_lab.models.store`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from det_lab.models.catalog import list_models as _list_models
from det_lab.models.catalog import resolve_model
from det_lab.models.catalog import require_torch_weights as _require_torch_weights
from det_lab.models.catalog import show_model as _show_model
from det_lab.models.errors import ModelMissing, ModelStoreError
from det_lab.models.layout import SHADOWING, ModelStoreLayout, check_name, run_environment
from det_lab.models.store import ModelInfo, ModelRevision, Revision
from det_lab.models.store import import_model as _import_hub
from det_lab.models.store import plan_import as _plan_hub
from det_lab.models.torch_weights import WeightFile, import_torch_weights, is_weight_file, list_torch_weights
from det_lab.models.torch_weights import plan_torch_import
from det_lab.settings import LabSettings

__all__ = [
    "ImportReport", "ModelInfo", "ModelMissing", "ModelRevision", "ModelStoreError", "ModelStoreLayout", "Revision",
    "SHADOWING", "StoreListing", "WeightFile", "import_model", "list_models", "require_model",
    "require_torch_weights", "run_environment", "show_model",
]


@dataclass
class ImportReport:
    """What ``det-lab models import`` did, or with ``dry_run`` would do."""

    kind: Literal["hub", "torch"]
    name: str  # org/name, or the weight file's name
    revision: str | None  # hub models only
    path: Path  # the snapshot directory or weight file on the volume
    new: bool  # a revision (or file) the volume did not have
    size: int
    copy_bytes: int
    dry_run: bool
    hub_commit: str | None = None
    lines: list[str] = field(default_factory=list)  # a dry run's plan, or notes

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class StoreListing:
    """Everything in the store: hub models and torch weight files."""

    root: Path
    models: list[ModelInfo]
    torch: list[WeightFile]

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "models": [m.to_json() for m in self.models],
                "torch": [{"name": w.name, "path": str(w.path), "size": w.size} for w in self.torch]}


def import_model(settings: LabSettings, source: Path, name: str | None = None, *,
                 dry_run: bool = False) -> ImportReport:
    """Import a downloaded hub snapshot as ``name`` (``org/name``), or a torch hub weight file
    (``*.pth``, no name), onto the volume once; with ``dry_run`` say what it would copy, writing nothing."""
    layout = ModelStoreLayout.from_settings(settings)
    source = Path(source).expanduser()
    if is_weight_file(source):
        if name is not None:
            raise ModelStoreError(f"{source} is a torch hub weight file: it is imported by its file name, without "
                                  "NAME (det-lab models import FILE)")
        weight, new = (plan_torch_import if dry_run else import_torch_weights)(layout, source)
        return ImportReport("torch", weight.name, None, weight.path, new, weight.size, weight.size if new else 0,
                            dry_run)
    if name is None:
        raise ModelStoreError(f"give the hub id to import {source} as: det-lab models import {source} ORG/NAME")
    check_name(name)
    if dry_run:
        plan = _plan_hub(layout, source, name)
        return ImportReport("hub", name, plan.revision, layout.repo(name) / "snapshots" / plan.revision,
                            not plan.exists, plan.size, 0 if plan.exists else plan.new_bytes, True,
                            plan.snapshot.hub_commit, plan.describe())
    done = _import_hub(layout, source, name)
    return ImportReport("hub", name, done.revision, done.path, done.created, done.size, done.copied_bytes, False,
                        done.hub_commit, done.notes)


def list_models(settings: LabSettings) -> StoreListing:
    """Every model and torch weight file on the volume."""
    layout = ModelStoreLayout.from_settings(settings)
    return StoreListing(layout.root, _list_models(layout), list_torch_weights(layout))


def show_model(settings: LabSettings, name: str) -> ModelInfo:
    """Model ``name``'s revisions, sizes, who imported each and when; one error line for an unknown one."""
    return _show_model(ModelStoreLayout.from_settings(settings), check_name(name))


def require_model(settings: LabSettings, hub_id: str, files: list[str] | tuple[str, ...] = (),
                  revision: str | None = None) -> ModelRevision:
    """The snapshot of ``hub_id`` a run loads offline, checked to hold ``files`` (a tokenizer, a
    backbone's weights); a trial calls it first, so a missing one is one line naming the import
    (:class:`ModelMissing`) before anything trains."""
    return resolve_model(ModelStoreLayout.from_settings(settings), hub_id, files, revision)


def require_torch_weights(settings: LabSettings, *files: str) -> list[Path]:
    """The paths of torch hub weight files under TORCH_HOME; :class:`ModelMissing` naming the import."""
    return _require_torch_weights(ModelStoreLayout.from_settings(settings), *files)
