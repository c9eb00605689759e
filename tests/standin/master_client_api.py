"""The master stand-in's endpoints that a user's side calls: Determined 0.38.1's CLI
(harness/determined/cli/*.py), its login (common/api/authentication.py) and SDK
(common/experimental/*). Paths: proto/src/determined/api/v1/api.proto; each handler names the
master's handler it follows (master/internal/api_*.go at v0.38.1).
"""

from __future__ import annotations

import base64
import io
import tarfile
from typing import Any, Iterator

from determined.common.api.authentication import salt_and_hash

from tests.standin.master import VERSION, ApiError, Raw, Request, Route, Stream, route
from tests.standin.capacity import validate_resources
from tests.standin.master_config import ConfigError, pack_files, parse_create
from tests.standin.master_state import TERMINAL, Experiment, Trial, User
from tests.standin.master_views import (checkpoint_view, checkpoint_workload, experiment_view, metrics_report,
                                        metrics_workload, sort_checkpoints, task_log_view, trial_view, user_view)

ROUTES: list[Route] = []


def _page(items: list[Any], req: Request, key: str) -> dict[str, Any]:
    """apiutils.Paginate: offset/limit (0: all) and the pagination block read_paginated follows."""
    offset, limit = int(req.q("offset") or 0), int(req.q("limit") or 0)
    chunk = items[offset:offset + limit] if limit > 0 else items[offset:]
    return {key: chunk, "pagination": {"offset": offset, "limit": limit, "startIndex": offset,
                                       "endIndex": offset + len(chunk), "total": len(items)}}


def experiment_of(req: Request, key: str) -> Experiment:
    exp = req.master.state.experiments.get(int(req.groups[key]))
    if exp is None:  # api.NotFoundErrs("experiment", id, true)
        raise ApiError(5, f"experiment '{req.groups[key]}' not found")
    return exp


def trial_of(req: Request, key: str) -> Trial:
    trial = req.master.state.trials.get(int(req.groups[key]))
    if trial is None:
        raise ApiError(5, f"trial '{req.groups[key]}' not found")
    return trial


# --- master and authentication ----------------------------------------------------------------

@route(ROUTES, "GET", "/info", auth=False)
def info(req: Request) -> dict[str, Any]:
    """master/internal/core.go getInfo (aproto.MasterInfo), read by cli/version.py:16-30."""
    return {"version": VERSION, "master_id": req.master.master_id, "cluster_id": req.master.cluster_id,
            "cluster_name": "det-lab-standin", "telemetry_enabled": False, "sso_providers": [],
            "rbac_enabled": False, "strict_job_queue_control": False, "user_management_enabled": True,
            "product": "Community", "feature_switches": []}


@route(ROUTES, "GET", "/api/v1/master", auth=False)
def get_master(req: Request) -> dict[str, Any]:
    """api_master.go GetMaster."""
    return {"version": VERSION, "masterId": req.master.master_id, "clusterId": req.master.cluster_id,
            "clusterName": "det-lab-standin", "telemetryEnabled": False, "hasCustomLogo": False,
            "strictJobQueueControl": False, "rbacEnabled": False, "userManagementEnabled": True,
            "product": "PRODUCT_UNSPECIFIED", "featureSwitches": [], "ssoProviders": []}


@route(ROUTES, "POST", "/api/v1/auth/login", auth=False)
def login(req: Request) -> dict[str, Any]:
    """api_auth.go Login: the password as sent (hashed by the client, isHashed) must match."""
    state = req.master.state
    user = state.user_by_name(req.body.get("username") or "")
    given = req.body.get("password") or ""
    if user is None or not user.active or given != (salt_and_hash(user.password) if req.body.get("isHashed")
                                                   else user.password):
        raise ApiError(16, "invalid credentials")  # grpcutil/auth.go:55 ErrInvalidCredentials
    return {"token": state.login(user), "user": user_view(user)}


@route(ROUTES, "POST", "/api/v1/auth/logout")
def logout(req: Request) -> dict[str, Any]:
    """api_auth.go Logout: the session is deleted."""
    for token, user in list(req.master.state.sessions.items()):
        if user is req.user and token == _bearer(req):
            del req.master.state.sessions[token]
    return {}


def _bearer(req: Request) -> str:
    return next((t for t, u in req.master.state.sessions.items() if u is req.user), "")


@route(ROUTES, "GET", "/api/v1/me")
def get_me(req: Request) -> dict[str, Any]:
    """api_user.go GetMe."""
    assert req.user is not None
    return {"user": user_view(req.user)}


