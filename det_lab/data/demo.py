"""Small, deterministic demo datasets, generated offline.

Two kinds of demo data let every template run end to end without a real robot or camera:

* :func:`make_vla_demo` / :func:`make_vla_demo_v21` write a language-conditioned pick task as a
  LeRobot dataset (layout v3.0 or v2.1). A point gripper above a table must pick up the block
  whose colour the instruction names. Block positions change every episode and appear only in
  the camera image, so a policy needs image, state *and* instruction to act well.
* :func:`make_3dgs_demo` writes a synthetic scene of coloured 3D Gaussians in COLMAP layout
  (``images/`` + ``sparse/0/``), with images rendered by the same splatting model a 3D Gaussian
  Splatting trainer fits.

The datasets are versioned with DVC, where identical bytes mean an identical revision, so the
same arguments always give byte-identical files: no timestamps, sorted JSON keys, fixed PNG and
Parquet writer settings, and no pandas metadata. Bytes are reproducible for a given environment
(numpy, pyarrow, Pillow and zlib versions); another zlib may compress PNGs differently.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

__all__ = [
    "IMAGE_KEY",
    "IMAGE_PATH",
    "VLA_TASKS",
    "make_3dgs_demo",
    "make_vla_demo",
    "make_vla_demo_v21",
]

# --- LeRobot demo -------------------------------------------------------------------------

VLA_TASKS: tuple[str, ...] = (
    "pick up the red block",
    "pick up the green block",
    "pick up the blue block",
)
_BLOCK_COLORS = np.array([[230, 50, 50], [50, 200, 60], [60, 90, 240]], dtype=np.uint8)
_BACKGROUND = np.array([40, 40, 40], dtype=np.uint8)
_ROBOT_COLOR = np.array([255, 255, 255], dtype=np.uint8)

IMAGE_KEY = "observation.images.front"
IMAGE_PATH = "images/{image_key}/episode_{episode_index:06d}/frame_{frame_index:06d}.png"
_STATE_NAMES = ["x", "y", "z", "gripper"]
_ACTION_NAMES = ["vx", "vy", "vz", "gripper"]

_FPS = 10
_GAIN = 3.0  # 1/s: proportional gain of the scripted expert
_VMAX = 1.0  # m/s per axis
_ACTION_NOISE = 0.02  # m/s
_GRASP_TOLERANCE = 0.05  # m
_CHUNKS_SIZE = 1000
_DATA_FILES_SIZE_IN_MB = 100
_VIDEO_FILES_SIZE_IN_MB = 500


@dataclass(frozen=True)
class _Episode:
    """One generated episode; row t of each array is frame t."""

    task_index: int
    states: np.ndarray  # (T, 4) float32: x, y, z, gripper
    actions: np.ndarray  # (T, 4) float32: vx, vy, vz, gripper command
    images: np.ndarray  # (T, S, S, 3) uint8, the observation before the action

    @property
    def length(self) -> int:
        return len(self.states)


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
    dest = _prepare_dest(dest)
    eps = _generate_vla_episodes(episodes, frames_per_episode, image_size, seed)
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
    dest = _prepare_dest(dest)
    eps = _generate_vla_episodes(episodes, frames_per_episode, image_size, seed)
    _write_images(dest, eps)
    _write_lerobot_v21(dest, eps, image_size)
    return dest


def _generate_vla_episodes(
    episodes: int, frames_per_episode: int, image_size: int, seed: int
) -> list[_Episode]:
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if frames_per_episode < 2:
        raise ValueError(f"frames_per_episode must be >= 2, got {frames_per_episode}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    return [
        _simulate_episode(
            np.random.default_rng([seed, k]), k % len(VLA_TASKS), frames_per_episode, image_size
        )
        for k in range(episodes)
    ]


def _sample_blocks(rng: np.random.Generator) -> np.ndarray:
    """Positions of the red, green and blue blocks, at least 0.4 apart so none overlap."""
    while True:
        blocks = rng.uniform(-0.7, 0.7, size=(len(VLA_TASKS), 2))
        gaps = np.linalg.norm(blocks[:, None] - blocks[None], axis=-1) + np.eye(len(blocks))
        if gaps.min() >= 0.4:
            return blocks


def _expert_action(pos: np.ndarray, gripper: float, target: np.ndarray) -> np.ndarray:
    """Noise-free expert action (vx, vy, vz, gripper command) for one state."""
    if gripper < 0.5:
        dist = float(np.linalg.norm(target - pos[:2]))
        # Descend along a funnel while closing in, so the grasp happens without a separate phase.
        goal = np.array([target[0], target[1], min(1.0, 2.0 * dist)])
        close = dist < _GRASP_TOLERANCE and pos[2] < _GRASP_TOLERANCE
    else:
        goal = np.array([pos[0], pos[1], 1.0])  # lift straight up
        close = True
    velocity = np.clip(_GAIN * (goal - pos), -_VMAX, _VMAX)
    return np.append(velocity, 1.0 if close else 0.0)


def _simulate_episode(
    rng: np.random.Generator, task_index: int, length: int, image_size: int
) -> _Episode:
    blocks = _sample_blocks(rng)
    pos = np.array([*rng.uniform(-0.8, 0.8, size=2), 1.0])
    gripper = 0.0
    states, actions, images = [], [], []
    for _ in range(length):
        states.append([*pos, gripper])
        images.append(_render_vla_frame(blocks, task_index, pos, gripper, image_size))
        action = _expert_action(pos, gripper, blocks[task_index])
        action[:3] += _ACTION_NOISE * rng.standard_normal(3)
        actions.append(action)
        pos = np.clip(pos + action[:3] / _FPS, [-1.0, -1.0, 0.0], [1.0, 1.0, 1.0])
        gripper = float(action[3])
    return _Episode(
        task_index=task_index,
        states=np.asarray(states, dtype=np.float32),
        actions=np.asarray(actions, dtype=np.float32),
        images=np.stack(images),
    )


def _to_pixels(xy: np.ndarray, size: int) -> tuple[float, float]:
    """Table coordinates in [-1, 1]² to continuous pixel coordinates (column, row); +y is up."""
    return (float(xy[0]) + 1.0) / 2.0 * size, (1.0 - float(xy[1])) / 2.0 * size


def _render_vla_frame(
    blocks: np.ndarray, task_index: int, pos: np.ndarray, gripper: float, size: int
) -> np.ndarray:
    """Top-down camera: the gripper as a white disc growing with height, coloured square blocks.

    Blocks are drawn last so that they stay visible under the gripper; its position is in the
    state anyway.
    """
    image = np.broadcast_to(_BACKGROUND, (size, size, 3)).copy()
    rows, cols = np.mgrid[0:size, 0:size] + 0.5
    cx, cy = _to_pixels(pos[:2], size)
    radius = size / 32 * (1.0 + 1.5 * float(pos[2]))
    image[(cols - cx) ** 2 + (rows - cy) ** 2 <= radius**2] = _ROBOT_COLOR
    half = max(1.0, size / 16)  # blocks are size/8 pixels wide
    for i, xy in enumerate(blocks):
        if i == task_index and gripper >= 0.5:
            xy = pos[:2]  # the picked block travels with the gripper
        cx, cy = _to_pixels(xy, size)
        image[(np.abs(cols - cx) < half) & (np.abs(rows - cy) < half)] = _BLOCK_COLORS[i]
    return image


def _write_images(dest: Path, eps: Sequence[_Episode]) -> None:
    for episode_index, ep in enumerate(eps):
        for frame_index, frame in enumerate(ep.images):
            rel = IMAGE_PATH.format(
                image_key=IMAGE_KEY, episode_index=episode_index, frame_index=frame_index
            )
            _write_png(dest / rel, frame)


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


def _lerobot_info(eps: Sequence[_Episode], image_size: int) -> dict[str, Any]:
    """The ``meta/info.json`` keys that v2.1 and v3.0 share."""
    return {
        "robot_type": "point_gripper_2d",
        "fps": _FPS,
        "total_episodes": len(eps),
        "total_frames": sum(ep.length for ep in eps),
        "total_tasks": len(_used_tasks(eps)),
        "chunks_size": _CHUNKS_SIZE,
        "splits": {"train": f"0:{len(eps)}"},
        "video_path": None,
        "image_path": IMAGE_PATH,
        "features": _lerobot_features(image_size),
    }


def _used_tasks(eps: Sequence[_Episode]) -> list[int]:
    return sorted({ep.task_index for ep in eps})


def _frames_table(eps: Sequence[_Episode], episode_indices: Sequence[int], first_index: int) -> pa.Table:
    """The frames of ``eps`` as a LeRobot data table; global ``index`` starts at ``first_index``."""
    lengths = [ep.length for ep in eps]
    frame_index = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    return pa.table({
        "observation.state": _list_array(np.concatenate([ep.states for ep in eps])),
        "action": _list_array(np.concatenate([ep.actions for ep in eps])),
        "next.done": pa.array(np.concatenate([np.arange(n) == n - 1 for n in lengths])),
        "timestamp": pa.array((frame_index / _FPS).astype(np.float32)),
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


def _lerobot_stats(frames: pa.Table, eps: Sequence[_Episode]) -> dict[str, Any]:
    """Statistics of every feature over ``frames`` (the data table of ``eps``)."""
    stats: dict[str, Any] = {IMAGE_KEY: _image_stats(np.concatenate([ep.images for ep in eps]))}
    for name, column in zip(frames.column_names, frames.columns):
        if pa.types.is_list(column.type):
            values = np.asarray(column.combine_chunks().flatten()).reshape(len(column), -1)
        else:
            values = np.asarray(column, dtype=np.float64).reshape(-1, 1)
        stats[name] = _feature_stats(values)
    return stats


def _write_lerobot_v30(dest: Path, eps: Sequence[_Episode], image_size: int) -> None:
    indices = list(range(len(eps)))
    info = _lerobot_info(eps, image_size) | {
        "codebase_version": "v3.0",
        "data_files_size_in_mb": _DATA_FILES_SIZE_IN_MB,
        "video_files_size_in_mb": _VIDEO_FILES_SIZE_IN_MB,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
    }
    _write_json(dest / "meta" / "info.json", info)
    frames = _frames_table(eps, indices, 0)
    _write_json(dest / "meta" / "stats.json", _lerobot_stats(frames, eps))
    tasks = _used_tasks(eps)
    _write_parquet(
        dest / "meta" / "tasks.parquet",
        pa.table({
            "task_index": pa.array(tasks, type=pa.int64()),
            "task": pa.array([VLA_TASKS[t] for t in tasks], type=pa.string()),
        }),
    )
    ends = np.cumsum([ep.length for ep in eps]).tolist()
    zeros = pa.array([0] * len(eps), type=pa.int64())
    _write_parquet(
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
    _write_parquet(dest / "data" / "chunk-000" / "file-000.parquet", frames)


def _write_lerobot_v21(dest: Path, eps: Sequence[_Episode], image_size: int) -> None:
    info = _lerobot_info(eps, image_size) | {
        "codebase_version": "v2.1",
        "total_chunks": 1 + (len(eps) - 1) // _CHUNKS_SIZE,
        "total_videos": 0,
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
    }
    _write_json(dest / "meta" / "info.json", info)
    indices = list(range(len(eps)))
    _write_json(dest / "meta" / "stats.json", _lerobot_stats(_frames_table(eps, indices, 0), eps))
    tasks = [{"task_index": t, "task": VLA_TASKS[t]} for t in _used_tasks(eps)]
    _write_jsonl(dest / "meta" / "tasks.jsonl", tasks)
    _write_jsonl(
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
        _write_parquet(dest / path, frames)
        episode_stats.append({"episode_index": i, "stats": _lerobot_stats(frames, [ep])})
        first += ep.length
    _write_jsonl(dest / "meta" / "episodes_stats.jsonl", episode_stats)


# --- 3DGS demo ----------------------------------------------------------------------------

_N_BLOBS = 32
_CAMERA_RADIUS = 4.0
_CAMERA_ELEVATIONS_DEG = (15.0, 40.0)  # alternate views between two rings
_PINHOLE_MODEL_ID = 1
_LOW_PASS = 0.3  # px², the screen-space dilation 3DGS rasterizers add to every 2D covariance
_OBSERVATION_NOISE_PX = 0.3


@dataclass(frozen=True)
class _Blobs:
    centers: np.ndarray  # (B, 3)
    sigmas: np.ndarray  # (B,) isotropic standard deviations
    colors: np.ndarray  # (B, 3) in [0, 1]
    opacities: np.ndarray  # (B,)


@dataclass(frozen=True)
class _ColmapImage:
    image_id: int
    qvec: np.ndarray  # (4,) world-to-camera rotation (qw, qx, qy, qz)
    tvec: np.ndarray  # (3,) world-to-camera translation
    name: str
    xys: np.ndarray  # (N, 2) observed keypoints, pixels
    point3d_ids: np.ndarray  # (N,) int64


@dataclass(frozen=True)
class _ColmapModel:
    """A COLMAP reconstruction with one PINHOLE camera (id 1) shared by all images."""

    width: int
    height: int
    params: tuple[float, float, float, float]  # fx, fy, cx, cy
    images: list[_ColmapImage]
    point_ids: np.ndarray  # (P,) int64
    xyz: np.ndarray  # (P, 3)
    rgb: np.ndarray  # (P, 3) uint8
    errors: np.ndarray  # (P,)
    tracks: list[list[tuple[int, int]]]  # per point: (image_id, point2D_idx)


def make_3dgs_demo(
    dest: Path,
    *,
    n_views: int = 16,
    image_size: int = 64,
    n_points: int = 200,
    seed: int = 0,
    fmt: Literal["text", "binary"] = "text",
) -> Path:
    """Write a synthetic scene of coloured 3D Gaussians in COLMAP layout into ``dest``.

    Layout: ``images/view_{i:03d}.png`` and the COLMAP model in ``sparse/0/`` —
    ``cameras.txt``, ``images.txt``, ``points3D.txt`` for ``fmt="text"``, or ``cameras.bin``,
    ``images.bin``, ``points3D.bin`` for ``fmt="binary"``. One PINHOLE camera with
    fx = fy = ``image_size`` and the principal point at the image centre; the cameras sit on two
    rings of radius 4 around the origin, looking at it. Images are alpha-composited splats of
    32 isotropic Gaussians on black, front to back, as a 3DGS rasterizer renders them.
    ``points3D`` are noisy samples of the Gaussians with their colours (an SfM-like
    initialisation), with tracks to every view they project into.

    Args:
        dest: Directory to create; it may exist only if empty.
        n_views: Number of cameras and images.
        image_size: Width and height of each image, in pixels.
        n_points: Number of 3D points in the sparse model.
        seed: Seed of the scene and of the points' noise.
        fmt: COLMAP model format to write.

    Returns:
        ``dest``.

    Raises:
        ValueError: If ``dest`` exists and is not an empty directory, or an argument is out of
            range.
    """
    if n_views < 1 or image_size < 8 or n_points < 1:
        raise ValueError(
            "need n_views >= 1, image_size >= 8 and n_points >= 1; "
            f"got {n_views}, {image_size}, {n_points}"
        )
    if fmt not in ("text", "binary"):
        raise ValueError(f"fmt must be 'text' or 'binary', got {fmt!r}")
    dest = _prepare_dest(dest)
    rng = np.random.default_rng(seed)
    blobs = _sample_blobs(rng)
    intrinsics = (float(image_size), float(image_size), image_size / 2.0, image_size / 2.0)
    poses = [_look_at_origin(_camera_center(i, n_views)) for i in range(n_views)]
    for i, (rot, trans) in enumerate(poses):
        image = _splat(blobs, rot, trans, intrinsics, image_size)
        _write_png(dest / "images" / f"view_{i:03d}.png", image)
    model = _sparse_model(rng, blobs, poses, intrinsics, image_size, n_points)
    sparse = dest / "sparse" / "0"
    if fmt == "text":
        _write_colmap_text(sparse, model)
    else:
        _write_colmap_binary(sparse, model)
    return dest


def _sample_blobs(rng: np.random.Generator) -> _Blobs:
    directions = rng.standard_normal((_N_BLOBS, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radii = 1.3 * rng.uniform(0.0, 1.0, _N_BLOBS) ** (1 / 3)  # uniform in a ball
    return _Blobs(
        centers=directions * radii[:, None],
        sigmas=rng.uniform(0.08, 0.22, _N_BLOBS),
        colors=rng.uniform(0.15, 1.0, (_N_BLOBS, 3)),
        opacities=rng.uniform(0.6, 0.95, _N_BLOBS),
    )


def _camera_center(i: int, n_views: int) -> np.ndarray:
    azimuth = 2 * math.pi * i / n_views
    elevation = math.radians(_CAMERA_ELEVATIONS_DEG[i % len(_CAMERA_ELEVATIONS_DEG)])
    return _CAMERA_RADIUS * np.array([
        math.cos(elevation) * math.cos(azimuth),
        math.cos(elevation) * math.sin(azimuth),
        math.sin(elevation),
    ])


def _look_at_origin(center: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World-to-camera (R, t) in COLMAP's convention: x right, y down, z forward; world z up."""
    forward = -center / np.linalg.norm(center)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    rot = np.stack([right, down, forward])
    return rot, -rot @ center


