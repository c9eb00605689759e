"""The lab configuration: one validated file shared by every det_lab command.

Where it comes from, first match wins:

1. ``$DET_LAB_CONFIG`` (must exist when set),
2. ``./det-lab.yaml`` in the current directory,
3. ``$XDG_CONFIG_HOME/det-lab/lab.yaml`` (``~/.config/det-lab/lab.yaml``),
4. ``/etc/det-lab/lab.yaml`` (the usual place on a team's machines),
5. none: built-in defaults.

Environment variables override single keys of whatever file was found (see ``ENV_OVERRIDES``).
Every ``DET_LAB_*`` variable det_lab reads is declared and parsed here (``ENV_VARS``,
:func:`env_value`); :func:`load_settings` checks all that are set, so a bad value is one error
before any command does anything. Every problem is raised as :class:`LabConfigError`, whose
message is one line naming the file (or variable) and the key.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator

from det_lab.errors import UserError
from det_lab.watchdog_settings import WatchdogSettings

DEFAULT_DATA_ROOT = Path("/mnt/data")
SYSTEM_CONFIG = Path("/etc/det-lab/lab.yaml")
LOCAL_CONFIG_NAME = "det-lab.yaml"
BUILTIN_PROJECTS = ("vla", "3dgs", "isaac")
DEFAULT_QUOTA_BYTES = 500 * 2**30

#: environment variable -> dotted key it overrides
ENV_OVERRIDES: dict[str, str] = {
    "DET_LAB_DATA_ROOT": "data_root",
    "DET_LAB_GROUP": "group",
    "DET_LAB_TRACKING": "tracking.backend",
    "MLFLOW_TRACKING_URI": "tracking.mlflow_uri",
    "DET_LAB_AIM_REPO": "tracking.aim_repo",
    "DET_MASTER": "master_url",  # what the det CLI uses, and what Determined sets inside tasks
    "DET_LAB_MASTER": "master_url",  # wins over DET_MASTER
}

_PROJECT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_SIZE = re.compile(r"\s*(\d+(\.\d+)?|\.\d+)\s*([a-zA-Z]{1,3})?\s*")


class LabConfigError(UserError, ValueError):
    """A lab configuration problem, phrased as one line for the user."""


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> int | float:
        value = kind(text)  # ValueError for "soon", "1.5" as int ...
        if value <= 0:
            raise ValueError
        return value
    parse.__doc__ = f"a positive {'whole ' if kind is int else ''}number"
    return parse


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError
        return text
    parse.__doc__ = "one of " + ", ".join(values)
    return parse


def _text(text: str) -> str:
    """any text"""
    return text


def _existing_dir(text: str) -> Path:
    """an existing directory"""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ValueError
    return path


def _path(text: str) -> Path:
    """a path"""
    return Path(text).expanduser()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable det_lab reads: how to parse it and what it is for (docs/reference/environment.md)."""

    parse: Callable[[str], Any]
    help: str
    bad_example: str | None = None  # a value the parser refuses (the tests try each)


