"""Running the cluster through Determined's own ``det deploy local`` code, with its gaps closed.

- **Preflight**: ``det-lab doctor``'s checks run first; any ``fail`` refuses the start (the
  ``master`` check is skipped: that is what is being started).
- **Docker**: checked before anything is written or created; without it every command stops with
  one line saying what to install.
- **Password in a temp file**: ``master_up`` dumps its config to a world-readable
  ``det-deploy-local-master-config-*`` temp file whenever it changes anything (a password from a
  flag, a weak or missing password, ``--storage-host-path``, ``--auto-work-dir``). det_lab writes
  the full master.yaml itself, 0600 in the private directory, with a strong
  ``initial_user_password``, and passes it as ``master_config_path`` with none of those flags, so
  ``master_up`` uses the file as it is and writes no temp file. The DB password never enters a
  file: ``master_up`` hands it to the master as ``DET_DB_PASSWORD``.
- **postgres:10.14**: ``db_up`` hard-codes it. For the duration of the call, det_lab replaces
  ``cluster_utils.db_up`` (module attribute, nothing on disk) with one that runs
  ``images.postgres`` under the same container name, network and volume, with a working health
  check and a ``determined-db`` network alias, and waits until it is healthy.
- **pkg_resources**: imported through :func:`det_lab.compat.import_deploy`.

Determined's private names this module depends on (all of them; the trial layer's are in
:mod:`det_lab.runs.harness`): :data:`DEPLOY_PRIVATE_NAMES`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from det_lab.errors import UserError
from det_lab.cluster import schema
from det_lab.cluster.bind_sources import check_bind_sources
from det_lab.cluster.render import DB_HOST, prepare_local_cache, publish_task_config, render_agent, render_master
from det_lab.cluster.plan import agent_yaml_path, master_yaml_path, use_gpus
from det_lab.cluster.secrets import ClusterSecrets, ensure_cluster_secrets, ensure_private_dir, write_private
from det_lab.cluster.settings import ClusterSettings
from det_lab.compat import import_deploy
from det_lab.checks import Check
from det_lab.cluster.health import cluster_checks
from det_lab.host_checks import host_checks
from det_lab.net import http_answers
from det_lab.settings import LabSettings

Out = Callable[[str], None]
DB_READY_TIMEOUT_S = 120
INSTALL_DOCKER = ("install Docker Engine (https://docs.docker.com/engine/install/) and the NVIDIA container "
                  "toolkit, start the daemon, and add your user to group 'docker'")


class DeployError(UserError, RuntimeError):
    """A deployment problem, phrased as one line for the user."""


class PreflightFailed(DeployError):
    """Doctor found problems; ``checks`` are the failing ones."""

    def __init__(self, checks: list[Check]) -> None:
        self.checks = checks
        names = ", ".join(c.name for c in checks)
        super().__init__(f"refusing to start: {len(checks)} doctor check(s) failed ({names}); fix them and re-run")


# --- checks before anything is created ------------------------------------------------------------

def preflight(lab: LabSettings) -> list[Check]:
    """The failing doctor checks that must stop ``up`` (empty: go): the machine's and the cluster's
    (doctor's Prometheus and Slurm accounting checks never fail; the ``master`` check is skipped:
    that is what is being started)."""
    return [c for c in host_checks(lab) + cluster_checks(lab) if c.status == "fail" and c.name != "master"]


def _require_bind_sources(lab: LabSettings, cluster: ClusterSettings, pool: str) -> None:
    """Refuse to start an agent whose tasks would fail at container creation (a missing bind source).
    The task cache on local disk is det_lab's to make (:func:`_make_task_cache`), once Docker answered."""
    problem = check_bind_sources(lab, cluster, pool, made_later=frozenset({str(cluster.tasks.local_cache)}))
    if problem:
        raise DeployError(problem)


def _make_task_cache(lab: LabSettings, cluster: ClusterSettings) -> None:
    """This agent's task cache, which every task mounts (made only on a machine that can start tasks)."""
    try:
        prepare_local_cache(lab, cluster)
    except OSError as exc:
        raise DeployError(f"cannot prepare tasks.local_cache {cluster.tasks.local_cache} "
                          f"({exc.strerror or exc}): run this as root, or create it writable by the lab's "
                          f"group, or set tasks.local_cache in {cluster.source or 'cluster.yaml'}") from None


def docker_client(timeout: int = 10) -> Any:
    """A connected Docker client, or :class:`DeployError` saying what to install."""
    endpoint = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:
        socket_path = endpoint.removeprefix("unix://")
        if endpoint.startswith("unix://") and not Path(socket_path).exists():
            reason = "no such socket"
        elif isinstance(exc, PermissionError) or "Permission denied" in str(exc):
            reason = "permission denied"
        else:
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
        raise DeployError(f"no Docker daemon reachable at {endpoint} ({reason}); {INSTALL_DOCKER}") from None
    return client


