"""What ``cluster up`` and ``cluster agent-up`` create, as data.

``--dry-run`` prints it; :mod:`det_lab.cluster.deploy` executes the same decisions through
Determined's deploy code. Names (containers, network, volume) are taken from
``determined.deploy.local.cluster_utils`` so the plan shows what that code will really create.
Secret values never appear: environment entries that carry one say which file it comes from.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from det_lab.cluster.render import DB_HOST, MASTER_CONTAINER_PORT, bind_mounts, task_config_path
from det_lab.cluster.schema import SHARED_FS_CONTAINER_PATH
from det_lab.cluster.secrets import ADMIN_PASSWORD_FILE, DB_PASSWORD_FILE
from det_lab.cluster.settings import ClusterSettings
from det_lab.settings import LabSettings

DOCKER_SOCKET = "/var/run/docker.sock"
# Names det deploy local gives its resources (cluster_utils.NETWORK_NAME, DB_NAME, MASTER_NAME,
# VOLUME_NAME). Copied so a dry run need not import determined.deploy (seconds of aws/gcp
# imports); tests/test_cluster_deploy.py checks them against the installed code.
NETWORK_NAME = "determined_default"
DB_NAME = "determined-db_1"
MASTER_NAME = "determined-master_1"
VOLUME_NAME = "determined-db-volume"


@dataclass(frozen=True)
class MountPlan:
    source: str
    target: str
    read_only: bool = False
    kind: str = "bind"  # or "volume"


@dataclass(frozen=True)
class ContainerPlan:
    role: str
    name: str
    image: str
    ports: dict[str, int] = field(default_factory=dict)  # host port -> container port
    mounts: list[MountPlan] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    network: str | None = None
    network_mode: str | None = None
    gpus: bool = False
    restart: str = "unless-stopped"
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FilePlan:
    path: Path
    mode: int
    secret: bool
    purpose: str


@dataclass
class DeployPlan:
    """Everything one command would create on this machine."""

    action: str
    master_url: str
    containers: list[ContainerPlan] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    files: list[FilePlan] = field(default_factory=list)
    task_mounts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def container(self, role: str) -> ContainerPlan:
        return next(c for c in self.containers if c.role == role)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for f in data["files"]:
            f["path"] = str(f["path"])
            f["mode"] = f"{f['mode']:04o}"
        return data

    def lines(self) -> list[str]:
        """The plan as plain text, one fact per line."""
        out = [f"plan: {self.action} (master {self.master_url}); nothing is created with --dry-run"]
        for f in self.files:
            out.append(f"file      {f.path} mode {f.mode:04o}{' (secret)' if f.secret else ''}: {f.purpose}")
        for n in self.networks:
            out.append(f"network   {n}")
        for v in self.volumes:
            out.append(f"volume    {v}")
        for c in self.containers:
            net = c.network or f"{c.network_mode} networking"
            out.append(f"container {c.name} [{c.role}] image {c.image} on {net}"
                       + (" with all GPUs" if c.gpus else "") + f", restart {c.restart}")
            for host, cont in c.ports.items():
                out.append(f"  port    {host} -> {cont}")
            for m in c.mounts:
                out.append(f"  mount   {m.source} -> {m.target} ({'ro' if m.read_only else 'rw'}, {m.kind})")
            for k, v in c.env.items():
                out.append(f"  env     {k}={v}")
        for m in self.task_mounts:
            out.append(f"task mount {m['host_path']} -> {m['container_path']} "
                       f"({'ro' if m['read_only'] else 'rw'}, {m['propagation']})")
        out.extend(f"note: {n}" for n in self.notes)
        return out


def master_yaml_path(private: Path) -> Path:
    return private / "master.yaml"


def agent_yaml_path(private: Path, agent_id: str) -> Path:
    return private / f"agent-{agent_id}.yaml"


def use_gpus(cluster: ClusterSettings) -> bool:
    """Whether the agent container gets the host's GPUs."""
    if cluster.agent.gpu == "auto":
        return shutil.which("nvidia-smi") is not None
    return bool(cluster.agent.gpu)


def _agent(cluster: ClusterSettings, private: Path, agent_id: str, pool: str) -> ContainerPlan:
    return ContainerPlan(
        role="agent", name=agent_id, image=cluster.images.reference("agent"),
        mounts=[MountPlan(DOCKER_SOCKET, DOCKER_SOCKET),
                MountPlan(str(agent_yaml_path(private, agent_id)), "/etc/determined/agent.yaml")],
        env={"DET_MASTER_HOST": cluster.master_host, "DET_MASTER_PORT": str(cluster.master_port),
             "DET_AGENT_ID": agent_id, "DET_RESOURCE_POOL": pool},
        network_mode="host", gpus=use_gpus(cluster),
        labels={"ai.determined.type": "agent", "determined.cluster": cluster.cluster_name},
    )


