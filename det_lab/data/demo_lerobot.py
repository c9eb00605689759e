"""The VLA demo as a LeRobot dataset, layout v3.0 (:func:`make_vla_demo`) or v2.1
(:func:`make_vla_demo_v21`): the episodes of :mod:`det_lab.data.demo_pick` with their images,
frames table, tasks, episodes and statistics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from det_lab.data.demo_files import prepare_dest, write_json, write_jsonl, write_parquet, write_png
from det_lab.data.demo_pick import FPS, VLA_TASKS, Episode, generate_episodes

IMAGE_KEY = "observation.images.front"
IMAGE_PATH = "images/{image_key}/episode_{episode_index:06d}/frame_{frame_index:06d}.png"
_STATE_NAMES = ["x", "y", "z", "gripper"]
_ACTION_NAMES = ["vx", "vy", "vz", "gripper"]

_CHUNKS_SIZE = 1000
_DATA_FILES_SIZE_IN_MB = 100
_VIDEO_FILES_SIZE_IN_MB = 500


def make_vla_demo(
    dest: Path,
    *,
    episodes: int = 12,
    frames_per_episode: int = 40,
    image_size: int = 32,
    seed: int = 0,
) -> Path:
    """Write the pick-the-named-block demo as a LeRobot v3.0 dataset into ``dest``.

    Layout: ``meta/info.json``, ``meta/stats.json``, ``meta/tasks.parquet``,
    ``meta/episodes/chunk-000/file-000.parquet``, all frames in
    ``data/chunk-000/file-000.parquet``, and the camera ``observation.images.front`` as PNG
    files at ``info["image_path"]`` (:data:`IMAGE_PATH`); ``video_path`` is null.

    Each frame holds ``observation.state`` = (x, y, z, gripper) of a point gripper over a
    [-1, 1]² table and ``action`` = (vx, vy, vz, gripper command) from a noisy scripted expert
    that flies to the named block, descends, closes the gripper and lifts it.

    Args:
        dest: Directory to create; it may exist only if empty.
        episodes: Number of episodes; tasks cycle through :data:`VLA_TASKS`.
        frames_per_episode: Frames per episode, at 10 fps.
        image_size: Side of the square RGB camera image, in pixels.
        seed: Episode ``k`` depends only on ``(seed, k)``.

    Returns:
        ``dest``.

    Raises:
        ValueError: If ``dest`` exists and is not an empty directory, or an argument is out of
            range.
    """
    dest = prepare_dest(dest)
    eps = generate_episodes(episodes, frames_per_episode, image_size, seed)
    _write_images(dest, eps)
    _write_lerobot_v30(dest, eps, image_size)
    return dest


def make_vla_demo_v21(
    dest: Path,
    *,
    episodes: int = 12,
    frames_per_episode: int = 40,
    image_size: int = 32,
    seed: int = 0,
) -> Path:
    """Write the same demo as :func:`make_vla_demo` in the LeRobot v2.1 layout.

    Layout: one ``data/chunk-000/episode_{episode_index:06d}.parquet`` per episode,
    ``meta/info.json``, ``meta/episodes.jsonl``, ``meta/tasks.jsonl``,
    ``meta/episodes_stats.jsonl``, ``meta/stats.json`` and the same PNG images. Frames, images
    and statistics equal those of :func:`make_vla_demo` for the same arguments.

    Args and Raises: as :func:`make_vla_demo`.

    Returns:
        ``dest``.
    """
    dest = prepare_dest(dest)
    eps = generate_episodes(episodes, frames_per_episode, image_size, seed)
    _write_images(dest, eps)
    _write_lerobot_v21(dest, eps, image_size)
    return dest


def _write_images(dest: Path, eps: Sequence[Episode]) -> None:
    for episode_index, ep in enumerate(eps):
        for frame_index, frame in enumerate(ep.images):
            rel = IMAGE_PATH.format(
                image_key=IMAGE_KEY, episode_index=episode_index, frame_index=frame_index
            )
            write_png(dest / rel, frame)


def _lerobot_features(image_size: int) -> dict[str, dict[str, Any]]:
    scalar = {"shape": [1], "names": None}
    return {
        IMAGE_KEY: {
            "dtype": "image",
            "shape": [image_size, image_size, 3],
            "names": ["height", "width", "channels"],
        },
        "observation.state": {"dtype": "float32", "shape": [len(_STATE_NAMES)], "names": _STATE_NAMES},
        "action": {"dtype": "float32", "shape": [len(_ACTION_NAMES)], "names": _ACTION_NAMES},
        "next.done": {"dtype": "bool", **scalar},
        "timestamp": {"dtype": "float32", **scalar},
        "frame_index": {"dtype": "int64", **scalar},
        "episode_index": {"dtype": "int64", **scalar},
        "index": {"dtype": "int64", **scalar},
        "task_index": {"dtype": "int64", **scalar},
    }


def _lerobot_info(eps: Sequence[Episode], image_size: int) -> dict[str, Any]:
    """The ``meta/info.json`` keys that v2.1 and v3.0 share."""
    return {
        "robot_type": "point_gripper_2d",
        "fps": FPS,
        "total_episodes": len(eps),
        "total_frames": sum(ep.length for ep in eps),
        "total_tasks": len(_used_tasks(eps)),
        "chunks_size": _CHUNKS_SIZE,
        "splits": {"train": f"0:{len(eps)}"},
        "video_path": None,
        "image_path": IMAGE_PATH,
        "features": _lerobot_features(image_size),
    }


def _used_tasks(eps: Sequence[Episode]) -> list[int]:
    return sorted({ep.task_index for ep in eps})


def _frames_table(eps: Sequence[Episode], episode_indices: Sequence[int], first_index: int) -> pa.Table:
    """The frames of ``eps`` as a LeRobot data table; global ``index`` starts at ``first_index``."""
    lengths = [ep.length for ep in eps]
    frame_index = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    return pa.table({
        "observation.state": _list_array(np.concatenate([ep.states for ep in eps])),
        "action": _list_array(np.concatenate([ep.actions for ep in eps])),
        "next.done": pa.array(np.concatenate([np.arange(n) == n - 1 for n in lengths])),
        "timestamp": pa.array((frame_index / FPS).astype(np.float32)),
        "frame_index": pa.array(frame_index),
        "episode_index": pa.array(np.repeat(np.asarray(episode_indices, dtype=np.int64), lengths)),
        "index": pa.array(np.arange(first_index, first_index + sum(lengths), dtype=np.int64)),
        "task_index": pa.array(np.repeat([ep.task_index for ep in eps], lengths).astype(np.int64)),
    })


def _list_array(values: np.ndarray) -> pa.Array:
    """(N, D) float32 rows as a ``list<float32>`` column."""
    n, d = values.shape
    offsets = pa.array(np.arange(0, (n + 1) * d, d, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float32()))


def _feature_stats(values: np.ndarray) -> dict[str, list[Any]]:
    """LeRobot statistics of (N, D) values along axis 0."""
    v = values.astype(np.float64)
    return {
        "min": v.min(axis=0).tolist(),
        "max": v.max(axis=0).tolist(),
        "mean": v.mean(axis=0).tolist(),
        "std": v.std(axis=0).tolist(),
        "count": [len(v)],
    }


def _image_stats(images: np.ndarray) -> dict[str, list[Any]]:
    """Per-channel statistics of uint8 images scaled to [0, 1], shaped (3, 1, 1) like LeRobot's."""
    flat = _feature_stats(images.reshape(-1, 3) / 255.0)
    stats: dict[str, list[Any]] = {k: [[[x]] for x in flat[k]] for k in ("min", "max", "mean", "std")}
    stats["count"] = [len(images)]
    return stats


