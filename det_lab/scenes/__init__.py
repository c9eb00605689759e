"""Scene readers for 3D reconstruction templates (COLMAP sparse models and their images)."""

from det_lab.scenes.colmap import (
    CAMERA_MODELS,
    Camera,
    ColmapError,
    ColmapImage,
    ColmapModel,
    Points3D,
    Scene,
    View,
    load_scene,
    qvec_to_rotmat,
    read_model,
)

__all__ = [
    "CAMERA_MODELS",
    "Camera",
    "ColmapError",
    "ColmapImage",
    "ColmapModel",
    "Points3D",
    "Scene",
    "View",
    "load_scene",
    "qvec_to_rotmat",
    "read_model",
]
