"""The master stand-in's experiment-config handling: what Determined 0.38.1's ``parseCreateExperiment``
(master/internal/core_experiment.go:269-411) does to a submitted config before an experiment exists.

The order is the master's: parse the YAML and check it is sane (expconf/parse.go:22-44,
schemas/schema.go:30-38), refuse ``resources.slots`` (:279-281), merge the named template under it
(:284-291), fill the defaults (:293), refuse a managed experiment without an entrypoint (:313-315),
merge the pool's task-container defaults and the master's checkpoint storage in (:318-350,
tests/standin/task_config.py), default the priority (:353-356), fill the defaults again (:359), check
completeness (:372-374) and that the searcher is current (:377-379).

The schemas are Determined's own (``../shared/determined/schemas/expconf/v0`` beside the checkout,
judged by ``../shared/tools/validate_expconf.py``); where they are absent, det_lab's mirror of the
rules (det_lab.runs.validate) judges and only the defaults the harness reads are filled in.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import io
import json
import random
import tarfile
import time
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.standin.task_config import experiment_config

#: Determined's schemas and validator, when ../shared sits beside the checkout
SHARED = Path(__file__).resolve().parents[3] / "shared"
SCHEMA_DIR = SHARED / "determined" / "schemas" / "expconf" / "v0"
VALIDATOR = SHARED / "tools" / "validate_expconf.py"
EXPERIMENT_SCHEMA = "http://determined.ai/schemas/expconf/v0/experiment.json"
#: master/internal/config/resource_manager_config.go: the fair-share scheduler's default priority
DEFAULT_PRIORITY = 42
#: master/pkg/schemas/expconf/const.go (0.38.1): the default task images
CPU_IMAGE = "determinedai/pytorch-ngc-dev:0736b6d"
CUDA_IMAGE = "determinedai/pytorch-ngc-dev:0736b6d"
ROCM_IMAGE = "determinedai/environments:rocm-5.6-pytorch-1.3-tf-2.10-rocm-mpich-0736b6d"
#: expconf/log_pattern_config.go:20-33 and const.go: the default log policies
LOG_POLICIES = [{"name": "CUDA OOM", "pattern": ".*CUDA out of memory.*", "action": None},
                {"name": "ECC Error", "pattern": ".*uncorrectable ECC error encountered.*", "action": None}]
#: the defaults the harness reads, for when Determined's schemas are not beside the checkout
FALLBACK_DEFAULTS = {"max_restarts": 5, "debug": False, "data": {}, "bind_mounts": [], "labels": [],
                     "min_validation_period": {"batches": 0}, "min_checkpoint_period": {"batches": 0},
                     "perform_initial_validation": False, "checkpoint_policy": "best", "scheduling_unit": 100,
                     "records_per_epoch": 0, "preemption_timeout": None, "profiling": {"enabled": False}}


class ConfigError(Exception):
    """A config the master refuses: ``message`` is its error; ``code`` the gRPC code it reaches the
    gateway with (2, Unknown, for the plain errors parseCreateExperiment returns; 5 for NotFound)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@lru_cache(maxsize=1)
def _validator() -> ModuleType | None:
    if not (VALIDATOR.is_file() and SCHEMA_DIR.is_dir()):
        return None
    spec = importlib.util.spec_from_file_location("det_standin_validate_expconf", VALIDATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def _schemas() -> Any:
    mod = _validator()
    return None if mod is None else mod.SchemaSet(str(SCHEMA_DIR))


def config_errors(conf: Any, *, complete: bool = False) -> list[str]:
    """``<config>.path: problem`` lines, as schemas.GetRenderedErrors renders them (schema.go:30-55)."""
    schemas = _schemas()
    if schemas is not None:
        return _validator().render_go(schemas.errors(conf, EXPERIMENT_SCHEMA, complete=complete))  # type: ignore[union-attr]
    from det_lab.runs.validate import determined_errors
    return [] if complete else [f"<config>.{p}" for p in determined_errors(conf)]


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    schemas = _schemas()
    while isinstance(schema, dict) and ("$ref" in schema or "optionalRef" in schema):
        ref = schema.get("$ref") or schema.get("optionalRef")
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "optionalRef")}
        schema = {**schemas.schemas[ref], **{k: v for k, v in rest.items() if k == "default"}}
    return schema