# --- users: master/internal/api_user.go ----------------------------------------------------------

@route(ROUTES, "GET", "/api/v1/users")
def get_users(req: Request) -> dict[str, Any]:
    users = sorted(req.master.state.users.values(), key=lambda u: u.id)
    return _page([user_view(u) for u in users], req, "users")


def _user(req: Request) -> User:
    user = req.master.state.users.get(int(req.groups["userId"]))
    if user is None:
        raise ApiError(5, f"user '{req.groups['userId']}' not found")
    return user


@route(ROUTES, "GET", "/api/v1/users/{userId}")
def get_user(req: Request) -> dict[str, Any]:
    return {"user": user_view(_user(req))}


@route(ROUTES, "GET", "/api/v1/users/{username}/by-username")
def get_user_by_username(req: Request) -> dict[str, Any]:
    user = req.master.state.user_by_name(req.groups["username"])
    if user is None:
        raise ApiError(5, f"user '{req.groups['username']}' not found")
    return {"user": user_view(user)}


def _password(body: dict[str, Any]) -> str | None:
    """The stand-in keeps plain passwords; a hashed one can only be matched as sent."""
    if body.get("password") is None:
        return None
    if body.get("isHashed") and body["password"]:
        raise ApiError(3, "the stand-in needs plain passwords (isHashed: false)")
    return str(body["password"])


@route(ROUTES, "POST", "/api/v1/users")
def post_user(req: Request) -> dict[str, Any]:
    """api_user.go PostUser: a unique username; an agent user group when given."""
    state, body = req.master.state, req.body.get("user") or {}
    if not (req.user and req.user.admin):
        raise ApiError(7, "only admin privileged users can create users")
    if not body.get("username") or state.user_by_name(body["username"]):
        raise ApiError(6, f"user {body.get('username')!r} already exists" if body.get("username")
                       else "username is required")
    user = state.add_user(body["username"], _password(req.body) or "", bool(body.get("admin")),
                          active=body.get("active", True), display_name=body.get("displayName") or "",
                          agent_user_group=body.get("agentUserGroup"))
    return {"user": user_view(user)}


@route(ROUTES, "PATCH", "/api/v1/users/{userId}")
def patch_user(req: Request) -> dict[str, Any]:
    """api_user.go PatchUser: what ``det user link-with-agent-user``, ``change-password``,
    ``activate`` and ``rename`` send."""
    user, body = _user(req), req.body
    if not (req.user and (req.user.admin or req.user is user)):
        raise ApiError(7, "access denied")
    for key, attr in (("username", "username"), ("displayName", "display_name"), ("admin", "admin"),
                      ("active", "active"), ("agentUserGroup", "agent_user_group")):
        if body.get(key) is not None:
            setattr(user, attr, body[key])
    password = _password(body)
    if password is not None:
        user.password = password
    return {"user": user_view(user)}


# --- templates: master/internal/templates/api.go --------------------------------------------------

@route(ROUTES, "GET", "/api/v1/templates")
def get_templates(req: Request) -> dict[str, Any]:
    return _page(sorted(req.master.state.templates.values(), key=lambda t: t["name"]), req, "templates")


@route(ROUTES, "GET", "/api/v1/templates/{name}")
def get_template(req: Request) -> dict[str, Any]:
    tpl = req.master.state.templates.get(req.groups["name"])
    if tpl is None:
        raise ApiError(5, f"template '{req.groups['name']}' not found")
    return {"template": tpl}


@route(ROUTES, "POST", "/api/v1/templates/{name}")
def post_template(req: Request) -> dict[str, Any]:
    """PostTemplate ~l.167-204: a plain INSERT; a second of a name is the database's error (Unknown)."""
    name = req.groups["name"]
    if name in req.master.state.templates:
        raise ApiError(2, 'ERROR: duplicate key value violates unique constraint "templates_pkey" (SQLSTATE 23505)')
    tpl = {"name": name, "config": req.body.get("config") or {}, "workspaceId": req.body.get("workspaceId") or 1}
    req.master.state.templates[name] = tpl
    return {"template": tpl}


@route(ROUTES, "PATCH", "/api/v1/templates/{name}")
def patch_template(req: Request) -> dict[str, Any]:
    tpl = get_template(req)["template"]
    tpl["config"] = req.body.get("config") or req.body
    return {"template": tpl}


@route(ROUTES, "DELETE", "/api/v1/templates/{name}")
def delete_template(req: Request) -> dict[str, Any]:
    get_template(req)
    del req.master.state.templates[req.groups["name"]]
    return {}