def _project(
    points: np.ndarray, rot: np.ndarray, trans: np.ndarray, intrinsics: tuple[float, float, float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Camera-frame points, pixel coordinates (COLMAP: pixel centres at +0.5) and depths."""
    fx, fy, cx, cy = intrinsics
    cam = points @ rot.T + trans
    z = cam[:, 2]
    uv = np.stack([fx * cam[:, 0] / z + cx, fy * cam[:, 1] / z + cy], axis=1)
    return cam, uv, z


def _splat(
    blobs: _Blobs,
    rot: np.ndarray,
    trans: np.ndarray,
    intrinsics: tuple[float, float, float, float],
    size: int,
) -> np.ndarray:
    """Render the blobs with the 3DGS image model: EWA-projected 2D Gaussians, alpha-blended."""
    fx, fy, _, _ = intrinsics
    cam, uv, z = _project(blobs.centers, rot, trans, intrinsics)
    # Covariance of an isotropic Gaussian is rotation invariant, so Σ2D = σ² J Jᵀ.
    jac = np.zeros((len(z), 2, 3))
    jac[:, 0, 0] = fx / z
    jac[:, 0, 2] = -fx * cam[:, 0] / z**2
    jac[:, 1, 1] = fy / z
    jac[:, 1, 2] = -fy * cam[:, 1] / z**2
    cov = blobs.sigmas[:, None, None] ** 2 * jac @ jac.transpose(0, 2, 1) + _LOW_PASS * np.eye(2)
    inv = np.linalg.inv(cov)
    py, px = np.mgrid[0:size, 0:size] + 0.5
    color = np.zeros((size, size, 3))
    transmittance = np.ones((size, size))
    for b in np.argsort(z, kind="stable"):
        if z[b] <= 0.1:
            continue
        dx, dy = px - uv[b, 0], py - uv[b, 1]
        power = -0.5 * (inv[b, 0, 0] * dx**2 + 2 * inv[b, 0, 1] * dx * dy + inv[b, 1, 1] * dy**2)
        alpha = np.minimum(0.99, blobs.opacities[b] * np.exp(power))
        color += (transmittance * alpha)[..., None] * blobs.colors[b]
        transmittance *= 1.0 - alpha
    return np.round(np.clip(color, 0.0, 1.0) * 255).astype(np.uint8)  # black background


def _sparse_model(
    rng: np.random.Generator,
    blobs: _Blobs,
    poses: list[tuple[np.ndarray, np.ndarray]],
    intrinsics: tuple[float, float, float, float],
    size: int,
    n_points: int,
) -> _ColmapModel:
    """Noisy blob samples as 3D points, observed (with pixel noise) in every view they fall in."""
    owner = np.arange(n_points) % _N_BLOBS
    xyz = blobs.centers[owner] + blobs.sigmas[owner, None] * rng.standard_normal((n_points, 3))
    rgb = np.clip(np.round(blobs.colors[owner] * 255 + rng.normal(0.0, 8.0, (n_points, 3))), 0, 255)
    point_ids = np.arange(1, n_points + 1, dtype=np.int64)
    tracks: list[list[tuple[int, int]]] = [[] for _ in range(n_points)]
    residuals: list[list[float]] = [[] for _ in range(n_points)]
    images = []
    for i, (rot, trans) in enumerate(poses):
        image_id = i + 1
        _, uv, z = _project(xyz, rot, trans, intrinsics)
        observed = uv + rng.normal(0.0, _OBSERVATION_NOISE_PX, uv.shape)
        visible = np.flatnonzero((z > 0.1) & np.all((observed >= 0) & (observed < size), axis=1))
        for idx, p in enumerate(visible):
            tracks[p].append((image_id, idx))
            residuals[p].append(float(np.linalg.norm(observed[p] - uv[p])))
        images.append(
            _ColmapImage(
                image_id=image_id,
                qvec=_rotmat_to_qvec(rot),
                tvec=trans,
                name=f"view_{i:03d}.png",
                xys=observed[visible],
                point3d_ids=point_ids[visible],
            )
        )
    fx, fy, cx, cy = intrinsics
    return _ColmapModel(
        width=size,
        height=size,
        params=(fx, fy, cx, cy),
        images=images,
        point_ids=point_ids,
        xyz=xyz,
        rgb=rgb.astype(np.uint8),
        errors=np.array([np.mean(r) if r else 0.0 for r in residuals]),
        tracks=tracks,
    )


def _rotmat_to_qvec(rot: np.ndarray) -> np.ndarray:
    """Unit quaternion (qw, qx, qy, qz) of a rotation matrix, with qw >= 0 (Shepperd's method)."""
    m = rot
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    if trace > 0:
        s = 2.0 * math.sqrt(trace + 1.0)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    qvec = np.array(q) / np.linalg.norm(q)
    return -qvec if qvec[0] < 0 else qvec


def _fmt(values: Any) -> str:
    """Space-separated shortest round-trip reprs, so text and binary models hold equal numbers."""
    return " ".join(repr(float(v)) for v in np.ravel(values))


def _points(model: _ColmapModel) -> zip[tuple[Any, ...]]:
    return zip(model.point_ids, model.xyz, model.rgb, model.errors, model.tracks)


def _write_colmap_text(sparse: Path, model: _ColmapModel) -> None:
    """``cameras.txt``, ``images.txt``, ``points3D.txt`` in COLMAP's TEXT model format."""
    sparse.mkdir(parents=True, exist_ok=True)
    cameras = [
        "# Camera list with one line of data per camera:",
        "#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]",
        "# Number of cameras: 1",
        f"1 PINHOLE {model.width} {model.height} {_fmt(model.params)}",
    ]
    n_obs = sum(len(im.xys) for im in model.images)
    per_image, per_point = n_obs / len(model.images), n_obs / len(model.point_ids)
    images = [
        "# Image list with two lines of data per image:",
        "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME",
        "#   POINTS2D[] as (X, Y, POINT3D_ID)",
        f"# Number of images: {len(model.images)}, mean observations per image: {per_image!r}",
    ]
    for im in model.images:
        images.append(f"{im.image_id} {_fmt(im.qvec)} {_fmt(im.tvec)} 1 {im.name}")
        images.append(" ".join(f"{_fmt(xy)} {pid}" for xy, pid in zip(im.xys, im.point3d_ids)))
    points = [
        "# 3D point list with one line of data per point:",
        "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)",
        f"# Number of points: {len(model.point_ids)}, mean track length: {per_point!r}",
    ]
    for pid, xyz, rgb, err, track in _points(model):
        fields = [str(pid), _fmt(xyz), " ".join(str(int(c)) for c in rgb), _fmt(err)]
        fields += [f"{image_id} {idx}" for image_id, idx in track]
        points.append(" ".join(fields))
    for name, lines in (("cameras.txt", cameras), ("images.txt", images), ("points3D.txt", points)):
        (sparse / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_colmap_binary(sparse: Path, model: _ColmapModel) -> None:
    """``cameras.bin``, ``images.bin``, ``points3D.bin`` in COLMAP's little-endian BINARY format."""
    sparse.mkdir(parents=True, exist_ok=True)
    cameras = struct.pack("<Q", 1) + struct.pack(
        "<iiQQ4d", 1, _PINHOLE_MODEL_ID, model.width, model.height, *model.params
    )
    images = [struct.pack("<Q", len(model.images))]
    for im in model.images:
        images.append(struct.pack("<i4d3di", im.image_id, *im.qvec, *im.tvec, 1))
        images.append(im.name.encode("utf-8") + b"\x00")
        images.append(struct.pack("<Q", len(im.xys)))
        for (x, y), pid in zip(im.xys, im.point3d_ids):
            images.append(struct.pack("<ddq", x, y, pid))
    points = [struct.pack("<Q", len(model.point_ids))]
    for pid, xyz, rgb, err, track in _points(model):
        points.append(struct.pack("<Q3d3BdQ", pid, *xyz, *rgb, err, len(track)))
        points.extend(struct.pack("<ii", image_id, idx) for image_id, idx in track)
    (sparse / "cameras.bin").write_bytes(cameras)
    (sparse / "images.bin").write_bytes(b"".join(images))
    (sparse / "points3D.bin").write_bytes(b"".join(points))


# --- deterministic file writers -----------------------------------------------------------


def _prepare_dest(dest: Path) -> Path:
    """Create ``dest``; refuse one that holds anything, so a dataset is never mixed with another."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise ValueError(f"dataset destination {dest} exists and is not a directory")
        if any(dest.iterdir()):
            raise ValueError(f"dataset destination {dest} is not empty; pick a new or empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def _write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Pillow writes no tIME chunk; fixing the compression settings fixes the bytes.
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(
        path, format="PNG", compress_level=6, optimize=False
    )


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, rows: Sequence[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row, sort_keys=True, allow_nan=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table,
        path,
        version="2.6",
        compression="snappy",
        use_dictionary=False,
        write_statistics=True,
        row_group_size=1 << 20,
        data_page_version="1.0",
        store_schema=True,
    )
