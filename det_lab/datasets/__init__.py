"""Deprecated: the dataset readers moved to :mod:`det_lab.formats` in det_lab 0.2.0; this alias goes
in 0.3.0. ``from det_lab.datasets import LeRobotDataset`` (and its submodules, ``det_lab.datasets.lerobot``
and the rest) keeps working until then, with one ``DeprecationWarning`` naming the new spelling."""

import sys
import warnings

from det_lab.formats import Episode, LeRobotDataset, LeRobotDatasetError, VideoDecoderMissing, split_episodes
from det_lab.formats import errors, lerobot, lerobot_stats, lerobot_tables, video

warnings.warn("det_lab.datasets is deprecated since det_lab 0.2.0 and goes in 0.3.0: import det_lab.formats "
              "instead (the same names)", DeprecationWarning, stacklevel=2)

# the old submodule paths are the new modules themselves (one class per name: isinstance keeps working)
for _name, _module in (("errors", errors), ("lerobot", lerobot), ("lerobot_stats", lerobot_stats),
                       ("lerobot_tables", lerobot_tables), ("video", video)):
    sys.modules[f"{__name__}.{_name}"] = _module

__all__ = ["Episode", "LeRobotDataset", "LeRobotDatasetError", "VideoDecoderMissing", "split_episodes"]