# --- experiments: master/internal/api_experiment.go -----------------------------------------------

def _zero_experiment() -> dict[str, Any]:
    """experimentv1.Experiment{} as the gateway marshals it (EmitDefaults): what validateOnly returns."""
    return {"id": 0, "description": "", "labels": [], "startTime": None, "state": "STATE_UNSPECIFIED",
            "archived": False, "numTrials": 0, "trialIds": [], "displayName": "", "userId": 0, "username": "",
            "resourcePool": "", "searcherType": "", "name": "", "notes": "", "jobId": "", "projectId": 0,
            "projectName": "", "workspaceId": 0, "workspaceName": "", "parentArchived": False, "config": None,
            "originalConfig": "", "projectOwnerId": 0, "checkpointSize": "0", "checkpointCount": 0}


@route(ROUTES, "POST", "/api/v1/experiments")
def create_experiment(req: Request) -> dict[str, Any]:
    """api_experiment.go:1592-1700 CreateExperiment, core_experiment.go:269-420 parseCreateExperiment."""
    state, body = req.master.state, req.body
    assert req.user is not None
    parent_id = int(body.get("parentId") or 0)
    with state.lock:
        parent = state.experiments.get(parent_id) if parent_id else None
        if parent_id and parent is None:
            raise ApiError(5, f"experiment '{parent_id}' not found")
        template = None
        if body.get("template"):
            tpl = state.templates.get(body["template"])
            if tpl is None:  # templates/service.go:42-43
                raise ApiError(5, f"template '{body['template']}' not found")
            template = tpl["config"]
        try:
            config = parse_create(body.get("config") or "", template, req.master.config,
                                  unmanaged=bool(body.get("unmanaged")))
        except ConfigError as exc:
            raise ApiError(exc.code, exc.message) from exc
        if body.get("validateOnly"):
            return {"experiment": _zero_experiment(), "config": None}
        model_def = parent.model_def if parent is not None else pack_files(body.get("modelDefinition") or [])
        res = config.get("resources") or {}
        try:
            warnings = validate_resources(req.master.config, state.agent_slots, int(res.get("slots_per_trial") or 0),
                                          bool(res.get("is_single_node")))
        except ValueError as exc:  # api_experiment.go:1672-1675
            raise ApiError(13, f"failed to create experiment: {exc}") from exc
        try:
            exp = state.create_experiment(config, body.get("config") or "", model_def, req.user,
                                          parent_id or None, bool(body.get("activate")))
        except (ValueError, ImportError) as exc:  # api_experiment.go:1672-1675 (searcher.NewSearcher's error)
            raise ApiError(13, f"failed to create experiment: {exc}") from exc
        return {"experiment": experiment_view(state, exp), "config": exp.config, "warnings": warnings}


@route(ROUTES, "GET", "/api/v1/experiments")
def get_experiments(req: Request) -> dict[str, Any]:
    """GetExperiments: the states filter, newest last."""
    state = req.master.state
    with state.lock:
        states = set(req.qlist("states"))
        exps = [experiment_view(state, e) for e in sorted(state.experiments.values(), key=lambda e: e.id)
                if not states or f"STATE_{e.state}" in states]
    return _page(exps, req, "experiments")


@route(ROUTES, "GET", "/api/v1/experiments/{experimentId}")
def get_experiment(req: Request) -> dict[str, Any]:
    with req.master.state.lock:
        exp = experiment_of(req, "experimentId")
        return {"experiment": experiment_view(req.master.state, exp), "config": exp.config}


@route(ROUTES, "GET", "/api/v1/experiments/{experimentId}/trials")
def get_experiment_trials(req: Request) -> dict[str, Any]:
    """api_trials.go:584-674 GetExperimentTrials: by id."""
    state = req.master.state
    with state.lock:
        exp = experiment_of(req, "experimentId")
        states = set(req.qlist("states"))
        trials = [trial_view(state, t) for t in sorted(state.trials.values(), key=lambda t: t.id)
                  if t.experiment is exp and (not states or f"STATE_{t.state}" in states)]
    return _page(trials, req, "trials")


def _checkpoints(req: Request, trial_ids: set[int], smaller_is_better: bool | None) -> dict[str, Any]:
    state = req.master.state
    states = set(req.qlist("states"))
    ckpts = [checkpoint_view(state, c) for c in state.checkpoints.values()
             if c.trial_id in trial_ids and (not states or c.state in states)]
    ckpts = sort_checkpoints(ckpts, req.q("sortByAttr"), req.q("sortByMetric"), req.q("orderBy"), smaller_is_better)
    return _page(ckpts, req, "checkpoints")


