"""Tracked runs as tables: det_lab runs of a project from MLflow or Aim, each linked to its trial.

Reading back is each backend's own (:mod:`det_lab.tracking.mlflow_reader`,
:mod:`det_lab.tracking.aim_reader`); ``DET_LAB_NOTEBOOK_TRACKER`` picks which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from det_lab.settings import LabSettings, env_value, load_settings
from det_lab.runs.identity import tracker_experiment

if TYPE_CHECKING:
    import pandas as pd

TRACKER_ENV = "DET_LAB_NOTEBOOK_TRACKER"


def tracker_name(settings: LabSettings | None = None) -> str:
    """``$DET_LAB_NOTEBOOK_TRACKER``, else the lab's backend (``both`` reads MLflow)."""
    choice = env_value(TRACKER_ENV) or (settings or load_settings()).tracking.backend
    if choice == "both":
        return "mlflow"
    if choice not in ("mlflow", "aim"):
        raise ValueError(f"no tracker to read runs from (backend {choice!r}); set {TRACKER_ENV}=mlflow or aim")
    return choice


def load_runs(settings: LabSettings | None = None, project: str = "vla", tracker: str | None = None) -> pd.DataFrame:
    """det_lab runs of ``project`` from MLflow or Aim, newest first.

    Columns: ``run_id``, ``name``, ``status``, ``start_time``, ``link`` (the Determined trial's
    URL on a cluster, the local run directory otherwise), ``link_kind`` (``trial`` /
    ``local run``), ``run_key``, ``params.<name>`` (dotted, numbers as numbers) and
    ``metrics.<group>/<name>`` (the last value). ``df.attrs["tracker"]`` says where they came from.
    """
    import pandas as pd

    settings = settings or load_settings()
    tracker = tracker or tracker_name(settings)
    rows = []
    for run in _reader(tracker).read_runs(settings, tracker_experiment(project)):
        link, kind = _link(run["tags"])
        rows.append({"run_id": run["run_id"], "name": run["name"], "status": run["status"],
                     "start_time": pd.Timestamp(run["start_time"], unit="s", tz="UTC"), "link": link,
                     "link_kind": kind, "run_key": run["run_key"],
                     **{f"params.{k}": v for k, v in run["params"].items()},
                     **{f"metrics.{k}": v for k, v in run["metrics"].items()}})
    df = pd.DataFrame(rows, columns=None if rows else ["run_id", "name", "status", "start_time", "link",
                                                       "link_kind", "run_key"])
    for col in [c for c in df.columns if c.startswith("params.")]:
        try:
            df[col] = pd.to_numeric(df[col])
        except (ValueError, TypeError):
            pass
    if rows:
        df = df.sort_values("start_time", ascending=False, ignore_index=True)
    df.attrs["tracker"] = tracker
    return df


def metric_histories(runs: pd.DataFrame, keys: list[str], settings: LabSettings | None = None) -> pd.DataFrame:
    """Long-form ``run_id, name, key, step, value`` for ``keys`` (``"<group>/<name>"``) of ``runs``."""
    import pandas as pd

    settings = settings or load_settings()
    tracker = runs.attrs.get("tracker") or tracker_name(settings)
    reader = _reader(tracker)
    rows = []
    for run_id, name in zip(runs["run_id"], runs["name"]):
        for key, points in reader.read_histories(settings, run_id, keys).items():
            rows += [{"run_id": run_id, "name": name, "key": key, "step": s, "value": v} for s, v in points]
    df = pd.DataFrame(rows, columns=["run_id", "name", "key", "step", "value"])
    return df.sort_values(["run_id", "key", "step"], ignore_index=True)


def _reader(tracker: str) -> Any:
    if tracker == "mlflow":
        from det_lab.tracking import mlflow_reader

        return mlflow_reader
    from det_lab.tracking import aim_reader

    return aim_reader


def _link(tags: dict[str, Any]) -> tuple[str, str]:
    """The trial's Web UI page (cluster) or the run's directory (local-style run), from the record's tags."""
    if tags.get("det.trial_url"):
        return str(tags["det.trial_url"]), "trial"
    if tags.get("det.local_run_dir"):
        return str(tags["det.local_run_dir"]), "local run"
    return "", ""
