"""Refuse a bad experiment config before anything is created (local and Slurm runs start here).

:func:`preflight` checks, in order, and raises :class:`PreflightError` (one line naming the file,
the key and the fix) at the first problem:

1. det_lab's own section (``data.det_lab``) and training length (a positive ``max_time``);
2. what a Determined 0.38.1 master would reject. The pinned ``determined`` wheel no longer ships
   the expconf schemas or their Python validator (removed in 0.21.1), so this module mirrors the
   0.38.1 ``schemas/expconf/v0`` rules for everything det_lab's configs use: the top-level keys,
   the searcher (by name, with the searchers 0.38 removed refused), resources, hyperparameters,
   lengths, reproducibility, and the keys the master requires (``searcher``, ``searcher.metric``,
   ``max_trials``). Other sections (environment, checkpoint_storage, bind_mounts, ...) are checked
   for their JSON type only. The tests compare these verdicts with the schemas themselves;
3. the dataset: a registered name that exists, a repository and revision that resolve, and room
   under the project's quota for what a pull would fetch;
4. the base models, tokenizers and backbone weights it loads, in the volume's model store
   (:mod:`det_lab.runs.base_models`), and a dataset already on the volume whose state or action
   size differs from the pretrained policy's;
5. that the volume's directories a run writes to are writable.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.settings import LabConfigError, LabSettings, check_writable

SEARCHERS = ("single", "random", "grid", "adaptive_asha", "async_halving")
REMOVED_SEARCHERS = ("custom", "adaptive", "adaptive_simple", "sync_halving")
HP_TYPES = ("int", "double", "log", "const", "categorical")


class PreflightError(UserError, ValueError):
    """An experiment config a run must not start with, as one line."""


# --- small JSON-schema-like rules -------------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[kind])


class _Fail(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")


def _check(value: Any, key: str, kind: str, *, minimum: float | None = None, maximum: float | None = None,
           exclusive_minimum: float | None = None, enum: tuple | None = None) -> None:
    """One scalar: ``None`` counts as absent, as in Determined."""
    if value is None:
        return
    if enum is not None:
        if value not in enum:
            raise _Fail(key, f"{value!r} is not one of {', '.join(map(str, enum))}")
        return
    if not _is(value, kind):
        raise _Fail(key, f"must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {value!r}")
    if minimum is not None and value < minimum:
        raise _Fail(key, f"must be at least {minimum:g} (got {value})")
    if maximum is not None and value > maximum:
        raise _Fail(key, f"must be at most {maximum:g} (got {value})")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise _Fail(key, f"must be greater than {exclusive_minimum:g} (got {value})")


def _keys(obj: Any, key: str, allowed: set[str] | tuple[str, ...]) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise _Fail(key, f"must be a mapping, not {obj!r}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise _Fail(f"{key}.{unknown[0]}" if key else str(unknown[0]),
                    f"unknown key (Determined accepts: {', '.join(sorted(allowed))})")
    return obj


def _length(obj: Any, key: str, positive: bool = False) -> None:
    if obj is None:
        return
    units = ("batches", "records", "epochs")
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in units:
        raise _Fail(key, "must be one of {batches: N}, {records: N}, {epochs: N}")
    unit, n = next(iter(obj.items()))
    _check(n, f"{key}.{unit}", "integer", minimum=1 if positive else 0)


# --- the Determined experiment config ---------------------------------------------------------

_TOP_LEVEL = {
    "bind_mounts": "array", "checkpoint_policy": None, "checkpoint_storage": "object", "data": "object",
    "data_layer": "object", "debug": "boolean", "description": "string", "entrypoint": None,
    "environment": "object", "hyperparameters": None, "integrations": "object", "internal": "object",
    "labels": None, "log_policies": "array", "max_restarts": None, "min_checkpoint_period": None,
    "min_validation_period": None, "name": "string", "optimizations": "object", "pbs": "object",
    "perform_initial_validation": "boolean", "preemption_timeout": "integer", "profiling": "object",
    "project": "string", "records_per_epoch": "integer", "reproducibility": None, "resources": None,
    "retention_policy": "object", "scheduling_unit": None, "searcher": None, "security": "object",
    "slurm": "object", "tensorboard_storage": "object", "workspace": "string",
}
_SEARCHER_COMMON = {"name", "metric", "smaller_is_better", "max_length", "source_trial_id", "source_checkpoint_uuid"}
_SEARCHER_EXTRA = {
    "single": set(),
    "random": {"max_concurrent_trials", "max_trials"},
    "grid": {"max_concurrent_trials"},
    "adaptive_asha": {"bracket_rungs", "max_trials", "time_metric", "max_time", "mode", "divisor", "max_rungs",
                      "max_concurrent_trials", "stop_once"},
    "async_halving": {"num_rungs", "max_trials", "divisor", "max_concurrent_trials", "stop_once", "time_metric",
                      "max_time"},
}
_RESOURCES = {
    "agent_label": "string", "devices": "array", "is_single_node": "boolean", "max_slots": "integer",
    "native_parallel": "boolean", "resource_pool": "string", "slots": "integer", "weight": "number",
}


def determined_errors(conf: Mapping[str, Any], *, template: bool = False) -> list[str]:
    """What a Determined 0.38.1 master would reject in ``conf``: ``key: problem`` lines (the
    first problem of each top-level section). A config ``template`` is merged into configs by the
    master, so what it leaves out (a searcher, say) is not missing."""
    problems = []
    try:
        _keys(conf, "", _TOP_LEVEL)
    except _Fail as exc:
        return [str(exc)]
    for name, kind in _TOP_LEVEL.items():
        if template and conf.get(name) is None:
            continue
        try:
            if kind is not None:
                _check(conf.get(name), name, kind)
            else:
                _SECTIONS[name](conf.get(name), name)
        except _Fail as exc:
            problems.append(str(exc))
    return problems


def _entrypoint(v: Any, key: str) -> None:
    if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(a, str) for a in v))):
        raise _Fail(key, "must be a command string or a list of strings")


def _labels(v: Any, key: str) -> None:
    if v is not None and not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
        raise _Fail(key, "must be a list of strings")


def _searcher(v: Any, key: str) -> None:
    if v is None:
        raise _Fail(key, "is missing (e.g. {name: single, metric: validation_loss})")
    if not isinstance(v, dict):
        raise _Fail(key, f"must be a mapping, not {v!r}")
    name = v.get("name")
    if name in REMOVED_SEARCHERS:
        raise _Fail(f"{key}.name", f"{name!r} was removed from Determined; use one of {', '.join(SEARCHERS)}")
    if name not in SEARCHERS:
        raise _Fail(f"{key}.name", f"{name!r} is not a searcher (Determined 0.38: {', '.join(SEARCHERS)})")
    _keys(v, key, _SEARCHER_COMMON | _SEARCHER_EXTRA[name])
    if v.get("metric") is None:
        raise _Fail(f"{key}.metric", "is missing: the validation metric the searcher compares")
    _check(v["metric"], f"{key}.metric", "string")
    _check(v.get("smaller_is_better"), f"{key}.smaller_is_better", "boolean")
    _check(v.get("source_trial_id"), f"{key}.source_trial_id", "integer")
    _check(v.get("source_checkpoint_uuid"), f"{key}.source_checkpoint_uuid", "string")
    if name in ("random", "adaptive_asha", "async_halving"):
        if v.get("max_trials") is None:
            raise _Fail(f"{key}.max_trials", f"is missing: the {name} searcher needs it")
        _check(v["max_trials"], f"{key}.max_trials", "integer", minimum=1)
    _check(v.get("max_concurrent_trials"), f"{key}.max_concurrent_trials", "integer", minimum=0)
    _check(v.get("divisor"), f"{key}.divisor", "number", exclusive_minimum=1)
    _check(v.get("max_rungs"), f"{key}.max_rungs", "integer", minimum=1)
    _check(v.get("num_rungs"), f"{key}.num_rungs", "integer", minimum=1)
    _check(v.get("mode"), f"{key}.mode", "string", enum=("aggressive", "standard", "conservative"))
    _check(v.get("stop_once"), f"{key}.stop_once", "boolean")
    _check(v.get("time_metric"), f"{key}.time_metric", "string")
    _check(v.get("max_time"), f"{key}.max_time", "integer")
    rungs = v.get("bracket_rungs")
    if rungs is not None and not (isinstance(rungs, list) and all(_is(r, "integer") for r in rungs)):
        raise _Fail(f"{key}.bracket_rungs", "must be a list of integers")
    length = v.get("max_length")
    if length is not None and not (_is(length, "integer") and length >= 0):
        _length(length, f"{key}.max_length", positive=True)


def _resources(v: Any, key: str) -> None:
    _keys(v, key, {*_RESOURCES, "priority", "shm_size", "slots_per_trial"})
    v = v or {}
    for name, kind in _RESOURCES.items():
        _check(v.get(name), f"{key}.{name}", kind)
    _check(v.get("slots_per_trial"), f"{key}.slots_per_trial", "integer", minimum=0)
    _check(v.get("priority"), f"{key}.priority", "integer", minimum=1, maximum=99)
    shm = v.get("shm_size")
    if shm is not None and not (_is(shm, "integer") or isinstance(shm, str)):
        raise _Fail(f"{key}.shm_size", "must be a size such as 4G or a number of bytes")


def _hyperparameters(v: Any, key: str) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise _Fail(key, f"must be a mapping of names to values or {{type: ...}} specs, not {v!r}")
    for name, spec in v.items():
        _hyperparameter(spec, f"{key}.{name}")


def _hyperparameter(spec: Any, key: str) -> None:
    if not isinstance(spec, dict):
        return  # a bare value is a constant
    kind = spec.get("type")
    if kind is None:
        _hyperparameters(spec, key)  # a nested group
        return
    if kind not in HP_TYPES:
        raise _Fail(f"{key}.type", f"{kind!r} is not a hyperparameter type ({', '.join(HP_TYPES)})")
    fields = {"int": ("minval", "maxval"), "double": ("minval", "maxval"), "log": ("minval", "maxval", "base"),
              "const": ("val",), "categorical": ("vals",)}[kind]
    _keys(spec, key, {"type", *fields, *(("count",) if kind in ("int", "double", "log") else ())})
    for f in fields:
        if f not in spec:
            raise _Fail(f"{key}.{f}", f"is missing: a {kind} hyperparameter needs {', '.join(fields)}")
    if kind in ("int", "double", "log"):
        number = "integer" if kind == "int" else "number"
        for f in ("minval", "maxval"):
            if spec[f] is None:
                raise _Fail(f"{key}.{f}", f"must be {'an' if number == 'integer' else 'a'} {number}, not null")
            _check(spec[f], f"{key}.{f}", number)
        if not spec["minval"] < spec["maxval"]:
            raise _Fail(key, f"minval ({spec['minval']}) must be less than maxval ({spec['maxval']})")
        _check(spec.get("count"), f"{key}.count", "integer", minimum=1)
    if kind == "log":
        if spec["base"] is None:
            raise _Fail(f"{key}.base", "must be a number, not null")
        _check(spec["base"], f"{key}.base", "number", exclusive_minimum=0)
    if kind == "categorical" and not (isinstance(spec["vals"], list) and spec["vals"]):
        raise _Fail(f"{key}.vals", "must be a non-empty list of values")


def _reproducibility(v: Any, key: str) -> None:
    _check(_keys(v, key, {"experiment_seed"}).get("experiment_seed"), f"{key}.experiment_seed", "integer", minimum=0)


_SECTIONS = {
    "checkpoint_policy": lambda v, k: _check(v, k, "string", enum=("best", "all", "none")),
    "entrypoint": _entrypoint,
    "hyperparameters": _hyperparameters,
    "labels": _labels,
    "max_restarts": lambda v, k: _check(v, k, "integer", minimum=0),
    "min_checkpoint_period": _length,
    "min_validation_period": _length,
    "reproducibility": _reproducibility,
    "resources": _resources,
    "scheduling_unit": lambda v, k: _check(v, k, "integer", minimum=1),
    "searcher": _searcher,
}


# --- the whole preflight ----------------------------------------------------------------------

def preflight(exp_conf: Mapping[str, Any], settings: LabSettings, source: str = "experiment config") -> None:
    """Raise :class:`PreflightError` for the first reason ``exp_conf`` must not run; create nothing.

    ``source`` names the config in the message (its path)."""
    lab = check_config(exp_conf, source)
    dataset_root = _datasets(lab, settings, source)
    _base_models(exp_conf, settings, source, dataset_root)
    _writable(lab.project, settings)


def check_config(exp_conf: Mapping[str, Any], source: str = "experiment config"):
    """The checks of the config alone (Determined's rules, det_lab's section), for a submission
    from a machine that need not hold the volume; returns det_lab's section."""
    if not isinstance(exp_conf, Mapping):
        raise PreflightError(f"{source}: an experiment config must be a mapping of keys")
    problems = determined_errors(exp_conf)
    if isinstance(exp_conf.get("searcher") or {}, dict):
        lab = _lab_section(exp_conf, source)  # det_lab's own section first: it names what det_lab needs
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PreflightError(f"{source}: {problems[0]}{more}")
    _batch_split(exp_conf, source)
    from det_lab.runs.retention import RetentionConfigError, RetentionPolicy

    try:  # checkpoint_storage's save_* keys: the schema's "integer, minimum 0", checked before anything runs
        RetentionPolicy.of(exp_conf)
    except RetentionConfigError as exc:
        raise PreflightError(f"{source}: {exc}") from None
    return lab


