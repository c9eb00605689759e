"""Read COLMAP sparse models (TEXT and BINARY) and the images they describe.

    scene = load_scene("/mnt/data/datasets/3dgs/garden")   # images/ + sparse/0/
    for view in scene.views:
        view.R, view.t, view.K, view.image   # world-to-camera pose, intrinsics, HxWx3 float32

Poses follow COLMAP: ``x_cam = R @ x_world + t`` with x right, y down, z forward, and pixel
centres at ``(col + 0.5, row + 0.5)``. Every COLMAP camera model parses (ids 0-17, as in
COLMAP's ``src/colmap/sensor/models.h``), but only the pinhole part is used: 3DGS trainers
expect undistorted images (``colmap image_undistorter``, or the Inria ``convert.py``), whose
model is PINHOLE. The rule: a camera whose model departs from a pinhole (non-zero distortion,
FOV's omega, or a fisheye projection) logs a warning once per camera; a camera without a
pinhole part (EQUIRECTANGULAR) is refused when a scene is loaded.

Every problem with a model raises :class:`ColmapError` (a ``ValueError``) whose message is one
line naming the file and what is wrong with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from det_lab.scenes import colmap_binary, colmap_text
from det_lab.scenes.colmap_model import (CAMERA_MODELS, FISHEYE_MODELS, SPHERICAL_MODELS, Camera, ColmapError,
                                         ColmapImage, ColmapModel, Points3D, qvec_to_rotmat)

log = logging.getLogger("det_lab.scenes")

__all__ = [
    "CAMERA_MODELS",
    "FISHEYE_MODELS",
    "SPHERICAL_MODELS",
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

_FILES = ("cameras", "images", "points3D")


@dataclass(frozen=True)
class View:
    """One posed image ready for training: ``image`` is (H, W, 3) float32 in [0, 1]."""

    name: str
    image: np.ndarray
    R: np.ndarray  # (3, 3) world-to-camera
    t: np.ndarray  # (3,)
    K: np.ndarray  # (3, 3), scaled to the loaded image's size
    camera_id: int

    @property
    def width(self) -> int:
        return int(self.image.shape[1])

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def viewmat(self) -> np.ndarray:
        """4x4 world-to-camera matrix."""
        m = np.eye(4)
        m[:3, :3], m[:3, 3] = self.R, self.t
        return m

    @property
    def center(self) -> np.ndarray:
        return -self.R.T @ self.t


@dataclass(frozen=True)
class Scene:
    """A COLMAP scene: the model, and its views sorted by image name."""

    root: Path
    model: ColmapModel
    views: list[View] = field(default_factory=list)

    @property
    def extent(self) -> float:
        """Inria's ``cameras_extent``: 1.1 x the largest camera distance from their mean centre."""
        centers = np.stack([v.center for v in self.views])
        return float(1.1 * np.linalg.norm(centers - centers.mean(0), axis=1).max())


# --- model -------------------------------------------------------------------------------------