def config_errors(lab: LabSettings, cluster: ClusterSettings, agent_ids: list[str]) -> list[str]:
    """Structural problems of the rendered master.yaml and of each agent's agent.yaml."""
    master = render_master(lab, cluster)
    errors = [f"master.yaml: {e}" for e in schema.master_errors(master)]
    for agent in agent_ids:
        errors += [f"agent-{agent}.yaml: {e}" for e in schema.agent_errors(render_agent(cluster, agent), master)]
    return errors


# --- files ----------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """The files ``up`` wrote and the secrets it uses."""

    master_yaml: Path
    agent_yaml: Path
    secrets: ClusterSecrets
    pool: str


def write_agent_config(cluster: ClusterSettings, private: Path, agent_id: str, pool: str | None) -> Path:
    conf = render_agent(cluster, agent_id, pool)
    errors = schema.agent_errors(conf, render_master_stub(cluster))
    if errors:
        raise DeployError(f"agent.yaml: {errors[0]}")
    path = agent_yaml_path(private, agent_id)
    write_private(path, yaml.safe_dump(conf, sort_keys=False))
    return path


def render_master_stub(cluster: ClusterSettings) -> dict[str, Any]:
    """Just the pools of the master config, to check an agent against."""
    return {"resource_pools": [{"pool_name": p} for p in cluster.pool_names()]}


def prepare_up(lab: LabSettings, cluster: ClusterSettings, private: Path, agent_id: str,
               admin_password_file: Path | None = None) -> Prepared:
    """Validate, make sure the secrets exist, write the private master.yaml and agent.yaml."""
    errors = config_errors(lab, cluster, [agent_id])
    if errors:
        raise DeployError(errors[0])
    ensure_private_dir(private)
    secrets = ensure_cluster_secrets(private, admin_password_file)
    conf = render_master(lab, cluster, initial_user_password=secrets.admin.value)
    master_yaml = master_yaml_path(private)
    write_private(master_yaml, yaml.safe_dump(conf, sort_keys=False))
    pool = cluster.pool_of_agent(agent_id).name
    publish_task_config(lab)  # what DET_LAB_CONFIG names in every task
    return Prepared(master_yaml, write_agent_config(cluster, private, agent_id, pool), secrets, pool)


# --- the database ---------------------------------------------------------------------------------

@contextlib.contextmanager
def supported_postgres(dep: ModuleType, cluster: ClusterSettings, client: Any, out: Out) -> Iterator[None]:
    """Within the block, ``cluster_utils.db_up`` runs ``images.postgres`` instead of postgres:10.14."""

    def db_up(name: str, password: str, network_name: str, cluster_name: str, volume_name: str) -> None:
        out(f"Creating {name} ({cluster.images.postgres})...")
        user, db = cluster.db.user, cluster.db.name
        client.containers.run(
            image=cluster.images.postgres,
            environment={"POSTGRES_USER": user, "POSTGRES_DB": db, "POSTGRES_PASSWORD": password, "PGUSER": user},
            volumes=[f"{volume_name}:/var/lib/postgresql/data"],
            name=name,
            detach=True,
            restart_policy={"Name": "unless-stopped"},
            command="--max_connections=96 --shared_buffers=512MB",
            # upstream's CMD-SHELL list drops '-d determined' and polls every 1 ms
            healthcheck={"test": ["CMD-SHELL", f"pg_isready -U {user} -d {db}"],
                         "interval": 1_000_000_000, "timeout": 5_000_000_000, "retries": 60},
            network=network_name,
            hostname=DB_HOST,
            networking_config={network_name: client.api.create_endpoint_config(aliases=[DB_HOST])},
        )
        wait_healthy(client, name, DB_READY_TIMEOUT_S)

    original = dep.db_up
    dep.db_up = db_up
    try:
        yield
    finally:
        dep.db_up = original


