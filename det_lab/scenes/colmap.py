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
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

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


class ColmapError(ValueError):
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
_FILES = ("cameras", "images", "points3D")


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


def qvec_to_rotmat(qvec: np.ndarray) -> np.ndarray:
    """Rotation matrix of a quaternion (w, x, y, z); the quaternion need not be unit length."""
    w, x, y, z = np.asarray(qvec, dtype=np.float64) / np.linalg.norm(qvec)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


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
        cameras = _read_cameras_bin(sparse / "cameras.bin")
        images = _read_images_bin(sparse / "images.bin")
        points = _read_points_bin(sparse / "points3D.bin")
    else:
        cameras = _read_cameras_txt(sparse / "cameras.txt")
        images = _read_images_txt(sparse / "images.txt")
        points = _read_points_txt(sparse / "points3D.txt")
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


def _camera(path: Path, where: str, cid: int, model: str | int, width: int, height: int,
            params: list[float]) -> Camera:
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


# --- text --------------------------------------------------------------------------------------


def _data_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped line) of every non-comment line; blank lines are kept."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ColmapError(f"{path}: cannot read: {exc}") from None
    return [(i, ln.strip()) for i, ln in enumerate(text.splitlines(), 1) if not ln.lstrip().startswith("#")]


def _numbers(path: Path, lineno: int, tokens: list[str], kind: type, what: str) -> list:
    try:
        return [kind(t) for t in tokens]
    except ValueError:
        raise ColmapError(f"{path}: line {lineno}: bad {what}: {' '.join(tokens)[:80]!r}") from None


def _read_cameras_txt(path: Path) -> dict[int, Camera]:
    cameras = {}
    for lineno, line in _data_lines(path):
        if not line:
            continue
        tok = line.split()
        if len(tok) < 4:
            raise ColmapError(f"{path}: line {lineno}: expected CAMERA_ID MODEL WIDTH HEIGHT PARAMS[], got {line[:80]!r}")
        cid, width, height = _numbers(path, lineno, [tok[0], tok[2], tok[3]], int, "camera id or size")
        params = _numbers(path, lineno, tok[4:], float, "camera parameters")
        cameras[cid] = _camera(path, f"line {lineno}", cid, tok[1], width, height, params)
    return cameras


def _read_images_txt(path: Path) -> dict[int, ColmapImage]:
    images = {}
    lines = _data_lines(path)
    i = 0
    while i < len(lines):
        lineno, line = lines[i]
        i += 1
        if not line:
            continue
        tok = line.split()
        if len(tok) < 10:
            raise ColmapError(f"{path}: line {lineno}: expected IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME, "
                              f"got {line[:80]!r}")
        iid, cam = _numbers(path, lineno, [tok[0], tok[8]], int, "image or camera id")
        pose = np.array(_numbers(path, lineno, tok[1:8], float, "pose"))
        name = " ".join(tok[9:])  # COLMAP names may hold spaces
        # The next line lists the keypoints; it is empty for an image without any.
        pts_lineno, pts = lines[i] if i < len(lines) else (lineno + 1, "")
        i += 1
        ptok = pts.split()
        if len(ptok) % 3:
            raise ColmapError(f"{path}: line {pts_lineno}: POINTS2D must be (X, Y, POINT3D_ID) triples, "
                              f"got {len(ptok)} values")
        xys = np.array(_numbers(path, pts_lineno, ptok, float, "POINTS2D"), dtype=np.float64).reshape(-1, 3)
        images[iid] = ColmapImage(iid, pose[:4], pose[4:], cam, name, xys[:, :2].copy(), xys[:, 2].astype(np.int64))
    return images


def _read_points_txt(path: Path) -> Points3D:
    ids, xyz, rgb, err, tracks = [], [], [], [], []
    for lineno, line in _data_lines(path):
        if not line:
            continue
        tok = line.split()
        if len(tok) < 8 or (len(tok) - 8) % 2:
            raise ColmapError(f"{path}: line {lineno}: expected POINT3D_ID X Y Z R G B ERROR "
                              f"(IMAGE_ID POINT2D_IDX)*, got {len(tok)} values")
        ids.append(_numbers(path, lineno, tok[:1], int, "point id")[0])
        xyz.append(_numbers(path, lineno, tok[1:4], float, "position"))
        colour = _numbers(path, lineno, tok[4:7], int, "colour")
        if not all(0 <= c <= 255 for c in colour):
            raise ColmapError(f"{path}: line {lineno}: colour {colour} is outside 0..255")
        rgb.append(colour)
        err.append(_numbers(path, lineno, tok[7:8], float, "error")[0])
        tracks.append(np.array(_numbers(path, lineno, tok[8:], int, "track"), dtype=np.int64).reshape(-1, 2))
    return _points(ids, xyz, rgb, err, tracks)