def _batch_split(exp_conf: Mapping[str, Any], source: str) -> None:
    """A global batch that slots x grad_accumulation divides (where all three are fixed numbers)."""
    from det_lab.runs.expconf import ExpConfError, micro_batch_size

    hparams = exp_conf.get("hyperparameters") or {}
    batch, steps = hparams.get("global_batch_size"), hparams.get("grad_accumulation", 1) or 1
    slots = (exp_conf.get("resources") or {}).get("slots_per_trial", 1) or 1
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (batch, steps, slots)):
        try:
            micro_batch_size(batch, slots, steps)
        except ExpConfError as exc:
            raise PreflightError(f"{source}: {exc}") from None


def _lab_section(exp_conf: Mapping[str, Any], source: str):
    from det_lab.runs.expconf import ExpConfError, lab_section, training_length

    searcher = exp_conf.get("searcher") or {}
    max_time = searcher.get("max_time")
    if isinstance(max_time, (int, float)) and max_time <= 0:
        raise PreflightError(f"{source}: searcher.max_time: must be a positive number of "
                             f"{searcher.get('time_metric') or 'batches'} (got {max_time})")
    try:
        lab = lab_section(dict(exp_conf), source)
        training_length(dict(exp_conf), lab)
    except (ExpConfError, ValueError) as exc:
        raise PreflightError(str(exc).splitlines()[0]) from None
    return lab


