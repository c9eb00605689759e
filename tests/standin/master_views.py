"""JSON views of the master stand-in's records, as Determined 0.38.1's protobuf messages marshal them
through grpc-gateway (camelCase names, enums as their names, int64 as strings where the binding
reads them so): experimentv1.Experiment, trialv1.Trial, checkpointv1.Checkpoint, userv1.User,
apiv1.MetricsReport, apiv1.TrialLogsResponse/TaskLogsResponse. The field lists are those of
proto/src/determined/{experiment,trial,checkpoint,user}/v1/*.proto at v0.38.1.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from typing import Any

from tests.standin.master_state import Checkpoint, Experiment, Metrics, State, Trial, User


def user_view(user: User) -> dict[str, Any]:
    """proto/src/determined/user/v1/user.proto User."""
    out: dict[str, Any] = {"id": user.id, "username": user.username, "admin": user.admin, "active": user.active,
                           "displayName": user.display_name, "remote": False, "modifiedAt": user.modified_at}
    if user.agent_user_group:
        out["agentUserGroup"] = dict(user.agent_user_group)
    return out


def _searcher_metric(exp: Experiment) -> tuple[str, bool]:
    searcher = exp.config.get("searcher") or {}
    return searcher.get("metric") or "", bool(searcher.get("smaller_is_better", True))


def experiment_view(state: State, exp: Experiment) -> dict[str, Any]:
    """experiment/v1/experiment.proto Experiment (api_experiment.go getExperiment)."""
    trials = sorted((t for t in state.trials.values() if t.experiment is exp), key=lambda t: t.id)
    ckpts = [c for c in state.checkpoints.values() if c.trial_id in {t.id for t in trials}]
    metric, _ = _searcher_metric(exp)
    best = _best_trial(state, exp, trials)
    out = {
        "id": exp.id, "description": exp.config.get("description") or "", "labels": exp.config.get("labels") or [],
        "startTime": exp.start_time, "endTime": exp.end_time, "state": f"STATE_{exp.state}", "archived": exp.archived,
        "numTrials": len(trials), "trialIds": [t.id for t in trials], "displayName": exp.owner.display_name,
        "userId": exp.owner.id, "username": exp.owner.username,
        "resourcePool": (exp.config.get("resources") or {}).get("resource_pool") or "default",
        "searcherType": (exp.config.get("searcher") or {}).get("name") or "", "searcherMetric": metric,
        "hyperparameters": exp.config.get("hyperparameters") or {}, "name": exp.config.get("name") or "",
        "notes": exp.notes, "jobId": exp.job_id, "forkedFrom": exp.parent_id, "progress": exp.progress,
        "projectId": 1, "projectName": "Uncategorized", "workspaceId": 1, "workspaceName": "Uncategorized",
        "parentArchived": False, "config": exp.config, "originalConfig": exp.original_config, "projectOwnerId": 1,
        "checkpointSize": str(sum(_size(c) for c in ckpts)), "checkpointCount": len(ckpts),
        "unmanaged": False, "modelDefinitionSize": len(exp.model_def),
    }
    if best is not None:
        out["bestTrialId"], out["bestTrialSearcherMetric"] = best
    return {k: v for k, v in out.items() if v is not None}


def avg(m: Metrics) -> dict[str, Any]:
    """A row's averaged metrics (a validation's are stored under validation_metrics)."""
    return m.metrics.get("validation_metrics" if m.group == "validation" else "avg_metrics") or {}


def _size(ckpt: Checkpoint) -> int:
    return sum(int(v) for v in ckpt.resources.values())


def _best_trial(state: State, exp: Experiment, trials: list[Trial]) -> tuple[int, float] | None:
    metric, smaller = _searcher_metric(exp)
    best = None
    for t in trials:
        for m in state.metrics:
            if m.trial_id == t.id and m.group == "validation" and not m.archived:
                value = avg(m).get(metric)
                if isinstance(value, (int, float)) and (best is None or (value < best[1]) == smaller):
                    best = (t.id, float(value))
    return best


def metrics_workload(m: Metrics) -> dict[str, Any]:
    """trial/v1/trial.proto MetricsWorkload."""
    return {"endTime": m.end_time, "state": "STATE_COMPLETED", "totalBatches": m.total_batches, "numInputs": 0,
            "metrics": {"avgMetrics": avg(m),
                        "batchMetrics": m.metrics.get("batch_metrics") or []}}


def checkpoint_workload(c: Checkpoint) -> dict[str, Any]:
    """trial/v1/trial.proto CheckpointWorkload."""
    return {"uuid": c.uuid, "endTime": c.report_time, "state": c.state, "resources": c.resources,
            "totalBatches": int(c.metadata.get("steps_completed") or 0), "metadata": c.metadata}


def trial_view(state: State, trial: Trial) -> dict[str, Any]:
    """trial/v1/trial.proto Trial (api_trials.go GetTrial, proto_get_trials_plus.sql)."""
    exp = trial.experiment
    metric, smaller = _searcher_metric(exp)
    own = [m for m in state.metrics if m.trial_id == trial.id and not m.archived]
    validations = [m for m in own if m.group == "validation"]
    ckpts = [c for c in state.checkpoints.values() if c.trial_id == trial.id]
    scored = [m for m in validations if isinstance(avg(m).get(metric), (int, float))]
    best = (min if smaller else max)(scored, key=lambda m: avg(m)[metric]) if scored else None
    summary: dict[str, Any] = {}
    for m in own:
        group = "avg_metrics" if m.group == "training" else f"{m.group}_metrics"
        for name, value in avg(m).items():
            summary.setdefault(group, {})[name] = {"last": value, "type": "number" if isinstance(value, (int, float))
                                                   else "string"}
    out: dict[str, Any] = {
        "id": trial.id, "experimentId": exp.id, "startTime": trial.start_time, "endTime": trial.end_time,
        "state": f"STATE_{trial.state}", "restarts": trial.restarts, "hparams": trial.hparams,
        "totalBatchesProcessed": max([m.total_batches for m in own] or [0]), "runnerState": trial.runner_state,
        "taskId": trial.task_id, "taskIds": [t for t, owner in state.task_trials.items() if owner is trial], "checkpointCount": len(ckpts),
        "totalCheckpointSize": str(sum(_size(c) for c in ckpts)), "summaryMetrics": summary,
        "metadata": trial.metadata, "wallClockTime": 0.0,
    }
    if validations:
        out["latestValidation"] = metrics_workload(validations[-1])
    if best is not None:
        out["bestValidation"] = metrics_workload(best)
        out["searcherMetricValue"] = avg(best)[metric]
    completed = [c for c in ckpts if c.state == "STATE_COMPLETED"]
    if completed:
        out["bestCheckpoint"] = checkpoint_workload(completed[-1])
    return {k: v for k, v in out.items() if v is not None}


def checkpoint_view(state: State, c: Checkpoint) -> dict[str, Any]:
    """checkpoint/v1/checkpoint.proto Checkpoint, with its training metadata (checkpoints_view)."""
    out: dict[str, Any] = {"uuid": c.uuid, "taskId": c.task_id, "allocationId": c.allocation_id,
                           "reportTime": c.report_time, "resources": c.resources, "metadata": c.metadata,
                           "state": c.state, "storageId": c.storage_id}
    trial = state.trials.get(c.trial_id) if c.trial_id is not None else None
    if trial is not None:
        metric, _ = _searcher_metric(trial.experiment)
        steps = int(c.metadata.get("steps_completed") or 0)
        own = [m for m in state.metrics if m.trial_id == trial.id and m.total_batches == steps and not m.archived]
        train = next((m for m in reversed(own) if m.group == "training"), None)
        val = next((m for m in reversed(own) if m.group == "validation"), None)
        training: dict[str, Any] = {"trialId": trial.id, "experimentId": trial.experiment.id,
                                    "experimentConfig": trial.experiment.config, "hparams": trial.hparams,
                                    "trainingMetrics": {"avgMetrics": (avg(train) if train else None)},
                                    "validationMetrics": {"avgMetrics": (avg(val) if val else None)}}
        if val is not None and isinstance(avg(val).get(metric), (int, float)):
            training["searcherMetric"] = avg(val)[metric]
        out["training"] = training
    else:
        out["training"] = {}
    return {k: v for k, v in out.items() if v is not None}


def metrics_report(m: Metrics) -> dict[str, Any]:
    """trial/v1/trial.proto MetricsReport (GetMetrics' stream items)."""
    return {"id": str(m.id), "trialId": m.trial_id, "endTime": m.end_time, "metrics": m.metrics,
            "totalBatches": m.total_batches, "archived": m.archived, "trialRunId": m.trial_run_id, "group": m.group}


def _level(raw: str | None) -> str:
    raw = raw or "LOG_LEVEL_INFO"
    return raw if raw.startswith("LOG_LEVEL_") else f"LOG_LEVEL_{raw.upper()}"


def task_log_view(n: int, log: dict[str, Any]) -> dict[str, Any]:
    """model/task.go:480-540 TaskLog.Message and Proto."""
    level = _level(log.get("level"))
    container = (log.get("container_id") or "")[:8] or " " * 8
    rank = f" [rank={log['rank_id']}]" if log.get("rank_id") is not None else ""
    message = f"[{log['timestamp']}] {container}{rank} || {level[len('LOG_LEVEL_'):]}: {log['log']}"
    return {"id": n, "taskId": log.get("task_id"), "allocationId": log.get("allocation_id"),
            "agentId": log.get("agent_id"), "containerId": log.get("container_id"), "rankId": log.get("rank_id"),
            "timestamp": log["timestamp"], "level": level, "log": log["log"], "source": log.get("source"),
            "stdtype": log.get("stdtype"), "message": message}


def dumps_line(result: dict[str, Any]) -> bytes:
    """One item of a server stream as grpc-gateway writes it: a JSON object per line."""
    return json.dumps({"result": result}).encode() + b"\n"


#: checkpointv1.State's numbers (proto/src/determined/checkpoint/v1/checkpoint.proto), SORT_BY_STATE's order
_CHECKPOINT_STATES = ["STATE_UNSPECIFIED", "STATE_ACTIVE", "STATE_COMPLETED", "STATE_ERROR", "STATE_DELETED",
                      "STATE_PARTIALLY_DELETED"]


def sort_checkpoints(ckpts: list[dict[str, Any]], attr: str | None, metric: str | None, order: str | None,
                     smaller_is_better: bool | None) -> list[dict[str, Any]]:
    """Checkpoint views in the order api_experiment.go:1256-1343 GetExperimentCheckpoints gives them, with
    master/pkg/protoutils/protoless/less.go's comparators: SORT_BY_SEARCHER_METRIC without an order sorts
    the better first (the experiment's smaller_is_better) and those without a searcher metric last; ties
    (and SORT_BY_END_TIME) by report time; no sort key: by trial id. ``smaller_is_better`` None: as
    api_trials.go:513-540 GetTrialCheckpoints, which has neither that default order nor nulls last."""
    searcher = attr == "SORT_BY_SEARCHER_METRIC" and smaller_is_better is not None
    if searcher and order in (None, "", "ORDER_BY_UNSPECIFIED"):
        order = "ORDER_BY_ASC" if smaller_is_better else "ORDER_BY_DESC"

    def reported(c: dict[str, Any]) -> dt.datetime:  # less.go CheckpointReportTimeLess: as times, not text
        return dt.datetime.fromisoformat(c["reportTime"].replace("Z", "+00:00"))

    def training(c: dict[str, Any], key: str) -> Any:
        return (c.get("training") or {}).get(key)

    def by(value: Any, a: dict[str, Any], b: dict[str, Any]) -> bool:  # less.go: a missing value is lower
        va, vb = value(a), value(b)
        if va is None:
            return True
        if vb is None:
            return False
        return reported(a) < reported(b) if va == vb else va < vb

    def less(a: dict[str, Any], b: dict[str, Any]) -> bool:
        if searcher:  # CheckpointSearcherMetricNullsLast, before the order is applied
            if training(a, "searcherMetric") is None:
                return False
            if training(b, "searcherMetric") is None:
                return True
        if order == "ORDER_BY_DESC":
            a, b = b, a
        trial_id = functools.partial(training, key="trialId")
        if metric:
            return by(lambda c: ((training(c, "validationMetrics") or {}).get("avgMetrics") or {}).get(metric), a, b)
        if attr == "SORT_BY_BATCH_NUMBER":
            return by(lambda c: c["metadata"].get("steps_completed"), a, b)
        if attr == "SORT_BY_UUID":
            return a["uuid"] < b["uuid"]
        if attr == "SORT_BY_END_TIME":
            return reported(a) < reported(b)
        if attr == "SORT_BY_STATE":
            return _CHECKPOINT_STATES.index(a["state"]) < _CHECKPOINT_STATES.index(b["state"])
        if attr == "SORT_BY_SEARCHER_METRIC":
            return by(functools.partial(training, key="searcherMetric"), a, b)
        return by(trial_id, a, b)

    return sorted(ckpts, key=functools.cmp_to_key(lambda a, b: -1 if less(a, b) else 1 if less(b, a) else 0))
