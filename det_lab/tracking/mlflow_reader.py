"""Reading det_lab runs back from MLflow: the rows and metric histories the notebooks show.

The key and tag rules are the writer's (:mod:`det_lab.tracking.mlflow_backend`): a run is found
by its ``RUN_KEY_TAG``, a metric is ``<group>/<name>``, hyperparameters are dotted params.
"""

from __future__ import annotations

from typing import Any

from det_lab.settings import LabSettings
from det_lab.tracking.mlflow_backend import RUN_KEY_TAG, default_local_uri


def _client(settings: LabSettings) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=settings.tracking.mlflow_uri or default_local_uri())


def read_runs(settings: LabSettings, experiment: str) -> list[dict[str, Any]]:
    """det_lab runs of MLflow experiment ``experiment``: ``run_id``, ``name``, ``status``,
    ``start_time`` (epoch seconds), ``run_key``, ``tags``, ``params`` and last ``metrics``."""
    client = _client(settings)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
             "start_time": r.info.start_time / 1000, "run_key": r.data.tags.get(RUN_KEY_TAG, ""),
             "tags": dict(r.data.tags), "params": dict(r.data.params), "metrics": dict(r.data.metrics)}
            for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` != ''",
                                        max_results=1000)]


def read_histories(settings: LabSettings, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value)]}`` for metric ``keys`` (``"<group>/<name>"``) of one run."""
    client = _client(settings)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}