def wait_healthy(client: Any, name: str, timeout: float) -> None:
    """Wait for a container's health check; a clear error if it exits or never gets healthy."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.api.inspect_container(name)["State"]
        if (state.get("Health") or {}).get("Status") == "healthy":
            return
        if state.get("Status") in ("exited", "dead") or time.monotonic() > deadline:
            lines = _log_tail(client, name)
            worst = next((ln for ln in reversed(lines) if "FATAL" in ln or "ERROR" in ln), lines[-1] if lines else "")
            hint = ""
            if any("incompatible with server" in ln for ln in lines):
                hint = ("; the DB volume was created by another PostgreSQL major version "
                        "(det deploy local used 10.14): pg_dump it with the old image and restore, "
                        "or set images.postgres to that version")
            what = "exited" if state.get("Status") in ("exited", "dead") else f"not healthy after {timeout:.0f}s"
            raise DeployError(f"{name} {what}: {worst or 'no log output'}{hint}")
        time.sleep(1)


def _log_tail(client: Any, name: str) -> list[str]:
    try:
        text = client.containers.get(name).logs(tail=20).decode(errors="replace")
    except Exception:
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


# --- commands -------------------------------------------------------------------------------------

#: (module, name, upstream line in determined 0.38.1, why): checked by tests/test_trials_harness.py
DEPLOY_PRIVATE_NAMES = (
    ("determined.deploy.local.cluster_utils", "_docker_client", "deploy/local/cluster_utils.py:60",
     "the module-global docker client cluster_utils caches: made the one det_lab checked"),
)


def _shared_client(dep: ModuleType, client: Any) -> None:
    dep._docker_client = client  # DEPLOY_PRIVATE_NAMES


def _guard_deploy_errors(action: str) -> contextlib.AbstractContextManager:
    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        try:
            yield
        except DeployError:
            raise
        except Exception as exc:  # docker.errors.*, requests, ConnectionError, TimeoutError ...
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DeployError(f"{action} failed: {type(exc).__name__}{': ' + detail if detail else ''}") from exc
    return guard()


def up(lab: LabSettings, cluster: ClusterSettings, private: Path, agent_id: str, *,
       admin_password_file: Path | None = None, client: Any = None, out: Out = print) -> Prepared:
    """Start database, master and a local agent (restarts them if running; the DB volume is kept)."""
    failed = preflight(lab)
    if failed:
        raise PreflightFailed(failed)
    _require_bind_sources(lab, cluster, cluster.pool_of_agent(agent_id).name)
    # Docker before anything is made: a machine that cannot start containers gets no task cache either
    client = client if client is not None else docker_client()
    _make_task_cache(lab, cluster)
    dep = import_deploy()
    _shared_client(dep, client)
    prepared = prepare_up(lab, cluster, private, agent_id, admin_password_file)
    from determined.common.api import authentication

    # a password master_up finds weak makes it generate one and dump the config to a temp file
    authentication.check_password_complexity(prepared.secrets.admin.value)
    # a pinned digest rides in the tag slot: det deploy local runs "<prefix>/determined-master:<tag>@sha256:..."
    prefix, version = cluster.images.repo_prefix, cluster.images.reference_version("master")
    with _guard_deploy_errors("starting the master"), supported_postgres(dep, cluster, client, out):
        dep.master_up(
            port=cluster.master_port, initial_user_password=None, master_config_path=prepared.master_yaml,
            storage_host_path=None, master_name=None, image_repo_prefix=prefix, version=version,
            db_password=prepared.secrets.db.value, delete_db=False, autorestart=True,
            cluster_name=cluster.cluster_name, auto_work_dir=None,
        )
    _start_agent(dep, cluster, prepared.agent_yaml, agent_id, prepared.pool)
    return prepared


def agent_up(lab: LabSettings, cluster: ClusterSettings, private: Path, agent_id: str, pool: str | None = None,
             *, client: Any = None) -> Path:
    """Start an agent on this machine that joins ``cluster.master_host`` (after doctor passes)."""
    failed = preflight(lab)  # above all: the volume must be mounted here at the same path
    if failed:
        raise PreflightFailed(failed)
    _require_bind_sources(lab, cluster, pool or cluster.pool_of_agent(agent_id).name)
    client = client if client is not None else docker_client()  # before anything is made (as in up)
    _make_task_cache(lab, cluster)
    dep = import_deploy()
    _shared_client(dep, client)
    ensure_private_dir(private)
    pool_name = pool or cluster.pool_of_agent(agent_id).name
    path = write_agent_config(cluster, private, agent_id, pool_name)
    publish_task_config(lab, replace=False)  # the master machine's copy wins ('cluster up' refreshes it)
    _start_agent(dep, cluster, path, agent_id, pool_name)
    return path


def _start_agent(dep: ModuleType, cluster: ClusterSettings, config: Path, agent_id: str, pool: str) -> None:
    with _guard_deploy_errors(f"starting agent {agent_id}"):
        dep.stop_agent(agent_id)  # a previous agent of that name would make the name clash
        dep.agent_up(
            master_host=cluster.master_host, master_port=cluster.master_port, agent_config_path=config,
            agent_name=agent_id, agent_resource_pool=pool, image_repo_prefix=cluster.images.repo_prefix,
            version=cluster.images.reference_version("agent"), gpu=use_gpus(cluster), autorestart=True,
            cluster_name=cluster.cluster_name, labels={"determined.cluster": cluster.cluster_name},
        )


def down(cluster: ClusterSettings, *, delete_db: bool = False, client: Any = None) -> None:
    """Stop and remove this machine's master, database, network and agents of the cluster."""
    client = client if client is not None else docker_client()
    dep = import_deploy()
    _shared_client(dep, client)
    with _guard_deploy_errors("stopping the cluster"):
        dep.cluster_down(cluster_name=cluster.cluster_name, delete_db=delete_db)


