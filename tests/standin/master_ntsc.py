"""The master stand-in's commands and notebooks launched with a config template, as Determined 0.38.1's
master makes them: ``LaunchCommand`` (``det cmd run [--template T]``: harness/determined/cli/command.py,
cli/ntsc.py:422-459) and ``LaunchNotebook`` (the Web UI's "Launch JupyterLab" dialog,
webui/react/src/utils/jupyter.ts: ``previewJupyterLab`` with ``preview: true`` shows the merged config,
``launchJupyterLab`` starts it; services/apiConfig.ts:2084-2105).

The config is Go's ``model.CommandConfig`` (master/pkg/model/command_config.go:42-56), built as
api_command.go:60-179 getCommandLaunchParams builds it: ``DefaultConfig`` from the pool's task-container
defaults (command_config.go:23-40, defaults.go), the template unmarshalled over it, then the request's
config (unknown fields refused), the pool and slots, the default priority, the work dir against a
context. ``json.Unmarshal`` over a filled struct keeps what a key does not name; Determined's own
unmarshalers append environment variables (environment_config.go:121-148) and put a new bind mount or
device ahead of the old ones at other container paths (experiment_config.go:30-50,175-196). The JSON
returned is the struct's, with its omitempty fields.

A launched command runs in the agent stand-in through ``/run/determined/command-entrypoint.sh``
(tests/standin/task_run.py); a launched notebook is accepted and queued but no agent stand-in runs
JupyterLab (no ``jupyterlab`` in the task image).
"""

from __future__ import annotations

import copy
import json
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tests.standin.master import ApiError, Request, Route, route
from tests.standin.master_config import CPU_IMAGE, CUDA_IMAGE, DEFAULT_PRIORITY, ROCM_IMAGE, pack_files
from tests.standin.master_state import Alloc, User, now_iso
from tests.standin.task_config import pool_defaults

ROUTES: list[Route] = []
#: api_command.go:45, api_notebook.go (jupyterEntrypoint)
COMMAND_ENTRYPOINT = "/run/determined/command-entrypoint.sh"
NOTEBOOK_ENTRYPOINT = "/run/determined/jupyter/notebook-entrypoint.sh"
#: command_config.go:8-17
IDLE_TYPES = ("kernels_or_terminals", "kernel_connections", "activity")
_UNITS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def parse_duration(text: str) -> int:
    """Go's time.ParseDuration, in nanoseconds (model.Duration's UnmarshalJSON: duration.go:21-36)."""
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    if not text or "".join(a + b for a, b in parts) != text.lstrip("+"):
        raise ValueError(f'error parsing duration: time: invalid duration "{text}"')
    return int(sum(float(n) * _UNITS[u] for n, u in parts))


def format_duration(ns: int) -> str:
    """Go's time.Duration.String() (model.Duration's MarshalJSON) for whole seconds and up."""
    if ns == 0:
        return "0s"
    h, rest = divmod(ns, 3600 * 10**9)
    m, rest = divmod(rest, 60 * 10**9)
    s, frac = divmod(rest, 10**9)
    sec = f"{s}" + (f".{frac:09d}".rstrip("0") if frac else "") + "s"
    return (f"{h}h{m}m" if h else (f"{m}m" if m else "")) + sec