def up_plan(lab: LabSettings, cluster: ClusterSettings, private: Path, agent_id: str,
            admin_password_file: Path | None = None) -> DeployPlan:
    """Master, database and a local agent on this machine."""
    cn = cluster.cluster_name
    network, volume = NETWORK_NAME, f"{cn}_{VOLUME_NAME}"
    admin_file = admin_password_file or private / ADMIN_PASSWORD_FILE
    db_file = private / DB_PASSWORD_FILE
    pool = cluster.pool_of_agent(agent_id).name
    db = ContainerPlan(
        role="database", name=f"{cn}_{DB_NAME}", image=cluster.images.postgres,
        mounts=[MountPlan(volume, "/var/lib/postgresql/data", kind="volume")],
        env={"POSTGRES_USER": cluster.db.user, "POSTGRES_DB": cluster.db.name,
             "POSTGRES_PASSWORD": f"<from {db_file}>"},
        network=network,
    )
    master = ContainerPlan(
        role="master", name=f"{cn}_{MASTER_NAME}", image=cluster.images.reference("master"),
        ports={str(cluster.master_port): MASTER_CONTAINER_PORT},
        mounts=[MountPlan(str(master_yaml_path(private)), "/etc/determined/master.yaml"),
                MountPlan(str(lab.data_root), SHARED_FS_CONTAINER_PATH)],
        env={"DET_DB_PASSWORD": f"<from {db_file}>"},
        network=network,
    )
    plan = DeployPlan(
        action="up", master_url=cluster.master_url,
        containers=[db, master, _agent(cluster, private, agent_id, pool)],
        networks=[network], volumes=[volume],
        files=[
            FilePlan(admin_file, 0o600, True, "initial admin/determined password (generated if missing)"),
            FilePlan(db_file, 0o600, True, "database password (generated if missing)"),
            FilePlan(master_yaml_path(private), 0o600, True, "master.yaml with initial_user_password"),
            FilePlan(agent_yaml_path(private, agent_id), 0o600, False, f"agent.yaml (pool {pool})"),
            FilePlan(task_config_path(lab), 0o644, False, "the lab config every task reads (DET_LAB_CONFIG)"),
            FilePlan(cluster.tasks.local_cache, 0o2775, False, "this agent's task cache, mounted into every task"),
        ],
        task_mounts=bind_mounts(lab, cluster),
    )
    plan.notes += [
        f"database {cluster.images.postgres} replaces det deploy local's hard-coded postgres:10.14; "
        f"reachable only on network {network} as {DB_HOST}",
        "det-lab doctor runs first and any 'fail' stops the start",
        f"the local agent joins pool {pool!r}; other GPU machines: det-lab cluster agent-up {cluster.master_host}",
    ]
    plan.notes += unpinned_notes(cluster, ("master", "agent"))
    return plan


def agent_plan(cluster: ClusterSettings, private: Path, agent_id: str, pool: str | None = None) -> DeployPlan:
    """One agent on this machine, joining the master at ``cluster.master_host``."""
    pool_name = pool or cluster.pool_of_agent(agent_id).name
    cluster.pool(pool_name)
    plan = DeployPlan(
        action="agent-up", master_url=cluster.master_url,
        containers=[_agent(cluster, private, agent_id, pool_name)],
        files=[FilePlan(agent_yaml_path(private, agent_id), 0o600, False, f"agent.yaml (pool {pool_name})")],
    )
    plan.notes.append(f"mount the shared volume at the same path as on the master before starting "
                      f"(task mounts and checkpoints use host paths); waits for {cluster.master_url}/info")
    plan.notes.append(f"makes {cluster.tasks.local_cache} (the task cache every task mounts) and refreshes "
                      f"the lab config tasks read on the volume")
    plan.notes += unpinned_notes(cluster, ("agent",))
    return plan


def unpinned_notes(cluster: ClusterSettings, roles: tuple[Literal["master", "agent"], ...]) -> list[str]:
    """How to pin each image that is named by its tag alone (a tag can be moved; a digest cannot)."""
    notes = []
    for role in roles:
        if cluster.images.digest(role) is None:
            ref = cluster.images.reference(role)
            notes.append(f"{role} image {ref} is named by tag only; pin it: set images.{role}_digest to the "
                         f"sha256:... that 'docker buildx imagetools inspect {ref}' prints")
    return notes