#: every DET_LAB_* variable det_lab reads (and the non-DET_LAB ones it honours), parsed here only
ENV_VARS: dict[str, EnvVar] = {
    "DET_LAB_CONFIG": EnvVar(_path, "lab config file (must exist when set); same as `--config`"),
    "DET_LAB_DATA_ROOT": EnvVar(_path, "overrides `data_root`: the shared volume"),
    "DET_LAB_GROUP": EnvVar(_text, "overrides `group`: Unix group owning the volume"),
    "DET_LAB_TRACKING": EnvVar(_choice("mlflow", "aim", "both", "none"), "overrides `tracking.backend`",
                               "tensorboard"),
    "DET_LAB_AIM_REPO": EnvVar(_text, "overrides `tracking.aim_repo` (aim://host:port or an absolute path)",
                               "relative/repo"),
    "DET_LAB_MASTER": EnvVar(_text, "overrides `master_url` (wins over `DET_MASTER`)", "ftp://host"),
    "DET_MASTER": EnvVar(_text, "overrides `master_url`; what the det CLI and Determined tasks use"),
    "MLFLOW_TRACKING_URI": EnvVar(_text, "overrides `tracking.mlflow_uri`", "nonsense"),
    "DET_LAB_LOCK_LIFETIME": EnvVar(_positive(int), "seconds a volume lock outlives a holder that stopped "
                                    "refreshing it (a machine lost mid-pull), and a GPU lease whose holder stopped "
                                    "its heartbeat is shown silent to other hosts; default 60", "soon"),
    "DET_LAB_GC_GRACE": EnvVar(_positive(float), "seconds `det-lab data gc` leaves an object just written to the "
                               "shared cache alone (a pull may still be publishing it); default 3600", "-5"),
    "DET_LAB_LIST_WORKERS": EnvVar(_positive(int), "processes `det-lab runs list` reads runs with, when it has "
                                   "2,000 or more to read (1: none); default one per CPU, at most 8", "many"),
    "DET_LAB_TEMPLATES": EnvVar(_existing_dir, "directory of experiment templates for `det-lab run` "
                                "(default: the installed experiment_templates/)", "/nonexistent/templates"),
    "DET_LAB_CLUSTER_CONFIG": EnvVar(_path, "cluster config file; same as `--cluster-config`"),
    "DET_LAB_CLUSTER_DIR": EnvVar(_path, "where cluster secrets and rendered files are kept"),
    "DET_LAB_GPU_KIND": EnvVar(_text, "set in cluster tasks: the agent's GPU kind (e.g. rtx4090)"),
    "DET_LAB_LOCAL_CACHE": EnvVar(_path, "set in cluster tasks: the agent's local-disk cache mounted into every "
                                  "task (`tasks.local_cache`; gsplat's CUDA build in torch_extensions/)"),
    "DET_LAB_ATTEMPT": EnvVar(_text, "set by the Slurm driver for its trial: <epoch>:<token> of the job start "
                              "the trial belongs to (a stale copy writes nothing: runs/fence.py)"),
    "DET_LAB_FENCE_POLL": EnvVar(_positive(float), "seconds between a Slurm trial's checks that it is still "
                                 "its run's current attempt; default 5", "0"),
    "DET_LAB_SEARCHER_POLL": EnvVar(_positive(float), "seconds between a cluster trial's looks at whether "
                                    "the searcher stopped it early (adaptive_asha); default 10", "0"),
    "DET_LAB_UNTESTED_HARNESS": EnvVar(_text, "set in an experiment's environment_variables: its tasks go on "
                                       "under a master whose harness is not Determined 0.38 (the startup hook "
                                       "stops them otherwise; docs/admin/fork.md)"),
    "DET_LAB_HARNESS_WHEELS": EnvVar(_path, "where the startup hook looks for the master's harness wheel "
                                     "(default /opt/determined/wheels, where Determined puts it)"),
    "DET_LAB_NOTEBOOK_OUT": EnvVar(_path, "where notebooks write plots (default ./notebook-out)"),
    "DET_LAB_NOTEBOOK_CONFIG": EnvVar(_path, "experiment config the notebooks submit"),
    "DET_LAB_NOTEBOOK_TRACKER": EnvVar(_choice("mlflow", "aim", "both"), "tracker the notebooks read (both: MLflow)",
                                       "wandb"),
    "DET_LAB_DET_TEMPLATE": EnvVar(_text, "Determined config template the notebooks submit with "
                                   "(default det-lab; empty for none)"),
    "DET_LAB_RL_PREEMPT_TIMEOUT": EnvVar(_positive(float), "seconds the rsl_rl supervisor waits for a "
                                         "preempted learner to save (default 90)", "-1"),
    "DET_LAB_RL_STOP_FILE": EnvVar(_path, "set by the rsl_rl supervisor for its learner: stop after "
                                   "the next save once this file exists"),
    "DET_LAB_STANDIN_CRASH_AT": EnvVar(_positive(int), "test hook: the Isaac stand-in raises at this "
                                       "iteration", "ten"),
    "DET_LAB_LOCAL_RUN": EnvVar(_path, "set by `det-lab run --local` for its trial: the run's run.json"),
    "DET_LAB_CODE_COMMIT": EnvVar(_text, "set by `det-lab run --local` for its trial: the code's git commit"),
    "DET_LAB_RUN_PID": EnvVar(_positive(int), "set by `det-lab run --local` for its trial: the pid of `det-lab run` "
                              "(the trial stops when it is gone)", "abc"),
    "DET_LAB_GPU_SAMPLE_INTERVAL": EnvVar(_positive(float), "seconds between two samples of a trial's own GPUs "
                                          "(its GPU efficiency; default 10)", "often"),
    "DET_LAB_SLURM_CONFIG": EnvVar(_path, "Slurm config file; same as `--slurm-config`"),
    "DET_LAB_GPU_STATE_DIR": EnvVar(_path, "this machine's GPU leases and queue, on local disk "
                                    "(default /tmp/det-lab-gpus; the same for every user of the machine)"),
    "DET_LAB_CODE_REPO": EnvVar(_text, "the code repository a run's lineage records (default: the work tree's "
                                "`origin` URL, else its path)"),
    "DET_LAB_WHEELS": EnvVar(_path, "read by the templates' startup hooks in a task: a directory of wheels to "
                             "install det_lab from (then `<data root>/.det-lab/wheels`)"),
    "DET_LAB_PIP_SPEC": EnvVar(_text, "read by the 3DGS template's startup hook in a task: what to `pip install` "
                               "when the image lacks det_lab (a wheel on the volume or a git URL)"),
    "DET_LAB_NOTEBOOK_PROJECT": EnvVar(_text, "project notebook 03 compares runs of (default vla)"),
    "DET_LAB_NOTEBOOK_HPARAM": EnvVar(_text, "hyperparameter notebook 03 plots the metric against (default lr)"),
    "DET_LAB_NOTEBOOK_METRIC": EnvVar(_text, "metric notebook 03 compares (default validation/val_action_l1)"),
    "HF_HOME": EnvVar(_path, "read only for where HF_DATASETS_CACHE defaults to in local and Slurm runs: every run "
                      "and task gets HF_HOME=<data root>/models/hf, the model store (det_lab.models)"),
    "HF_DATASETS_CACHE": EnvVar(_path, "kept for local and Slurm runs (default: the datasets/ of HF_HOME as it was "
                                "before det_lab pointed HF_HOME at the model store); cluster tasks: the agent's "
                                "local cache"),
    "DET_LAB_GPU_LEASE": EnvVar(_text, "set by `det-lab run --local` for its trial: the id of the GPU lease it "
                                "holds (with CUDA_VISIBLE_DEVICES)"),
}


