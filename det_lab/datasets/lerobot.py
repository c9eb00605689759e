"""A reader for LeRobot datasets, layouts v3.0 and v2.1 (v2.0), without the lerobot package.

lerobot needs Python >= 3.12 and pins an older torch, so det_lab reads the format itself
(layouts: LeRobot's ``src/lerobot/datasets/lerobot_dataset.py`` and its v2.1 -> v3.0 converter)::

    ds = LeRobotDataset(path, horizon=10)          # every episode
    train_eps, val_eps = split_episodes(ds.episode_indices, val_episodes=2)
    train, val = ds.select(train_eps), ds.select(val_eps)
    item = train[0]
    item["observation.state"]      # (state_dim,) float32
    item["action"]                 # (horizon, action_dim) float32: actions t .. t+H-1
    item["action_is_pad"]          # (horizon,) bool: True past the episode's last frame
    item["observation.images.front"]  # (3, H, W) float32 in [0, 1]
    item["task"], item["task_index"], item["episode_index"], item["frame_index"], item["index"]

All tabular data (state, action, indices) is loaded into memory once; images are read per
item: files at ``info["image_path"]``, bytes embedded in the parquet frames, or frames decoded
from ``info["video_path"]`` videos when torchcodec, PyAV or torchvision is installed.

Every problem with the dataset is a :class:`LeRobotDatasetError` (a ``ValueError``) whose
message is one line naming the file and what is wrong with it: at load time for the metadata
and tables, when an item is read for a corrupt image or video (naming the episode and frame).

Strings may be stored as any Arrow string type (``string``, ``large_string`` as pandas 3
writes them, ``string_view``, dictionary-encoded). Normalisation statistics come from
``meta/stats.json`` or, where it is absent, are aggregated from the per-episode statistics
(``meta/episodes_stats.jsonl`` in v2.1, the ``stats/...`` columns in v3.0) as LeRobot does.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.utils.data
from PIL import Image

__all__ = ["Episode", "LeRobotDataset", "LeRobotDatasetError", "VideoDecoderMissing", "split_episodes"]

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
STATE = "observation.state"
ACTION = "action"
_INDEX_COLUMNS = ("episode_index", "frame_index", "task_index", "timestamp", "index")
_CAMERA_DTYPES = ("image", "video")


class LeRobotDatasetError(ValueError):
    """A malformed or unreadable LeRobot dataset; the message is ``<file>: <problem>``."""


class VideoDecoderMissing(LeRobotDatasetError):
    """The dataset stores a camera as video and no decoder (torchcodec, av, torchvision) is installed."""


def _error(path: Path, problem: str) -> LeRobotDatasetError:
    return LeRobotDatasetError(f"{path}: {problem}")


@dataclass(frozen=True)
class Episode:
    """One episode: its frames are rows ``start .. start + length - 1`` of the reader."""

    index: int
    length: int
    tasks: tuple[str, ...]
    start: int
    video: dict[str, tuple[Path, float]]  # camera -> (video file, timestamp of frame 0 in it)


def split_episodes(episodes: Sequence[int], *, val_episodes: int | None = None,
                   val_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split episode indices into disjoint (train, held-out) lists, deterministically by ``seed``.

    ``val_episodes`` held out if given, else ``round(val_fraction * n)``, at least one; both
    sides keep at least one episode.
    """
    eps = sorted(set(int(e) for e in episodes))
    n = len(eps)
    if n < 2:
        raise ValueError(f"need at least 2 episodes to hold some out, got {n}")
    k = val_episodes if val_episodes is not None else max(1, round(val_fraction * n))
    if not 1 <= k < n:
        raise ValueError(f"cannot hold out {k} of {n} episodes (need 1 <= k < {n})")
    order = np.random.default_rng(seed).permutation(n)
    val = sorted(eps[i] for i in order[:k])
    return [e for e in eps if e not in set(val)], val


