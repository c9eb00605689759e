"""What every checkpoint and tracker run of a trial records about where it came from."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

from det_lab import __version__
from det_lab.compat import DETERMINED_VERSION
from det_lab.data import PulledDataset
from det_lab.data.git import describe_commit
from det_lab.trials.identity import TrialIdentity
from det_lab.trials.provenance import code_lineage, environment_lineage
from det_lab.trials.record import RunRecord

CODE_COMMIT_ENV = "DET_LAB_CODE_COMMIT"


#: lineage entries too large for tracker tags (checkpoint metadata and run.json keep them)
UNTAGGED = ("config", "hyperparameters")


def collect_lineage(identity: TrialIdentity, dataset: PulledDataset | None, record: RunRecord,
                    environments_dir: Path | None = None, provenance: bool = True) -> dict[str, Any]:
    """Versions, host, code commit, run key, the dataset's identity and the record's own extras;
    the code's repository and local changes, the environment (stored in ``environments_dir``), the
    config as run, seed, template and scheduler (:mod:`det_lab.trials.provenance`).

    ``provenance=False`` leaves out the code and environment entries (git diffs, the patch file,
    a scan of every installed distribution): a trial's other ranks, whose checkpoint metadata
    Determined merges into the chief's, need not repeat them."""
    lineage: dict[str, Any] = {
        "det_lab_version": __version__,
        "determined_version": DETERMINED_VERSION,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "code_commit": os.environ.get(CODE_COMMIT_ENV) or describe_commit(Path.cwd()),
        "run_key": identity.run.key,
        "scheduler": record.kind or "determined",
        "template": identity.record_dir and _template_of(record),
        "seed": identity.seed,
        "config": identity.exp_conf,
        "hyperparameters": identity.hparams,
        **record.lineage_extras(),
    }
    if provenance:
        try:  # never stops a trial: a failure leaves the entry out
            if identity.record_dir is None:
                record.dir.mkdir(parents=True, exist_ok=True)
            lineage["code"] = code_lineage(Path.cwd(), record.dir)
            lineage["environment"] = environment_lineage(environments_dir)
        except Exception:  # noqa: BLE001
            pass
    if dataset is not None:
        lineage["dataset"] = asdict(dataset.identity)
    return {k: v for k, v in lineage.items() if v is not None}


def _template_of(record: RunRecord) -> str | None:
    try:
        return record.state().get("template")
    except (OSError, ValueError):
        return None


def tracker_view(lineage: dict[str, Any]) -> dict[str, Any]:
    """The lineage as tracker tags carry it: without the config and hyperparameters (the tracker
    has those as params; checkpoints and run.json keep the config), with the config's hash."""
    import hashlib
    import json

    out = {k: v for k, v in lineage.items() if k not in UNTAGGED}
    if "config" in lineage:
        out["config_sha256"] = hashlib.sha256(json.dumps(lineage["config"], sort_keys=True, default=str)
                                              .encode()).hexdigest()
    return out


def seed_everything(seed: int) -> None:
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
