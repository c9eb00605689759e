"""The Slurm section of the lab configuration: the machines, their GPUs, time limits, images.

Like the Determined cluster section it lives in its own file, shared by every machine:

1. ``--slurm-config PATH`` / ``$DET_LAB_SLURM_CONFIG`` (must exist when given),
2. ``<data_root>/.det-lab/slurm.yaml`` on the shared volume,
3. none: built-in defaults (this machine, no GPUs, Slurm's default partition).

Example::

    controller: gpu-box-1
    nodes:
      - {name: gpu-box-1, cpus: 32, memory: 128GiB, gpus: 2, gpu_kind: rtx4090}
      - {name: gpu-box-2, cpus: 64, memory: 256GiB, gpus: 4, gpu_kind: a100}
    default_time: "04:00:00"
    images:                                               # trials run under apptainer exec --nv
      default: /mnt/data/.det-lab/images/det-lab-task.sif
      isaac-lab-base:latest: /mnt/data/.det-lab/images/isaac-lab.sif
    accounting:                                           # slurmdbd + MariaDB: limits, fair-share, sacct
      members:
        - {user: alice, projects: [vla], gpu_limit: 2, fairshare: 2}
        - {user: bob, projects: [vla, 3dgs]}
      defaults: {gpu_limit: 1, fairshare: 1}              # for every member that names neither
      projects: {3dgs: {gpu_limit: 2}}                    # the whole project at most 2 GPUs at once
      deny_on_limit: false                                # true: refuse at submission instead of queueing
      interactive_time: "02:00:00"                        # salloc / srun --pty jobs end after this

Problems are raised as :class:`SlurmConfigError`, one line naming the file and key.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from pydantic import ByteSize, Field, ValidationError, field_validator, model_validator

from det_lab.errors import UserError
from det_lab.settings import LabSettings, StrictModel, env_value, read_section_file

SLURM_FILE = "slurm.yaml"
CPU_PARTITION = "cpu"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or INFINITE
_TIME = re.compile(r"^(INFINITE|UNLIMITED|\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}){0,2})$")


class SlurmConfigError(UserError, ValueError):
    """A Slurm configuration problem, phrased as one line for the user."""



def check_time(value: str) -> str:
    """``value`` if it is a Slurm time limit, else a ValueError saying what the formats are."""
    if not _TIME.match(value):
        raise ValueError(f"{value!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS)")
    return value


class NodeSettings(StrictModel):
    """One machine: a Slurm node. Its GPUs become ``gres`` of type ``gpu_kind``."""

    name: str = Field(description="the node's host name (Slurm's NodeName)")
    addr: str | None = Field(default=None, description="NodeAddr when the name does not resolve")
    cpus: int = Field(default=1, ge=1, description="CPUs Slurm may hand out on it")
    memory: ByteSize | None = Field(default=None, description="RealMemory (leave some for the OS)")
    gpus: int = Field(default=0, ge=0, description="its GPUs, as gres gpu:<gpu_kind>:N")
    gpu_kind: str | None = Field(default=None, description="e.g. rtx4090: the gres type and the partition name")
    gpu_files: str | None = Field(default=None, description="device files; default /dev/nvidia[0-N]")

    @field_validator("name", "gpu_kind")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"{v!r} must be letters, digits, '-' or '_'")
        return v

    @model_validator(mode="after")
    def _kind_with_gpus(self) -> NodeSettings:
        if self.gpus and not self.gpu_kind:
            raise ValueError(f"node {self.name}: gpu_kind is needed with gpus (e.g. gpu_kind: rtx4090)")
        return self

    @property
    def partition(self) -> str:
        return self.gpu_kind if self.gpus else CPU_PARTITION

    @property
    def device_files(self) -> str:
        return self.gpu_files or (f"/dev/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else "/dev/nvidia0")


#: Slurm account and user names: what sacctmgr accepts and Unix allows (lower case, no spaces)
_ACCOUNT = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


class MemberDefaults(StrictModel):
    """What a member gets for a value they do not name."""

    gpu_limit: int | None = Field(default=None, ge=0, description="GPUs one member may hold at once; none: no limit")
    fairshare: int = Field(default=1, ge=1, description="the member's share of the lab (relative to the others)")


class MemberSettings(StrictModel):
    """A lab member: a Unix name, the projects whose accounts they charge (the first is their default)."""

    user: str = Field(description="the member's Unix user name")
    projects: list[str] = Field(min_length=1, description="the projects whose accounts they charge; the first is their default")
    gpu_limit: int | None = Field(default=None, ge=0, description="GPUs they may hold at once (default: defaults.gpu_limit)")
    fairshare: int | None = Field(default=None, ge=1, description="their share of the lab (default: defaults.fairshare)")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER.match(v):
            raise ValueError(f"{v!r} is not a Unix user name (lower-case letters, digits, '_', '-', '.')")
        return v

    @field_validator("projects")
    @classmethod
    def _projects(cls, v: list[str]) -> list[str]:
        for name in v:
            check_account(name)
        return v


class ProjectLimit(StrictModel):
    """A project's own limit: the GPUs all its members' jobs may hold together."""

    gpu_limit: int | None = Field(default=None, ge=0, description="GPUs all the project's jobs together may hold (the account's GrpTRES); null: no limit")
    fairshare: int = Field(default=1, ge=1, description="the project account's share of the lab")


def check_account(name: str) -> str:
    """``name`` if Slurm accepts it as an account name, else a ValueError saying why."""
    if not _ACCOUNT.match(name):
        raise ValueError(f"{name!r} cannot be a Slurm account (lower-case letters, digits, '-' or '_', "
                         f"at most 63 characters)")
    if name == "root":
        raise ValueError("'root' is Slurm's own top account")
    return name


class AccountingSettings(StrictModel):
    """slurmdbd + MariaDB: who is in the lab, their limits and shares, and where the database is."""

    members: list[MemberSettings] = Field(default_factory=list, description="the lab's members, their projects, GPU limits and shares")
    defaults: MemberDefaults = Field(default_factory=MemberDefaults, description="limits and share of a member who names none")
    projects: dict[str, ProjectLimit] = Field(default_factory=dict, description="a project's own limit and share, by project name")
    deny_on_limit: bool = Field(default=False, description="refuse a job over a per-user limit instead of queueing it")
    interactive_time: str = Field(default="02:00:00", description="time limit of salloc / srun --pty jobs")
    gpu_billing: float = Field(default=4.0, gt=0, description="what a GPU-hour costs in CPU-hours (fair-share)")
    half_life: str = Field(default="7-0", description="PriorityDecayHalfLife: how fast past use is forgotten")
    dbd_host: str | None = Field(default=None, description="the machine running slurmdbd (default: controller)")
    dbd_port: int = Field(default=6819, ge=1, le=65535, description="slurmdbd's port (DbdPort)")
    storage_host: str = Field(default="localhost", description="the MariaDB server slurmdbd stores accounting in")
    storage_port: int = Field(default=3306, ge=1, le=65535, description="MariaDB's port")
    storage_user: str = Field(default="slurm", description="the MariaDB user slurmdbd connects as")
    storage_db: str = Field(default="slurm_acct_db", description="the MariaDB database")
    password_file: Path | None = Field(default=None, description="the database password (default: generated once)")
    dbd_extra: dict[str, str] = Field(default_factory=dict, description="further slurmdbd.conf keys, as given")

    @field_validator("interactive_time", "half_life")
    @classmethod
    def _time(cls, v: str) -> str:
        return check_time(v)

    @field_validator("projects")
    @classmethod
    def _project_names(cls, v: dict[str, ProjectLimit]) -> dict[str, ProjectLimit]:
        for name in v:
            check_account(name)
        return v

    @model_validator(mode="after")
    def _unique(self) -> AccountingSettings:
        users = [m.user for m in self.members]
        dup = sorted({u for u in users if users.count(u) > 1})
        if dup:
            raise ValueError(f"members: {dup[0]!r} is listed twice")
        return self

    def gpu_limit(self, member: MemberSettings) -> int | None:
        return member.gpu_limit if member.gpu_limit is not None else self.defaults.gpu_limit

    def fairshare(self, member: MemberSettings) -> int:
        return member.fairshare if member.fairshare is not None else self.defaults.fairshare

    def member(self, user: str) -> MemberSettings | None:
        return next((m for m in self.members if m.user == user), None)

    def accounts(self) -> list[str]:
        """One Slurm account per project a member names or a limit is given for, in first-seen order."""
        out: list[str] = []
        for name in [p for m in self.members for p in m.projects] + list(self.projects):
            if name not in out:
                out.append(name)
        return out


class SlurmSettings(StrictModel):
    """The whole Slurm section."""

    cluster_name: str = Field(default="det-lab", description="Slurm's ClusterName (accounting records are kept under it)")
    controller: str = Field(default_factory=lambda: socket.gethostname().split(".")[0],
                            description="the machine running slurmctld",
                            json_schema_extra={"doc_default": "this machine's short host name"})
    controller_addr: str | None = Field(default=None, description="the controller's address when its name does not resolve")
    nodes: list[NodeSettings] = Field(default_factory=lambda: [
        NodeSettings(name=socket.gethostname().split(".")[0], cpus=os.cpu_count() or 1)],
        description="the machines Slurm runs jobs on; one partition per GPU kind",
        json_schema_extra={"doc_default": "this machine, with its CPUs and no GPU"})
    default_partition: str | None = Field(default=None, description="default: the first node's partition")
    max_time: str = Field(default="7-00:00:00", description="the longest time limit a job may ask for (partitions' MaxTime)")
    default_time: str = Field(default="1-00:00:00", description="the time limit of a job that asks for none (DefaultTime)")
    signal_seconds: int = Field(default=300, ge=30,
                                description="how long before the time limit a job is told to checkpoint")
    images: dict[str, Path] = Field(default_factory=dict, description=(
        "an experiment config's environment.image (or 'default') -> the Apptainer .sif its trials run in"))
    binds: list[Path] = Field(default_factory=list, description="extra paths bound into the images")
    slurmctld_port: int = Field(default=6817, ge=1, le=65535, description="slurmctld's port")
    slurmd_port: int = Field(default=6818, ge=1, le=65535, description="slurmd's port")
    slurm_user: str = Field(default="slurm", description="the Unix user slurmctld runs as")
    state_dir: Path = Field(default=Path("/var/spool/slurmctld"), description="slurmctld's state directory (StateSaveLocation)")
    spool_dir: Path = Field(default=Path("/var/spool/slurmd"), description="slurmd's spool directory (SlurmdSpoolDir)")
    log_dir: Path = Field(default=Path("/var/log/slurm"), description="where the daemons write their logs")
    extra: dict[str, str] = Field(default_factory=dict, description="further slurm.conf keys, as given")
    accounting: AccountingSettings | None = Field(default=None, description=(
        "slurmdbd accounting: members, GPU limits, fair-share (none: accounting_storage/none)"))
    source: Path | None = Field(default=None, exclude=True)

    @field_validator("max_time", "default_time")
    @classmethod
    def _time(cls, v: str) -> str:
        return check_time(v)

    @field_validator("images")
    @classmethod
    def _images(cls, v: dict[str, Path]) -> dict[str, Path]:
        for path in v.values():
            if not path.is_absolute():
                raise ValueError(f"{str(path)!r} must be an absolute path (the same on every node)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SlurmSettings:
        if not self.nodes:
            raise ValueError("nodes: at least one node is needed")
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"nodes: {sorted(dup)[0]!r} is listed twice")
        if self.default_partition and self.default_partition not in self.partitions():
            raise ValueError(f"default_partition: {self.default_partition!r} is not a partition "
                             f"(partitions: {', '.join(self.partitions())})")
        return self

    def partitions(self) -> dict[str, list[NodeSettings]]:
        """One partition per GPU kind (``cpu`` for nodes without GPUs), in the nodes' order."""
        out: dict[str, list[NodeSettings]] = {}
        for node in self.nodes:
            out.setdefault(node.partition, []).append(node)
        return out

    @property
    def default(self) -> str:
        return self.default_partition or self.nodes[0].partition


