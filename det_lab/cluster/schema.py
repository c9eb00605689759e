"""Structural validation of master.yaml and agent.yaml against the documented 0.38 fields.

Determined publishes JSON schemas only for *experiment* configs (``schemas/expconf/v0``); the
master and agent configs are Go structs (``master/internal/config/config.go``,
``agent/internal/options/options.go``) with no published schema, so this module encodes the fields
of Determined 0.38.1's ``docs/reference/deploy/master-config-reference.rst`` and
``agent-config-reference.rst`` as a small schema plus the cross-field rules the master enforces at
startup. Every problem is one line:
``master.yaml: resource_pools[1].pool_name: duplicate pool 'gpu'``.

Unknown keys are errors, as they are to Determined: the master decodes master.yaml's top level
with ``DisallowUnknownFields`` (``master/cmd/determined-master/root.go`` ``getConfig`` ~l.177),
and ``resource_manager``, its ``scheduler`` and ``checkpoint_storage`` through
``master/pkg/union/unmarshal.go``, which refuses keys outside the chosen type too: the master does
not start. The agent decodes its file with ``DisallowUnknownFields`` as well. Only
``task_container_defaults`` is decoded leniently (its own ``UnmarshalJSON``,
``master/pkg/model/task_container_defaults.go`` ~l.80), where a typo would silently drop a
setting, so det_lab reports it there too. The top level lists every key of 0.38.1's ``Config``
(``master/internal/config/config.go`` ~l.173-206, ``resource_config.go`` ~l.28-35, and the old
``scheduler``/``provisioner`` that ``shimOldRMConfig`` still accepts); those det_lab does not
render are checked no deeper.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

PROPAGATIONS = {"rprivate", "private", "rshared", "shared", "rslave", "slave"}
SHARED_FS_CONTAINER_PATH = "/determined_shared_fs"


@dataclass(frozen=True)
class Obj:
    """A mapping with known keys; ``required`` keys must be present and non-null."""

    fields: dict[str, Any]
    required: frozenset[str] = field(default_factory=frozenset)
    open: bool = False  # free-form values (e.g. metadata)


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class OneOf:
    options: tuple[Any, ...]


def _req(*names: str) -> frozenset[str]:
    return frozenset(names)


STR, INT, BOOL = (str,), (int,), (bool,)
ENV_LIST = OneOf((ListOf(STR), Obj({k: ListOf(STR) for k in ("cpu", "cuda", "gpu", "rocm")})))
IMAGE = OneOf((STR, Obj({k: STR for k in ("cpu", "cuda", "gpu", "rocm")})))
BIND_MOUNT = Obj({"host_path": STR, "container_path": STR, "read_only": BOOL, "propagation": STR},
                 _req("host_path", "container_path"))
TASK_CONTAINER_DEFAULTS = Obj({
    "shm_size_bytes": INT, "network_mode": STR, "dtrain_network_interface": STR,
    "nccl_port_range": STR, "gloo_port_range": STR, "image": IMAGE,
    "environment_variables": ENV_LIST, "bind_mounts": ListOf(BIND_MOUNT), "work_dir": STR,
    "force_pull_image": BOOL,
    "registry_auth": Obj({"username": STR, "password": STR, "serveraddress": STR, "email": STR}),
    "add_capabilities": ListOf(STR), "drop_capabilities": ListOf(STR), "devices": ListOf(Obj({}, open=True)),
    "startup_hook": STR, "log_policies": ListOf(Obj({}, open=True)), "preemption_timeout": INT,
    **{k: Obj({}, open=True) for k in ("cpu_pod_spec", "gpu_pod_spec", "checkpoint_gc_pod_spec", "slurm", "pbs",
                                       "kubernetes")},
})
# numa_packing: the community fork's 0.42+ (a 0.38.1 master refuses it: ClusterSettings checks the version)
SCHEDULER = Obj({"type": STR, "fitting_policy": STR, "allow_heterogeneous_fits": BOOL,
                 "preemption": BOOL, "default_priority": INT, "numa_packing": BOOL}, _req("type"))
TASK_USER = Obj({"uid": INT, "gid": INT, "user": STR, "group": STR}, _req("uid", "gid", "user", "group"))
MASTER = Obj({
    "config_file": STR, "port": INT, "root": STR, "cluster_name": STR,
    "log": Obj({"level": STR, "color": BOOL}),
    "db": Obj({"user": STR, "password": STR, "host": STR, "port": INT, "name": STR,
               "ssl_mode": STR, "ssl_root_cert": STR}, _req("user", "host", "port", "name")),
    "tensorboard_timeout": INT, "notebook_timeout": INT, "launch_error": BOOL, "enable_cors": BOOL,
    "security": Obj({
        "initial_user_password": STR, "default_task": TASK_USER,
        "tls": Obj({"cert": STR, "key": STR}),
        "ssh": Obj({"rsa_key_size": INT, "key_type": STR}),
        "authz": Obj({}, open=True), "token": Obj({}, open=True),
    }),
    "checkpoint_storage": Obj({
        "type": STR, "host_path": STR, "storage_path": STR, "propagation": STR,
        "container_path": STR, "checkpoint_path": STR, "tensorboard_path": STR,
        "save_experiment_best": INT, "save_trial_best": INT, "save_trial_latest": INT,
    }, _req("type")),
    "task_container_defaults": TASK_CONTAINER_DEFAULTS,
    "resource_manager": Obj({
        "type": STR, "cluster_name": STR, "scheduler": SCHEDULER,
        "default_compute_resource_pool": STR, "default_aux_resource_pool": STR,
        "no_default_resource_pools": BOOL, "require_authentication": BOOL, "client_ca": STR,
        "metadata": Obj({}, open=True),
    }, _req("type")),
    "resource_pools": ListOf(Obj({
        "pool_name": STR, "description": STR, "max_aux_containers_per_agent": INT,
        "agent_reconnect_wait": STR, "task_container_defaults": TASK_CONTAINER_DEFAULTS,
        "scheduler": SCHEDULER,
    }, _req("pool_name"))),
    "telemetry": Obj({"enabled": BOOL, "otel_enabled": BOOL, "otel_endpoint": STR}),
    "observability": Obj({"enable_prometheus": BOOL}),
    "logging": Obj({"type": STR, "host": STR, "port": INT, "security": Obj({}, open=True)}),
    "retention_policy": Obj({"log_retention_days": INT, "schedule": STR}),
    "cache": Obj({"cache_dir": STR}),
    "webhooks": Obj({"signing_key": STR, "base_url": STR}),
    "feature_switches": ListOf(STR),
    "reserved_ports": ListOf(INT),
    "additional_resource_managers": ListOf(Obj({}, open=True)),
    # valid in 0.38.1, not rendered by det_lab: accepted, not checked further
    **{k: Obj({}, open=True) for k in ("ui_customization", "__internal", "scim", "saml", "oidc", "det_cloud",
                                       "integrations", "scheduler", "provisioner")},
}, _req("db", "checkpoint_storage"))
AGENT = Obj({
    "master_host": STR, "master_port": INT, "agent_id": STR, "resource_pool": STR,
    "container_master_host": STR, "container_master_port": INT, "slot_type": STR, "visible_gpus": STR,
    "container_runtime": STR, "agent_reconnect_attempts": INT, "agent_reconnect_backoff": INT,
    "hooks": Obj({"on_connection_lost": ListOf(STR)}),
    "http_proxy": STR, "https_proxy": STR, "ftp_proxy": STR, "no_proxy": STR, "debug": BOOL,
    "log": Obj({"level": STR, "color": BOOL}),
    "security": Obj({"tls": Obj({"enabled": BOOL, "skip_verify": BOOL, "master_cert": STR,
                                 "master_cert_name": STR, "client_cert": STR, "client_key": STR})}),
    "api_enabled": BOOL, "bind_ip": STR, "bind_port": INT,
}, _req("master_host", "master_port"))


def _structure(value: Any, spec: Any, path: str) -> Iterator[str]:
    where = path or "(top level)"
    if isinstance(spec, tuple):
        # bool is an int in Python; a YAML `true` is never a valid port
        if not isinstance(value, spec) or (spec == INT and isinstance(value, bool)):
            yield f"{where}: expected {spec[0].__name__}, got {type(value).__name__} {value!r}"
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            yield f"{where}: expected a list, got {type(value).__name__}"
            return
        for i, item in enumerate(value):
            yield from _structure(item, spec.item, f"{path}[{i}]")
    elif isinstance(spec, OneOf):
        if all(list(_structure(value, o, path)) for o in spec.options):
            yield f"{where}: unexpected form {value!r}"
    elif isinstance(spec, Obj):
        if not isinstance(value, dict):
            yield f"{where}: expected a mapping, got {type(value).__name__}"
            return
        for key in sorted(spec.required):
            if value.get(key) is None:
                yield f"{_join(path, key)}: required"
        if spec.open:
            return
        for key, sub in value.items():
            if key not in spec.fields:
                yield f"{_join(path, key)}: unknown key"
            elif sub is not None:
                yield from _structure(sub, spec.fields[key], _join(path, key))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _absolute(path: Any) -> bool:
    return isinstance(path, str) and posixpath.isabs(path)


def master_errors(conf: dict[str, Any]) -> list[str]:
    """Every problem with a master config, each as one line (empty: valid)."""
    errors = list(_structure(conf, MASTER, ""))
    if errors:
        return errors
    old_rm = [k for k in ("scheduler", "provisioner") if k in conf]
    new_rm = [k for k in ("resource_manager", "resource_pools") if k in conf]
    if old_rm and new_rm:  # root.go shimOldRMConfig ~l.216
        errors.append(f"{old_rm[0]}: the pre-0.13 form cannot be used with {new_rm[0]} (the master refuses both "
                      f"at once); move it under resource_manager")
    if conf.get("port", 8080) != 8080:
        errors.append("port: det deploy local publishes container port 8080 only; "
                      "change the host port with master_port instead")
    if (conf.get("security") or {}).get("tls"):
        errors.append("security.tls: det deploy local cannot run a TLS master (health checks are plain "
                      "HTTP); put a TLS proxy in front (docs/admin/cluster.md)")
    cs = conf["checkpoint_storage"]
    if cs["type"] == "shared_fs":
        host = cs.get("host_path")
        if not _absolute(host):
            errors.append(f"checkpoint_storage.host_path: must be an absolute path, got {host!r}")
        sp = cs.get("storage_path")
        if sp is not None and _absolute(host):
            inside = posixpath.normpath(posixpath.join(host, sp))
            if inside != host and not inside.startswith(host.rstrip("/") + "/"):
                errors.append(f"checkpoint_storage.storage_path: {sp!r} is not under host_path {host}")
    errors += _task_defaults_errors(conf.get("task_container_defaults") or {}, "task_container_defaults")
    pools = conf.get("resource_pools")
    names: list[str] = []
    for i, pool in enumerate(pools or []):
        name = pool["pool_name"]
        if name in names:
            errors.append(f"resource_pools[{i}].pool_name: duplicate pool {name!r}")
        names.append(name)
        errors += _task_defaults_errors(pool.get("task_container_defaults") or {},
                                        f"resource_pools[{i}].task_container_defaults")
    defined = set(names) if pools else {"default"}
    rm = conf.get("resource_manager") or {}
    if rm and rm.get("type") != "agent":
        errors.append(f"resource_manager.type: det deploy local runs the agent resource manager, got {rm.get('type')!r}")
    for key in ("default_compute_resource_pool", "default_aux_resource_pool"):
        pool = rm.get(key, "default")
        if pool not in defined:
            errors.append(f"resource_manager.{key}: pool {pool!r} is not defined "
                          f"(defined: {', '.join(sorted(defined))})")
    sched = rm.get("scheduler") or {}
    if sched and sched.get("type") not in ("priority", "fair_share"):
        errors.append(f"resource_manager.scheduler.type: {sched.get('type')!r} is not supported in 0.38 (use priority)")
    if not 1 <= sched.get("default_priority", 42) <= 99:
        errors.append("resource_manager.scheduler.default_priority: must be 1-99")
    return errors


def _task_defaults_errors(tcd: dict[str, Any], path: str) -> list[str]:
    errors = []
    targets: set[str] = set()
    for i, m in enumerate(tcd.get("bind_mounts") or []):
        where = f"{path}.bind_mounts[{i}]"
        for key in ("host_path", "container_path"):
            if not _absolute(m[key]):
                errors.append(f"{where}.{key}: must be an absolute path, got {m[key]!r}")
        if m.get("propagation", "rprivate") not in PROPAGATIONS:
            errors.append(f"{where}.propagation: {m['propagation']!r} is not one of {', '.join(sorted(PROPAGATIONS))}")
        target = posixpath.normpath(m["container_path"])
        if target == SHARED_FS_CONTAINER_PATH:
            errors.append(f"{where}.container_path: {target} is where shared_fs checkpoint storage is mounted")
        if target in targets:
            errors.append(f"{where}.container_path: {target} is mounted twice")
        targets.add(target)
    return errors


def agent_errors(conf: dict[str, Any], master: dict[str, Any] | None = None) -> list[str]:
    """Every problem with an agent config, checked against ``master``'s pools when given."""
    errors = list(_structure(conf, AGENT, ""))
    if errors:
        return errors
    if not 1 <= conf["master_port"] <= 65535:
        errors.append(f"master_port: {conf['master_port']} is not a TCP port")
    if conf.get("slot_type", "auto") not in ("auto", "cuda", "gpu", "rocm", "cpu", "none"):
        errors.append(f"slot_type: {conf['slot_type']!r} is not one of auto, cuda, rocm, cpu, none")
    if master is not None:
        pools = [p["pool_name"] for p in master.get("resource_pools") or []] or ["default"]
        pool = conf.get("resource_pool", "default")
        if pool not in pools:
            errors.append(f"resource_pool: the master has no pool {pool!r} (pools: {', '.join(pools)}); "
                          "it would reject this agent")
    return errors


