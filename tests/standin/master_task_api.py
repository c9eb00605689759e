"""The master stand-in's endpoints that a trial's side calls: Determined 0.38.1's exec/prep_container.py,
exec/launch.py, core/*.py (metrics, checkpoints, preemption, progress, early exit), the log shipper
(master/static/srv/ship_logs.py), and ``task_spec``: the Allocation the agent stand-in starts
(master/pkg/tasks/task_trial.go:101-140 TrialSpec). Each handler names the master's handler it follows.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any

from tests.standin.master import ApiError, Master, Request, Route, route
from tests.standin.master_client_api import trial_of
from tests.standin.master_state import Alloc, Checkpoint, Metrics, now_iso
from tests.standin.model import Allocation
from tests.standin.task_config import pool_defaults

ROUTES: list[Route] = []
#: model.MetricGroup.Validate (master/pkg/model/metrics.go): a name of word characters
_GROUP = re.compile(r"^[a-zA-Z0-9_\-]+$")


def task_spec(master: Master, alloc: Alloc, slot_ids: list[int], slot_type: str = "cpu") -> Allocation:
    """What the master hands the agent for ``alloc`` (task_trial.go:101-140, task.go:194-245; a
    command's: task_command.go:63-127)."""
    if alloc.command is not None:
        return command_spec(master, alloc, slot_ids, slot_type)
    trial, exp = alloc.trial, alloc.trial.experiment
    with master.state.lock:
        token = master.state.login(exp.owner)  # core_experiment.go:396 getTaskSessionToken
        pool = (exp.config.get("resources") or {}).get("resource_pool") or "default"
        return Allocation(
            master_url=master.url, experiment_id=exp.id, trial_id=trial.id, trial_run_id=trial.run_id,
            trial_seed=trial.seed, request_id=trial.request_id, task_id=trial.task_id, allocation_id=alloc.id,
            resources_id=alloc.resources_id, container_id=alloc.container_id, hparams=dict(trial.hparams),
            config=exp.config, det_user=exp.owner.username, session_token=token, slot_ids=list(slot_ids),
            slot_type=slot_type, latest_checkpoint=alloc.latest_checkpoint, steps_completed=alloc.steps_completed,
            task_container_defaults=pool_defaults(master.config, pool))


def command_spec(master: Master, alloc: Alloc, slot_ids: list[int], slot_type: str = "cpu") -> Allocation:
    """A command's or notebook's task: no experiment or trial, its config's mounts and variables."""
    cmd = alloc.command
    with master.state.lock:
        token = master.state.login(cmd.owner)  # api_command.go getTaskSessionToken
        pool = cmd.config["resources"]["resource_pool"]
        return Allocation(
            master_url=master.url, experiment_id=0, trial_id=0, trial_run_id=0, trial_seed=0, request_id="",
            task_id=cmd.id, allocation_id=alloc.id, resources_id=alloc.resources_id, container_id=alloc.container_id,
            hparams={}, config=cmd.config, det_user=cmd.owner.username, session_token=token, slot_ids=list(slot_ids),
            slot_type=slot_type, task_container_defaults=pool_defaults(master.config, pool), task_type=cmd.task_type,
            extra_env=dict(cmd.extra_env), entrypoint=list(cmd.config["entrypoint"]), work_dir=cmd.config["work_dir"])


def _alloc(req: Request) -> Alloc:
    alloc = req.master.state.allocs.get(req.groups["allocationId"])
    if alloc is None:
        raise ApiError(5, f"allocation '{req.groups['allocationId']}' not found")
    return alloc


@route(ROUTES, "GET", "/api/v1/tasks/{taskId}/context_directory")
def get_task_context_directory(req: Request) -> dict[str, Any]:
    """api_experiment.go:2319-2350 GetTaskContextDirectory: the experiment's stored tarball."""
    trial = req.master.state.task_trials.get(req.groups["taskId"])
    command = req.master.state.commands.get(req.groups["taskId"])  # a command's files (api_command.go)
    if trial is None and command is None:
        raise ApiError(5, f"task '{req.groups['taskId']}' not found")
    return {"b64Tgz": base64.b64encode(trial.experiment.model_def if trial else command.context).decode()}


@route(ROUTES, "GET", "/api/v1/allocations/{allocationId}/resources/{resourcesId}/rendezvous")
def rendezvous(req: Request) -> dict[str, Any]:
    """task/allocation.go rendezvous (api_trials.go:1575-1594): one container, rank 0; a complete
    rendezvous makes the allocation ready (allocation.go:384-394), so a pause preempts it. An allocation
    fitted over several agents waits for all its containers (tests/standin/agents.py)."""
    alloc = _alloc(req)
    if alloc.resources:
        from tests.standin.agents import watch_rendezvous
        return watch_rendezvous(req.master, alloc, req.groups["resourcesId"])
    with req.master.state.lock:
        alloc = _alloc(req)
        alloc.ready = True
        return {"rendezvousInfo": {"addresses": ["127.0.0.1"], "rank": 0, "slots": [len(alloc.slot_ids)]}}


@route(ROUTES, "POST", "/api/v1/allocations/{allocationId}/all_gather")
def all_gather(req: Request) -> dict[str, Any]:
    """api_tasks.go:255-286 AllocationAllGather: waits for ``numPeers`` contributions."""
    state = req.master.state
    with state.changed:
        alloc = _alloc(req)
        gather = state.logs.setdefault(f"_gather/{alloc.id}", [])
        gather.append({"uuid": req.body.get("requestUuid"), "data": req.body.get("data")})
        state.changed.notify_all()
        deadline = time.monotonic() + 600
        while len(gather) < int(req.body.get("numPeers") or 1) and time.monotonic() < deadline:
            state.changed.wait(1.0)
        return {"data": [g["data"] for g in gather]}


def _noop(req: Request) -> dict[str, Any]:
    _alloc(req)
    return {}


for _path in ("proxy_address", "notify_container_running", "acceleratorData", "waiting"):
    route(ROUTES, "POST", f"/api/v1/allocations/{{allocationId}}/{_path}")(_noop)  # api_tasks.go:241-415


@route(ROUTES, "POST", "/api/v1/allocations/{allocationId}/ready")
def allocation_ready(req: Request) -> dict[str, Any]:
    """api_tasks.go:227-239 AllocationReady (allocation.go:362-378 SetReady)."""
    with req.master.state.lock:
        _alloc(req).ready = True
    return {}


@route(ROUTES, "GET", "/api/v1/allocations/{allocationId}/signals/preemption")
def preemption_signal(req: Request) -> dict[str, Any]:
    """api_trials.go:1283-1299 AllocationPreemptionSignal: a long poll of ``timeout_seconds``."""
    timeout = float(req.q("timeout_seconds", "timeoutSeconds", default="0") or 0)
    return {"preempt": req.master.state.wait_preemption(_alloc(req), timeout)}


@route(ROUTES, "POST", "/api/v1/allocations/{allocationId}/signals/ack_preemption")
def ack_preemption(req: Request) -> dict[str, Any]:
    """api_trials.go:1301-1313: an acknowledged preemption is not a user-requested stop (allocation.go:1156)."""
    with req.master.state.lock:
        _alloc(req).acked = True
    return {}


@route(ROUTES, "POST", "/api/v1/allocations/{allocationId}/signals/pending_preemption")
def pending_preemption(req: Request) -> dict[str, Any]:
    """api_trials.go:1315-1332: TerminateAllocation with forcePreemption."""
    state = req.master.state
    with state.lock:
        alloc = _alloc(req)
        alloc.ready = True
        state.signal(alloc, "terminate")
    return {}


@route(ROUTES, "POST", "/api/v1/trials/{trialId}/metrics")
def report_trial_metrics(req: Request) -> dict[str, Any]:
    """api_trials.go:1441-1476 ReportTrialMetrics: a validation feeds the searcher, then the row is
    stored; rows of earlier runs at or past these steps are archived (db/postgres_trial_metrics.go)."""
    state, body = req.master.state, req.body
    group, m = body.get("group") or "", body.get("metrics") or {}
    if not _GROUP.match(group):
        raise ApiError(3, f"invalid metric group name: {group!r}")
    with state.lock:
        trial = trial_of(req, "trialId")
        steps, run_id = int(m.get("stepsCompleted") or 0), int(m.get("trialRunId") or 0)
        sent = m.get("metrics") or {}  # v1Metrics, stored as the metrics column holds it (snake_case keys;
        # a validation's under validation_metrics: db/postgres_trial_metrics.go, sdk metrics.py:39)
        key = "validation_metrics" if group == "validation" else "avg_metrics"
        values = {key: sent.get("avgMetrics", sent.get("avg_metrics")) or {},
                  "batch_metrics": sent.get("batchMetrics", sent.get("batch_metrics"))}
        if group == "validation":
            state.report_validation(trial, values[key])
        for old in state.metrics:
            if old.trial_id == trial.id and old.group == group and old.trial_run_id < run_id \
                    and old.total_batches >= steps:
                old.archived = True
        state.metrics.append(Metrics(state.next_id("metrics"), trial.id, run_id, group, steps, values,
                                     m.get("reportTime") or now_iso()))
        state.notify()
    return {}


@route(ROUTES, "POST", "/api/v1/trials/{trialId}/progress")
def report_trial_progress(req: Request) -> dict[str, Any]:
    """api_trials.go:1405-1439 ReportTrialProgress (raw progress, 0..1)."""
    with req.master.state.lock:
        req.master.state.report_progress(trial_of(req, "trialId"), float(req.body.get("progress") or 0))
    return {}


@route(ROUTES, "POST", "/api/v1/trials/{trialId}/early_exit")
def report_early_exit(req: Request) -> dict[str, Any]:
    """api_trials.go:1374-1403 ReportTrialSearcherEarlyExit (trial.go:269-299)."""
    with req.master.state.lock:
        trial = trial_of(req, "trialId")
        reason = str(req.body.get("reason") or "").removeprefix("EXITED_REASON_")
        if reason not in ("INVALID_HP", "INIT_INVALID_HP"):
            raise ApiError(3, f"unhandled early exit reason: {reason}")
        trial.user_exit_reason = reason
    return {}


@route(ROUTES, "POST", "/api/v1/trials/{trialId}/runner/metadata")
def runner_metadata(req: Request) -> dict[str, Any]:
    """api_trials.go:1596-1616 PostTrialRunnerMetadata."""
    with req.master.state.lock:
        trial_of(req, "trialId").runner_state = str((req.body.get("metadata") or req.body).get("state") or "")
    return {}


@route(ROUTES, "PATCH", "/api/v1/trials/{trialId}")
def patch_trial(req: Request) -> dict[str, Any]:
    """api_trials.go PatchTrial (unmanaged trials' heartbeat): accepted, nothing to do for managed ones."""
    with req.master.state.lock:
        trial_of(req, "trialId")
    return {}


@route(ROUTES, "POST", "/api/v1/trial-source-info")
def trial_source_info(req: Request) -> dict[str, Any]:
    """api_trial_source_info.go ReportTrialSourceInfo."""
    info = req.body.get("trialSourceInfo") or {}
    return {"trialId": info.get("trialId"), "checkpointUuid": info.get("checkpointUuid")}


@route(ROUTES, "POST", "/api/v1/runs/start")
def run_prepare(req: Request) -> dict[str, Any]:
    """api_runs.go RunPrepareForReporting: the storage id of the run's checkpoint storage."""
    return {"storageId": 1}


@route(ROUTES, "POST", "/api/v1/runs/{runId}/metadata")
def post_run_metadata(req: Request) -> dict[str, Any]:
    with req.master.state.lock:
        trial = req.master.state.trials.get(int(req.groups["runId"]))
        if trial is None:
            raise ApiError(5, f"run '{req.groups['runId']}' not found")
        trial.metadata = dict(req.body.get("metadata") or {})
        return {"metadata": trial.metadata}


@route(ROUTES, "GET", "/api/v1/runs/{runId}/metadata")
def get_run_metadata(req: Request) -> dict[str, Any]:
    trial = req.master.state.trials.get(int(req.groups["runId"]))
    if trial is None:
        raise ApiError(5, f"run '{req.groups['runId']}' not found")
    return {"metadata": trial.metadata}


@route(ROUTES, "POST", "/api/v1/checkpoints")
def report_checkpoint(req: Request) -> dict[str, Any]:
    """api_trials.go:1498-1573 ReportCheckpoint: owned by the trial of its task."""
    state, c = req.master.state, req.body
    with state.lock:
        trial = state.task_trials.get(c.get("taskId") or "")
        state.checkpoints[c["uuid"]] = Checkpoint(
            c["uuid"], c.get("taskId") or "", c.get("allocationId"), c.get("reportTime") or now_iso(),
            {k: str(v) for k, v in (c.get("resources") or {}).items()}, dict(c.get("metadata") or {}),
            c.get("state") or "STATE_COMPLETED", c.get("storageId"), trial.id if trial else None)
        state.notify()
    return {}


@route(ROUTES, "PATCH", "/api/v1/checkpoints")
def patch_checkpoints(req: Request) -> dict[str, Any]:
    """api_checkpoint.go PatchCheckpoints: new resources; none left is DELETED, fewer PARTIALLY_DELETED."""
    state = req.master.state
    with state.lock:
        for patch in req.body.get("checkpoints") or []:
            ckpt = state.checkpoints.get(patch.get("uuid"))
            if ckpt is None:
                raise ApiError(5, f"checkpoint '{patch.get('uuid')}' not found")
            if patch.get("resources") is not None:
                files = {k: str(v) for k, v in (patch["resources"].get("resources") or {}).items()}
                ckpt.state = "STATE_DELETED" if not files else (
                    "STATE_PARTIALLY_DELETED" if set(files) != set(ckpt.resources) else ckpt.state)
                ckpt.resources = files
    return {}


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _store_logs(req: Request, logs: list[dict[str, Any]]) -> dict[str, Any]:
    state = req.master.state
    with state.lock:
        for log in logs:
            entry = {_snake(k): v for k, v in log.items()}
            entry.setdefault("timestamp", now_iso())
            state.logs.setdefault(str(entry.get("task_id") or ""), []).append(entry)
        state.notify()
    return {}


@route(ROUTES, "POST", "/api/v1/task/logs")
def post_task_logs(req: Request) -> dict[str, Any]:
    """api_tasks.go:465-515 PostTaskLogs (ship_logs.py's batches)."""
    return _store_logs(req, list(req.body.get("logs") or []))


@route(ROUTES, "POST", "/task-logs")
def post_task_logs_echo(req: Request) -> dict[str, Any]:
    """master/internal/core.go's echo route for core/_log_shipper.py:165-166 (a JSON list)."""
    import json
    return _store_logs(req, list(json.loads(req.raw or b"[]")))