def _lerobot_stats(frames: pa.Table, eps: Sequence[Episode]) -> dict[str, Any]:
    """Statistics of every feature over ``frames`` (the data table of ``eps``)."""
    stats: dict[str, Any] = {IMAGE_KEY: _image_stats(np.concatenate([ep.images for ep in eps]))}
    for name, column in zip(frames.column_names, frames.columns):
        if pa.types.is_list(column.type):
            values = np.asarray(column.combine_chunks().flatten()).reshape(len(column), -1)
        else:
            values = np.asarray(column, dtype=np.float64).reshape(-1, 1)
        stats[name] = _feature_stats(values)
    return stats


def _write_lerobot_v30(dest: Path, eps: Sequence[Episode], image_size: int) -> None:
    indices = list(range(len(eps)))
    info = _lerobot_info(eps, image_size) | {
        "codebase_version": "v3.0",
        "data_files_size_in_mb": _DATA_FILES_SIZE_IN_MB,
        "video_files_size_in_mb": _VIDEO_FILES_SIZE_IN_MB,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
    }
    write_json(dest / "meta" / "info.json", info)
    frames = _frames_table(eps, indices, 0)
    write_json(dest / "meta" / "stats.json", _lerobot_stats(frames, eps))
    tasks = _used_tasks(eps)
    write_parquet(
        dest / "meta" / "tasks.parquet",
        pa.table({
            "task_index": pa.array(tasks, type=pa.int64()),
            "task": pa.array([VLA_TASKS[t] for t in tasks], type=pa.string()),
        }),
    )
    ends = np.cumsum([ep.length for ep in eps]).tolist()
    zeros = pa.array([0] * len(eps), type=pa.int64())
    write_parquet(
        dest / "meta" / "episodes" / "chunk-000" / "file-000.parquet",
        pa.table({
            "episode_index": pa.array(indices, type=pa.int64()),
            "tasks": pa.array([[VLA_TASKS[ep.task_index]] for ep in eps], type=pa.list_(pa.string())),
            "length": pa.array([ep.length for ep in eps], type=pa.int64()),
            "data/chunk_index": zeros,
            "data/file_index": zeros,
            "dataset_from_index": pa.array([0, *ends[:-1]], type=pa.int64()),
            "dataset_to_index": pa.array(ends, type=pa.int64()),
            "meta/episodes/chunk_index": zeros,
            "meta/episodes/file_index": zeros,
        }),
    )
    write_parquet(dest / "data" / "chunk-000" / "file-000.parquet", frames)