def default_slurm_file(lab: LabSettings) -> Path:
    """``<data_root>/.det-lab/slurm.yaml``: shared by every machine."""
    return lab.data_root / ".det-lab" / SLURM_FILE


def load_slurm_settings(lab: LabSettings, path: Path | str | None = None) -> SlurmSettings:
    """Load and validate the Slurm section; ``path`` (or ``$DET_LAB_SLURM_CONFIG``) overrides the default."""
    file, raw = read_section_file(path or env_value("DET_LAB_SLURM_CONFIG"), default_slurm_file(lab),
                                  SlurmConfigError, "Slurm config")
    where = str(file) if file else "built-in Slurm defaults"
    try:
        return SlurmSettings.model_validate({**raw, "source": file})
    except ValidationError as exc:
        err = exc.errors()[0]
        key = _key_name(err["loc"], raw)
        if err["type"] == "extra_forbidden" and len(err["loc"]) > 1:
            raise SlurmConfigError(f"{where}: unknown key {key!r}") from None
        if err["type"] == "extra_forbidden":
            known = ", ".join(k for k, f in SlurmSettings.model_fields.items() if not f.exclude)
            raise SlurmConfigError(f"{where}: unknown key {key!r} (expected one of: {known})") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise SlurmConfigError(f"{where}: {key + ': ' if key else ''}{msg}") from None


def _key_name(loc: tuple, raw: dict) -> str:
    """A pydantic error location as the config's key, a member by its user name: accounting.members[bob].gpu_limit."""
    parts: list[str] = []
    node: object = raw
    for p in loc:
        if isinstance(p, int) and parts and parts[-1] == "members" and isinstance(node, list) and p < len(node):
            item = node[p]
            label = item.get("user") if isinstance(item, dict) else None
            parts[-1] += f"[{label}]" if label else f"[{p}]"
            node = item
            continue
        parts.append(str(p))
        node = node.get(p) if isinstance(node, dict) else None
    return ".".join(parts)
