"""Mirror what a trial reports to Determined into MLflow and/or Aim.

    from det_lab.tracking import RunInfo, open_mirror
    mirror = open_mirror(settings, RunInfo(key="det-e12-t34", name="vla e12 t34"), journal_dir)
    mirror.log_metrics("training", step, {"loss": loss})
    mirror.log_checkpoint(uuid, step)
    print(mirror.close())        # what was delivered, what waits in the journal

One small class per tracker (:mod:`.mlflow_backend`, :mod:`.aim_backend`) behind
:class:`.backend.TrackerBackend`; delivery, batching, outages and replay are the
:class:`.mirror.Mirror`'s job.
"""

from __future__ import annotations

from pathlib import Path

from det_lab.settings import LabSettings
from det_lab.tracking.backend import TrackerBackend
from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import DeliverySummary, Mirror

__all__ = ["DeliverySummary", "Mirror", "RunInfo", "TrackerBackend", "backends_for", "open_mirror"]

BACKENDS = ("mlflow", "aim", "both", "none")


def backends_for(settings: LabSettings, backend: str | None = None) -> list[TrackerBackend]:
    """The backends the lab config (or an experiment's ``backend`` override) selects."""
    choice = backend or settings.tracking.backend
    if choice not in BACKENDS:
        raise ValueError(f"tracking backend {choice!r} is not one of {', '.join(BACKENDS)}")
    out: list[TrackerBackend] = []
    if choice in ("mlflow", "both"):
        from det_lab.tracking.mlflow_backend import MlflowBackend

        out.append(MlflowBackend(settings.tracking.mlflow_uri))
    if choice in ("aim", "both"):
        from det_lab.tracking.aim_backend import AimBackend, default_local_repo

        out.append(AimBackend(settings.tracking.aim_repo or default_local_repo()))
    return out


def open_mirror(settings: LabSettings, run: RunInfo, journal_dir: Path, backend: str | None = None) -> Mirror:
    """A started :class:`Mirror` for ``run`` with the configured backends."""
    return Mirror(run, backends_for(settings, backend), journal_dir)
