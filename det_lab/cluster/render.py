"""master.yaml and agent.yaml, rendered as plain dicts from the lab and cluster settings.

What the master config carries, and why (facts from Determined 0.38.1: the master and agent config
references, ``docs/reference/deploy/master-config-reference.rst`` and
``agent-config-reference.rst``; ``master/internal/config/config.go``; ``det deploy local`` in
``determined/deploy/local/cluster_utils.py``):

- ``checkpoint_storage``: ``shared_fs`` on the data root, ``storage_path: checkpoints``; the
  templates' experiment configs narrow ``storage_path`` to ``checkpoints/<project>`` (merged over
  this, keeping ``host_path``), where local runs write too.
- ``task_container_defaults.bind_mounts``: the dataset tree (``datasets``, ``snapshots``,
  ``dvc-cache``) read-only and ``outputs`` read-write, at the same paths as on the host, with
  ``propagation: rslave`` so an NFS/autofs mount made after the container started still shows up.
  The master ignores ``propagation`` for the ``shared_fs`` mount itself (it always uses
  ``rprivate`` at ``/determined_shared_fs``), so ``checkpoints`` is also bind-mounted here, at its
  host path, where ``rslave`` is honoured: code that reads other runs' checkpoints by their host
  path sees the live NFS mount. Determined's own checkpoint writes still go through
  ``/determined_shared_fs``; keep the volume hard-mounted (fstab, not an expiring autofs map) on
  agent machines so that mount is there when a trial starts.
- ``db``: a user master config *replaces* the built-in one, so user/host/port/name are here. The
  password is not: ``det deploy local`` passes ``DET_DB_PASSWORD`` to the master container, and
  the master reads that key (only keys it registers are read from ``DET_*`` variables:
  ``master/cmd/determined-master/init.go`` ~l.83-143).
- The base models (``models/``: :mod:`det_lab.models`) are read-only in tasks through the root's
  read-only mount; no mount of their own, since Docker refuses a task whose mount source is missing
  (:mod:`det_lab.cluster.bind_sources`) and a volume made before the store has no ``models/``.
  ``HF_HOME``, ``HF_HUB_CACHE`` and ``TORCH_HOME`` point at it with ``HF_HUB_OFFLINE=1``, and
  ``HF_DATASETS_CACHE`` at the agent's local cache (the datasets library writes there).
- ``task_container_defaults.environment_variables``: ``DET_LAB_CONFIG`` names the task copy of the
  lab config on the volume (:func:`publish_task_config`): a task's environment is only Determined's
  variables, these defaults and the experiment's (``master/pkg/tasks/task.go`` ~l.194-260), so
  without it a task would know none of the lab's projects, quotas or group.
- ``shm_size_bytes``, ``network_mode``, ``preemption_timeout``: in the master's block and in every
  pool's. Determined parses a pool's block with its own defaults filled in (4 GiB, bridge, 3600 s:
  ``master/pkg/model/task_container_defaults.go`` ~l.80-89) and those win over the master's in the
  merge (~l.183-335), so a pool block without them would reset the lab's values.
- ``security.initial_user_password`` only in the private copy (see :mod:`det_lab.cluster.secrets`);
  ``feature_switches: [prevent_blank_password]`` makes a new cluster refuse a blank one.
"""

from __future__ import annotations

from typing import Any

import grp
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from det_lab.cluster.settings import ClusterSettings, PoolSettings
from det_lab.errors import UserError
from det_lab.models import run_environment
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout, atomic_write_text

#: the DB container's address on the ``determined_default`` network (fixed by det deploy local)
DB_HOST = "determined-db"
DB_PORT = 5432
#: ``det deploy local`` maps container port 8080 to the host's master_port; the master must listen on 8080
MASTER_CONTAINER_PORT = 8080
#: where task containers find the data root and the pool's GPU kind
ENV_DATA_ROOT = "DET_LAB_DATA_ROOT"
ENV_GPU_KIND = "DET_LAB_GPU_KIND"
#: the lab config a task reads (DET_LAB_CONFIG), relative to the volume's state directory
TASK_CONFIG_NAME = "lab.yaml"


def task_config_path(lab: LabSettings) -> Path:
    """Where tasks find the lab config: on the volume, which every agent mounts at the same path."""
    return VolumeLayout.from_settings(lab).state / TASK_CONFIG_NAME


def _task_config_data(lab: LabSettings) -> dict[str, Any]:
    data = lab.model_dump(mode="json", exclude_defaults=True, exclude={"source"})
    data["data_root"] = str(lab.data_root)
    return data