@route(ROUTES, "GET", "/api/v1/experiments/{id}/checkpoints")
def get_experiment_checkpoints(req: Request) -> dict[str, Any]:
    """api_experiment.go:1256-1343 GetExperimentCheckpoints (the SDK's top_checkpoint: the first by searcher metric)."""
    with req.master.state.lock:
        exp = experiment_of(req, "id")
        smaller = bool((exp.config.get("searcher") or {}).get("smaller_is_better", True))
        return _checkpoints(req, {t.id for t in req.master.state.trials.values() if t.experiment is exp}, smaller)


@route(ROUTES, "GET", "/api/v1/trials/{id}/checkpoints")
def get_trial_checkpoints(req: Request) -> dict[str, Any]:
    """api_trials.go:471-547 GetTrialCheckpoints."""
    with req.master.state.lock:
        return _checkpoints(req, {trial_of(req, "id").id}, None)


def _lifecycle(req: Request, target: str) -> dict[str, Any]:
    """experiment.go:485-546 Activate/Pause/Cancel/KillExperiment."""
    state = req.master.state
    with state.lock:
        exp = experiment_of(req, "id")
        if target in ("STOPPING_CANCELED", "STOPPING_KILLED") and (
                exp.state in TERMINAL or exp.state == target or (target == "STOPPING_CANCELED" and exp.state.startswith("STOPPING"))):
            return {}
        if not state.update_experiment_state(exp, target):
            raise ApiError(9, f"experiment in incompatible state {exp.state}")
    return {}


for _verb, _target in (("activate", "ACTIVE"), ("pause", "PAUSED"), ("cancel", "STOPPING_CANCELED"),
                       ("kill", "STOPPING_KILLED")):
    route(ROUTES, "POST", f"/api/v1/experiments/{{id}}/{_verb}")(lambda req, t=_target: _lifecycle(req, t))


@route(ROUTES, "POST", "/api/v1/trials/{id}/kill")
def kill_trial(req: Request) -> dict[str, Any]:
    """api_trials.go:549-583 KillTrial: the trial is patched to STOPPING_KILLED."""
    with req.master.state.lock:
        req.master.state.patch_trial_state(trial_of(req, "id"), "STOPPING_KILLED")
    return {}


@route(ROUTES, "GET", "/api/v1/experiments/{experimentId}/model_def")
def get_model_def(req: Request) -> dict[str, Any]:
    """api_experiment.go:2300-2317 GetModelDef."""
    return {"b64Tgz": base64.b64encode(experiment_of(req, "experimentId").model_def).decode()}


@route(ROUTES, "GET", "/api/v1/experiments/{experimentId}/searcher/best_searcher_validation_metric")
def best_validation(req: Request) -> dict[str, Any]:
    """api_experiment.go:2279-2298: NotFound while no trial has validated."""
    with req.master.state.lock:
        exp = experiment_of(req, "experimentId")
        view = experiment_view(req.master.state, exp)
    if "bestTrialSearcherMetric" not in view:
        raise ApiError(5, "no validations for experiment")
    return {"metric": view["bestTrialSearcherMetric"]}


# --- trials, metrics, logs, checkpoints --------------------------------------------------------

@route(ROUTES, "GET", "/api/v1/trials/{trialId}")
def get_trial(req: Request) -> dict[str, Any]:
    """api_trials.go:717-747 GetTrial."""
    with req.master.state.lock:
        return {"trial": trial_view(req.master.state, trial_of(req, "trialId"))}


@route(ROUTES, "GET", "/api/v1/trials/{trialId}/workloads")
def get_trial_workloads(req: Request) -> dict[str, Any]:
    """api_trials.go:1086-1135 GetTrialWorkloads: training, validation and checkpoint workloads by batch."""
    state = req.master.state
    with state.lock:
        trial = trial_of(req, "trialId")
        items: list[tuple[int, dict[str, Any]]] = [
            (m.total_batches, {m.group if m.group in ("training", "validation") else "training": metrics_workload(m)})
            for m in state.metrics if m.trial_id == trial.id and not m.archived]
        items += [(int(c.metadata.get("steps_completed") or 0), {"checkpoint": checkpoint_workload(c)})
                  for c in state.checkpoints.values() if c.trial_id == trial.id]
    items.sort(key=lambda i: i[0])
    return _page([w for _, w in items], req, "workloads")