def read_model(sparse_dir: str | Path, fmt: Literal["auto", "text", "binary"] = "auto") -> ColmapModel:
    """Read ``cameras``, ``images`` and ``points3D`` from ``sparse_dir`` (e.g. ``sparse/0``).

    With ``fmt="auto"`` the binary model is read when all three ``.bin`` files are there, else
    the text model when all three ``.txt`` files are (COLMAP's own preference).

    Raises:
        ColmapError: a file is missing, truncated or malformed, or the model is inconsistent.
    """
    sparse = Path(sparse_dir)
    if not sparse.is_dir():
        raise ColmapError(f"{sparse}: no such directory (expected a COLMAP sparse model, e.g. sparse/0)")
    if fmt == "auto":
        have = {e: [(sparse / f"{n}.{e}").is_file() for n in _FILES] for e in ("bin", "txt")}
        # a complete model of either kind; else the kind that is partly there, to name what is missing
        fmt = "binary" if all(have["bin"]) or (not all(have["txt"]) and any(have["bin"])) else "text"
    ext = ".bin" if fmt == "binary" else ".txt"
    for name in _FILES:
        if not (sparse / f"{name}{ext}").is_file():
            other = ".txt" if ext == ".bin" else ".bin"
            have = [f"{n}{e}" for n in _FILES for e in (ext, other) if (sparse / f"{n}{e}").is_file()]
            raise ColmapError(f"{sparse / (name + ext)}: missing (found: {', '.join(have) or 'nothing'})")
    if fmt == "binary":
        cameras = colmap_binary.read_cameras(sparse / "cameras.bin")
        images = colmap_binary.read_images(sparse / "images.bin")
        points = colmap_binary.read_points(sparse / "points3D.bin")
    else:
        cameras = colmap_text.read_cameras(sparse / "cameras.txt")
        images = colmap_text.read_images(sparse / "images.txt")
        points = colmap_text.read_points(sparse / "points3D.txt")
    for im in images.values():
        if im.camera_id not in cameras:
            raise ColmapError(f"{sparse / ('images' + ext)}: image {im.id} ({im.name}) refers to unknown camera "
                              f"{im.camera_id} (cameras: {sorted(cameras)})")
    for pid, track in zip(points.ids, points.tracks):
        unknown = set(track[:, 0].tolist()) - images.keys()
        if unknown:
            raise ColmapError(f"{sparse / ('points3D' + ext)}: point {pid} is tracked in unknown image(s) "
                              f"{sorted(unknown)[:5]}")
    for cam in cameras.values():
        if cam.ignored and cam.model not in SPHERICAL_MODELS:  # spherical: refused by load_scene
            log.warning("%s: camera %d is %s; %s is ignored (undistort the images for 3DGS: "
                        "colmap image_undistorter)", sparse, cam.id, cam.model, cam.ignored)
    return ColmapModel(sparse, fmt, cameras, images, points)


# --- scene -------------------------------------------------------------------------------------


def load_scene(root: str | Path, images: str = "images", sparse: str = "sparse/0",
               fmt: Literal["auto", "text", "binary"] = "auto") -> Scene:
    """Read ``<root>/<sparse>`` and load every registered image from ``<root>/<images>``.

    Images may be downscaled copies (``images_2``, ``images_4``: the 360_v2 convention): ``K``
    is scaled to each loaded image's size, which must keep the camera's aspect ratio.

    Raises:
        ColmapError: the model is broken (see :func:`read_model`), or an image is missing,
            unreadable or of the wrong shape.
    """
    from PIL import Image, UnidentifiedImageError

    root = Path(root)
    model = read_model(root / sparse, fmt)
    image_dir = root / images
    views = []
    cameras_file = model.path / ("cameras.bin" if model.format == "binary" else "cameras.txt")
    for cam in model.cameras.values():
        if cam.model in SPHERICAL_MODELS and any(im.camera_id == cam.id for im in model.images.values()):
            raise ColmapError(f"{cameras_file}: camera {cam.id} is {cam.model}, a spherical model: 3DGS needs "
                              "perspective images (reproject them to PINHOLE, e.g. as cube-map faces)")
    for im in sorted(model.images.values(), key=lambda i: i.name):
        cam = model.cameras[im.camera_id]
        file = image_dir / im.name
        if not file.is_file():
            raise ColmapError(f"{file}: image file missing (image {im.id} of {model.path})")
        try:
            with Image.open(file) as pil:
                pixels = np.asarray(pil.convert("RGB"), dtype=np.float32) / 255.0
        except (OSError, UnidentifiedImageError) as exc:
            raise ColmapError(f"{file}: cannot read image: {exc}") from None
        h, w = pixels.shape[:2]
        sx, sy = w / cam.width, h / cam.height
        if abs(sx - sy) > 0.02 * max(sx, sy):
            raise ColmapError(f"{file}: image is {w}x{h} but camera {cam.id} is {cam.width}x{cam.height} "
                              "(not the same aspect ratio)")
        K = cam.K * np.array([[sx], [sy], [1.0]])
        views.append(View(im.name, pixels, im.R, im.t, K, cam.id))
    if not views:
        raise ColmapError(f"{model.path}: the model has no images")
    return Scene(root, model, views)