def env_value(name: str, default: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """``name`` from the environment, parsed as declared in ``ENV_VARS``; ``default`` when unset
    or empty. An unparseable value is a one-line :class:`LabConfigError` naming the variable."""
    env = os.environ if env is None else env
    text = env.get(name)
    if text is None or text == "":
        return default
    var = ENV_VARS[name]
    try:
        return var.parse(text)
    except ValueError:
        key = f"{ENV_OVERRIDES[name]}: " if name in ENV_OVERRIDES else ""
        raise LabConfigError(
            f"environment variable {name}={text}: {key}must be {var.parse.__doc__}; fix or unset it"
        ) from None


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Parse every declared variable that is set, so a bad one fails before any work."""
    env = os.environ if env is None else env
    for name in ENV_VARS:
        env_value(name, env=env)


class StrictModel(BaseModel):
    """A config section: unknown keys are errors (a typo must not be ignored), values immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ProjectSettings(StrictModel):
    """A project on the shared volume (``datasets/<name>``, ``outputs/<name>`` ...)."""

    quota: ByteSize = Field(default=ByteSize(DEFAULT_QUOTA_BYTES), description="the most the project may hold on the volume (its datasets, shared cache, snapshots, checkpoints and outputs; hard links once); checked before every pull")
    description: str = Field(default="", description="what the project is, for listings")

    @field_validator("quota", mode="before")
    @classmethod
    def _whole_size(cls, v: Any) -> Any:
        # pydantic parses only a prefix of the text: "1.5.5GiB" would be 1 byte
        if isinstance(v, str) and not _SIZE.fullmatch(v):
            raise ValueError(f"{v!r} is not a size such as 500GiB, 1.5TiB or 100GB")
        return v

    @field_validator("quota")
    @classmethod
    def _positive(cls, v: ByteSize) -> ByteSize:
        if v <= 0:
            raise ValueError("must be a positive size such as 500GiB")
        return v


class TrackingSettings(StrictModel):
    """Where metrics are mirrored. ``None`` URIs mean the local default (see the tracking docs)."""

    backend: Literal["mlflow", "aim", "both", "none"] = Field(default="mlflow", description="where every run's metrics, parameters and lineage are mirrored")
    mlflow_uri: str | None = Field(default=None, description="MLflow tracking URI (http://host:5000 or sqlite:///path); null: a SQLite store in ~/.local/share/det-lab/")
    aim_repo: str | None = Field(default=None, description="Aim repository: aim://host:53800 (an aim server) or an absolute path on local disk, never on NFS; null: ~/.local/share/det-lab/aim")

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, v: str | None) -> str | None:
        if v is None:
            return v
        scheme = urlparse(v).scheme
        if scheme not in {"http", "https", "sqlite", "file", "postgresql", "mysql"}:
            raise ValueError(f"{v!r} is not an MLflow tracking URI (http://host:5000 or sqlite:///path)")
        return v

    @field_validator("aim_repo")
    @classmethod
    def _aim_repo(cls, v: str | None) -> str | None:
        if v is None or v.startswith("/") or v.startswith("~"):
            return v
        parsed = urlparse(v)
        if parsed.scheme != "aim" or not parsed.hostname or not parsed.port:
            raise ValueError(f"{v!r} is neither aim://host:port nor an absolute path")
        return v

    @property
    def uses_mlflow(self) -> bool:
        return self.backend in ("mlflow", "both")

    @property
    def uses_aim(self) -> bool:
        return self.backend in ("aim", "both")


