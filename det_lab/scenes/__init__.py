"""Scene readers for 3D reconstruction templates (COLMAP sparse models and their images)."""

from det_lab.scenes.colmap import *  # noqa: F403
from det_lab.scenes.colmap import __all__  # noqa: F401
