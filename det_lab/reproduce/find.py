"""Finding a run's lineage from whatever names it: a run name, a checkpoint UUID, an MLflow run
id or an Aim run hash.

A local-style run (``det-lab run --local`` / ``--slurm``) keeps its lineage in ``run.json``;
every checkpoint keeps the lineage of the trial that wrote it in ``metadata.json`` (``det_lab``),
which is how a cluster run is found; a tracker run carries the lineage as tags and leads to its
run record (``det.local_run_dir``, or the run key).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.settings import LabSettings
from det_lab.runs.record import ClusterRunRecord, VolumeRunRecord, iter_records
from det_lab.volume import VolumeLayout

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_HEX = re.compile(r"^[0-9a-f]{16,64}$")


class ReproduceError(UserError, RuntimeError):
    """Why a run cannot be found or rebuilt, as one line."""


@dataclass
class Origin:
    """A run to reproduce or compare: its lineage and, where det_lab keeps one, its record."""

    ref: str
    lineage: dict[str, Any]
    record: VolumeRunRecord | None = None
    checkpoint: dict[str, Any] | None = None  # {"uuid", "step"} when named by a checkpoint
    found_by: str = "run"
    tracker: dict[str, str] = field(default_factory=dict)
    record_dir: Path | None = None  # a cluster trial's directory on the volume (it has no run.json)

    @property
    def name(self) -> str:
        return self.record.dir.name if self.record else str(self.lineage.get("run_key", self.ref))

    @cached_property
    def state(self) -> dict[str, Any]:
        """The original's ``run.json``, read once (config, seed and checkpoints all ask for it)."""
        return self.record.state() if self.record else {}

    @property
    def config(self) -> dict[str, Any] | None:
        return self.lineage.get("config") or self.state.get("exp_conf")

    @property
    def hparams(self) -> dict[str, Any]:
        return self.lineage.get("hyperparameters") or self.state.get("hparams") or {}

    @property
    def seed(self) -> int | None:
        seed = self.lineage.get("seed")
        return seed if seed is not None else self.state.get("seed")

    @property
    def patch_file(self) -> Path | None:
        """The saved local changes of a dirty run (next to its record)."""
        code = self.lineage.get("code") or {}
        where = self.record.dir if self.record is not None else self.record_dir
        if not code.get("patch") or where is None:
            return None
        return where / code["patch"]

    def metrics(self) -> list[dict[str, Any]]:
        return self.record.metrics() if self.record else []


def locate(settings: LabSettings, ref: str) -> Origin:
    """The run ``ref`` names (see the module docstring); :class:`ReproduceError` if none does."""
    layout = VolumeLayout.from_settings(settings)
    records = [r for p in sorted(settings.projects) for r in iter_records(layout, p)]
    for record in records:
        if record.dir.name == ref:
            return _from_record(ref, record)
    if _UUID.match(ref):
        return _from_checkpoint(layout, ref, records)
    if _HEX.match(ref):
        tags, tracker = _tracker_tags(settings, ref)
        if tags is not None:
            return _from_tags(ref, tags, tracker, records)
    raise ReproduceError(f"{ref!r} names no run, checkpoint or tracker run on {settings.data_root} "
                         "(runs: det-lab runs list; checkpoints: their UUID; MLflow: the run id; Aim: the run hash)")


def _from_record(ref: str, record: VolumeRunRecord) -> Origin:
    state = record.state()
    lineage = state.get("lineage")
    if not lineage:
        raise ReproduceError(f"run {record.dir.name} has no det_lab lineage in {record.run_file} "
                             "(it never started, or ran before det_lab recorded lineage)")
    return Origin(ref, lineage, record)


def _record_by_key(records: list[VolumeRunRecord], run_key: str | None) -> VolumeRunRecord | None:
    """The run whose ``run.json`` has ``run_key``; the one whose directory the key names first
    (``local-<name>``), should a copied directory carry the same key. The named ones' ``run.json``
    is read first: every run's only when none of them has the key (a cluster run's)."""
    if not run_key:
        return None

    def has_key(record: VolumeRunRecord) -> bool:
        try:
            return record.state().get("run_key") == run_key
        except ValueError:
            return False

    named = (r for r in records if run_key.endswith(f"-{r.dir.name}"))
    return next(filter(has_key, named), None) or next(filter(has_key, records), None)


def find_checkpoint(layout: VolumeLayout, uuid: str) -> Path | None:
    """The directory of checkpoint ``uuid`` under ``<data root>/checkpoints`` (a project's
    directory, or an experiment's ``storage_path`` one level deeper)."""
    for pattern in (f"*/{uuid}", f"*/*/{uuid}", uuid):
        for found in layout.checkpoints.glob(pattern):
            if (found / "metadata.json").is_file():
                return found
    return None


