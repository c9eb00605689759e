"""The pick-the-named-block task behind the VLA demo: a point gripper above a [-1, 1]² table, a
noisy scripted expert flying to the block the instruction names, and a top-down camera.

Episode ``k`` depends only on ``(seed, k)``; the LeRobot layouts are written by
:mod:`det_lab.data.demo_lerobot`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VLA_TASKS: tuple[str, ...] = (
    "pick up the red block",
    "pick up the green block",
    "pick up the blue block",
)
_BLOCK_COLORS = np.array([[230, 50, 50], [50, 200, 60], [60, 90, 240]], dtype=np.uint8)
_BACKGROUND = np.array([40, 40, 40], dtype=np.uint8)
_ROBOT_COLOR = np.array([255, 255, 255], dtype=np.uint8)

FPS = 10  # frames per second, and the simulation's step
_GAIN = 3.0  # 1/s: proportional gain of the scripted expert
_VMAX = 1.0  # m/s per axis
_ACTION_NOISE = 0.02  # m/s
_GRASP_TOLERANCE = 0.05  # m


@dataclass(frozen=True)
class Episode:
    """One generated episode; row t of each array is frame t."""

    task_index: int
    states: np.ndarray  # (T, 4) float32: x, y, z, gripper
    actions: np.ndarray  # (T, 4) float32: vx, vy, vz, gripper command
    images: np.ndarray  # (T, S, S, 3) uint8, the observation before the action

    @property
    def length(self) -> int:
        return len(self.states)


def generate_episodes(
    episodes: int, frames_per_episode: int, image_size: int, seed: int
) -> list[Episode]:
    """``episodes`` episodes of the task, cycling through :data:`VLA_TASKS`; ValueError for an
    argument out of range."""
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
) -> Episode:
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
        pos = np.clip(pos + action[:3] / FPS, [-1.0, -1.0, 0.0], [1.0, 1.0, 1.0])
        gripper = float(action[3])
    return Episode(
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
