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
from det_lab.trials.record import RunRecord

CODE_COMMIT_ENV = "DET_LAB_CODE_COMMIT"


def collect_lineage(identity: TrialIdentity, dataset: PulledDataset | None, record: RunRecord) -> dict[str, Any]:
    """Versions, host, code commit, run key, the dataset's identity and the record's own extras."""
    lineage: dict[str, Any] = {
        "det_lab_version": __version__,
        "determined_version": DETERMINED_VERSION,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "code_commit": os.environ.get(CODE_COMMIT_ENV) or describe_commit(Path.cwd()),
        "run_key": identity.run.key,
        **record.lineage_extras(),
    }
    if dataset is not None:
        lineage["dataset"] = asdict(dataset.identity)
    return {k: v for k, v in lineage.items() if v is not None}


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
