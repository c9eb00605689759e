"""The COLMAP sparse model as data: camera models, cameras, registered images, the 3D points, and
their checked construction (a bad one is a one-line :class:`ColmapError` naming the file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from det_lab.errors import UserError


class ColmapError(UserError, ValueError):
    """A broken or unreadable COLMAP model or scene, as one line naming the file."""


# model id -> (name, parameter names); the order of parameters is COLMAP's.
CAMERA_MODELS: dict[int, tuple[str, tuple[str, ...]]] = {
    0: ("SIMPLE_PINHOLE", ("f", "cx", "cy")),
    1: ("PINHOLE", ("fx", "fy", "cx", "cy")),
    2: ("SIMPLE_RADIAL", ("f", "cx", "cy", "k")),
    3: ("RADIAL", ("f", "cx", "cy", "k1", "k2")),
    4: ("OPENCV", ("fx", "fy", "cx", "cy", "k1", "k2", "p1", "p2")),
    5: ("OPENCV_FISHEYE", ("fx", "fy", "cx", "cy", "k1", "k2", "k3", "k4")),
    6: ("FULL_OPENCV", ("fx", "fy", "cx", "cy", "k1", "k2", "p1", "p2", "k3", "k4", "k5", "k6")),
    7: ("FOV", ("fx", "fy", "cx", "cy", "omega")),
    8: ("SIMPLE_RADIAL_FISHEYE", ("f", "cx", "cy", "k")),
    9: ("RADIAL_FISHEYE", ("f", "cx", "cy", "k1", "k2")),
    10: ("THIN_PRISM_FISHEYE", ("fx", "fy", "cx", "cy", "k1", "k2", "p1", "p2", "k3", "k4", "sx1", "sy1")),
    11: ("RAD_TAN_THIN_PRISM_FISHEYE", ("fx", "fy", "cx", "cy", "k0", "k1", "k2", "k3", "k4", "k5",
                                        "p0", "p1", "s0", "s1", "s2", "s3")),
    12: ("SIMPLE_DIVISION", ("f", "cx", "cy", "k")),
    13: ("DIVISION", ("fx", "fy", "cx", "cy", "k")),
    14: ("SIMPLE_FISHEYE", ("f", "cx", "cy")),
    15: ("FISHEYE", ("fx", "fy", "cx", "cy")),
    16: ("EUCM", ("fx", "fy", "cx", "cy", "alpha", "beta")),
    17: ("EQUIRECTANGULAR", ("w", "h")),  # spherical: no focal length, no principal point
}
# projections that are not a pinhole even with all distortion parameters zero (COLMAP's
# PERSPECTIVE_FISHEYE_CAMERA_MODEL_CASES), and those that have no pinhole part at all
FISHEYE_MODELS = frozenset({"OPENCV_FISHEYE", "SIMPLE_RADIAL_FISHEYE", "RADIAL_FISHEYE", "THIN_PRISM_FISHEYE",
                            "RAD_TAN_THIN_PRISM_FISHEYE", "SIMPLE_FISHEYE", "FISHEYE"})
SPHERICAL_MODELS = frozenset({"EQUIRECTANGULAR"})
_MODEL_IDS = {name: mid for mid, (name, _) in CAMERA_MODELS.items()}


@dataclass(frozen=True)
class Camera:
    """One COLMAP camera: its model, size and parameters, with the pinhole part as ``K``."""

    id: int
    model: str
    width: int
    height: int
    params: tuple[float, ...]

    @property
    def param_dict(self) -> dict[str, float]:
        return dict(zip(CAMERA_MODELS[_MODEL_IDS[self.model]][1], self.params))

    @property
    def focal(self) -> tuple[float, float]:
        """Focal lengths in pixels; a :class:`ColmapError` for a spherical model, which has none."""
        if self.model in SPHERICAL_MODELS:
            raise ColmapError(f"camera {self.id} is {self.model}, a spherical model without focal length: "
                              "3DGS needs perspective images (convert them to PINHOLE, e.g. cube maps)")
        p = self.param_dict
        return (p["f"], p["f"]) if "f" in p else (p["fx"], p["fy"])

    @property
    def principal_point(self) -> tuple[float, float]:
        p = self.param_dict
        return p["cx"], p["cy"]

    @property
    def K(self) -> np.ndarray:  # noqa: N802 (the usual name)
        """3x3 intrinsics (distortion not included)."""
        (fx, fy), (cx, cy) = self.focal, self.principal_point
        return np.array([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]])

    @property
    def distortion(self) -> dict[str, float]:
        """The parameters that are not focal length or principal point (ignored by 3DGS)."""
        if self.model in SPHERICAL_MODELS:
            return {}
        return {k: v for k, v in self.param_dict.items() if k not in ("f", "fx", "fy", "cx", "cy")}

    @property
    def ignored(self) -> str | None:
        """What treating this camera as a pinhole ignores, or None where it is a pinhole."""
        if self.model in SPHERICAL_MODELS:
            return "its spherical projection (it has no pinhole intrinsics)"
        distortion = {k: v for k, v in self.distortion.items() if v != 0}
        if self.model == "EUCM" and self.param_dict["alpha"] == 0:
            distortion = {}  # beta only matters with alpha != 0; alpha = 0 is the pinhole
        if self.model in FISHEYE_MODELS:
            return f"its fisheye projection and distortion {distortion}" if distortion else "its fisheye projection"
        return f"its distortion {distortion}" if distortion else None


@dataclass(frozen=True)
class ColmapImage:
    """One registered image: world-to-camera rotation (``qvec``, w first) and translation."""

    id: int
    qvec: np.ndarray  # (4,) qw, qx, qy, qz
    tvec: np.ndarray  # (3,)
    camera_id: int
    name: str
    xys: np.ndarray  # (M, 2) keypoints in pixels
    point3d_ids: np.ndarray  # (M,) int64, -1 where the keypoint has no 3D point

    @property
    def R(self) -> np.ndarray:  # noqa: N802
        return qvec_to_rotmat(self.qvec)

    @property
    def t(self) -> np.ndarray:
        return np.asarray(self.tvec, dtype=np.float64)

    @property
    def center(self) -> np.ndarray:
        """Camera centre in world coordinates."""
        return -self.R.T @ self.t


@dataclass(frozen=True)
class Points3D:
    """The sparse point cloud, column-wise (row i of every array is one point)."""

    ids: np.ndarray  # (P,) int64
    xyz: np.ndarray  # (P, 3) float64
    rgb: np.ndarray  # (P, 3) uint8
    errors: np.ndarray  # (P,) float64, mean reprojection error in pixels
    tracks: list[np.ndarray]  # P arrays of (image_id, point2d_idx), shape (L, 2) int64

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ColmapModel:
    """A sparse model: cameras and images by id, and the 3D points."""

    path: Path
    format: Literal["text", "binary"]
    cameras: dict[int, Camera]
    images: dict[int, ColmapImage]
    points3d: Points3D


def qvec_to_rotmat(qvec: np.ndarray) -> np.ndarray:
    """Rotation matrix of a quaternion (w, x, y, z); the quaternion need not be unit length."""
    w, x, y, z = np.asarray(qvec, dtype=np.float64) / np.linalg.norm(qvec)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def camera_from(path: Path, where: str, cid: int, model: str | int, width: int, height: int,
                params: list[float]) -> Camera:
    """A camera read at ``where`` in ``path``, its model (name or id), parameter count and size checked."""
    if isinstance(model, int):
        if model not in CAMERA_MODELS:
            raise ColmapError(f"{path}: {where}: unknown camera model id {model}")
        model = CAMERA_MODELS[model][0]
    if model not in _MODEL_IDS:
        raise ColmapError(f"{path}: {where}: unknown camera model {model!r}")
    expected = len(CAMERA_MODELS[_MODEL_IDS[model]][1])
    if len(params) != expected:
        raise ColmapError(f"{path}: {where}: {model} takes {expected} parameters, got {len(params)}")
    if width <= 0 or height <= 0:
        raise ColmapError(f"{path}: {where}: camera size {width}x{height} is not positive")
    return Camera(cid, model, width, height, tuple(float(p) for p in params))


def points_from(ids, xyz, rgb, err, tracks) -> Points3D:
    """The point cloud of per-point lists, as :class:`Points3D`'s typed arrays."""
    return Points3D(np.array(ids, dtype=np.int64), np.array(xyz, dtype=np.float64).reshape(-1, 3),
                    np.array(rgb, dtype=np.uint8).reshape(-1, 3), np.array(err, dtype=np.float64), tracks)