#: the fields of a notebook's config (Determined 0.38.1 ``master/pkg/model/command_config.go``)
NOTEBOOK_FIELDS = frozenset({"description", "bind_mounts", "environment", "resources", "entrypoint",
                             "tensorboard_args", "idle_timeout", "notebook_idle_type", "work_dir", "debug",
                             "pbs", "slurm"})


def notebook_template_errors(conf: dict[str, Any]) -> list[str]:
    """Problems of a notebook config template beyond what the expconf schema checks of its
    ``bind_mounts``/``environment``: unknown keys, an unparsable ``idle_timeout``, a bad idle type."""
    from det_lab.cluster.settings import NOTEBOOK_IDLE_TYPES, go_duration_seconds

    errors = [f"{k}: not a field of a notebook's config" for k in conf if k not in NOTEBOOK_FIELDS]
    timeout = conf.get("idle_timeout")
    if timeout is not None:
        try:
            go_duration_seconds(str(timeout))
        except ValueError as exc:
            errors.append(f"idle_timeout: {exc}")
    kind = conf.get("notebook_idle_type")
    if kind is not None and kind not in NOTEBOOK_IDLE_TYPES:
        errors.append(f"notebook_idle_type: {kind!r} is not one of {', '.join(NOTEBOOK_IDLE_TYPES)}")
    return errors