def _datasets(lab, settings: LabSettings, source: str) -> Path | None:
    """Check the dataset; returns its directory when it is already on the volume (else None)."""
    from det_lab.data import DataError, DatasetSpec, lookup
    from det_lab.data.pull import _bytes_missing, _Out
    from det_lab.data.status import resolve
    from det_lab.volume import QuotaExceeded, VolumeLayout, check_quota

    try:
        settings.project(lab.project)
    except LabConfigError as exc:
        raise PreflightError(f"{source}: data.det_lab.project: {exc}") from None
    if lab.dataset is None:
        return None
    try:
        spec = lab.dataset_spec(lambda name: lookup(settings, name))
        if not isinstance(spec, DatasetSpec):  # a directory read in place: it must be on the volume
            return Path(spec.resolve(settings))
        identity = resolve(spec)  # repository, revision and DVC path exist
        layout = VolumeLayout.from_settings(settings)
        out = _Out(identity.md5, identity.size, identity.nfiles)
        snapshot = layout.snapshots(spec.project) / out.stem
        if (snapshot / "snapshot.json").is_file():
            return snapshot / Path(spec.path).name  # where a pull serves it (det_lab.data.pull)
        check_quota(settings, spec.project, _bytes_missing(layout.dvc_cache(spec.project), out))
    except (DataError, QuotaExceeded) as exc:
        raise PreflightError(f"{source}: data.det_lab.dataset: {exc}") from None
    return None


