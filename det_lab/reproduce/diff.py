"""What differs between two runs: config and hyperparameters, dataset identity, code, Python
environment, scheduler and host; and their final metrics, side by side."""

from __future__ import annotations

from typing import Any

from det_lab.reproduce import envdiff
from det_lab.reproduce.code import diff_stat
from det_lab.reproduce.compare import series
from det_lab.reproduce.find import Origin
from det_lab.tracking.events import flatten

#: dataset identity fields that say which bytes a run read (``rev`` is how it was asked for)
DATASET_FIELDS = ("repo", "path", "commit", "md5")
CODE_FIELDS = ("repo", "commit", "dirty", "patch_sha256")


def _config(origin: Origin) -> dict[str, str]:
    """The config as run, less what other sections compare (hyperparameters, the dataset)."""
    conf = {k: v for k, v in (origin.config or {}).items() if k != "hyperparameters"}
    lab = dict(((conf.get("data") or {}).get("det_lab") or {}))
    lab.pop("dataset", None)
    conf["data"] = {**(conf.get("data") or {}), "det_lab": lab}
    return flatten(conf)


def _scheduler(origin: Origin) -> dict[str, Any]:
    lin = origin.lineage
    return {"scheduler": lin.get("scheduler", "determined" if origin.record is None else origin.record.kind),
            "host": lin.get("host")}


def _ids(origin: Origin) -> dict[str, Any]:
    lin = origin.lineage
    return {k: lin[k] for k in ("run_key", "slurm_job_id", "slurm_node") if lin.get(k) is not None}


def _pairs(section: str, a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"section": section, "field": k, "a": a.get(k), "b": b.get(k)}
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def final_metrics(origin: Origin) -> dict[str, float]:
    """The last value of each metric the run recorded (``<group>/<name>``)."""
    return {k: v[max(v)] for k, v in series(origin.metrics()).items() if v}


def runs_diff(a: Origin, b: Origin) -> dict[str, Any]:
    """Every difference between runs ``a`` and ``b`` (each ``{section, field, a, b}``), the code's
    ``git diff --stat``, their saved patches, ids and final metrics."""
    la, lb = a.lineage, b.lineage
    diffs = _pairs("config", _config(a), _config(b))
    diffs += _pairs("hyperparameters", flatten(a.hparams), flatten(b.hparams))
    da, db = la.get("dataset") or {}, lb.get("dataset") or {}
    diffs += _pairs("dataset", {k: da.get(k) for k in DATASET_FIELDS}, {k: db.get(k) for k in DATASET_FIELDS})
    ca, cb = la.get("code") or {}, lb.get("code") or {}
    diffs += _pairs("code", {k: ca.get(k) for k in CODE_FIELDS}, {k: cb.get(k) for k in CODE_FIELDS})
    ea, eb = envdiff.recorded(la), envdiff.recorded(lb)
    diffs += _pairs("environment", {"python": la.get("python")}, {"python": lb.get("python")})
    if ea is not None and eb is not None:
        diffs += [{"section": "environment", "field": n, "a": x, "b": y} for n, x, y in envdiff.differences(ea, eb)]
    elif (la.get("environment") or {}).get("hash") != (lb.get("environment") or {}).get("hash"):
        diffs.append({"section": "environment", "field": "hash", "a": (la.get("environment") or {}).get("hash"),
                      "b": (lb.get("environment") or {}).get("hash")})
    diffs += _pairs("scheduler", _scheduler(a), _scheduler(b))
    stat = diff_stat(ca, cb) if ca.get("commit") and cb.get("commit") and ca["commit"] != cb["commit"] else None
    fa, fb = final_metrics(a), final_metrics(b)
    return {
        "a": a.name, "b": b.name,
        "differences": diffs,
        "code_diff_stat": stat,
        "patches": {"a": str(a.patch_file) if a.patch_file else None, "b": str(b.patch_file) if b.patch_file else None},
        "ids": {"a": _ids(a), "b": _ids(b)},
        "final_metrics": {k: {"a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb))},
    }