def _metrics_stream(req: Request, group: str | None) -> Stream:
    """api_trials.go:986-1084 GetMetrics / GetTrainingMetrics / GetValidationMetrics: one batch per trial."""
    state = req.master.state
    ids = {int(i) for raw in req.qlist("trialIds") for i in raw.split(",")}
    group = group or req.q("group") or "training"
    with state.lock:
        batches = [[metrics_report(m) for m in state.metrics if m.trial_id == tid and m.group == group]
                   for tid in sorted(ids)]
    return Stream({"metrics": b} for b in batches if b)


route(ROUTES, "GET", "/api/v1/trials/metrics/trial_metrics")(lambda req: _metrics_stream(req, None))
route(ROUTES, "GET", "/api/v1/trials/metrics/training_metrics")(lambda req: _metrics_stream(req, "training"))
route(ROUTES, "GET", "/api/v1/trials/metrics/validation_metrics")(lambda req: _metrics_stream(req, "validation"))


def follow_logs(req: Request, task_ids: list[str], done: Any, wrap: Any) -> Iterator[dict[str, Any]]:
    """api_tasks.go:610-740 taskLogs: what is stored, then (follow) what comes until the task ends."""
    state, sent = req.master.state, 0
    follow = (req.q("follow") or "").lower() == "true"
    limit = int(req.q("limit") or 0)
    while True:
        with state.changed:
            logs = [log for t in task_ids for log in state.logs.get(t, [])]
            finished = done()
            if follow and sent >= len(logs) and not finished:
                state.changed.wait(1.0)
                continue
        if limit and not follow:
            logs = logs[:limit]
        for i in range(sent, len(logs)):
            yield wrap(i + 1, logs[i])
        sent = len(logs)
        if not follow or finished:
            return


@route(ROUTES, "GET", "/api/v1/trials/{trialId}/logs")
def trial_logs(req: Request) -> Stream:
    """api_trials.go:133-237 TrialLogs: the trial's task logs as TrialLogsResponse."""
    trial = trial_of(req, "trialId")

    def wrap(n: int, log: dict[str, Any]) -> dict[str, Any]:
        view = task_log_view(n, log)
        return {k: view[k] for k in ("id", "timestamp", "message", "level", "agentId", "containerId", "rankId",
                                     "log", "source", "stdtype")} | {"trialId": trial.id}
    task_ids = [t for t, owner in req.master.state.task_trials.items() if owner is trial]  # a continued trial's too
    return Stream(follow_logs(req, task_ids, lambda: trial.state in TERMINAL, wrap))


@route(ROUTES, "GET", "/api/v1/tasks/{taskId}/logs")
def task_logs(req: Request) -> Stream:
    """api_tasks.go:417-442 TaskLogs."""
    trial = req.master.state.task_trials.get(req.groups["taskId"])
    command = req.master.state.commands.get(req.groups["taskId"])
    if command is not None:  # a command's logs end with its allocation
        return Stream(follow_logs(req, [command.id], lambda: command.alloc.state == "TERMINATED", task_log_view))
    return Stream(follow_logs(req, [req.groups["taskId"]], lambda: trial is None or trial.state in TERMINAL,
                              task_log_view))


@route(ROUTES, "GET", "/api/v1/checkpoints/{uuid}")
def get_checkpoint(req: Request) -> dict[str, Any]:
    """api_checkpoint.go GetCheckpoint."""
    with req.master.state.lock:
        ckpt = req.master.state.checkpoints.get(req.groups["uuid"])
        if ckpt is None:
            raise ApiError(5, f"checkpoint '{req.groups['uuid']}' not found")
        return {"checkpoint": checkpoint_view(req.master.state, ckpt)}


@route(ROUTES, "GET", "/checkpoints/{uuid}")
def download_checkpoint(req: Request) -> Raw:
    """master/internal/checkpoint_download.go: the checkpoint's files as a tar.gz (shared_fs only here)."""
    from pathlib import Path
    ckpt = req.master.state.checkpoints.get(req.groups["uuid"])
    trial = req.master.state.trials.get(ckpt.trial_id) if ckpt and ckpt.trial_id else None
    storage = (trial.experiment.config.get("checkpoint_storage") or {}) if trial else {}
    if ckpt is None or storage.get("type") != "shared_fs":
        raise ApiError(5, f"checkpoint '{req.groups['uuid']}' not found")
    root = Path(storage["host_path"]) / (storage.get("storage_path") or "") / ckpt.uuid
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname=".")
    return Raw(buf.getvalue(), "application/gzip")
