"""The template's view of a LeRobot dataset: det_lab's reader plus tokenised instructions.

The format itself is read by :mod:`det_lab.formats.lerobot` (shared with notebooks and other
templates); this module only turns its items into the tensors :class:`model.VLAPolicy` takes:
per item with images decoded on the fly (:class:`PolicyFrames`), or whole batches gathered from
the uint8 frame cache (:class:`CachedPolicyFrames`, ``frame_cache`` set; see ``frame_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from det_lab.formats import LeRobotDataset, split_episodes
from frame_cache import open_frames
from model import tokenize


@dataclass
class Splits:
    """Training and held-out frames of one dataset (disjoint episodes)."""

    full: LeRobotDataset
    train: PolicyFrames | CachedPolicyFrames
    val: PolicyFrames | CachedPolicyFrames
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


class CachedPolicyFrames(torch.utils.data.Dataset):
    """The items of :class:`PolicyFrames` with uint8 images from the frame cache, served a batch
    at a time: the loader calls :meth:`__getitems__` with a batch's indices and
    :func:`collate_batch` passes the result through, so a batch costs a few numpy gathers.

    ``images`` is one ``(B, cameras, C, H, W)`` uint8 tensor (the model scales it on the device).
    """

    def __init__(self, frames: LeRobotDataset, cache: np.ndarray, *, vocab_size: int, max_text_tokens: int) -> None:
        self.frames, self.cache = frames, cache
        eps = [frames.episodes[e] for e in frames.selected_episodes]
        self.rows = np.concatenate([np.arange(e.start, e.start + e.length) for e in eps]) if eps else np.zeros(0, np.int64)
        self.ends = np.concatenate([np.full(e.length, e.start + e.length) for e in eps]) if eps else np.zeros(0, np.int64)
        self.steps = np.arange(frames.horizon)
        n_tasks = int(frames.task_index.max()) + 1 if len(frames.task_index) else 0
        tokens = [tokenize(frames.tasks.get(t, ""), vocab_size, max_text_tokens) for t in range(n_tasks)]
        self.text_ids = np.stack([t[0] for t in tokens]) if tokens else np.zeros((0, max_text_tokens), np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        idx = np.asarray(indices, dtype=np.int64)
        rows, ends = self.rows[idx], self.ends[idx]
        chunk = rows[:, None] + self.steps
        ids = self.text_ids[self.frames.task_index[rows]]
        order = np.argsort(rows)  # a sorted gather reads the memory map sequentially
        images = np.empty((len(rows), *self.cache.shape[1:]), dtype=np.uint8)
        images[order] = self.cache[rows[order]]
        return {
            "images": torch.from_numpy(images),
            "state": torch.from_numpy(self.frames.state[rows]),
            "text_ids": torch.from_numpy(ids),
            "text_valid": torch.from_numpy(ids != 0),
            "action": torch.from_numpy(self.frames.action[np.minimum(chunk, ends[:, None] - 1)]),
            "action_is_pad": torch.from_numpy(chunk >= ends[:, None]),
        }


def collate_batch(batch: Any) -> Any:
    """The loader's ``collate_fn`` for :class:`CachedPolicyFrames`: the batch is already one."""
    return batch


def load_splits(path: Path, hp: dict[str, Any], cache_dir: Path | None = None, revision: str | None = None,
                fallback_dir: Path | None = None) -> Splits:
    """Read the dataset at ``path`` and hold out ``hp["val_episodes"]`` episodes for validation.

    With ``cache_dir``, images come from the uint8 frame cache there (built on first use) for
    dataset revision ``revision`` (see :func:`frame_cache.open_frames`).
    """
    model = hp["model"]
    cameras = hp.get("cameras")  # default: every camera in the dataset
    full = LeRobotDataset(path, horizon=int(hp["horizon"]), cameras=cameras)
    if not full.cameras:
        raise ValueError(f"{path}: the dataset has no camera (image or video feature)")
    train_eps, val_eps = split_episodes(full.episode_indices, val_episodes=int(hp["val_episodes"]),
                                        seed=int(hp.get("split_seed", 0)))
    text = dict(vocab_size=int(model["vocab_size"]), max_text_tokens=int(model["max_text_tokens"]))
    if cache_dir is not None:
        cache = open_frames(full, cache_dir, resize=hp.get("resize"), revision=revision, fallback_dir=fallback_dir)
        return Splits(full, CachedPolicyFrames(full.select(train_eps), cache, **text),
                      CachedPolicyFrames(full.select(val_eps), cache, **text), train_eps, val_eps)
    kw = dict(text, resize=hp.get("resize"))
    return Splits(full, PolicyFrames(full.select(train_eps), **kw), PolicyFrames(full.select(val_eps), **kw),
                  train_eps, val_eps)
