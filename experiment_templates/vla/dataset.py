"""The template's view of a LeRobot dataset: det_lab's reader plus tokenised instructions.

The format itself is read by :mod:`det_lab.datasets.lerobot` (shared with notebooks and other
templates); this module only turns its items into the tensors :class:`model.VLAPolicy` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from det_lab.datasets import LeRobotDataset, split_episodes
from model import tokenize


@dataclass
class Splits:
    """Training and held-out frames of one dataset (disjoint episodes)."""

    full: LeRobotDataset
    train: PolicyFrames
    val: PolicyFrames
    train_episodes: list[int]
    val_episodes: list[int]


class PolicyFrames(torch.utils.data.Dataset):
    """Items ``{"images": [(C,H,W)...], "state", "text_ids", "text_valid", "action", "action_is_pad"}``."""

    def __init__(self, frames: LeRobotDataset, *, vocab_size: int, max_text_tokens: int,
                 resize: int | None = None) -> None:
        self.frames = frames
        self.vocab_size, self.max_text_tokens, self.resize = vocab_size, max_text_tokens, resize
        self._tokens: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.frames)

    def _text(self, task_index: int, task: str) -> tuple[np.ndarray, np.ndarray]:
        if task_index not in self._tokens:
            self._tokens[task_index] = tokenize(task, self.vocab_size, self.max_text_tokens)
        return self._tokens[task_index]

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.frames[i]
        images = [torch.from_numpy(item[k]) for k in self.frames.cameras]
        if self.resize:
            images = [F.interpolate(im[None], size=(self.resize, self.resize), mode="bilinear",
                                    align_corners=False, antialias=True)[0] for im in images]
        ids, valid = self._text(item["task_index"], item["task"])
        return {
            "images": images,
            "state": torch.from_numpy(item["observation.state"]),
            "text_ids": torch.from_numpy(ids),
            "text_valid": torch.from_numpy(valid),
            "action": torch.from_numpy(item["action"]),
            "action_is_pad": torch.from_numpy(item["action_is_pad"]),
        }


def load_splits(path: Path, hp: dict[str, Any]) -> Splits:
    """Read the dataset at ``path`` and hold out ``hp["val_episodes"]`` episodes for validation."""
    model = hp["model"]
    cameras = hp.get("cameras")  # default: every camera in the dataset
    full = LeRobotDataset(path, horizon=int(hp["horizon"]), cameras=cameras)
    if not full.cameras:
        raise ValueError(f"{path}: the dataset has no camera (image or video feature)")
    train_eps, val_eps = split_episodes(full.episode_indices, val_episodes=int(hp["val_episodes"]),
                                        seed=int(hp.get("split_seed", 0)))
    kw = dict(vocab_size=int(model["vocab_size"]), max_text_tokens=int(model["max_text_tokens"]),
              resize=hp.get("resize"))
    return Splits(full, PolicyFrames(full.select(train_eps), **kw), PolicyFrames(full.select(val_eps), **kw),
                  train_eps, val_eps)
