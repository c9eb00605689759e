"""Where a run's events go: one resolved target per backend, recorded in its journal.

A target is resolved once, when the trial starts, from the lab config (or an experiment's
``backend`` override) and written into the journal's ``run.json``. The sender process and
``det-lab tracking sync`` deliver to that recorded target, never to whatever tracker the shell
that runs them happens to be configured for. Nothing here imports MLflow or Aim.
"""

from __future__ import annotations

import os
from pathlib import Path

from det_lab.settings import LabSettings

BACKENDS = ("mlflow", "aim", "both", "none")


def _local_base() -> Path:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "det-lab"
    base.mkdir(parents=True, exist_ok=True)
    return base


def default_mlflow_store() -> Path:
    """The directory of the local MLflow store: ``~/.local/share/det-lab`` (never on NFS)."""
    return _local_base()


def default_local_uri() -> str:
    """A SQLite store on local disk (never on NFS): ``~/.local/share/det-lab/mlflow.db``."""
    return f"sqlite:///{default_mlflow_store() / 'mlflow.db'}"


def default_local_repo() -> str:
    """A local Aim repo on local disk (never on NFS): ``~/.local/share/det-lab/aim``."""
    base = _local_base() / "aim"
    base.mkdir(parents=True, exist_ok=True)
    return str(base)


def targets_for(settings: LabSettings, backend: str | None = None) -> dict[str, str]:
    """``{backend name: tracking URI or Aim repo}`` for the lab config (or ``backend`` override)."""
    choice = backend or settings.tracking.backend
    if choice not in BACKENDS:
        raise ValueError(f"tracking backend {choice!r} is not one of {', '.join(BACKENDS)}")
    out: dict[str, str] = {}
    if choice in ("mlflow", "both"):
        out["mlflow"] = settings.tracking.mlflow_uri or default_local_uri()
    if choice in ("aim", "both"):
        repo = settings.tracking.aim_repo
        out["aim"] = os.path.expanduser(repo) if repo else default_local_repo()
    return out
