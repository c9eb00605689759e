"""The cluster section of the lab configuration: hosts, pools, images, GC, database names.

It lives in its own file so that the lab config (``det_lab.settings``) stays what every
laptop needs, and the cluster part is shared by every machine of the cluster:

1. ``--cluster-config PATH`` / ``$DET_LAB_CLUSTER_CONFIG`` (must exist when given),
2. ``<data_root>/.det-lab/cluster.yaml`` on the shared volume, so the master machine and every
   agent machine read the same pools,
3. none: built-in defaults (one machine, one ``default`` pool).

The file holds no secrets (see :mod:`det_lab.cluster.secrets`). Problems are raised as
:class:`ClusterConfigError` with a one-line message naming the file and key.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal, get_args

from pydantic import ByteSize, Field, ValidationError, field_validator, model_validator

from det_lab.errors import UserError
from det_lab.compat import DETERMINED_VERSION
from det_lab.settings import LabSettings, StrictModel, env_value, read_section_file

CLUSTER_FILE = "cluster.yaml"
DEFAULT_POOL = "default"
#: Determined 0.38 warns about PostgreSQL older than 12 and recommends 13+; upstream hard-codes 10.14.
MIN_POSTGRES_MAJOR = 12
DEFAULT_POSTGRES_IMAGE = "postgres:14"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DOCKER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$")
# Docker's reference grammar (distribution/reference): tag, digest, and registry/path prefix
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPO_PREFIX = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
#: a Go duration as Determined's model.Duration parses it ("2h", "90m", "1h30m")
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(h|m|s|ms))+$")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
NotebookIdleType = Literal["kernels_or_terminals", "kernel_connections", "activity"]
NOTEBOOK_IDLE_TYPES: tuple[str, ...] = get_args(NotebookIdleType)


class ClusterConfigError(UserError, ValueError):
    """A cluster configuration problem, phrased as one line for the user."""


class PoolSettings(StrictModel):
    """A resource pool: one per machine or per GPU kind."""

    name: str = Field(description="the pool's name (letters, digits, '.', '-', '_'); experiments pick it with resources.resource_pool")
    description: str = Field(default="", description="what the pool is, shown in the Web UI")
    agents: list[str] = Field(default_factory=list, description="agent ids (hostnames) that join this pool")
    gpu_kind: str | None = Field(default=None, description="e.g. rtx4090; exported to tasks as DET_LAB_GPU_KIND")
    max_aux_containers_per_agent: int = Field(default=100, ge=0, description="CPU-only tasks (notebooks, TensorBoards, commands) an agent of the pool runs at once")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"pool name {v!r} must be letters, digits, '.', '-' or '_' (at most 63)")
        return v


class AgentSettings(StrictModel):
    """Settings every agent gets in its agent.yaml."""

    container_master_host: str | None = Field(
        default=None, description="how task containers reach the master (default: master_host)")
    slot_type: Literal["auto", "cuda", "rocm", "cpu", "none"] = Field(default="auto", description="what an agent offers as slots: auto detects its GPUs; cpu offers its CPUs")
    visible_gpus: str | None = Field(default=None, description="the GPUs an agent offers (e.g. 0,1); null: all")
    gpu: bool | Literal["auto"] = Field(
        default="auto", description="pass the host GPUs to the agent container; auto = when nvidia-smi exists")


class ImageSettings(StrictModel):
    """Container images. Mirror them: nobody maintains the Docker Hub copies any more.

    ``det deploy local`` runs ``<repo_prefix>/determined-master:<version>`` (and ``-agent``); a
    digest pins the image's content: the reference becomes ``...:<version>@sha256:<hex>``, which
    Docker pulls and runs by digest (the tag is then only a label).
    """

    repo_prefix: str = Field(default="determinedai", description="where the master and agent images come from (ghcr.io/wu-cvgl for the community fork)")
    version: str = Field(default=DETERMINED_VERSION, description="the master and agent images' tag")
    master_digest: str | None = Field(default=None, description="sha256:<64 hex> of the master image")
    agent_digest: str | None = Field(default=None, description="sha256:<64 hex> of the agent image")
    task: str | None = Field(default=None, description="default task image; None keeps Determined's")
    postgres: str = Field(default=DEFAULT_POSTGRES_IMAGE, description="the master database's image (PostgreSQL 12 or later)")

    @field_validator("repo_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not _REPO_PREFIX.match(v):
            raise ValueError(f"{v!r} is not an image repository prefix (e.g. determinedai or ghcr.io/wu-cvgl)")
        return v

    @field_validator("version")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not _TAG.match(v):
            raise ValueError(f"{v!r} is not an image tag (letters, digits, '_', '.', '-'; at most 128; "
                             "put a digest in master_digest/agent_digest)")
        return v

    @field_validator("master_digest", "agent_digest")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not _DIGEST.match(v):
            raise ValueError(f"{v!r} is not an image digest (sha256: and 64 lower-case hex digits; "
                             "docker buildx imagetools inspect IMAGE prints it)")
        return v

    def is_fork_at_least(self, version: tuple[int, int]) -> bool:
        """Whether ``version`` names the community fork at ``version`` or later (upstream's last is 0.38.1)."""
        m = re.match(r"^(\d+)\.(\d+)", self.version)
        return bool(m) and (int(m.group(1)), int(m.group(2))) >= version

    def digest(self, role: Literal["master", "agent"]) -> str | None:
        """The digest ``role``'s image is pinned to, or None where it is named by tag only."""
        return self.master_digest if role == "master" else self.agent_digest

    def reference_version(self, role: Literal["master", "agent"]) -> str:
        """What ``det deploy local`` puts after ``determined-<role>:``: the tag, and the digest if pinned."""
        digest = self.digest(role)
        return f"{self.version}@{digest}" if digest else self.version

    def reference(self, role: Literal["master", "agent"]) -> str:
        """The full image reference ``det deploy local`` runs for ``role``."""
        return f"{self.repo_prefix}/determined-{role}:{self.reference_version(role)}"

    @field_validator("postgres")
    @classmethod
    def _supported_postgres(cls, v: str) -> str:
        tag = v.rsplit(":", 1)[1] if ":" in v.rsplit("/", 1)[-1] else ""
        major = re.match(r"^(\d+)", tag)
        if major and int(major.group(1)) < MIN_POSTGRES_MAJOR:
            raise ValueError(
                f"{v} is older than PostgreSQL {MIN_POSTGRES_MAJOR}, which Determined 0.38 warns about; "
                f"use {DEFAULT_POSTGRES_IMAGE}")
        return v


class GCSettings(StrictModel):
    """Which checkpoints survive garbage collection (the union of the three is kept)."""

    save_experiment_best: int = Field(default=0, ge=0, description="best checkpoints of each experiment kept")
    save_trial_best: int = Field(default=1, ge=0, description="best checkpoints of each trial kept")
    save_trial_latest: int = Field(default=1, ge=0, description="latest checkpoints of each trial kept")


class DBSettings(StrictModel):
    """The database the master uses. Host and port are fixed by ``det deploy local``."""

    name: str = Field(default="determined", description="the master's PostgreSQL database")
    user: str = Field(default="postgres", description="the PostgreSQL user the master (and det-lab cluster backup) connects as")

    @field_validator("name", "user")
    @classmethod
    def _ident(cls, v: str) -> str:
        if not re.match(r"^[a-z_][a-z0-9_]{0,62}$", v):
            raise ValueError(f"{v!r} must be a lower-case PostgreSQL identifier")
        return v


class SchedulerSettings(StrictModel):
    """The priority scheduler (``fair_share`` is deprecated in 0.38, ``round_robin`` removed)."""

    default_priority: int = Field(default=42, ge=1, le=99, description="priority of a task that names none (1 is the highest)")
    preemption: bool = Field(default=False, description="let a higher-priority task preempt a lower one")
    fitting_policy: Literal["best", "worst"] = Field(default="best", description="best packs tasks onto the fewest agents; worst spreads them")
    numa_packing: bool | None = Field(
        default=None, description="community fork 0.42+ only: false stops packing a task's GPUs by NUMA node")


class TaskUser(StrictModel):
    """A Unix identity for tasks; used for ``security.default_task`` and user links."""

    uid: int = Field(ge=0, description="Unix user id tasks run as")
    gid: int = Field(ge=0, description="Unix group id tasks run as")
    user: str = Field(description="Unix user name")
    group: str = Field(description="Unix group name")


class BindMount(StrictModel):
    """An extra bind mount for every task container (same path on host and in the container)."""

    host_path: Path = Field(description="absolute path on every agent")
    container_path: Path | None = Field(default=None, description="where it appears in the task (default: host_path)")
    read_only: bool = Field(default=True, description="mount it read-only")
    propagation: Literal["rprivate", "private", "rshared", "shared", "rslave", "slave"] = Field(default="rslave", description="mount propagation; rslave shows mounts made on the host later (an NFS remount) inside running tasks")

    @field_validator("host_path", "container_path")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"{str(v)!r} must be an absolute path")
        return v


