"""Re-running a recorded run: the same code (a scratch worktree at its commit, its saved patch
applied; for code that was not in git, the copy in its checkpoint), the same dataset revision
(pinned to its commit and checked by content hash), the same config, hyperparameters and seed;
from the start, or from one of its checkpoints.

The scratch tree and the config as re-run live in ``<data root>/outputs/<project>/reproduce/<new
run>/`` (``code/``, ``config.yaml``); the new run is an ordinary run of the record layer, whose
``run.json`` names the run it reproduces (``reproduces``), which its tracker run carries as
``det_lab.reproduces.*`` tags.
"""

from __future__ import annotations

import copy
import shutil
import datetime as dt
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from det_lab.data.directory import DIRECTORY_REV
from det_lab.reproduce.code import checkout, remove
from det_lab.reproduce.find import Origin, ReproduceError
from det_lab.settings import LabSettings
from det_lab.runs.record import REPRODUCES_KEY, LocalRunRecord, VolumeRunRecord
from det_lab.volume import VolumeLayout

REPRODUCE_DIR = "reproduce"


@dataclass
class Plan:
    """A reproduction ready to start."""

    origin: Origin
    record: VolumeRunRecord
    cwd: Path
    command: list[str]
    scratch: Path
    code_source: str  # where the code came from, in words
    from_step: int = 0


def pinned_config(origin: Origin) -> dict[str, Any]:
    """The run's config as run, its dataset pinned to the recorded revision and its
    hyperparameters to the recorded values."""
    if not origin.config:
        raise ReproduceError(f"run {origin.name} recorded no experiment config: it cannot be re-run")
    conf = copy.deepcopy(origin.config)
    lab = conf.setdefault("data", {}).setdefault("det_lab", {})
    ds = origin.lineage.get("dataset")
    if ds and ds.get("rev") == DIRECTORY_REV:  # a directory read in place: the same directory, hash checked
        lab["dataset"] = {"dir": ds["repo"]}
    elif ds:
        lab["dataset"] = {"repo": ds["repo"], "path": ds["path"], "rev": ds["commit"]}
    conf["hyperparameters"] = copy.deepcopy(origin.hparams)
    return conf


def serve_dataset(settings: LabSettings, origin: Origin, conf: dict[str, Any]) -> dict[str, Any] | None:
    """Pull the pinned revision now (shared cache, else the DVC remote) and check its content
    hash; a one-line :class:`ReproduceError` when its objects are gone."""
    from det_lab.data import lookup, pull
    from det_lab.data.errors import DataError
    from det_lab.runs.expconf import lab_section

    ds = origin.lineage.get("dataset")
    if not ds:
        return None
    what = f"dataset {ds['path']} at {ds['commit'][:12]} of {ds['repo']} (md5 {ds['md5']})"
    try:
        spec = lab_section(conf).dataset_spec(lambda name: lookup(settings, name))
        pulled = pull(spec, settings, progress=False)
    except DataError as exc:
        raise ReproduceError(f"{what} cannot be served: {exc}") from None
    if pulled.identity.md5 != ds["md5"]:
        raise ReproduceError(f"{what}: that revision now holds md5 {pulled.identity.md5}; the recorded bytes are gone")
    return {"md5": pulled.identity.md5, "path": str(pulled.path)}


