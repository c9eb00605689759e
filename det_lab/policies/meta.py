"""What LeRobot's policy factory reads of a dataset (``LeRobotDatasetMetadata``), from det_lab's reader.

``make_policy(cfg, ds_meta=...)`` takes the policy's input and output features from
``ds_meta.features`` and ``make_pre_post_processors`` its normalisation statistics from
``ds_meta.stats``; ``resolve_delta_timestamps`` reads ``features`` and ``fps``. det_lab reads the
dataset itself (:class:`det_lab.formats.LeRobotDataset`), so this is the metadata in LeRobot's
types, holding only the features det_lab's reader serves: ``observation.state``, ``action`` and
the chosen cameras.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from det_lab.formats import LeRobotDataset

log = logging.getLogger("det_lab.policies")

#: the per-frame columns every LeRobot dataset has, kept so the features read like LeRobot's
_INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
_SERVED = ("observation.state", "action")


@dataclass
class DatasetMeta:
    """The subset of ``LeRobotDatasetMetadata`` the factory and processors use."""

    root: Path
    repo_id: str
    fps: int
    features: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, np.ndarray]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] in ("image", "video")]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] == "image"]

    @property
    def total_frames(self) -> int:
        return int(self.info.get("total_frames") or 0)

    @property
    def total_episodes(self) -> int:
        return int(self.info.get("total_episodes") or 0)


def dataset_meta(frames: LeRobotDataset) -> DatasetMeta:
    """The metadata of ``frames`` (its loaded cameras only), in the types LeRobot's loader gives:
    feature shapes as tuples, statistics as numpy arrays (``cast_stats_to_numpy``)."""
    keep = {*_SERVED, *frames.cameras, *_INDEX_COLUMNS}
    features = {}
    for key, ft in frames.features.items():
        if key in keep:
            features[key] = {**ft, "shape": tuple(ft["shape"])}
    left_out = sorted(k for k in frames.features if k.startswith("observation.") and k not in keep)
    if left_out:
        log.warning("%s: features %s are not read by det_lab and are no policy input", frames.root, left_out)
    stats = {key: {name: np.array(value) for name, value in per.items()}
             for key, per in frames.stats.items() if key in features}
    return DatasetMeta(root=frames.root, repo_id=f"local/{frames.root.name}", fps=int(round(frames.fps)),
                       features=features, stats=stats, info=frames.info)