def task_config_text(lab: LabSettings) -> str:
    """The lab config as tasks read it: every setting the lab made, the data root absolute."""
    data = _task_config_data(lab)
    where = lab.source or "the lab config"
    return (f"# written by det-lab from {where}; tasks read it through DET_LAB_CONFIG. Edit {where}"
            f" and run 'det-lab cluster up' (or 'cluster agent-up') again instead.\n"
            + yaml.safe_dump(data, sort_keys=False))


class TaskConfigUnwritable(UserError, PermissionError):
    """The volume refuses the task copy of the lab config (a root_squash export, a foreign owner)."""


def publish_task_config(lab: LabSettings, *, replace: bool = True) -> Path:
    """Write (or refresh) the task copy of the lab config on the volume; readable by the group.

    ``replace=False`` (an agent machine) writes it only where it is missing: the copy is the master
    machine's, and an agent whose own lab config differs must not change what every task reads."""
    path = task_config_path(lab)
    if not task_config_problem(lab) or (not replace and path.exists()):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, task_config_text(lab), mode=0o644)
    except PermissionError as exc:
        raise TaskConfigUnwritable(
            f"cannot write {path} ({exc.strerror or exc}): tasks read the lab config there; on a root_squash "
            f"volume run this as a member of the lab's group rather than as root") from None
    return path


def prepare_local_cache(lab: LabSettings, cluster: ClusterSettings) -> Path:
    """Make this agent's task cache directory (``tasks.local_cache``), writable by every linked user:
    the lab's group with setgid when there is one, else sticky and world-writable like /tmp."""
    root = cluster.tasks.local_cache
    for d in (root, root / "torch_extensions", root / "isaac"):
        d.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 and lab.group:
            os.chown(d, 0, grp.getgrnam(lab.group).gr_gid)
            d.chmod(0o2775)
        elif d.stat().st_uid == os.geteuid():
            d.chmod(0o1777 if not lab.group else 0o2775)
    return root


def task_config_problem(lab: LabSettings) -> str | None:
    """Why tasks would not read this lab config: its copy on the volume is missing or stale."""
    path = task_config_path(lab)
    try:
        current = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return f"{path} is missing or unreadable: cluster tasks would not know the lab's projects, quotas or group"
    if current != _task_config_data(lab):  # the same settings, whichever machine's copy wrote it
        return f"{path} differs from {lab.source or 'the lab config'}: cluster tasks read the old settings"
    return None


def bind_mounts(lab: LabSettings, cluster: ClusterSettings) -> list[dict[str, Any]]:
    """The task bind mounts, at the same paths as on the host.

    The whole volume is there read-only, so a dataset read in place (``data.det_lab.dataset:
    {dir: ...}``) is found wherever on the volume it lies; Docker mounts the writable trees below
    over it. The datasets tree (the DVC remotes and their git repos) is read-only. A trial's first pull of
    a revision fills the shared cache and publishes a snapshot, and takes the volume's locks and
    registry under ``.det-lab/``, so those are writable; a published snapshot is itself
    read-only (mode 0555/0444), so trials cannot change the data they read.
    """
    root = VolumeLayout.from_settings(lab).root

    def mount(sub: str, read_only: bool) -> dict[str, Any]:
        path = str(root / sub) if sub else str(root)
        return {"host_path": path, "container_path": path, "read_only": read_only, "propagation": "rslave"}

    mounts = [
        mount("", True),
        mount("datasets", True),
        mount("snapshots", False),
        mount("dvc-cache", False),
        mount(".det-lab", False),
        mount("outputs", False),
        mount("checkpoints", False),
    ]
    # caches that must outlive a trial (gsplat's CUDA build, Isaac Sim's shader caches): each agent's
    # local disk, made by 'cluster agent-up' (prepare_local_cache); a container's own files go with it
    cache = str(cluster.tasks.local_cache)
    mounts.append({"host_path": cache, "container_path": cache, "read_only": False, "propagation": "rprivate"})
    for extra in cluster.bind_mounts:
        mounts.append({
            "host_path": str(extra.host_path),
            "container_path": str(extra.container_path or extra.host_path),
            "read_only": extra.read_only,
            "propagation": extra.propagation,
        })
    return mounts


#: tracking stores a task container reaches over the network (a path would be the container's own)
REMOTE_MLFLOW_SCHEMES = ("http://", "https://", "postgresql://", "postgresql+", "mysql://", "mysql+")


