"""Readers for dataset formats that templates and notebooks share.

    from det_lab.formats import LeRobotDataset, split_episodes
    ds = LeRobotDataset(path, horizon=10)
    train_eps, val_eps = split_episodes(ds.episode_indices, val_episodes=2)
    train, val = ds.select(train_eps), ds.select(val_eps)
"""

from det_lab.formats.errors import LeRobotDatasetError, VideoDecoderMissing
from det_lab.formats.lerobot import Episode, LeRobotDataset, split_episodes

__all__ = ["Episode", "LeRobotDataset", "LeRobotDatasetError", "VideoDecoderMissing", "split_episodes"]
