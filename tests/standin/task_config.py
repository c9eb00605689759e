"""What a Determined 0.38.1 task is configured from: the master's task-container defaults (with a pool's
block merged over them), the experiment config with those defaults merged in, the linked Unix user and
the task image. Shared by the old ``run_trial`` (tests/task_standin.py) and ``run_allocation``
(tests/standin/task_run.py). References are determined-ai/determined at v0.38.1, ``path:line``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: master/pkg/model/task_container_defaults.go:80-84 (UnmarshalJSON): a parsed block starts from these
BLOCK_DEFAULTS = {"shm_size_bytes": 4294967296, "network_mode": "bridge", "preemption_timeout": 3600}
#: master/pkg/tasks/task.go:27-31
WORK_DIR, RUN_DIR, PYTHON_USER_BASE = "/run/determined/workdir", "/run/determined", "/run/determined/pythonuserbase"
#: master/pkg/schemas/expconf/storage_config.go:17
SHARED_FS_CONTAINER_PATH = "/determined_shared_fs"


def _env_name(entry: str) -> str:
    return entry.split("=", 1)[0]  # task_container_defaults.go:354-357 envVarName


def _merge_env(self_: list[str], other: list[str]) -> list[str]:
    """task_container_defaults.go:337-352 mergeEnvVars: ``other``'s entries, then ``self_``'s not named there."""
    names = {_env_name(v) for v in other}
    return list(other) + [v for v in self_ if _env_name(v) not in names]


def env_list(value: Any, device: str = "cpu") -> list[str]:
    """An ``environment_variables`` value (a list, or a map by device type) for ``device``
    (expconf EnvironmentVariables().For(deviceType), used at master/pkg/tasks/task.go:272)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return list(value.get(device) or [])
    return list(value)


def pool_defaults(master: dict[str, Any], pool: str) -> dict[str, Any]:
    """The task-container defaults a task in ``pool`` gets.

    master/internal/rm/agentrm/agent_resource_manager.go:498-524: the master's block, with the pool's
    ``task_container_defaults`` merged over it when the pool has one. The pool's block is parsed with
    defaults filled in (task_container_defaults.go:80-89), so its shm size, network mode and preemption
    timeout win over the master's whether the pool set them or not (Merge, :183-335).
    """
    res = {**BLOCK_DEFAULTS, **copy.deepcopy(master.get("task_container_defaults") or {})}
    block = next((p.get("task_container_defaults") for p in master.get("resource_pools") or []
                  if p.get("pool_name") == pool), None)
    if block is None:
        return res
    other = {**BLOCK_DEFAULTS, **copy.deepcopy(block)}
    for key in ("shm_size_bytes", "network_mode", "preemption_timeout", "dtrain_network_interface",
                "nccl_port_range", "gloo_port_range", "startup_hook"):  # Merge :192-210, :278-280, :330-332
        if other.get(key):
            res[key] = other[key]
    if other.get("image") is not None:
        res["image"] = other["image"]
    if other.get("environment_variables") is not None:
        if res.get("environment_variables") is None:
            res["environment_variables"] = other["environment_variables"]
        else:  # by device type (:240-248)
            res["environment_variables"] = {
                d: _merge_env(env_list(res["environment_variables"], d), env_list(other["environment_variables"], d))
                for d in ("cpu", "cuda", "rocm")}
    if other.get("bind_mounts") is not None:  # the pool's, then the master's at other container paths (:282-296)
        taken = {m["container_path"] for m in other["bind_mounts"]}
        res["bind_mounts"] = list(other["bind_mounts"]) + [
            m for m in res.get("bind_mounts") or [] if m["container_path"] not in taken]
    return res


def experiment_config(master: dict[str, Any], pool: str, expconf: dict[str, Any]) -> dict[str, Any]:
    """The experiment config as the master runs it: the defaults merged in.

    task_container_defaults.go:114-177 MergeIntoExpConfig: environment variables appended (defaults
    first, experiment last, so the experiment's win, per device type: expconf/environment_config.go:
    159-176, a plain list being every device's :178-190); bind mounts
    the experiment's, then the defaults' at container paths not taken (expconf/experiment_config.go:247-262);
    core_experiment.go:344-350: checkpoint storage the experiment's, its unset keys from the master's.
    ``_task_container_defaults`` carries the pool's defaults along (not part of Determined's config).
    """
    tcd = pool_defaults(master, pool)
    conf = copy.deepcopy(expconf)
    env = conf.setdefault("environment", {})
    defaults, own = tcd.get("environment_variables"), env.get("environment_variables")
    if isinstance(defaults, dict) or isinstance(own, dict):  # by device type; a plain list is every device's
        env["environment_variables"] = {d: env_list(defaults, d) + env_list(own, d) for d in ("cpu", "cuda", "rocm")}
    else:
        env["environment_variables"] = env_list(defaults) + env_list(own)
    mounts = list(conf.get("bind_mounts") or [])
    taken = {m["container_path"] for m in mounts}
    mounts += [m for m in tcd.get("bind_mounts") or [] if m["container_path"] not in taken]
    conf["bind_mounts"] = mounts
    storage = dict(master.get("checkpoint_storage") or {})
    if (conf.get("checkpoint_storage") or {}).get("type", storage.get("type")) == storage.get("type"):
        storage.update(conf.get("checkpoint_storage") or {})
        conf["checkpoint_storage"] = storage
    conf.setdefault("resources", {})
    conf["_task_container_defaults"] = tcd
    return conf


@dataclass
class LinkedUser:
    """The Unix user a Determined user is linked to (agent user group, model.AgentUserGroup): the task
    runs as its ``uid:gid`` (master/pkg/tasks/task.go:408-413). ``groups`` is only used by the old
    ``run_trial``; a container started by Determined gets no supplementary groups. ``group`` is the
    group's name for the injected /etc/group entry (task.go:396); by default the gid's name here."""

    name: str
    uid: int
    gid: int
    groups: list[int] = field(default_factory=list)
    group: str | None = None


@dataclass
class Image:
    """What the task image holds: the directory whose ``python3`` is the image's, its ENV, and the host
    directories that are the image's own files (made visible read-only at the same paths)."""

    bin_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    dirs: list[Path] = field(default_factory=list)