def environment_variables(lab: LabSettings, cluster: ClusterSettings) -> list[str]:
    """Variables every task gets, so det_lab inside a container finds the same volume, lab config,
    tracking and local cache."""
    env = [f"{ENV_DATA_ROOT}={lab.data_root}", f"DET_LAB_CONFIG={task_config_path(lab)}",
           f"DET_LAB_LOCAL_CACHE={cluster.tasks.local_cache}"]
    t = lab.tracking
    # base models: the volume's store, read-only and offline; the datasets library's cache on the agent's disk
    env += [f"{k}={v}" for k, v in run_environment(lab.data_root, cluster.tasks.local_cache).items()]
    env.append(f"DET_LAB_TRACKING={t.backend}")
    if t.mlflow_uri and t.mlflow_uri.startswith(REMOTE_MLFLOW_SCHEMES):
        env.append(f"MLFLOW_TRACKING_URI={t.mlflow_uri}")
    if t.aim_repo and t.aim_repo.startswith("aim://"):
        env.append(f"DET_LAB_AIM_REPO={t.aim_repo}")
    return env


def tracking_problems(lab: LabSettings) -> list[str]:
    """Why cluster tasks would lose their tracking record: a store they cannot reach.

    Without a server URI each task writes a store inside its own container (MLflow: a SQLite file;
    Aim: a local repo), which is deleted with the container.
    """
    t, where = lab.tracking, lab.source or "the lab config"
    problems = []
    if t.uses_mlflow and not (t.mlflow_uri or "").startswith(REMOTE_MLFLOW_SCHEMES):
        problems.append(
            f"tracking.backend is {t.backend} but tracking.mlflow_uri is {t.mlflow_uri or 'not set'}: cluster "
            f"tasks would write MLflow runs to a file inside their container and lose them; set tracking.mlflow_uri "
            f"in {where} to a server the tasks reach (http://<host>:5000, e.g. 'mlflow server' on the master "
            f"machine) or tracking.backend: none")
    for key, uri in (("tracking.mlflow_uri", t.mlflow_uri if t.uses_mlflow else None),
                     ("tracking.aim_repo", t.aim_repo if t.backend in ("aim", "both") else None)):
        host = urlsplit(uri).hostname if uri and "://" in uri else None
        if host and (host == "localhost" or host.startswith("127.") or host == "::1"):
            # network_mode: bridge (rendered above): each container has a loopback of its own
            problems.append(
                f"{key} is {uri}: in a cluster task {host} is the task's own container, so its metrics "
                f"would not arrive; use this machine's name or address in {where} (e.g. "
                f"{uri.replace(host, socket.gethostname(), 1)})")
    if t.backend in ("aim", "both") and not (t.aim_repo or "").startswith("aim://"):
        problems.append(
            f"tracking.backend is {t.backend} but tracking.aim_repo is {t.aim_repo or 'not set'}: cluster tasks "
            f"would write Aim runs inside their container and lose them; set tracking.aim_repo in {where} to "
            f"aim://<host>:53800 (an 'aim server') or tracking.backend: none")
    return problems


def task_scalars(cluster: ClusterSettings) -> dict[str, Any]:
    """The task-container defaults a pool's block must repeat, or Determined's defaults replace them."""
    return {"shm_size_bytes": int(cluster.tasks.shm_size), "network_mode": "bridge",
            "preemption_timeout": cluster.tasks.preemption_timeout}


def _pool(pool: PoolSettings, cluster: ClusterSettings) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pool_name": pool.name,
        "description": pool.description or (f"{pool.gpu_kind} GPUs" if pool.gpu_kind else ""),
        "max_aux_containers_per_agent": pool.max_aux_containers_per_agent,
    }
    if pool.gpu_kind:
        # environment variables merge by name over the master's; the scalars would be reset
        out["task_container_defaults"] = {**task_scalars(cluster),
                                          "environment_variables": [f"{ENV_GPU_KIND}={pool.gpu_kind}"]}
    return out