def _points(ids, xyz, rgb, err, tracks) -> Points3D:
    return Points3D(np.array(ids, dtype=np.int64), np.array(xyz, dtype=np.float64).reshape(-1, 3),
                    np.array(rgb, dtype=np.uint8).reshape(-1, 3), np.array(err, dtype=np.float64), tracks)


# --- binary ------------------------------------------------------------------------------------


class _Reader:
    """Little-endian reads from a file's bytes that fail as one-line ColmapErrors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.buf = path.read_bytes()
        except OSError as exc:
            raise ColmapError(f"{path}: cannot read: {exc}") from None
        self.pos = 0

    def take(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ColmapError(f"{self.path}: truncated: {len(self.buf)} bytes, needed {self.pos + size} "
                              f"to read {what}")
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out

    def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        size = dtype.itemsize * count
        if count < 0 or self.pos + size > len(self.buf):
            raise ColmapError(f"{self.path}: truncated: {len(self.buf)} bytes, needed {self.pos + size} "
                              f"to read {what}")
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += size
        return out

    def cstring(self, what: str) -> str:
        end = self.buf.find(b"\x00", self.pos)
        if end < 0:
            raise ColmapError(f"{self.path}: truncated: no terminating NUL in {what}")
        raw, self.pos = self.buf[self.pos:end], end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ColmapError(f"{self.path}: {what} is not UTF-8: {raw[:40]!r}") from None

    def count(self, what: str) -> int:
        (n,) = self.take("Q", what)
        # each record takes at least 8 bytes: a count beyond that is garbage, not a big model
        if n > len(self.buf):
            raise ColmapError(f"{self.path}: {what} is {n}, more than the file could hold (corrupt?)")
        return n

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise ColmapError(f"{self.path}: {len(self.buf) - self.pos} unexpected bytes after the last record")


_XY_ID = np.dtype([("x", "<f8"), ("y", "<f8"), ("id", "<i8")])
_TRACK = np.dtype([("image", "<i4"), ("idx", "<i4")])


def _read_cameras_bin(path: Path) -> dict[int, Camera]:
    r = _Reader(path)
    cameras = {}
    for k in range(r.count("the number of cameras")):
        cid, model, width, height = r.take("iiQQ", f"camera #{k}")
        if model not in CAMERA_MODELS:
            raise ColmapError(f"{path}: camera {cid}: unknown camera model id {model}")
        n = len(CAMERA_MODELS[model][1])
        params = list(r.take(f"{n}d", f"the parameters of camera {cid}"))
        cameras[cid] = _camera(path, f"camera {cid}", cid, model, width, height, params)
    r.done()
    return cameras


def _read_images_bin(path: Path) -> dict[int, ColmapImage]:
    r = _Reader(path)
    images = {}
    for k in range(r.count("the number of images")):
        iid, *pose, cam = r.take("i7di", f"image #{k}")
        name = r.cstring(f"the name of image {iid}")
        n = r.count(f"the number of points of image {iid}")
        pts = r.array(_XY_ID, n, f"the points of image {iid}")
        xys = np.stack([pts["x"], pts["y"]], axis=1) if n else np.zeros((0, 2))
        images[iid] = ColmapImage(iid, np.array(pose[:4]), np.array(pose[4:]), cam, name, xys,
                                  pts["id"].astype(np.int64))
    r.done()
    return images


def _read_points_bin(path: Path) -> Points3D:
    r = _Reader(path)
    ids, xyz, rgb, err, tracks = [], [], [], [], []
    for k in range(r.count("the number of points")):
        pid, x, y, z, cr, cg, cb, e = r.take("Q3d3Bd", f"point #{k}")
        n = r.count(f"the track length of point {pid}")
        track = r.array(_TRACK, n, f"the track of point {pid}")
        ids.append(pid)
        xyz.append((x, y, z))
        rgb.append((cr, cg, cb))
        err.append(e)
        tracks.append(np.stack([track["image"], track["idx"]], axis=1).astype(np.int64) if n
                      else np.zeros((0, 2), dtype=np.int64))
    r.done()
    return _points(ids, xyz, rgb, err, tracks)


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
