"""Scene readers for 3D reconstruction templates (COLMAP sparse models and their images)."""

from det_lab.scenes.colmap import *  # noqa: F403
from det_lab.scenes.colmap import __all__ as _colmap_all
from det_lab.scenes.keys import render_key, render_keys

__all__ = [*_colmap_all, "render_key", "render_keys"]