def render_master(lab: LabSettings, cluster: ClusterSettings, *,
                  initial_user_password: str | None = None) -> dict[str, Any]:
    """The master config. Without ``initial_user_password`` it is safe to print or share."""
    layout = VolumeLayout.from_settings(lab)
    tcd: dict[str, Any] = {
        **task_scalars(cluster),
        "bind_mounts": bind_mounts(lab, cluster),
        "environment_variables": environment_variables(lab, cluster),
    }
    if cluster.images.task:
        tcd["image"] = {"cpu": cluster.images.task, "cuda": cluster.images.task}
    security: dict[str, Any] = {}
    if cluster.default_task:
        security["default_task"] = cluster.default_task.model_dump()
    if initial_user_password is not None:
        security["initial_user_password"] = initial_user_password
    conf: dict[str, Any] = {
        "port": MASTER_CONTAINER_PORT,
        "cluster_name": cluster.display_name,
        "log": {"level": "info", "color": False},
        "db": {
            "user": cluster.db.user,
            "host": DB_HOST,
            "port": DB_PORT,
            "name": cluster.db.name,
            "ssl_mode": "disable",  # the DB is reachable only on the private Docker network
        },
        "checkpoint_storage": {
            "type": "shared_fs",
            "host_path": str(layout.root),
            "storage_path": layout.checkpoints.name,
            **cluster.gc.model_dump(),
        },
        "task_container_defaults": tcd,
        "resource_manager": {
            "type": "agent",
            "scheduler": {
                # a union keyed on `type`: the priority fields sit beside it, not under `priority:`
                "type": "priority",
                "fitting_policy": cluster.scheduler.fitting_policy,
                "preemption": cluster.scheduler.preemption,
                "default_priority": cluster.scheduler.default_priority,
                **({} if cluster.scheduler.numa_packing is None else {"numa_packing": cluster.scheduler.numa_packing}),
            },
            "default_compute_resource_pool": cluster.default_compute_pool,
            "default_aux_resource_pool": cluster.default_aux_pool,
        },
        "resource_pools": [_pool(p, cluster) for p in cluster.pools],
        "feature_switches": ["prevent_blank_password"],
        "telemetry": {"enabled": False},
        # /prom/det-state-metrics and /debug/prom/metrics for Prometheus (det-lab monitor config)
        "observability": {"enable_prometheus": True},
        "retention_policy": {"log_retention_days": cluster.log_retention_days, "schedule": "0 3 * * *"},
    }
    if security:
        conf["security"] = security
    if cluster.notebooks.idle_seconds is not None:
        # for notebooks that set no idle_timeout of their own (master/internal/api_notebook.go)
        conf["notebook_timeout"] = cluster.notebooks.idle_seconds
    return conf


def render_agent(cluster: ClusterSettings, agent_id: str, pool: str | None = None) -> dict[str, Any]:
    """The agent config of ``agent_id``; its pool is ``pool`` or the one listing it."""
    pool_name = pool if pool is not None else cluster.pool_of_agent(agent_id).name
    cluster.pool(pool_name)  # unknown pool -> ClusterConfigError, as the master would reject it
    conf: dict[str, Any] = {
        "master_host": cluster.master_host,
        "master_port": cluster.master_port,  # the agent's own default is 80, never what we want
        "agent_id": agent_id,
        "resource_pool": pool_name,
        "container_master_host": cluster.container_master_host,
        "container_master_port": cluster.master_port,
        "slot_type": cluster.agent.slot_type,
        "log": {"level": "info", "color": False},
    }
    if cluster.agent.visible_gpus:
        conf["visible_gpus"] = cluster.agent.visible_gpus
    return conf


def render_task_template(lab: LabSettings, cluster: ClusterSettings) -> dict[str, Any]:
    """A Determined config template (``det template create``) with det_lab's mounts and variables.

    Master-level ``task_container_defaults`` already give every task these; the template also
    carries them where a team runs det_lab against a master whose config it does not manage, and
    names them in the Web UI's "Launch JupyterLab" dialog.
    """
    environment: dict[str, Any] = {"environment_variables": environment_variables(lab, cluster)}
    if cluster.images.task:
        environment["image"] = {"cpu": cluster.images.task, "cuda": cluster.images.task}
    return {"bind_mounts": bind_mounts(lab, cluster), "environment": environment}


def render_notebook_template(lab: LabSettings, cluster: ClusterSettings) -> dict[str, Any]:
    """The task template plus the lab's idle rule for JupyterLab (``det notebook start --template``).

    A separate template: ``idle_timeout`` and ``notebook_idle_type`` are fields of a notebook's
    config (Determined's ``model.CommandConfig``) that an experiment config refuses (its schema
    allows no other keys), so they cannot go into the template experiments use. A user lengthens
    the limit for one notebook with ``--config idle_timeout=8h``: a launch's own config is merged
    over its template.
    """
    conf = render_task_template(lab, cluster)
    nb = cluster.notebooks
    if nb.idle_timeout is not None:
        conf["idle_timeout"] = nb.idle_timeout
    conf["notebook_idle_type"] = nb.idle_type
    return conf