@dataclass(frozen=True)
class DownPlan:
    """What :func:`down` would stop and remove here, as Determined's ``cluster_down`` finds it."""

    containers: list[str]  # stopped and removed
    networks: list[str]  # removed
    db_volume: str  # the database volume (every experiment's history)
    db_volume_exists: bool
    delete_db: bool

    def lines(self) -> list[str]:
        """The plan as text, one thing removed per line."""
        out = [f"would stop and remove container {c}" for c in self.containers]
        out += [f"would remove network {n}" for n in self.networks]
        if not self.db_volume_exists:
            out.append(f"database volume {self.db_volume}: none on this machine")
        elif self.delete_db:
            out.append(f"would DELETE the database volume {self.db_volume} (all experiments, trials, metrics, users)")
        else:
            out.append(f"keeps the database volume {self.db_volume}")
        return out

    def as_dict(self) -> dict[str, Any]:
        """The plan as ``cluster down --dry-run --json`` prints it."""
        return {"containers": self.containers, "networks": self.networks, "db_volume": self.db_volume,
                "db_volume_exists": self.db_volume_exists,
                "deletes_db_volume": self.delete_db and self.db_volume_exists}


def down_plan(cluster: ClusterSettings, *, delete_db: bool = False, client: Any = None) -> DownPlan:
    """What :func:`down` would remove, found the way Determined's ``cluster_down`` finds it
    (determined/deploy/local/cluster_utils.py, 0.38.1: ``master_down`` and ``db_down`` by exact
    container name, ``stop_cluster_agents`` by the ``determined.cluster`` label, ``remove_network``
    by name, ``db_down``'s volume ``<cluster_name>_determined-db-volume``); changes nothing."""
    from docker.errors import NotFound

    client = client if client is not None else docker_client()
    dep = import_deploy()
    cn = cluster.cluster_name
    named = [f"{cn}_{dep.MASTER_NAME}", f"{cn}_{dep.DB_NAME}"]
    with _guard_deploy_errors("listing the cluster's containers"):
        containers = [n for n in named for c in client.containers.list(all=True, filters={"name": [n]}) if c.name == n]
        containers += [c.name for c in client.containers.list(all=True, filters={"label": [f"determined.cluster={cn}"]})
                       if c.name not in containers]
        networks = [n.name for n in client.networks.list(names=[dep.NETWORK_NAME])]
        volume = f"{cn}_{dep.VOLUME_NAME}"
        try:
            client.volumes.get(volume)
            exists = True
        except NotFound:
            exists = False
    return DownPlan(containers, networks, volume, exists, delete_db)


@dataclass(frozen=True)
class ContainerStatus:
    name: str
    role: str
    image: str
    status: str

    def as_dict(self) -> dict[str, str]:
        """The container as ``cluster status --json`` prints it."""
        return {"name": self.name, "role": self.role, "image": self.image, "status": self.status}


def cluster_containers(cluster: ClusterSettings, client: Any) -> list[ContainerStatus]:
    """The cluster's containers on this machine: master, database, agents."""
    dep = import_deploy()
    cn = cluster.cluster_name
    wanted = {f"{cn}_{dep.MASTER_NAME}": "master", f"{cn}_{dep.DB_NAME}": "database"}
    found: dict[str, ContainerStatus] = {}
    for c in client.containers.list(all=True):
        labels = c.labels or {}
        role = wanted.get(c.name) or ("agent" if labels.get("determined.cluster") == cn else None)
        if role:
            image = (c.image.tags or [c.image.short_id])[0] if c.image else "?"
            found[c.name] = ContainerStatus(c.name, role, image, c.status)
    order = {"database": 0, "master": 1, "agent": 2}
    return sorted(found.values(), key=lambda s: (order[s.role], s.name))


def master_answers(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    """Whether ``url/info`` answers (plain HTTP, as det deploy local's health check)."""
    return http_answers(f"{url}/info", timeout)


def container_logs(cluster: ClusterSettings, client: Any, tail: int = 50) -> Iterator[tuple[str, str]]:
    """(container, line) for the last ``tail`` lines of each cluster container here."""
    for status in cluster_containers(cluster, client):
        with _guard_deploy_errors(f"reading logs of {status.name}"):
            text = client.containers.get(status.name).logs(tail=tail).decode(errors="replace")
        for line in text.splitlines():
            yield status.name, line
