"""Reading det_lab runs back from Aim: the rows and metric histories the notebooks show.

The rules are the writer's (:mod:`det_lab.tracking.aim_backend`): the run's tags, run key and
status live under the run's ``det_lab`` section, hyperparameters under ``hparams``, and a metric
group is the ``subset`` of the sequence's context.
"""

from __future__ import annotations

from typing import Any

from det_lab.settings import LabSettings
from det_lab.tracking.aim_backend import GROUP_CONTEXT, META_SECTION, PARAMS_SECTION, default_local_repo
from det_lab.tracking.events import flatten


def _repo(settings: LabSettings) -> Any:
    from aim import Repo

    return Repo(settings.tracking.aim_repo or default_local_repo())


def _series(run: Any) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for m in run.metrics():
        steps, (values, *_rest) = m.data.items_list()
        out[f"{m.context.to_dict().get(GROUP_CONTEXT, '')}/{m.name}"] = sorted(zip((int(s) for s in steps), values))
    return out


def read_runs(settings: LabSettings, experiment: str) -> list[dict[str, Any]]:
    """det_lab runs of Aim experiment ``experiment``: ``run_id`` (hash), ``name``, ``status``,
    ``start_time`` (epoch seconds), ``run_key``, ``tags``, ``params`` and last ``metrics``."""
    rows = []
    for run in _repo(settings).iter_runs():
        meta = run.get(META_SECTION) or {}
        if run.experiment != experiment or not meta.get("run_key"):
            continue
        rows.append({"run_id": run.hash, "name": run.name, "status": meta.get("status", "RUNNING"),
                     "start_time": run.creation_time, "run_key": meta["run_key"], "tags": dict(meta),
                     "params": flatten(run.get(PARAMS_SECTION) or {}),
                     "metrics": {k: pts[-1][1] for k, pts in _series(run).items() if pts}})
    return rows


def read_histories(settings: LabSettings, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value)]}`` for metric ``keys`` (``"<group>/<name>"``) of one run."""
    from aim import Run

    series = _series(Run(run_id, repo=_repo(settings), read_only=True))
    return {k: series.get(k, []) for k in keys}
