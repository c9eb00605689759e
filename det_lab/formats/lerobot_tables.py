"""The metadata and tables of a LeRobot dataset (v3.0 and v2.1/v2.0 layouts), read with pyarrow.

Layouts: LeRobot's ``src/lerobot/datasets/lerobot_dataset.py`` and its v2.1 -> v3.0 converter.
Every problem is a :class:`~det_lab.formats.errors.LeRobotDatasetError` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from det_lab.formats.errors import dataset_error

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
STATE = "observation.state"
ACTION = "action"
INDEX_COLUMNS = ("episode_index", "frame_index", "task_index", "timestamp", "index")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise dataset_error(path, "missing") from None
    except (OSError, ValueError) as exc:
        raise dataset_error(path, f"unreadable JSON: {exc}") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise dataset_error(path, "missing") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise dataset_error(path, f"line {n}: not JSON: {exc}") from None
    return out


def read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    if not path.is_file():
        raise dataset_error(path, "missing parquet file")
    try:
        schema = pq.read_schema(path)
        if columns is not None:
            absent = [c for c in columns if c not in schema.names]
            if absent:
                raise dataset_error(path, f"no column {absent[0]!r} (has {schema.names})")
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (pa.ArrowException, OSError) as exc:
        raise dataset_error(path, f"unreadable parquet: {exc}") from None


def read_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    if not path.is_file():
        raise dataset_error(path, "missing: not a LeRobot dataset (expected meta/info.json)")
    info = read_json(path)
    if not isinstance(info, dict):
        raise dataset_error(path, "must be a JSON object")
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise dataset_error(path, f"codebase_version {version!r} is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})")
    for key in ("features", "data_path"):
        if not info.get(key):
            raise dataset_error(path, f"{key} is missing")
    return info


def is_string(dtype: pa.DataType) -> bool:
    """Any Arrow string type: string, large_string (pandas 3), string_view, or dictionary of those."""
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or bool(is_view and is_view(dtype))


def read_tasks_v3(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.parquet"
    table = read_parquet(path)
    if "task_index" not in table.column_names:
        raise dataset_error(path, "no column 'task_index'")
    # lerobot writes the task string as the (pandas) index; our demo writes a 'task' column
    names = [c for c in table.column_names if c != "task_index" and is_string(table.schema.field(c).type)]
    if not names:
        raise dataset_error(path, "no task string column")
    key = "task" if "task" in names else names[0]
    return dict(zip(table.column("task_index").to_pylist(), table.column(key).to_pylist()))


def read_tasks_v2(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.jsonl"
    rows = read_jsonl(path)
    try:
        return {int(t["task_index"]): str(t["task"]) for t in rows}
    except (KeyError, TypeError, ValueError):
        raise dataset_error(path, "each line needs task_index and task") from None


def read_episodes_v3(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise dataset_error(root / "meta" / "episodes", "missing: no chunk-*/file-*.parquet episode metadata")
    out = []
    for path in files:
        table = read_parquet(path)
        for col in ("episode_index", "length"):
            if col not in table.column_names:
                raise dataset_error(path, f"no column {col!r}")
        wanted = [c for c in table.column_names if c in ("episode_index", "length", "tasks")
                  or c.startswith(("data/", "videos/", "stats/"))]
        for row in table.select(wanted).to_pylist():
            out.append({**row, "_file": path})
    return sorted(out, key=lambda e: e["episode_index"])


def read_episodes_v2(root: Path) -> list[dict[str, Any]]:
    path = root / "meta" / "episodes.jsonl"
    rows = read_jsonl(path)
    for n, row in enumerate(rows, 1):
        if "episode_index" not in row or "length" not in row:
            raise dataset_error(path, f"line {n}: needs episode_index and length")
    return sorted(rows, key=lambda e: e["episode_index"])


def data_files_v3(root: Path, info: dict[str, Any], meta: list[dict[str, Any]]) -> list[tuple[Path, list[int]]]:
    """Each data file with the episodes the metadata places in it."""
    by_file: dict[tuple[int, int], list[int]] = {}
    for ep in meta:
        if "data/chunk_index" not in ep or "data/file_index" not in ep:
            raise dataset_error(ep["_file"], "no columns data/chunk_index, data/file_index")
        by_file.setdefault((int(ep["data/chunk_index"]), int(ep["data/file_index"])), []).append(int(ep["episode_index"]))
    template = info["data_path"]
    files = {key: root / template.format(chunk_index=key[0], file_index=key[1]) for key in by_file}
    for ep in meta:
        ep["_data"] = files[(int(ep["data/chunk_index"]), int(ep["data/file_index"]))]
    return [(files[key], eps) for key, eps in sorted(by_file.items())]


def data_files_v2(root: Path, info: dict[str, Any], meta: list[dict[str, Any]]) -> list[tuple[Path, list[int]]]:
    chunks = int(info.get("chunks_size") or 1000)
    template = info["data_path"]
    for ep in meta:
        idx = int(ep["episode_index"])
        ep["_data"] = root / template.format(episode_chunk=idx // chunks, episode_index=idx)
    return [(ep["_data"], [int(ep["episode_index"])]) for ep in meta]


def read_frames(files: list[tuple[Path, list[int]]], embedded: list[str]) -> dict[str, Any]:
    """The frame columns of every data file, concatenated: numpy arrays (images: lists)."""
    columns = [STATE, ACTION, *INDEX_COLUMNS, *embedded]
    parts: dict[str, list[Any]] = {c: [] for c in columns}
    for path, episodes in files:
        table = read_parquet(path, columns)
        present = set(np.unique(table.column("episode_index").to_numpy()).tolist())
        absent = sorted(set(episodes) - present)
        if absent:
            raise dataset_error(path, f"holds no frames of episode {absent[0]}, which the episode metadata places here")
        for c in (STATE, ACTION):
            parts[c].append(matrix(table.column(c), path, c))
        for c in INDEX_COLUMNS:
            parts[c].append(table.column(c).to_numpy())
        for c in embedded:
            parts[c].extend(table.column(c).to_pylist())
    out: dict[str, Any] = {}
    for c in columns:
        if c in embedded:
            out[c] = parts[c]
        else:
            out[c] = np.concatenate(parts[c]) if parts[c] else np.zeros((0,))
    for c in ("episode_index", "frame_index", "task_index", "index"):
        out[c] = out[c].astype(np.int64)
    out["timestamp"] = out["timestamp"].astype(np.float64)
    return out


def matrix(column: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    """A ``list<float>`` / fixed-size-list column as an (N, D) float32 array."""
    flat = column.combine_chunks()
    if not (pa.types.is_list(flat.type) or pa.types.is_fixed_size_list(flat.type) or pa.types.is_large_list(flat.type)):
        raise dataset_error(path, f"column {name!r} is {flat.type}, expected a list of floats")
    values = flat.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    n = len(flat)
    if n and len(values) % n:
        raise dataset_error(path, f"column {name!r} has rows of different lengths")
    return values.reshape(n, -1 if n else 0)
