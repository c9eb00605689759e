"""Normalisation statistics of a LeRobot dataset: ``meta/stats.json``, or LeRobot's aggregation of
the per-episode statistics (``meta/episodes_stats.jsonl`` in v2.1, ``stats/...`` columns in v3.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from det_lab.formats.errors import dataset_error, first_line
from det_lab.formats.lerobot_tables import read_json, read_jsonl


def read_stats(root: Path, meta: list[dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """``meta/stats.json``; without it, the per-episode statistics aggregated (empty if none)."""
    path = root / "meta" / "stats.json"
    if path.is_file():
        stats = read_json(path)
        if not isinstance(stats, dict):
            raise dataset_error(path, "must be a JSON object of features")
        return stats
    per_episode: list[dict[str, dict[str, Any]]] = []
    v2_file = root / "meta" / "episodes_stats.jsonl"
    if v2_file.is_file():
        for n, row in enumerate(read_jsonl(v2_file), 1):
            if not isinstance(row.get("stats"), dict):
                raise dataset_error(v2_file, f"line {n}: needs a 'stats' object")
            per_episode.append(row["stats"])
    else:  # v3.0: columns stats/<feature>/<statistic> of meta/episodes
        for ep in meta:
            stats: dict[str, dict[str, Any]] = {}
            for col, value in ep.items():
                if col.startswith("stats/") and value is not None:
                    feature, _, stat = col.removeprefix("stats/").rpartition("/")
                    stats.setdefault(feature, {})[stat] = value
            if stats:
                per_episode.append(stats)
    try:
        return aggregate_stats(per_episode)
    except (KeyError, ValueError, TypeError) as exc:
        where = v2_file if v2_file.is_file() else root / "meta" / "episodes"
        raise dataset_error(where, f"per-episode statistics do not aggregate: {first_line(exc)}") from None


def aggregate_stats(per_episode: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, np.ndarray]]:
    """LeRobot's ``aggregate_stats``: min of mins, max of maxes, count-weighted mean, pooled std."""
    out = {}
    for key in sorted({k for stats in per_episode for k in stats}):
        parts = [{s: np.asarray(v, dtype=np.float64) for s, v in stats[key].items()}
                 for stats in per_episode if key in stats]
        means = np.stack([p["mean"] for p in parts])
        variances = np.stack([p["std"] ** 2 for p in parts])
        counts = np.stack([p["count"] for p in parts])
        total = counts.sum(axis=0)
        while counts.ndim < means.ndim:
            counts = counts[..., None]
        mean = (means * counts).sum(axis=0) / total
        variance = ((variances + (means - mean) ** 2) * counts).sum(axis=0) / total
        out[key] = {"min": np.min(np.stack([p["min"] for p in parts]), axis=0),
                    "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
                    "mean": mean, "std": np.sqrt(variance), "count": total}
    return out