def _base_models(exp_conf: Mapping[str, Any], settings: LabSettings, source: str, dataset_root: Path | None) -> None:
    from det_lab.models import ModelMissing
    from det_lab.runs.base_models import SizeMismatch, check_base_models, check_sizes, policy_sections
    from det_lab.runs.base_models import pretrained_config

    try:
        check_base_models(settings, exp_conf, source=source)
        info = dataset_root / "meta" / "info.json" if dataset_root is not None else None
        if info is None or not info.is_file():
            return  # a dataset not pulled yet: the trial checks its sizes before it trains
        import json

        features = json.loads(info.read_text()).get("features") or {}
        for section in policy_sections(exp_conf.get("hyperparameters")):
            base = pretrained_config(settings, section.get("pretrained"))
            if base is not None:
                check_sizes(base, features, str(section["pretrained"]), f"{source}: hyperparameters.policy.pretrained")
    except (ModelMissing, SizeMismatch) as exc:
        raise PreflightError(str(exc)) from None


def _writable(project: str, settings: LabSettings) -> None:
    from det_lab.volume import VolumeLayout

    layout = VolumeLayout.from_settings(settings)
    if not layout.outputs(project).is_dir():
        raise PreflightError(f"{layout.outputs(project)} does not exist: run 'det-lab init' (or set DET_LAB_DATA_ROOT)")
    try:
        check_writable(layout.outputs(project), layout.project_checkpoints(project), layout.locks)
    except LabConfigError as exc:
        raise PreflightError(str(exc)) from None


def load_and_check(path: Path, settings: LabSettings) -> dict[str, Any]:
    """Read an experiment config file (one-line errors for unreadable, non-UTF-8 or broken YAML)
    and :func:`preflight` it; returns the config."""
    from det_lab.settings import read_yaml_mapping

    conf = read_yaml_mapping(path, PreflightError)
    preflight(conf, settings, str(path))
    return conf