def _from_checkpoint(layout: VolumeLayout, uuid: str, records: list[VolumeRunRecord]) -> Origin:
    where = find_checkpoint(layout, uuid)
    if where is None:
        raise ReproduceError(f"checkpoint {uuid} is not under {layout.checkpoints} (no metadata.json found)")
    meta = _checkpoint_metadata(uuid, where / "metadata.json")
    lineage = meta.get("det_lab")
    if not lineage:
        raise ReproduceError(f"checkpoint {uuid} ({where}) has no det_lab lineage in its metadata.json: "
                             "it was not written by a det_lab trial")
    record = _record_by_key(records, lineage.get("run_key"))
    step = int(meta.get("steps_completed", 0))
    origin = Origin(uuid, lineage, record, {"uuid": uuid, "step": step, "dir": str(where)}, "checkpoint")
    project = ((lineage.get("config") or {}).get("data") or {}).get("det_lab", {}).get("project")
    if record is None and project and lineage.get("run_key"):  # a cluster trial: its saved patch is there
        origin.record_dir = ClusterRunRecord(layout, project, lineage["run_key"]).dir
    return origin


def _checkpoint_metadata(uuid: str, path: Path) -> dict[str, Any]:
    """Checkpoint ``uuid``'s ``metadata.json``; a damaged one (cut short by an interrupted copy,
    edited by hand) is one :class:`ReproduceError` naming the file."""
    advice = "reproduce it from another of the run's checkpoints or by its run name (det-lab runs list)"
    try:
        meta = json.loads(path.read_bytes())
    except UnicodeDecodeError as exc:
        raise ReproduceError(f"checkpoint {uuid}: {path} is not valid JSON (not UTF-8 text: {exc.reason} "
                             f"at byte {exc.start}): it is damaged; {advice}") from None
    except json.JSONDecodeError as exc:
        raise ReproduceError(f"checkpoint {uuid}: {path} is not valid JSON ({exc.msg} at line {exc.lineno} "
                             f"column {exc.colno}; cut short or edited?): {advice}") from None
    if not isinstance(meta, dict):
        raise ReproduceError(f"checkpoint {uuid}: {path} holds a JSON {type(meta).__name__}, not an object: "
                             f"it is damaged; {advice}")
    return meta


def _tracker_tags(settings: LabSettings, ref: str) -> tuple[dict[str, str] | None, dict[str, str]]:
    """The tags of tracker run ``ref``: an MLflow run id (32 hex digits) or an Aim run hash, each
    asked of the tracker it looks like first."""
    lookups = [_mlflow_tags, _aim_tags]
    if len(ref) != 32:
        lookups.reverse()
    for lookup in lookups:
        found = lookup(settings, ref)
        if found is not None:
            return found
    return None, {}


def _mlflow_tags(settings: LabSettings, ref: str) -> tuple[dict[str, str], dict[str, str]] | None:
    if not (settings.tracking.mlflow_uri or settings.tracking.backend in ("mlflow", "both")):
        return None
    import os

    # one try, not MLflow's minutes of retries: a server that is down means "not found here"
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    from det_lab.tracking.mlflow_backend import default_local_uri

    try:
        run = MlflowClient(tracking_uri=settings.tracking.mlflow_uri or default_local_uri()).get_run(ref)
    except Exception:  # noqa: BLE001 (no such run, or no server answering)
        return None
    return dict(run.data.tags), {"mlflow_run_id": ref}


def _aim_tags(settings: LabSettings, ref: str) -> tuple[dict[str, str], dict[str, str]] | None:
    if not (settings.tracking.aim_repo or settings.tracking.backend in ("aim", "both")):
        return None
    from det_lab.tracking.aim_backend import META_SECTION, default_local_repo

    try:
        from aim import Repo

        run = Repo(settings.tracking.aim_repo or default_local_repo()).get_run(ref)
    except Exception:  # noqa: BLE001 (no repository there, or no server answering)
        return None
    if run is None:
        return None
    return {str(k): str(v) for k, v in (run.get(META_SECTION) or {}).items()}, {"aim_run_hash": ref}


def _from_tags(ref: str, tags: dict[str, str], tracker: dict[str, str], records: list[VolumeRunRecord]) -> Origin:
    which = next(iter(tracker), "tracker").replace("_", " ")
    record_dir = tags.get("det.local_run_dir")
    record = None
    if record_dir and (Path(record_dir) / "run.json").is_file():
        record = next((r for r in records if r.dir == Path(record_dir)), None)
    record = record or _record_by_key(records, tags.get("run_key") or tags.get("det_lab.run_key"))
    lineage = record.state().get("lineage") if record is not None else None
    if lineage:
        return Origin(ref, lineage, record, None, which, tracker)
    if "run_key" not in tags and "code_commit" not in tags and "det_lab_version" not in tags:
        raise ReproduceError(f"{which} {ref} has no det_lab lineage (no run_key, code or dataset tags): "
                             "it was not logged by a det_lab trial")
    raise ReproduceError(f"{which} {ref} has det_lab lineage but its run record is not on this volume "
                         "(a cluster run): reproduce it from one of its checkpoints (det-lab reproduce <UUID>)")