class LabSettings(StrictModel):
    """The whole lab configuration."""

    data_root: Path = Field(default=DEFAULT_DATA_ROOT, description="the shared NFS volume, mounted at the same path on every machine (relative to the config file when relative)")
    group: str | None = Field(default=None, description="Unix group that owns the shared volume")
    projects: dict[str, ProjectSettings] = Field(
        default_factory=lambda: {name: ProjectSettings() for name in BUILTIN_PROJECTS},
        description="the projects on the volume, by name; vla, 3dgs and isaac always exist",
    )
    tracking: TrackingSettings = Field(default=TrackingSettings(), description="experiment tracking: MLflow, Aim, both or none")
    master_url: str | None = Field(default=None, description="the Determined master (http://host:8080); null: no master, local and Slurm runs only")
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings,
                                       description="the idle-GPU watchdog (det-lab watchdog)")
    source: Path | None = Field(default=None, exclude=True, description="file it was loaded from")

    @field_validator("data_root")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        v = v.expanduser()
        if not v.is_absolute():
            raise ValueError(f"{str(v)!r} must be an absolute path")
        return v

    @field_validator("projects")
    @classmethod
    def _project_names(cls, v: dict[str, ProjectSettings]) -> dict[str, ProjectSettings]:
        for name in v:
            if not _PROJECT_NAME.match(name):
                raise ValueError(
                    f"project name {name!r} must be lower-case letters, digits, '-' or '_'"
                )
        return v

    @field_validator("master_url")
    @classmethod
    def _master_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parsed = urlparse(v if "://" in v else f"http://{v}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{v!r} is not a master URL such as http://master-host:8080")
        return f"{parsed.scheme}://{parsed.netloc}"

    def project(self, name: str) -> ProjectSettings:
        """The settings of project ``name``; a clear error for an unknown one."""
        try:
            return self.projects[name]
        except KeyError:
            known = ", ".join(sorted(self.projects))
            raise LabConfigError(f"unknown project {name!r} (known: {known})") from None