def go_duration_seconds(text: str) -> float:
    """Seconds in a Go duration string such as ``2h`` or ``1h30m`` (ValueError if it is not one)."""
    if not _GO_DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration like 2h, 90m or 1h30m")
    return sum(float(n) * _DURATION_UNITS[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ms|h|m|s)", text))


class NotebookSettings(StrictModel):
    """Idle JupyterLab notebooks: the lab-wide default after which Determined ends one.

    Rendered as the master's ``notebook_timeout`` (used for notebooks that set no ``idle_timeout``)
    and into the notebook template; a user lengthens it per notebook with
    ``det notebook start --config idle_timeout=8h``. ``idle_timeout: null`` turns it off.
    """

    idle_timeout: str | None = Field(default="2h", description="a Go duration after which Determined ends an idle notebook (the master's notebook_timeout); null: never")
    idle_type: NotebookIdleType = Field(default="kernels_or_terminals", description="what counts as activity: kernels, terminals, kernels_or_terminals or activity")

    @field_validator("idle_timeout")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None and go_duration_seconds(v) < 60:
            raise ValueError(f"{v!r} is under a minute; a notebook would end while it starts")
        return v

    @property
    def idle_seconds(self) -> int | None:
        return None if self.idle_timeout is None else int(go_duration_seconds(self.idle_timeout))


class BackupSettings(StrictModel):
    """Backups of the master's database (``det-lab cluster backup``).

    Without ``host``, pg_dump runs inside the master's database container (``docker exec``, on the
    master machine); with ``host`` (a name, an IP or a socket directory) det_lab's own PostgreSQL
    client tools connect to it as ``db.user`` with the password in the cluster's ``db-password`` file.
    """

    dir: Path | None = Field(default=None, description="default: <data_root>/.det-lab/backups")
    keep_daily: int = Field(default=7, ge=1, description="newest backup of each of the last N days with one")
    keep_weekly: int = Field(default=4, ge=0, description="newest backup of each of the last M weeks with one")
    keep_last: int = Field(default=3, ge=1, description="newest N backups whatever their day, so that a manual "
                           "backup after a failure never prunes that morning's good one")
    host: str | None = Field(default=None, description="PostgreSQL host (a name, an IP or a socket directory); null: run pg_dump inside the master's database container")
    port: int = Field(default=5432, ge=1, le=65535, description="PostgreSQL port, with host")
    pg_bin: Path | None = Field(default=None, description="directory of pg_dump/pg_restore/psql")
    max_age_hours: int = Field(default=48, ge=1, description="doctor warns when the newest backup is older")
    on_calendar: str = Field(default="*-*-* 03:15:00", description="systemd OnCalendar= of the nightly timer")

    @field_validator("dir", "pg_bin")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"{str(v)!r} must be an absolute path")
        return v