class LeRobotDataset(torch.utils.data.Dataset):
    """Frames of a local LeRobot dataset with action chunks of ``horizon`` steps (see module doc).

    Args:
        root: The dataset directory (holding ``meta/info.json``).
        horizon: Actions per item: frame t gets actions t .. t+horizon-1 of its episode, the
            last action repeated past the episode's end and flagged in ``action_is_pad``.
        episodes: Episode indices to serve (default: all).
        cameras: Camera features to load (default: every ``image``/``video`` feature); ``()``
            loads no images.

    Raises:
        LeRobotDatasetError: missing ``meta/info.json``, unsupported ``codebase_version``, missing
            metadata or parquet file, missing column, frame counts that disagree with the
            metadata, a missing image, or a video camera without a decoder installed.
    """

    def __init__(self, root: str | Path, *, horizon: int = 1, episodes: Sequence[int] | None = None,
                 cameras: Sequence[str] | None = None) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.root = Path(root)
        self.horizon = horizon
        self.info = _read_info(self.root)
        self.version: str = self.info["codebase_version"]
        self.fps = float(self.info.get("fps") or 0)
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        for key in (STATE, ACTION):
            if key not in self.features:
                raise _error(self.root / "meta/info.json", f"features has no {key!r}")
        all_cameras = [k for k, f in self.features.items() if f.get("dtype") in _CAMERA_DTYPES]
        self.cameras: list[str] = list(all_cameras if cameras is None else cameras)
        for key in self.cameras:
            if key not in all_cameras:
                raise _error(self.root / "meta/info.json", f"no image or video feature {key!r} (has {all_cameras})")
        v3 = self.version == "v3.0"
        self.tasks: dict[int, str] = _read_tasks_v3(self.root) if v3 else _read_tasks_v2(self.root)
        meta = _read_episodes_v3(self.root) if v3 else _read_episodes_v2(self.root)
        self.stats: dict[str, Any] = _read_stats(self.root, meta)
        embedded = [k for k in self.cameras if self._camera_source(k) == "embedded"]
        files = _data_files_v3(self.root, self.info, meta) if v3 else _data_files_v2(self.root, self.info, meta)
        frames = _read_frames(files, embedded)
        self._load(frames, meta, embedded)
        if any(self._camera_source(k) == "video" for k in self.cameras):
            self._decode = _video_decoder(self.root / "meta/info.json")
        self._items = np.concatenate([np.arange(e.start, e.start + e.length) for e in self.episodes.values()]) \
            if self.episodes else np.zeros(0, dtype=np.int64)
        if episodes is not None:
            self._items = self.select(episodes)._items
        self._check_images()

    # --- public ----------------------------------------------------------------------------------

    @property
    def episode_indices(self) -> list[int]:
        """Every episode of the dataset (not only the selected ones)."""
        return sorted(self.episodes)

    @property
    def selected_episodes(self) -> list[int]:
        return sorted({int(e) for e in self.episode_index[self._items]})

    @property
    def state_dim(self) -> int:
        return int(self.state.shape[1])

    @property
    def action_dim(self) -> int:
        return int(self.action.shape[1])

    def image_shape(self, camera: str) -> tuple[int, int, int]:
        """(channels, height, width) of a camera, from ``info.json``."""
        ft = self.features[camera]
        dims = dict(zip(ft.get("names") or ["height", "width", "channels"], ft["shape"]))
        return int(dims.get("channels", 3)), int(dims["height"]), int(dims["width"])

    def select(self, episodes: Sequence[int]) -> LeRobotDataset:
        """The same reader serving only ``episodes`` (shares all loaded arrays)."""
        missing = sorted(set(int(e) for e in episodes) - set(self.episodes))
        if missing:
            raise ValueError(f"{self.root}: no episodes {missing} (has {len(self.episodes)})")
        view = copy.copy(self)
        chosen = [self.episodes[int(e)] for e in sorted(set(int(e) for e in episodes))]
        view._items = np.concatenate([np.arange(e.start, e.start + e.length) for e in chosen]) \
            if chosen else np.zeros(0, dtype=np.int64)
        return view

    def norm_stats(self, key: str) -> dict[str, np.ndarray]:
        """``mean``/``std``/``min``/``max`` of a feature (float32 arrays), from ``meta/stats.json``
        or aggregated from the per-episode statistics where that file is absent."""
        if key not in self.stats:
            source = "meta/stats.json" if (self.root / "meta/stats.json").is_file() else \
                ("meta/episodes" if self.version == "v3.0" else "meta/episodes_stats.jsonl")
            raise _error(self.root / source, f"no statistics for {key!r}")
        return {k: np.asarray(v, dtype=np.float32) for k, v in self.stats[key].items()
                if k in ("mean", "std", "min", "max")}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = int(self._items[i])
        rows = row + np.arange(self.horizon)
        end = self._episode_end[row]
        pad = rows >= end
        item: dict[str, Any] = {
            STATE: self.state[row],
            ACTION: self.action[np.minimum(rows, end - 1)],
            "action_is_pad": pad,
            "task_index": int(self.task_index[row]),
            "task": self.tasks.get(int(self.task_index[row]), ""),
            "episode_index": int(self.episode_index[row]),
            "frame_index": int(self.frame_index[row]),
            "index": int(self.index[row]),
        }
        for key in self.cameras:
            item[key] = self._image(key, row)
        return item

    # --- loading ---------------------------------------------------------------------------------

    def _load(self, frames: dict[str, Any], meta: list[dict[str, Any]], embedded: list[str]) -> None:
        order = np.lexsort((frames["frame_index"], frames["episode_index"]))
        for name in list(frames):
            frames[name] = frames[name][order] if isinstance(frames[name], np.ndarray) else [frames[name][j] for j in order]
        self.state, self.action = frames[STATE], frames[ACTION]
        self.episode_index, self.frame_index = frames["episode_index"], frames["frame_index"]
        self.task_index, self.timestamp, self.index = frames["task_index"], frames["timestamp"], frames["index"]
        self._embedded = {k: frames[k] for k in embedded}

        self.episodes: dict[int, Episode] = {}
        self._data_files: dict[int, Path] = {}
        self._episode_end = np.zeros(len(self.state), dtype=np.int64)
        for ep in meta:
            idx = int(ep["episode_index"])
            start = int(np.searchsorted(self.episode_index, idx, side="left"))
            stop = int(np.searchsorted(self.episode_index, idx, side="right"))
            where = ep["_data"]
            if stop - start != int(ep["length"]):
                raise _error(where, f"episode {idx} has {stop - start} frames, its metadata says {ep['length']}")
            if not np.array_equal(self.frame_index[start:stop], np.arange(stop - start)):
                raise _error(where, f"episode {idx}: frame_index is not 0..{stop - start - 1}")
            self.episodes[idx] = Episode(idx, stop - start, tuple(ep.get("tasks") or ()), start,
                                         self._video_files(ep))
            self._data_files[idx] = where
            self._episode_end[start:stop] = stop
        listed = set(self.episodes)
        extra = sorted(set(np.unique(self.episode_index).tolist()) - listed)
        if extra:
            raise _error(self.root / "data", f"frames of episodes {extra[:5]} are not in the episode metadata")
        total = self.info.get("total_frames")
        if total is not None and int(total) != len(self.state):
            raise _error(self.root / "meta/info.json",
                         f"total_frames is {total} but the data files hold {len(self.state)} frames")

    def _camera_source(self, key: str) -> str:
        if self.features[key].get("dtype") == "video":
            if not self.info.get("video_path"):
                raise _error(self.root / "meta/info.json", f"{key!r} is a video feature but video_path is null")
            return "video"
        return "file" if self.info.get("image_path") else "embedded"

    def _video_files(self, ep: dict[str, Any]) -> dict[str, tuple[Path, float]]:
        out = {}
        template = self.info.get("video_path")
        for key in self.cameras:
            if self._camera_source(key) != "video":
                continue
            idx = int(ep["episode_index"])
            if self.version == "v3.0":
                rel = template.format(video_key=key, chunk_index=int(ep[f"videos/{key}/chunk_index"]),
                                      file_index=int(ep[f"videos/{key}/file_index"]))
                offset = float(ep.get(f"videos/{key}/from_timestamp") or 0.0)
            else:
                chunk = idx // int(self.info.get("chunks_size") or 1000)
                rel = template.format(video_key=key, episode_chunk=chunk, episode_index=idx)
                offset = 0.0
            path = self.root / rel
            if not path.is_file():
                raise _error(path, f"missing video of {key!r} (episode {idx})")
            out[key] = (path, offset)
        return out

    def _image_file(self, key: str, row: int) -> Path:
        return self.root / self.info["image_path"].format(
            image_key=key, episode_index=int(self.episode_index[row]), frame_index=int(self.frame_index[row]))

    def _check_images(self) -> None:
        """Cheap early check: the first and last image file of every episode exist."""
        for key in self.cameras:
            if self._camera_source(key) != "file":
                continue
            for ep in self.episodes.values():
                for row in (ep.start, ep.start + ep.length - 1):
                    path = self._image_file(key, row)
                    if not path.is_file():
                        raise _error(path, f"missing image of {key!r} (episode {ep.index}, frame {self.frame_index[row]})")

    def _image(self, key: str, row: int) -> np.ndarray:
        source = self._camera_source(key)
        episode, frame = int(self.episode_index[row]), int(self.frame_index[row])
        where = f"{key!r} of episode {episode}, frame {frame}"
        if source == "file":
            path = self._image_file(key, row)
            if not path.is_file():
                raise _error(path, f"missing image of {where}")
            pixels = _decode_image(path, path, where)
        elif source == "embedded":
            cell = self._embedded[key][row]
            blob = cell.get("bytes") if isinstance(cell, dict) else cell
            data_file = self._data_files[episode]
            if not blob:
                raise _error(data_file, f"{where} has no image bytes")
            pixels = _decode_image(io.BytesIO(blob), data_file, where)
        else:
            path, offset = self.episodes[episode].video[key]
            ts = offset + float(self.timestamp[row])
            try:
                pixels = self._decode(path, ts)
            except LeRobotDatasetError as exc:
                raise _error(path, f"{where}: {str(exc).removeprefix(f'{path}: ')}") from None
            except Exception as exc:  # noqa: BLE001 (decoders raise anything for a broken file)
                raise _error(path, f"cannot decode {where} at {ts:.3f} s (truncated or not a video?): "
                                   f"{_first_line(exc)}") from None
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32) / 255.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    # torchcodec prefixes its messages with "<function>, <C++ source file>:<line>, "
    line = re.sub(r"^\w+, \S+\.(?:cpp|h):\d+, ", "", line)
    return f"{type(exc).__name__}: {line}"