def find_config_file(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path | None:
    """The lab config file that applies, following the documented search order."""
    env = os.environ if env is None else env
    explicit = env.get("DET_LAB_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            hint = (" (in a Determined task: the lab config the master machine publishes on the volume; run "
                    "'det-lab cluster up' or 'det-lab cluster config --out DIR' there)"
                    if env.get("DET_TASK_ID") else "")
            raise LabConfigError(f"DET_LAB_CONFIG={explicit}: no such file{hint}")
        return path
    xdg = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    for candidate in ((cwd or Path.cwd()) / LOCAL_CONFIG_NAME, xdg / "det-lab" / "lab.yaml", SYSTEM_CONFIG):
        if candidate.is_file():
            return candidate
    return None


def load_settings(
    path: Path | str | None = None, env: Mapping[str, str] | None = None
) -> LabSettings:
    """Load, merge and validate the lab configuration.

    ``path`` overrides the search; ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    check_environment(env)
    file = Path(path).expanduser() if path is not None else find_config_file(env)
    raw: dict[str, Any] = read_yaml_mapping(file, LabConfigError) if file else {}
    if file and isinstance(raw.get("data_root"), str):
        # relative data roots in a file are relative to that file
        raw["data_root"] = str((file.parent / Path(raw["data_root"]).expanduser()).absolute())
    if "projects" in raw and isinstance(raw["projects"], dict):
        # the built-in projects always exist; the file may change their quotas or add more
        raw["projects"] = {**{p: {} for p in BUILTIN_PROJECTS}, **raw["projects"]}
    where = str(file) if file else "built-in defaults"
    _validate(raw, lambda key: f"{where}: {key}")

    for var, key in ENV_OVERRIDES.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        if key == "data_root":
            value = str(Path(value).expanduser().absolute())
        _set_dotted(raw, key, value)
        _validate(raw, lambda k, var=var, value=value: f"environment variable {var}={value}: {k}")
    return LabSettings.model_validate({**raw, "source": file})


def check_writable(*dirs: Path) -> None:
    """Raise :class:`LabConfigError` unless a file can be created in each of ``dirs`` (or, for one
    not made yet, its nearest existing parent): a read-only mount, root_squash or a missing group
    write bit all show up here, before any work starts."""
    for d in dirs:
        while not d.is_dir() and d.parent != d:
            d = d.parent
        try:
            fd, probe = tempfile.mkstemp(prefix=".det-lab-probe-", dir=d)
        except OSError as exc:
            raise LabConfigError(
                f"{d} is not writable ({exc.strerror}): remount the data volume read-write or fix its "
                "permissions ('det-lab doctor' checks both), or point data_root / DET_LAB_DATA_ROOT "
                "at a writable volume"
            ) from None
        os.close(fd)
        os.unlink(probe)


def read_section_file(path: Path | str | None, default: Path, error: type[Exception],
                      what: str) -> tuple[Path | None, dict]:
    """A config section's file and its mapping: ``path`` when given (it must exist), else
    ``default`` when it exists, else none (``{}``: the built-in defaults)."""
    if path is not None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise error(f"{file}: no such {what} file")
        return file, read_yaml_mapping(file, error)
    return (default, read_yaml_mapping(default, error)) if default.is_file() else (None, {})


def read_yaml_mapping(file: Path, error: type[Exception] = LabConfigError) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; every problem is one line raised as ``error``."""
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{file}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{file}: not UTF-8 text (byte {exc.object[exc.start]:#x} at offset {exc.start}); "
                    "save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{file}{at}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{file}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def _validate(raw: dict[str, Any], where) -> None:
    try:
        LabSettings.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {key!r}"
            known = _known_keys(err["loc"][:-1])
            if known:
                msg += f" (expected one of: {', '.join(known)})"
            raise LabConfigError(where(msg)) from None
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        if isinstance(given, (str, int, float, bool)) and repr(given) not in msg:
            msg += f" (got {given!r})"
        raise LabConfigError(where(f"{key}: {msg}")) from None


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = LabSettings
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:  # a dict key such as a project name
            if model is LabSettings:
                return []
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif str(part) == "projects":
            model = ProjectSettings
    return [k for k, f in model.model_fields.items() if not f.exclude]


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[leaf] = value
