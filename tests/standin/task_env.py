"""A trial container's environment as Determined 0.38.1's master, agent and Docker compose it, from an
``Allocation`` (tests/standin/model.py). References are determined-ai/determined v0.38.1, ``path:line``.

Order, as the container's ``Env`` list is built:
1. master/pkg/tasks/task.go:194-245 ``EnvVars``: PYTHONUSERBASE, the DET_* task variables, the task's
   logging metadata, then ``ExtraEnvVars``: the trial's (task_trial.go:114-134), the resources type
   (master/internal/rm/agentrm/resources.go:56) and the unique ports (master/internal/task/allocation.go:703-706);
2. task.go:272: the experiment's ``environment_variables`` for the device type (the task-container
   defaults' already merged in ahead of them when the experiment was created);
3. agent/internal/containers/spec.go:30-33: the agent's proxy, master and agent variables, then the
   container's id and slots;
4. Docker: the image's ENV under all of these, ``HOSTNAME``, and ``HOME`` when unset ("/" for a user the
   image's /etc/passwd lacks, task-setup.sh:43-55).
A name set twice keeps its last value: ship-logs.sh, the container's first process, is bash.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tests.standin.model import Allocation
from tests.standin.task_config import PYTHON_USER_BASE, RUN_DIR, WORK_DIR, env_list, experiment_config

#: master/pkg/tasks/task.go:38-53, task_trial.go:41-46: the ports a trial asks for, at their bases (the
#: master's port registry hands out the first free one from each base: allocation.go:688)
UNIQUE_PORTS = {"DTRAIN_SSH_PORT": 12350, "INTER_TRAIN_PROCESS_COMM_PORT_1": 12360,
                "INTER_TRAIN_PROCESS_COMM_PORT_2": 12365, "C10D_PORT": 29400}
#: Docker's PATH for an image that sets none (daemon/container.go defaultPath)
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _jsonify(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # Go's json.Marshal: compact


def master_env(alloc: Allocation, tcd: dict[str, Any]) -> list[str]:
    """Steps 1 and 2: what the master puts into the container spec (task.go:261-272)."""
    e = {
        "PYTHONUSERBASE": PYTHON_USER_BASE,  # task.go:198
        "DET_TASK_ID": alloc.task_id,  # :199
        "DET_ALLOCATION_ID": alloc.allocation_id,  # :200
        "DET_RESOURCES_ID": alloc.resources_id,  # :201
        "DET_CONTAINER_ID": alloc.container_id,  # :202
        "DET_SESSION_TOKEN": alloc.session_token,  # :203
        "DET_USER_TOKEN": alloc.session_token,  # :204
        "DET_WORKDIR": alloc.work_dir or WORK_DIR,  # :205 (task_command.go:73-77: a command's work_dir)
        "DET_RUN_DIR": RUN_DIR,  # :206
        "DET_USER": alloc.det_user,  # :208-210
    }
    if tcd.get("gloo_port_range"):
        e["GLOO_PORT_RANGE"] = tcd["gloo_port_range"]  # :212-214
    if tcd.get("dtrain_network_interface"):
        e["DET_INTER_NODE_NETWORK_INTERFACE"] = tcd["dtrain_network_interface"]  # :216-219
    e["DET_USE_TLS"] = "false"  # :221-226 (no master certificate)
    e["DET_SEGMENT_ENABLED"] = "false"  # :228
    # :233-240; the agent RM fills the fields (resources.go:51-55); Go marshals a map with sorted keys
    e["DET_TASK_LOGGING_METADATA"] = _jsonify({"allocation_id": alloc.allocation_id, "task_id": alloc.task_id})
    if alloc.task_type != "TRIAL":  # a command's or notebook's ExtraEnvVars (api_command.go, api_notebook.go)
        e.update(alloc.extra_env)
        e["DET_RESOURCES_TYPE"] = "docker-container"  # resources.go:56
        env_conf = (alloc.config.get("environment") or {}).get("environment_variables")
        return [f"{k}={v}" for k, v in e.items()] + env_list(env_conf, alloc.slot_type)
    extra = {  # :242-244 ExtraEnvVars
        "DET_EXPERIMENT_ID": str(alloc.experiment_id),  # task_trial.go:115
        "DET_TRIAL_ID": str(alloc.trial_id),  # :116
        "DET_TRIAL_RUN_ID": str(alloc.trial_run_id),  # :117
        "DET_TRIAL_SEED": str(alloc.trial_seed),  # :118
        "DET_EXPERIMENT_CONFIG": _jsonify(alloc.config),  # :119
        "DET_HPARAMS": _jsonify(alloc.hparams),  # :120
        "DET_STEPS_COMPLETED": str(alloc.steps_completed),  # :121
        "DET_TASK_TYPE": "TRIAL",  # :122
    }
    if alloc.latest_checkpoint:
        extra["DET_LATEST_CHECKPOINT"] = alloc.latest_checkpoint  # :124-126
    extra["DET_RESOURCES_TYPE"] = "docker-container"  # resources.go:56
    extra.update({k: str(v) for k, v in UNIQUE_PORTS.items()})  # allocation.go:703-706
    e.update(extra)
    entries = [f"{k}={v}" for k, v in e.items()]
    env_conf = (alloc.config.get("environment") or {}).get("environment_variables")
    return entries + env_list(env_conf, alloc.slot_type)  # task.go:267-272


def agent_env(alloc: Allocation, agent: dict[str, Any], *, cluster_id: str, master_id: str) -> list[str]:
    """Step 3: agent/internal/containers/spec.go:30-33 overwriteSpec."""
    entries = [f"{k}={agent[k.lower()]}" for k in ("HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "NO_PROXY")
               if agent.get(k.lower())]  # :62-83 addProxyInfo (the names a task sets itself are left alone)
    host = agent.get("container_master_host") or agent["master_host"]  # :210-213
    port = agent.get("container_master_port") or agent["master_port"]  # :214-217
    entries += [  # :218-226 makeGlobalEnvVars
        f"DET_CLUSTER_ID={cluster_id}", f"DET_MASTER_ID={master_id}", f"DET_MASTER=http://{host}:{port}",
        f"DET_MASTER_HOST={host}", f"DET_MASTER_ADDR={host}", f"DET_MASTER_PORT={port}",
        f"DET_AGENT_ID={agent['agent_id']}"]
    entries += [f"DET_CONTAINER_ID={alloc.container_id}",  # :144-153 containerEnv
                f"DET_SLOT_IDS=[{','.join(str(i) for i in alloc.slot_ids)}]"]
    return entries


def docker_env(image_env: dict[str, str], container_env: list[str], hostname: str) -> dict[str, str]:
    """Step 4 and the bash resolution: the image's ENV under the container's (Docker replaces an image
    variable by name), HOSTNAME, HOME "/" when unset (the linked user is not in the image's
    /etc/passwd, which is all runc reads), then the last value of each name."""
    env = {"PATH": DOCKER_DEFAULT_PATH, **image_env}
    env = {"HOSTNAME": hostname, **env}
    for entry in container_env:
        name, _, value = entry.partition("=")
        env[name] = value
    env.setdefault("HOME", "/")
    return env


def trial_allocation(master: dict[str, Any], pool: str, expconf: dict[str, Any], *, master_url: str,
                     det_user: str, experiment_id: int = 1, trial_id: int = 1, trial_run_id: int = 1,
                     hparams: dict[str, Any] | None = None, latest_checkpoint: str | None = None,
                     slot_ids: list[int] | None = None, slot_type: str = "cpu", steps_completed: int = 0,
                     trial_seed: int = 0) -> Allocation:
    """An Allocation as the master hands one over for ``expconf`` (for tests and probes; the master
    stand-in builds its own): the task-container defaults merged in (experiment_config), the few
    defaults the harness reads filled in, a constant hyperparameter's value sampled as itself."""
    conf = experiment_config(master, pool, expconf)
    tcd = conf.pop("_task_container_defaults")
    conf.setdefault("resources", {}).setdefault("slots_per_trial", max(1, len(slot_ids or [])))
    conf.setdefault("debug", False)
    if hparams is None:
        hparams = {k: (v.get("val") if isinstance(v, dict) and v.get("type") == "const" else v)
                   for k, v in (conf.get("hyperparameters") or {}).items()}
    task_id = f"{experiment_id}.{uuid.uuid4()}"  # the master's trial task ids (model.NewTaskID)
    container = str(uuid.uuid4())
    return Allocation(
        master_url=master_url, experiment_id=experiment_id, trial_id=trial_id, trial_run_id=trial_run_id,
        trial_seed=trial_seed, request_id=str(uuid.uuid4()), task_id=task_id,
        allocation_id=f"{task_id}.{trial_run_id}", resources_id=container, container_id=container,
        hparams=hparams, config=conf, det_user=det_user, session_token=uuid.uuid4().hex,
        slot_ids=list(slot_ids or []), slot_type=slot_type, latest_checkpoint=latest_checkpoint,
        steps_completed=steps_completed, task_container_defaults=tcd)