def _decode_image(source: Path | io.BytesIO, where_file: Path, what: str) -> np.ndarray:
    """HWC uint8 pixels of an image file or bytes; a damaged image is one error naming the file."""
    try:
        with Image.open(source) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as exc:  # PIL raises SyntaxError for some broken PNGs
        raise _error(where_file, f"corrupt image for {what}: {_first_line(exc)}") from None


# --- metadata ----------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise _error(path, "missing") from None
    except (OSError, ValueError) as exc:
        raise _error(path, f"unreadable JSON: {exc}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise _error(path, "missing") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise _error(path, f"line {n}: not JSON: {exc}") from None
    return out


def _read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    if not path.is_file():
        raise _error(path, "missing parquet file")
    try:
        schema = pq.read_schema(path)
        if columns is not None:
            absent = [c for c in columns if c not in schema.names]
            if absent:
                raise _error(path, f"no column {absent[0]!r} (has {schema.names})")
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (pa.ArrowException, OSError) as exc:
        raise _error(path, f"unreadable parquet: {exc}") from None


def _read_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    if not path.is_file():
        raise _error(path, "missing: not a LeRobot dataset (expected meta/info.json)")
    info = _read_json(path)
    if not isinstance(info, dict):
        raise _error(path, "must be a JSON object")
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise _error(path, f"codebase_version {version!r} is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})")
    for key in ("features", "data_path"):
        if not info.get(key):
            raise _error(path, f"{key} is missing")
    return info


def _is_string(dtype: pa.DataType) -> bool:
    """Any Arrow string type: string, large_string (pandas 3), string_view, or dictionary of those."""
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or bool(is_view and is_view(dtype))


def _read_tasks_v3(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.parquet"
    table = _read_parquet(path)
    if "task_index" not in table.column_names:
        raise _error(path, "no column 'task_index'")
    # lerobot writes the task string as the (pandas) index; our demo writes a 'task' column
    names = [c for c in table.column_names if c != "task_index" and _is_string(table.schema.field(c).type)]
    if not names:
        raise _error(path, "no task string column")
    key = "task" if "task" in names else names[0]
    return dict(zip(table.column("task_index").to_pylist(), table.column(key).to_pylist()))


def _read_tasks_v2(root: Path) -> dict[int, str]:
    path = root / "meta" / "tasks.jsonl"
    rows = _read_jsonl(path)
    try:
        return {int(t["task_index"]): str(t["task"]) for t in rows}
    except (KeyError, TypeError, ValueError):
        raise _error(path, "each line needs task_index and task") from None


def _read_stats(root: Path, meta: list[dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """``meta/stats.json``; without it, the per-episode statistics aggregated (empty if none)."""
    path = root / "meta" / "stats.json"
    if path.is_file():
        stats = _read_json(path)
        if not isinstance(stats, dict):
            raise _error(path, "must be a JSON object of features")
        return stats
    per_episode: list[dict[str, dict[str, Any]]] = []
    v2_file = root / "meta" / "episodes_stats.jsonl"
    if v2_file.is_file():
        for n, row in enumerate(_read_jsonl(v2_file), 1):
            if not isinstance(row.get("stats"), dict):
                raise _error(v2_file, f"line {n}: needs a 'stats' object")
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
        return _aggregate_stats(per_episode)
    except (KeyError, ValueError, TypeError) as exc:
        where = v2_file if v2_file.is_file() else root / "meta" / "episodes"
        raise _error(where, f"per-episode statistics do not aggregate: {_first_line(exc)}") from None


def _aggregate_stats(per_episode: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, np.ndarray]]:
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


def _read_episodes_v3(root: Path) -> list[dict[str, Any]]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise _error(root / "meta" / "episodes", "missing: no chunk-*/file-*.parquet episode metadata")
    out = []
    for path in files:
        table = _read_parquet(path)
        for col in ("episode_index", "length"):
            if col not in table.column_names:
                raise _error(path, f"no column {col!r}")
        wanted = [c for c in table.column_names if c in ("episode_index", "length", "tasks")
                  or c.startswith(("data/", "videos/", "stats/"))]
        for row in table.select(wanted).to_pylist():
            out.append({**row, "_file": path})
    return sorted(out, key=lambda e: e["episode_index"])


def _read_episodes_v2(root: Path) -> list[dict[str, Any]]:
    path = root / "meta" / "episodes.jsonl"
    rows = _read_jsonl(path)
    for n, row in enumerate(rows, 1):
        if "episode_index" not in row or "length" not in row:
            raise _error(path, f"line {n}: needs episode_index and length")
    return sorted(rows, key=lambda e: e["episode_index"])


def _data_files_v3(root: Path, info: dict[str, Any], meta: list[dict[str, Any]]) -> list[tuple[Path, list[int]]]:
    """Each data file with the episodes the metadata places in it."""
    by_file: dict[tuple[int, int], list[int]] = {}
    for ep in meta:
        if "data/chunk_index" not in ep or "data/file_index" not in ep:
            raise _error(ep["_file"], "no columns data/chunk_index, data/file_index")
        by_file.setdefault((int(ep["data/chunk_index"]), int(ep["data/file_index"])), []).append(int(ep["episode_index"]))
    template = info["data_path"]
    files = {key: root / template.format(chunk_index=key[0], file_index=key[1]) for key in by_file}
    for ep in meta:
        ep["_data"] = files[(int(ep["data/chunk_index"]), int(ep["data/file_index"]))]
    return [(files[key], eps) for key, eps in sorted(by_file.items())]


def _data_files_v2(root: Path, info: dict[str, Any], meta: list[dict[str, Any]]) -> list[tuple[Path, list[int]]]:
    chunks = int(info.get("chunks_size") or 1000)
    template = info["data_path"]
    for ep in meta:
        idx = int(ep["episode_index"])
        ep["_data"] = root / template.format(episode_chunk=idx // chunks, episode_index=idx)
    return [(ep["_data"], [int(ep["episode_index"])]) for ep in meta]


def _read_frames(files: list[tuple[Path, list[int]]], embedded: list[str]) -> dict[str, Any]:
    """The frame columns of every data file, concatenated: numpy arrays (images: lists)."""
    columns = [STATE, ACTION, *_INDEX_COLUMNS, *embedded]
    parts: dict[str, list[Any]] = {c: [] for c in columns}
    for path, episodes in files:
        table = _read_parquet(path, columns)
        present = set(np.unique(table.column("episode_index").to_numpy()).tolist())
        absent = sorted(set(episodes) - present)
        if absent:
            raise _error(path, f"holds no frames of episode {absent[0]}, which the episode metadata places here")
        for c in (STATE, ACTION):
            parts[c].append(_matrix(table.column(c), path, c))
        for c in _INDEX_COLUMNS:
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


def _matrix(column: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    """A ``list<float>`` / fixed-size-list column as an (N, D) float32 array."""
    flat = column.combine_chunks()
    if not (pa.types.is_list(flat.type) or pa.types.is_fixed_size_list(flat.type) or pa.types.is_large_list(flat.type)):
        raise _error(path, f"column {name!r} is {flat.type}, expected a list of floats")
    values = flat.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    n = len(flat)
    if n and len(values) % n:
        raise _error(path, f"column {name!r} has rows of different lengths")
    return values.reshape(n, -1 if n else 0)


# --- video -------------------------------------------------------------------------------------


def _video_decoder(where: Path) -> Callable[[Path, float], np.ndarray]:
    """A function (video file, timestamp in s) -> HWC uint8 frame, from the first decoder installed."""
    import importlib.util

    if importlib.util.find_spec("torchcodec") is not None:
        return _decode_torchcodec
    if importlib.util.find_spec("av") is not None:
        return _decode_pyav
    if importlib.util.find_spec("torchvision") is not None:
        return _decode_torchvision
    raise VideoDecoderMissing(f"{where}: cameras are stored as video and no decoder is installed "
                              "(pip install torchcodec, or av); or convert the videos to image files")


@functools.lru_cache(maxsize=8)
def _torchcodec(path: Path) -> Any:
    from torchcodec.decoders import VideoDecoder

    return VideoDecoder(str(path))


def _past_end(path: Path, ts: float, end: float | None) -> LeRobotDatasetError:
    ends = f"the video ends at {end:.3f} s" if end is not None else "the video has no frames"
    return _error(path, f"no frame at {ts:.3f} s: {ends}, shorter than the dataset's metadata says")


def _decode_torchcodec(path: Path, ts: float) -> np.ndarray:
    decoder = _torchcodec(path)
    end = decoder.metadata.end_stream_seconds
    if end is not None and ts >= end:
        raise _past_end(path, ts, end)
    frames = decoder.get_frames_played_at(seconds=[ts])
    return frames.data[0].permute(1, 2, 0).numpy()


def _decode_pyav(path: Path, ts: float) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        half_frame = 0.5 / max(float(stream.average_rate or 30), 1.0)
        container.seek(max(0, int(ts / stream.time_base)), stream=stream, backward=True)
        last = None
        for frame in container.decode(stream):
            if frame.time is not None and frame.time >= ts - half_frame:
                return frame.to_ndarray(format="rgb24")
            last = frame.time
        raise _past_end(path, ts, None if last is None else last + 2 * half_frame)


def _decode_torchvision(path: Path, ts: float) -> np.ndarray:
    from torchvision.io import read_video

    frames, _, _ = read_video(str(path), start_pts=ts, end_pts=ts + 1e-3, pts_unit="sec")
    if len(frames) == 0:
        raise _error(path, f"no frame at {ts:.3f} s")
    return frames[0].numpy()