def _bind_mounts(value: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BindMountsConfig.UnmarshalJSON (experiment_config.go:175-196), each BindMount with propagation
    rprivate unless given (:209-213)."""
    new = [{"host_path": m.get("host_path", ""), "container_path": m.get("container_path", ""),
            "read_only": bool(m.get("read_only", False)), "propagation": m.get("propagation", "rprivate")}
           for m in value]
    taken = {m["container_path"] for m in new}
    return new + [m for m in old if m["container_path"] not in taken]


def _runtime_item(value: Any, old: dict[str, str]) -> dict[str, str]:
    """RuntimeItem.UnmarshalJSON (environment_config.go:50-95): a string is every device's image."""
    if isinstance(value, str):
        return {"cpu": value, "cuda": value, "rocm": value}
    out = dict(old)
    for key in ("cpu", "cuda", "rocm"):
        if key in value:
            out[key] = value[key] or ""
    if not out.get("cuda") and value.get("gpu"):
        out["cuda"] = value["gpu"]
    return {k: v for k, v in out.items() if v}


def _runtime_items(value: Any, old: dict[str, list[str]]) -> dict[str, list[str]]:
    """RuntimeItems.UnmarshalJSON (environment_config.go:121-148): appended, a list to every device."""
    out = {k: list(v) for k, v in old.items()}
    for key in ("cpu", "cuda", "rocm"):
        add = value if isinstance(value, list) else (value.get(key) or [])
        if not isinstance(value, list) and key == "cuda" and not out.get("cuda") and not add:
            add = value.get("gpu") or []
        if add:
            out[key] = out.get(key, []) + list(add)
    return out


#: the CommandConfig's fields (command_config.go:42-56) and their nested structs: key -> kind
_TOP = {"description": "str", "bind_mounts": "mounts", "environment": "env", "resources": "res",
        "entrypoint": "list", "tensorboard_args": "list", "idle_timeout": "duration",
        "notebook_idle_type": "str", "work_dir": "ptr", "debug": "bool", "pbs": "obj", "slurm": "obj"}
_ENV = {"image": "image", "environment_variables": "envvars", "proxy_ports": "list", "ports": "map",
        "registry_auth": "ptr", "force_pull_image": "bool", "pod_spec": "ptr", "add_capabilities": "list",
        "drop_capabilities": "list"}
_RES = {"slots": "int", "max_slots": "ptr", "weight": "num", "native_parallel": "bool", "shm_size": "ptr",
        "resource_pool": "str", "priority": "ptr", "is_single_node": "ptr", "devices": "devices"}


def _decode(target: dict[str, Any], value: Any, fields: dict[str, str], where: str, strict: bool) -> None:
    """json.Unmarshal of ``value`` into the struct ``target`` (a null leaves a value field as it is)."""
    if not isinstance(value, dict):
        raise ValueError(f"json: cannot unmarshal {type(value).__name__} into Go value of type {where}")
    for key, v in value.items():
        kind = fields.get(key)
        if kind is None:
            if strict:
                raise ValueError(f'json: unknown field "{key}"')
            continue
        if v is None:
            if kind in ("ptr", "list", "map", "duration"):
                target[key] = None
            continue
        if kind == "env":
            _decode(target[key], v, _ENV, "model.Environment", strict)
        elif kind == "res":
            _decode(target[key], v, _RES, "model.ResourcesConfig", strict)
        elif kind == "mounts":
            target[key] = _bind_mounts(v, target[key] or [])
        elif kind == "devices":
            new = [d if isinstance(d, dict) else dict(zip(("host_path", "container_path", "mode"),
                                                          (d.split(":") + ["mrw"])[:3])) for d in v]
            taken = {d.get("container_path") for d in new}
            target[key] = new + [d for d in target[key] or [] if d.get("container_path") not in taken]
        elif kind == "image":
            target[key] = _runtime_item(v, target[key])
        elif kind == "envvars":
            target[key] = _runtime_items(v, target[key])
        elif kind == "map":
            target[key] = {**(target[key] or {}), **v}
        elif kind == "duration":
            target[key] = parse_duration(v) if isinstance(v, str) else _bad(f"invalid duration: {json.dumps(v)}")
        elif kind == "int":
            target[key] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _bad(
                f"json: cannot unmarshal {type(v).__name__} into Go struct field {where}.{key} of type int")
        elif kind == "obj":
            target[key] = {**(target[key] or {}), **v}
        else:
            target[key] = v


def _bad(message: str) -> Any:
    raise ValueError(message)


def default_config(tcd: dict[str, Any]) -> dict[str, Any]:
    """model.DefaultConfig (command_config.go:23-40; defaults.go:8-47): the pool's defaults."""
    image = {"cpu": CPU_IMAGE, "cuda": CUDA_IMAGE, "rocm": ROCM_IMAGE}
    if tcd.get("image") is not None:
        image = _runtime_item(tcd["image"], {})
    env_vars = _runtime_items(tcd["environment_variables"], {}) if tcd.get("environment_variables") is not None else {}
    return {
        "description": "", "bind_mounts": _bind_mounts(tcd.get("bind_mounts") or [], []),
        "environment": {"image": image, "environment_variables": env_vars, "proxy_ports": None, "ports": None,
                        "registry_auth": tcd.get("registry_auth"), "force_pull_image": bool(tcd.get("force_pull_image")),
                        "pod_spec": None, "add_capabilities": tcd.get("add_capabilities"),
                        "drop_capabilities": tcd.get("drop_capabilities")},
        "resources": {"slots": 0, "max_slots": None, "weight": 1, "native_parallel": False, "shm_size": None,
                      "resource_pool": "", "priority": None, "is_single_node": None, "devices": tcd.get("devices")},
        "entrypoint": None, "tensorboard_args": None, "idle_timeout": None,
        "notebook_idle_type": "kernels_or_terminals", "work_dir": tcd.get("work_dir"), "debug": False,
        "pbs": dict(tcd.get("pbs") or {}), "slurm": dict(tcd.get("slurm") or {}),
    }


def default_priority(master: dict[str, Any], pool: str) -> int:
    """config.go:718-745 DefaultPriorityForPool: the pool's priority scheduler's, else the agent RM's."""
    for rp in master.get("resource_pools") or []:
        if rp.get("pool_name") == pool:
            for sched in (rp.get("scheduler"), (master.get("resource_manager") or {}).get("scheduler")):
                if (sched or {}).get("type") == "priority" and sched.get("default_priority") is not None:
                    return int(sched["default_priority"])
    return DEFAULT_PRIORITY


def to_json(conf: dict[str, Any]) -> dict[str, Any]:
    """json.Marshal of the CommandConfig: omitempty fields dropped when empty, the duration as Go prints it."""
    out = copy.deepcopy(conf)
    if not out["tensorboard_args"]:
        del out["tensorboard_args"]
    env, res = out["environment"], out["resources"]
    if env["registry_auth"] is None:
        del env["registry_auth"]
    env["environment_variables"] = {k: v for k, v in env["environment_variables"].items() if v}
    for key in ("max_slots", "shm_size", "priority"):
        if res[key] is None:
            del res[key]
    if not res["native_parallel"]:
        del res["native_parallel"]
    if out["idle_timeout"] is not None:
        out["idle_timeout"] = format_duration(out["idle_timeout"])
    return out


def command_config(master: dict[str, Any], template: dict[str, Any] | None, request: dict[str, Any] | None,
                   *, files: bool = False) -> dict[str, Any]:
    """api_command.go:60-179 getCommandLaunchParams: the merged CommandConfig (internal form)."""
    request = request or {}
    asked = request.get("resources") or {}
    slots = asked.get("slots", 1) if isinstance(asked, dict) else 1  # model.ParseJustResources: 1 unless given
    slots = slots if isinstance(slots, int) else 1
    rm = master.get("resource_manager") or {}
    pools = [p.get("pool_name") for p in master.get("resource_pools") or []]
    pool = (asked.get("resource_pool") if isinstance(asked, dict) else None) or (
        rm.get("default_aux_resource_pool") if slots == 0 else rm.get("default_compute_resource_pool")) or "default"
    if pools and pool not in pools:  # ResolveResources
        raise ApiError(3, f"resource pool {pool} does not exist or is not available")
    tcd = pool_defaults(master, pool)
    conf = default_config(tcd)
    if template is not None:  # templates/service.go:33-72, unknown fields allowed
        try:
            _decode(conf, template, _TOP, "model.CommandConfig", strict=False)
        except ValueError as exc:
            raise ApiError(2, f"yaml.Unmarshal(template): {exc}") from exc
    work_dir_default = conf["work_dir"]
    if request:
        try:
            _decode(conf, request, _TOP, "model.CommandConfig", strict=True)
        except ValueError as exc:
            raise ApiError(3, f"unable to decode the merged config: {json.dumps(request)}: {exc}") from exc
    conf["resources"]["resource_pool"], conf["resources"]["slots"] = pool, slots
    if conf["resources"]["priority"] is None:
        conf["resources"]["priority"] = default_priority(master, pool)
    if files:  # spec_util.go:89-117 fillContextDir
        if conf["work_dir"] is not None and conf["work_dir"] != work_dir_default:
            raise ApiError(3, "cannot set work_dir and context directory at the same time")
        conf["work_dir"] = None
    return conf


def _validate(conf: dict[str, Any], what: str) -> None:
    """command_config.go:59-75 Validate, as check.Validate reports it."""
    errors = []
    if conf["resources"]["slots"] < 0:
        errors.append("resources.slots must be >= 0")
    if not conf["entrypoint"]:
        errors.append("entrypoint must be non-empty")
    if conf["notebook_idle_type"] not in IDLE_TYPES:
        errors.append("invalid notebook idle type")
    if conf["resources"]["is_single_node"] is not None:
        errors.append("resources.is_single_node cannot be set for NTSCs")
    if errors:
        raise ApiError(3, f"invalid {what} config: " + "\n".join(errors))


def _pet_name() -> str:
    words = ("quick", "brave", "calm", "otter", "heron", "lynx", "merry", "noble", "swift")
    return "-".join(random.choice(words) for _ in range(3))  # expconf.TaskNameGeneratorWords = 3


@dataclass
class Command:
    """A command or notebook (master/internal/command/command.go): one allocation, no restarts."""

    id: str
    task_type: str  # COMMAND | NOTEBOOK
    config: dict[str, Any]
    owner: User
    context: bytes
    extra_env: dict[str, str]
    job_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    start_time: str = field(default_factory=now_iso)
    alloc: Alloc | None = None
    exit_status: str = ""

    def exited(self, exit_code: int | None) -> None:
        """command.go:230-280 OnExit: the allocation's exit becomes the task's."""
        self.exit_status = "allocation stopped early" if exit_code is None else (
            "command exited successfully" if exit_code == 0 else f"container failed with non-zero exit code: {exit_code}")


def command_view(cmd: Command) -> dict[str, Any]:
    """command.go:329-372 ToV1Command / ToV1Notebook (enrichState: PENDING, ASSIGNED are QUEUED)."""
    alloc = cmd.alloc
    state = "STATE_QUEUED" if alloc is None or alloc.state == "PENDING" else (
        "STATE_TERMINATED" if alloc.state == "TERMINATED" else ("STATE_RUNNING" if alloc.ready or cmd.task_type == "COMMAND"
                                                               else "STATE_PULLING"))
    out = {"id": cmd.id, "state": state, "description": cmd.config["description"], "container": None,
           "startTime": cmd.start_time, "username": cmd.owner.username, "userId": cmd.owner.id,
           "displayName": cmd.owner.display_name, "resourcePool": cmd.config["resources"]["resource_pool"],
           "exitStatus": cmd.exit_status, "jobId": cmd.job_id, "workspaceId": 1}
    if cmd.task_type == "NOTEBOOK":
        out["serviceAddress"] = f"/proxy/{cmd.id}/?token={cmd.extra_env.get('DET_NOTEBOOK_TOKEN', '')}"
    return out


def _launch_params(req: Request) -> tuple[dict[str, Any], bytes]:
    state, body = req.master.state, req.body
    name = body.get("templateName") or body.get("template_name") or ""
    template = None
    if name:
        tpl = state.templates.get(name)
        if tpl is None:  # templates/service.go:53-54
            raise ApiError(5, f"template '{name}' not found")
        template = tpl["config"]
    files = list(body.get("files") or [])
    conf = command_config(req.master.config, template, body.get("config"), files=bool(files))
    return conf, pack_files(files) if files else b""


def _start(req: Request, task_type: str, conf: dict[str, Any], context: bytes, env: dict[str, str]) -> Command:
    """command.go:120-190 Start: the task and its one allocation, queued for the agent."""
    state = req.master.state
    assert req.user is not None
    with state.lock:
        task_id = str(uuid.uuid4())
        cmd = Command(task_id, task_type, conf, req.user, context, env)
        container = str(uuid.uuid4())
        slots = int(conf["resources"]["slots"])
        alloc = Alloc(f"{task_id}.1", None, container, container, slots, command=cmd)  # type: ignore[arg-type]
        cmd.alloc = alloc
        state.commands[task_id] = cmd
        state.allocs[alloc.id] = alloc
        state.pending.append(alloc)
        state.notify()
    return cmd


@route(ROUTES, "POST", "/api/v1/commands")
def launch_command(req: Request) -> dict[str, Any]:
    """api_command.go LaunchCommand: entrypoint behind command-entrypoint.sh, DET_TASK_TYPE=COMMAND."""
    conf, context = _launch_params(req)
    if not conf["description"]:
        conf["description"] = f"Command ({_pet_name()})"
    conf["entrypoint"] = [COMMAND_ENTRYPOINT, *(conf["entrypoint"] or [])]
    _validate(conf, "command")
    cmd = _start(req, "COMMAND", conf, context, {"DET_TASK_TYPE": "COMMAND"})
    return {"command": command_view(cmd), "config": to_json(conf), "warnings": []}


@route(ROUTES, "POST", "/api/v1/notebooks")
def launch_notebook(req: Request) -> dict[str, Any]:
    """api_notebook.go:236-373 LaunchNotebook: the master's notebook_timeout as the idle timeout when
    none is set, a default description; ``preview`` returns the config there, before the entrypoint."""
    conf, context = _launch_params(req)
    timeout = req.master.config.get("notebook_timeout")
    if conf["idle_timeout"] is None and timeout is not None:
        conf["idle_timeout"] = int(timeout) * 10**9
    if not conf["description"]:
        conf["description"] = f"JupyterLab ({_pet_name()})"
    if req.body.get("preview"):
        empty = {"id": "", "state": "STATE_UNSPECIFIED", "description": "", "container": None,
                 "serviceAddress": "", "startTime": None, "username": "", "userId": 0, "displayName": "",
                 "resourcePool": "", "exitStatus": "", "jobId": "", "workspaceId": 0}
        return {"notebook": empty, "config": to_json(conf)}
    port = random.randint(2900, 3899)  # getRandomPort(minNotebookPort, maxNotebookPort)
    env = {"NOTEBOOK_PORT": str(port), "NOTEBOOK_CONFIG": json.dumps(to_json(conf), separators=(",", ":")),
           "NOTEBOOK_IDLE_TYPE": conf["notebook_idle_type"], "DET_TASK_TYPE": "NOTEBOOK",
           "DET_NOTEBOOK_TOKEN": uuid.uuid4().hex}
    conf["entrypoint"] = [NOTEBOOK_ENTRYPOINT]
    _validate(conf, "notebook")
    cmd = _start(req, "NOTEBOOK", conf, context, env)
    return {"notebook": command_view(cmd), "config": to_json(conf), "warnings": []}


def _command_of(req: Request, task_type: str) -> Command:
    cmd = req.master.state.commands.get(req.groups["id"])
    if cmd is None or cmd.task_type != task_type:
        raise ApiError(5, f"{task_type.lower()} '{req.groups['id']}' not found")
    return cmd


@route(ROUTES, "GET", "/api/v1/commands/{id}")
def get_command(req: Request) -> dict[str, Any]:
    """api_command.go GetCommand."""
    with req.master.state.lock:
        cmd = _command_of(req, "COMMAND")
        return {"command": command_view(cmd), "config": to_json(cmd.config)}


@route(ROUTES, "GET", "/api/v1/notebooks/{id}")
def get_notebook(req: Request) -> dict[str, Any]:
    """api_notebook.go GetNotebook."""
    with req.master.state.lock:
        cmd = _command_of(req, "NOTEBOOK")
        return {"notebook": command_view(cmd), "config": to_json(cmd.config)}


@route(ROUTES, "POST", "/api/v1/notebooks/{id}/kill")
def kill_notebook(req: Request) -> dict[str, Any]:
    """api_notebook.go KillNotebook: the allocation is killed (a queued one never starts)."""
    state = req.master.state
    with state.lock:
        cmd = _command_of(req, "NOTEBOOK")
        if cmd.alloc is not None:
            state.signal(cmd.alloc, "kill")
        return {"notebook": command_view(cmd)}