def _union_member(schema: dict[str, Any], value: Any) -> dict[str, Any] | None:
    union = schema.get("union") or (schema.get("then") or {}).get("union")
    if not union:
        return None
    mod = _validator()
    for item in union["items"]:
        key = item.get("unionKey", "never")
        if key not in ("always", "never") and mod.evaluate_union_key(key, value):  # type: ignore[union-attr]
            return _resolve(item)
    return None


def _fill(value: Any, schema: dict[str, Any]) -> Any:
    """schemas.WithDefaults (master/pkg/schemas/defaults.go:27-140): a null or missing field takes the
    schema's default, then every object below is filled, a union by the member its key selects."""
    schema = _resolve(schema)
    if not isinstance(schema, dict):  # a boolean schema has no defaults
        return value
    if value is None and "default" in schema:
        value = copy.deepcopy(schema["default"])
    if value is None:
        return None
    member = _union_member(schema, value)
    if member is not None:
        return _fill(value, member)
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            value[key] = _fill(value.get(key), sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in [k for k in value if k not in (schema.get("properties") or {})]:
                value[key] = _fill(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [_fill(v, schema["items"]) for v in value]
    return value


def _hyperparameters(hps: dict[str, Any]) -> dict[str, Any]:
    """expconf/hyperparameters_config.go:98-115: a plain value is a const; an object without a type nests."""
    out = {}
    for name, hp in hps.items():
        if not isinstance(hp, dict):
            out[name] = {"type": "const", "val": hp}
        elif "type" not in hp:
            out[name] = _hyperparameters(hp)
        else:
            out[name] = hp
    return out


def with_defaults(conf: dict[str, Any]) -> dict[str, Any]:
    """schemas.WithDefaults plus the runtime defaults Go types carry: the name (experiment_config.go:108-120),
    the experiment seed (:350-358), the log policies (log_pattern_config.go:20-33), the images
    (environment_config.go:85-99)."""
    conf = copy.deepcopy(conf)
    conf["hyperparameters"] = _hyperparameters(conf.get("hyperparameters") or {})
    if conf.get("name") is None:
        conf["name"] = f"Experiment ({random.choice(['quick', 'brave', 'calm'])}-{random.choice(['otter', 'heron', 'lynx'])})"
    repro = conf.get("reproducibility") or {}
    if repro.get("experiment_seed") is None:
        conf["reproducibility"] = {**repro, "experiment_seed": int(time.time()) & 0xFFFFFFFF}
    names = {p.get("name") for p in conf.get("log_policies") or []}
    conf["log_policies"] = list(conf.get("log_policies") or []) + [p for p in LOG_POLICIES if p["name"] not in names]
    env = conf.get("environment") or {}
    image = env.get("image")
    if not isinstance(image, dict):
        image = {"cpu": image, "cuda": image, "rocm": image} if image else {}
    conf["environment"] = {**env, "image": {"cpu": image.get("cpu") or CPU_IMAGE, "cuda": image.get("cuda") or CUDA_IMAGE,
                                            "rocm": image.get("rocm") or ROCM_IMAGE}}
    if _schemas() is None:
        for key, default in FALLBACK_DEFAULTS.items():
            if conf.get(key) is None:
                conf[key] = copy.deepcopy(default)
        res = conf.setdefault("resources", {}) or {}
        res.setdefault("slots_per_trial", 1)
        conf["resources"] = res
        conf.setdefault("searcher", {}).setdefault("smaller_is_better", True)
        return conf
    return _fill(conf, {"$ref": EXPERIMENT_SCHEMA})


def merge(config: Any, template: Any) -> Any:
    """schemas.Merge (master/pkg/schemas/merge.go): ``config``'s values win, objects merge key by key,
    anything else of ``template`` only fills a missing or null value."""
    if config is None:
        return copy.deepcopy(template)
    if isinstance(config, dict) and isinstance(template, dict):
        out = copy.deepcopy(config)
        for key, value in template.items():
            out[key] = merge(config.get(key), value)
        return out
    return config


def parse_any_yaml(text: str) -> dict[str, Any]:
    """expconf/parse.go:22-44,70-77 ParseAnyExperimentConfigYAML: YAML to JSON, then the sanity check."""
    try:
        conf = yaml.safe_load(text) if text else {}
        json.dumps(conf)
    except (yaml.YAMLError, TypeError, ValueError) as exc:
        raise ConfigError(f"unable to convert yaml to json: {exc}") from exc
    if conf is None:
        conf = {}
    if not isinstance(conf, dict):
        raise ConfigError("unable to unmarshal json-formatted experiment config")
    if conf.get("version", 0) != 0:
        raise ConfigError(f"invalid version: {conf['version']}")
    errors = config_errors(conf)
    if errors:
        raise ConfigError("version 0 experiment config is invalid: config is invalid: " + "\n".join(errors))
    return conf


def parse_config_text(text: str) -> dict[str, Any]:
    """core_experiment.go:274-277: ParseAnyExperimentConfigYAML's error as an invalid configuration."""
    try:
        return parse_any_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"invalid experiment configuration: {exc.message}") from exc


def parse_create(text: str, template: dict[str, Any] | None, master: dict[str, Any], *,
                 unmanaged: bool = False, pool: str = "default") -> dict[str, Any]:
    """The active config of a CreateExperiment request (core_experiment.go:269-379)."""
    conf = parse_config_text(text)
    if (conf.get("resources") or {}).get("slots") is not None:
        raise ConfigError('<config>.resources: additionalProperties "slots" not allowed')
    if template is not None:
        conf = merge(conf, template)
    defaulted = with_defaults(conf)
    if not unmanaged and defaulted.get("entrypoint") is None:
        raise ConfigError("managed experiments require entrypoint")
    conf = experiment_config(master, pool, conf)
    conf.pop("_task_container_defaults")
    res = conf.setdefault("resources", {}) or {}
    if res.get("priority") is None:
        conf["resources"] = {**res, "priority": DEFAULT_PRIORITY}
    conf = with_defaults(conf)
    errors = config_errors(conf, complete=True)
    if errors:
        raise ConfigError("invalid experiment configuration: config is invalid or incomplete: " + "\n".join(errors))
    searcher = conf.get("searcher") or {}
    if searcher.get("name") in ("adaptive_asha", "async_halving") and (
            searcher.get("max_time") is None or searcher.get("time_metric") is None):  # searcher_config.go:223-249
        raise ConfigError(f"invalid experiment configuration: the `{searcher['name']}` searcher requires "
                          "`max_time` and `time_metric` to be set")
    return conf


def pack_files(files: list[dict[str, Any]]) -> bytes:
    """The context as the master stores it: api_tensorboard.go:56-71 filesToArchive, then
    archive.ToTarGz (master/pkg/archive/archive.go:150-216), item by item."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in files:
            content = base64.b64decode(f.get("content") or "")
            info = tarfile.TarInfo(f["path"])
            info.type = bytes([int(f.get("type") or 0)]) if int(f.get("type") or 0) else tarfile.REGTYPE
            info.mode, info.uid, info.gid = int(f.get("mode") or 0o644), int(f.get("uid") or 0), int(f.get("gid") or 0)
            info.mtime = int(f.get("mtime") or 0)
            info.size = len(content) if info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(content) if info.type == tarfile.REGTYPE else None)
    return buf.getvalue()