class TaskDefaults(StrictModel):
    """What every task container gets, rendered into the master's and every pool's defaults."""

    shm_size: ByteSize = Field(
        default=ByteSize(4 * 1024**3),
        description="size of each task container's /dev/shm (Determined's shm_size_bytes; an experiment's "
                    "resources.shm_size overrides it). Each container has its own: the VLA frame cache in "
                    "shm is built per trial")
    preemption_timeout: int = Field(default=3600, ge=1,
                                    description="seconds a preempted task gets to checkpoint and exit")
    local_cache: Path = Field(
        default=Path("/var/cache/det-lab"),
        description="each agent's local-disk cache mounted into every task at the same path (gsplat's CUDA "
                    "build in torch_extensions/, Isaac Sim's caches in isaac/); 'cluster agent-up' makes it")


class ClusterSettings(StrictModel):
    """The whole cluster section."""

    cluster_name: str = Field(default="determined", description="prefix of the Docker container names")
    display_name: str = Field(default="det-lab", description="the cluster's name in the Web UI")
    master_host: str = Field(default_factory=socket.gethostname,
                             description="address of the master machine, routable from every agent and task",
                             json_schema_extra={"doc_default": "this machine's host name"})
    master_port: int = Field(default=8080, ge=1, le=65535, description="host port the master is published on")
    pools: list[PoolSettings] = Field(default_factory=lambda: [PoolSettings(name=DEFAULT_POOL, description="GPU machines")], description="resource pools: one per machine or per GPU kind")
    default_compute_pool: str = Field(default=DEFAULT_POOL, description="the pool of GPU tasks that name none")
    default_aux_pool: str = Field(default=DEFAULT_POOL, description="the pool of CPU-only tasks (notebooks, TensorBoards) that name none")
    scheduler: SchedulerSettings = Field(default=SchedulerSettings(), description="the master's priority scheduler")
    agent: AgentSettings = Field(default=AgentSettings(), description="what every agent.yaml gets")
    images: ImageSettings = Field(default=ImageSettings(), description="container images: master, agent, task, database")
    gc: GCSettings = Field(default=GCSettings(), description="which checkpoints survive Determined's checkpoint garbage collection")
    db: DBSettings = Field(default=DBSettings(), description="the master's database")
    backup: BackupSettings = Field(default=BackupSettings(), description="backups of the master's database (det-lab cluster backup)")
    notebooks: NotebookSettings = Field(default=NotebookSettings(), description="idle JupyterLab notebooks")
    tasks: TaskDefaults = Field(default_factory=TaskDefaults, description="defaults of every task container")
    log_retention_days: int = Field(default=90, ge=-1, le=32767, description="days the master keeps task logs (-1: for ever)")
    default_task: TaskUser | None = Field(
        default=None, description="identity of tasks whose user is not linked (Determined's default: root)")
    users: dict[str, str | TaskUser] = Field(
        default_factory=dict, description="Determined user -> Unix user name, or an explicit identity")
    bind_mounts: list[BindMount] = Field(default_factory=list, description="extra task bind mounts")
    source: Path | None = Field(default=None, exclude=True)

    @field_validator("cluster_name")
    @classmethod
    def _cluster_name(cls, v: str) -> str:
        if not _DOCKER_NAME.match(v):
            raise ValueError(f"{v!r} must be letters, digits, '.', '-' or '_' (it prefixes container names)")
        return v

    @field_validator("master_host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v or "://" in v or "/" in v or ":" in v:
            raise ValueError(f"{v!r} must be a bare host name or IP (the port is master_port)")
        return v

    @model_validator(mode="after")
    def _pools_consistent(self) -> ClusterSettings:
        if not self.pools:
            raise ValueError("pools: at least one pool is needed")
        names: set[str] = set()
        owner: dict[str, str] = {}
        for pool in self.pools:
            if pool.name in names:
                raise ValueError(f"pools: duplicate pool name {pool.name!r}")
            names.add(pool.name)
            for agent in pool.agents:
                if agent in owner:
                    raise ValueError(f"pools: agent {agent!r} is listed in both {owner[agent]!r} and {pool.name!r}")
                owner[agent] = pool.name
        for key in ("default_compute_pool", "default_aux_pool"):
            value = getattr(self, key)
            if value not in names:
                raise ValueError(
                    f"{key}: pool {value!r} is not defined (pools: {', '.join(sorted(names))}); "
                    f"keep a pool named 'default' or point {key} at one of them")
        if self.scheduler.numa_packing is not None and not self.images.is_fork_at_least((0, 42)):
            raise ValueError(
                f"scheduler.numa_packing: only the community fork's master 0.42+ reads it, and an earlier "
                f"master refuses to start with it (images.version is {self.images.version}); remove it or "
                "run the fork's images (docs/admin/fork.md)")
        seen: set[Path] = set()
        for m in self.bind_mounts:
            target = m.container_path or m.host_path
            if target in seen:
                raise ValueError(f"bind_mounts: two mounts target {target}")
            seen.add(target)
        return self

    def pool_names(self) -> list[str]:
        return [p.name for p in self.pools]

    def pool(self, name: str) -> PoolSettings:
        """The pool called ``name``; a clear error for an unknown one."""
        for p in self.pools:
            if p.name == name:
                return p
        raise ClusterConfigError(f"unknown pool {name!r} (pools: {', '.join(self.pool_names())})")

    def pool_of_agent(self, agent_id: str) -> PoolSettings:
        """The pool an agent joins: the one listing it, else the default compute pool."""
        for p in self.pools:
            if agent_id in p.agents:
                return p
        return self.pool(self.default_compute_pool)

    @property
    def container_master_host(self) -> str:
        return self.agent.container_master_host or self.master_host

    @property
    def master_url(self) -> str:
        return f"http://{self.master_host}:{self.master_port}"


def default_cluster_file(lab: LabSettings) -> Path:
    """``<data_root>/.det-lab/cluster.yaml``: shared by every machine of the cluster."""
    return lab.data_root / ".det-lab" / CLUSTER_FILE


def load_cluster_settings(lab: LabSettings, path: Path | str | None = None) -> ClusterSettings:
    """Load and validate the cluster section: from ``path``, else ``$DET_LAB_CLUSTER_CONFIG``, else
    :func:`default_cluster_file` when it exists (``source`` None: the built-in defaults). Every
    reader of the cluster config goes through here, so the variable means the same everywhere."""
    file, raw = read_section_file(path or env_value("DET_LAB_CLUSTER_CONFIG"), default_cluster_file(lab),
                                  ClusterConfigError, "cluster config")
    where = str(file) if file else "built-in cluster defaults"
    try:
        return ClusterSettings.model_validate({**raw, "source": file})
    except ValidationError as exc:
        raise ClusterConfigError(f"{where}: {_one_line(exc)}") from None


def _one_line(exc: ValidationError) -> str:
    errors = exc.errors()
    # for `str | TaskUser` pydantic reports the str branch first; a mapping meant the other one
    err = next((e for e in errors if not (e["type"] == "string_type" and isinstance(e.get("input"), dict))),
               errors[0])
    loc = [str(p) for p in err["loc"]]
    # pydantic puts union members in the path ("users.alice.str"); keep what a user wrote
    loc = [p for p in loc if p not in ("str", "TaskUser", "bool", "literal['auto']")]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"unknown key {key!r}"
    msg = err["msg"].removeprefix("Value error, ")
    given = err.get("input")
    if isinstance(given, (str, int, float, bool)) and repr(given) not in msg and err["type"] != "missing":
        msg += f" (got {given!r})"
    return f"{key}: {msg}" if key else msg
