"""LeRobot's training items, read by det_lab's reader: what ``LeRobotDataset.__getitem__`` returns.

A policy config asks for frames around each item through its ``delta_indices`` (LeRobot's
``resolve_delta_timestamps`` in frames): ACT an action chunk ``t .. t+99``, Diffusion two
observations ``t-1, t`` and actions ``t-1 .. t+14``. As LeRobot does, each offset is clamped to
the item's episode and flagged in ``<key>_is_pad``; every item also carries the task string and
its index columns. Images are ``(C, H, W)`` float32 in [0, 1] (a history stacks them:
``(T, C, H, W)``), so the batches a loader collates from these items are LeRobot's batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from det_lab.formats import LeRobotDataset


class PolicyFrames(torch.utils.data.Dataset[dict[str, Any]]):
    """The items of ``frames`` with the offsets ``delta_indices`` asks for (see the module doc).

    Args:
        frames: det_lab's reader over the episodes to serve.
        delta_indices: feature key -> frame offsets (``None``: the current frame only).
        drop_n_last_frames: leave out each episode's last frames, as LeRobot's
            ``EpisodeAwareSampler`` does for policies that set it (Diffusion: 7).
    """

    def __init__(self, frames: LeRobotDataset, delta_indices: Mapping[str, Sequence[int]] | None = None,
                 drop_n_last_frames: int = 0) -> None:
        self.frames = frames
        self.delta_indices = {k: np.asarray(v, dtype=np.int64) for k, v in (delta_indices or {}).items()}
        rows = frames.rows
        ends = np.asarray([self._bounds(r)[1] for r in rows], dtype=np.int64)
        self.rows = rows[rows < ends - int(drop_n_last_frames)] if drop_n_last_frames else rows
        self.keys = ["observation.state", "action", *frames.cameras]

    def __len__(self) -> int:
        return len(self.rows)

    def _bounds(self, row: int) -> tuple[int, int]:
        episode = self.frames.episodes[int(self.frames.episode_index[row])]
        return episode.start, episode.start + episode.length

    def _read(self, key: str, row: int) -> torch.Tensor:
        f = self.frames
        if key == "observation.state":
            return torch.from_numpy(np.asarray(f.state[row]))
        if key == "action":
            return torch.from_numpy(np.asarray(f.action[row]))
        return torch.from_numpy(f.image(key, row))

    def __getitem__(self, i: int) -> dict[str, Any]:
        f = self.frames
        row = int(self.rows[i])
        start, end = self._bounds(row)
        item: dict[str, Any] = {}
        for key in self.keys:
            deltas = self.delta_indices.get(key)
            if deltas is None:
                item[key] = self._read(key, row)
                continue
            wanted = row + deltas
            rows = np.clip(wanted, start, end - 1)
            item[key] = torch.stack([self._read(key, int(r)) for r in rows])
            item[f"{key}_is_pad"] = torch.from_numpy((wanted < start) | (wanted >= end))
        task_index = int(f.task_index[row])
        item.update({
            "timestamp": torch.tensor(float(f.timestamp[row]), dtype=torch.float32),
            "frame_index": torch.tensor(int(f.frame_index[row])),
            "episode_index": torch.tensor(int(f.episode_index[row])),
            "index": torch.tensor(int(f.index[row])),
            "task_index": torch.tensor(task_index),
            "task": f.tasks.get(task_index, ""),
        })
        return item