def _write_lerobot_v21(dest: Path, eps: Sequence[Episode], image_size: int) -> None:
    info = _lerobot_info(eps, image_size) | {
        "codebase_version": "v2.1",
        "total_chunks": 1 + (len(eps) - 1) // _CHUNKS_SIZE,
        "total_videos": 0,
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
    }
    write_json(dest / "meta" / "info.json", info)
    indices = list(range(len(eps)))
    write_json(dest / "meta" / "stats.json", _lerobot_stats(_frames_table(eps, indices, 0), eps))
    tasks = [{"task_index": t, "task": VLA_TASKS[t]} for t in _used_tasks(eps)]
    write_jsonl(dest / "meta" / "tasks.jsonl", tasks)
    write_jsonl(
        dest / "meta" / "episodes.jsonl",
        [
            {"episode_index": i, "tasks": [VLA_TASKS[ep.task_index]], "length": ep.length}
            for i, ep in enumerate(eps)
        ],
    )
    episode_stats = []
    first = 0
    for i, ep in enumerate(eps):
        frames = _frames_table([ep], [i], first)
        path = info["data_path"].format(episode_chunk=i // _CHUNKS_SIZE, episode_index=i)
        write_parquet(dest / path, frames)
        episode_stats.append({"episode_index": i, "stats": _lerobot_stats(frames, [ep])})
        first += ep.length
    write_jsonl(dest / "meta" / "episodes_stats.jsonl", episode_stats)
