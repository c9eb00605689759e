"""Mirror what a trial reports to Determined into MLflow and/or Aim.

    from det_lab.tracking import RunInfo, open_mirror
    mirror = open_mirror(settings, RunInfo(key="det-e12-t34", name="vla e12 t34"), journal_dir)
    mirror.log_metrics("training", step, {"loss": loss})
    mirror.log_checkpoint(uuid, step)
    print(mirror.close())        # what was delivered, what waits in the journal

The trial process only journals (:class:`.mirror.Mirror`, :mod:`.journal`); one sender process
per backend delivers (:mod:`.sender`), through one small class per tracker
(:mod:`.mlflow_backend`, :mod:`.aim_backend`) behind :class:`.backend.TrackerBackend`.
``det-lab tracking sync`` delivers what a finished run's senders could not (:mod:`.sync`).
"""

from __future__ import annotations

from pathlib import Path

from det_lab.settings import LabSettings
from det_lab.tracking.backend import TrackerBackend
from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import DeliverySummary, Mirror, WriteFence
from det_lab.tracking.null_mirror import NullMirror as NullMirror
from det_lab.tracking.targets import BACKENDS, targets_for

__all__ = ["BACKENDS", "DeliverySummary", "Mirror", "RunInfo", "TrackerBackend", "open_mirror", "targets_for"]


def open_mirror(settings: LabSettings, run: RunInfo, journal_dir: Path, backend: str | None = None,
                fence: WriteFence | None = None) -> Mirror:
    """A started :class:`Mirror` for ``run`` with the configured backends' targets (``fence``: the
    trial's, which its journal writes go through)."""
    return Mirror(run, targets_for(settings, backend), journal_dir, fence=fence)