def prepare(settings: LabSettings, origin: Origin, *, name: str | None = None, continue_: bool = False,
            record_cls: type[VolumeRunRecord] = LocalRunRecord) -> Plan:
    """Check out the code, serve the data and create the new run (nothing runs yet)."""
    from det_lab.runs import local
    from det_lab.runs.expconf import lab_section

    code = origin.lineage.get("code") or {}
    copied = None if code.get("commit") else _checkpoint_code(settings, origin)
    conf = pinned_config(origin)
    project = lab_section(conf).project
    start = _start_checkpoint(settings, origin) if continue_ else None
    serve_dataset(settings, origin, conf)
    base = origin.name if len(origin.name) < 60 else origin.name[:60]
    name = name or f"{base}-repro-{dt.datetime.now():%H%M%S}-{uuid.uuid4().hex[:4]}"
    scratch = VolumeLayout.from_settings(settings).outputs(project) / REPRODUCE_DIR / name
    if scratch.exists():
        raise ReproduceError(f"{scratch} exists: choose another --run name")
    scratch.mkdir(parents=True)
    try:  # a refusal leaves nothing behind: no scratch tree, no worktree registered
        if copied is None:
            template = checkout(code, scratch / "code", origin.patch_file)
            source = f"{code.get('repo')} at {code['commit']}"
            source += " + its saved local changes" if code.get("dirty") else ""
        else:  # not in git (a cluster trial's context, an installed template): the checkpoint's copy
            template = Path(shutil.copytree(copied, scratch / "code"))
            source = f"the copy in checkpoint {copied.parent.name} (the run's code was not in git)"
        config = scratch / "config.yaml"
        config.write_text(yaml.safe_dump(conf, sort_keys=False))
        record, cwd, command = local.prepare(settings, str(template), config, False, origin.seed,
                                             record_cls=record_cls, name=name)
    except (ReproduceError, local.RunError, OSError) as exc:
        if (scratch / "code").exists() and copied is None:
            remove(code, scratch / "code")
        shutil.rmtree(scratch, ignore_errors=True)
        raise ReproduceError(str(exc)) from None
    summary = origin.record.tracking_summary() if origin.record else None
    tracker_run = next((b["run_id"] for b in (summary or {}).get("backends", [])), None)
    reproduces = {"run": origin.name, "run_key": origin.lineage.get("run_key"), "found_by": origin.found_by,
                  "ref": origin.ref, "tracker_run": tracker_run, **origin.tracker,
                  "checkpoint": start["uuid"] if start else None}
    changes: dict[str, Any] = {REPRODUCES_KEY: reproduces}
    if start:
        changes.update(latest_checkpoint=start["uuid"], latest_checkpoint_step=start["step"],
                       checkpoints=[{"uuid": start["uuid"], "step": start["step"]}])
    record.update(**changes)
    return Plan(origin, record, cwd, command, scratch, source, start["step"] if start else 0)


def _checkpoint_dir(settings: LabSettings, origin: Origin, uuid_: str) -> Path | None:
    """Checkpoint ``uuid_``'s directory: where :func:`~det_lab.reproduce.find.locate` found it
    when the run was named by it (still there), else searched for under the volume's checkpoints."""
    from det_lab.reproduce.find import find_checkpoint

    named = origin.checkpoint or {}
    if named.get("uuid") == uuid_ and named.get("dir") and (Path(named["dir"]) / "metadata.json").is_file():
        return Path(named["dir"])
    return find_checkpoint(VolumeLayout.from_settings(settings), uuid_)


def _checkpoint_code(settings: LabSettings, origin: Origin) -> Path:
    """The ``code/`` copy Determined keeps in each checkpoint: the named one's, else the run's
    latest; a one-line refusal when there is none."""
    uuid_ = (origin.checkpoint or {}).get("uuid") or origin.state.get("latest_checkpoint")
    where = _checkpoint_dir(settings, origin, uuid_) if uuid_ else None
    if where is None or not (where / "code").is_dir():
        raise ReproduceError(f"run {origin.name} recorded no code repository and commit (its code was not in git) "
                             "and has no checkpoint with a copy of its code: it cannot be rebuilt")
    return where / "code"


def _start_checkpoint(settings: LabSettings, origin: Origin) -> dict[str, Any]:
    """The checkpoint ``--continue`` starts from: the one named, else the run's latest; it must
    still be on the volume."""
    if origin.checkpoint:
        start = origin.checkpoint
    elif origin.state.get("latest_checkpoint"):
        state = origin.state
        start = {"uuid": state["latest_checkpoint"], "step": int(state.get("latest_checkpoint_step") or 0)}
    else:
        raise ReproduceError(f"run {origin.name} has no checkpoint to continue from")
    if _checkpoint_dir(settings, origin, start["uuid"]) is None:
        raise ReproduceError(f"checkpoint {start['uuid']} of run {origin.name} is gone from the volume: "
                             "reproduce the run from the start (without --continue)")
    return start
