"""The 3DGS demo: a synthetic scene of coloured 3D Gaussians in COLMAP layout (``images/`` +
``sparse/0/``), its images rendered by the same splatting model a 3D Gaussian Splatting trainer
fits, and its sparse model written as COLMAP TEXT or BINARY."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from det_lab.data.demo_files import prepare_dest, write_png

_N_BLOBS = 32
_CAMERA_RADIUS = 4.0
_CAMERA_ELEVATIONS_DEG = (15.0, 40.0)  # alternate views between two rings
_PINHOLE_MODEL_ID = 1
_LOW_PASS = 0.3  # px², the screen-space dilation 3DGS rasterizers add to every 2D covariance
_OBSERVATION_NOISE_PX = 0.3


@dataclass(frozen=True)
class _Blobs:
    centers: np.ndarray  # (B, 3)
    sigmas: np.ndarray  # (B,) isotropic standard deviations
    colors: np.ndarray  # (B, 3) in [0, 1]
    opacities: np.ndarray  # (B,)


@dataclass(frozen=True)
class _ColmapImage:
    image_id: int
    qvec: np.ndarray  # (4,) world-to-camera rotation (qw, qx, qy, qz)
    tvec: np.ndarray  # (3,) world-to-camera translation
    name: str
    xys: np.ndarray  # (N, 2) observed keypoints, pixels
    point3d_ids: np.ndarray  # (N,) int64


@dataclass(frozen=True)
class _ColmapModel:
    """A COLMAP reconstruction with one PINHOLE camera (id 1) shared by all images."""

    width: int
    height: int
    params: tuple[float, float, float, float]  # fx, fy, cx, cy
    images: list[_ColmapImage]
    point_ids: np.ndarray  # (P,) int64
    xyz: np.ndarray  # (P, 3)
    rgb: np.ndarray  # (P, 3) uint8
    errors: np.ndarray  # (P,)
    tracks: list[list[tuple[int, int]]]  # per point: (image_id, point2D_idx)


def make_3dgs_demo(
    dest: Path,
    *,
    n_views: int = 16,
    image_size: int = 64,
    n_points: int = 200,
    seed: int = 0,
    fmt: Literal["text", "binary"] = "text",
) -> Path:
    """Write a synthetic scene of coloured 3D Gaussians in COLMAP layout into ``dest``.

    Layout: ``images/view_{i:03d}.png`` and the COLMAP model in ``sparse/0/`` —
    ``cameras.txt``, ``images.txt``, ``points3D.txt`` for ``fmt="text"``, or ``cameras.bin``,
    ``images.bin``, ``points3D.bin`` for ``fmt="binary"``. One PINHOLE camera with
    fx = fy = ``image_size`` and the principal point at the image centre; the cameras sit on two
    rings of radius 4 around the origin, looking at it. Images are alpha-composited splats of
    32 isotropic Gaussians on black, front to back, as a 3DGS rasterizer renders them.
    ``points3D`` are noisy samples of the Gaussians with their colours (an SfM-like
    initialisation), with tracks to every view they project into.

    Args:
        dest: Directory to create; it may exist only if empty.
        n_views: Number of cameras and images.
        image_size: Width and height of each image, in pixels.
        n_points: Number of 3D points in the sparse model.
        seed: Seed of the scene and of the points' noise.
        fmt: COLMAP model format to write.

    Returns:
        ``dest``.

    Raises:
        ValueError: If ``dest`` exists and is not an empty directory, or an argument is out of
            range.
    """
    if n_views < 1 or image_size < 8 or n_points < 1:
        raise ValueError(
            "need n_views >= 1, image_size >= 8 and n_points >= 1; "
            f"got {n_views}, {image_size}, {n_points}"
        )
    if fmt not in ("text", "binary"):
        raise ValueError(f"fmt must be 'text' or 'binary', got {fmt!r}")
    dest = prepare_dest(dest)
    rng = np.random.default_rng(seed)
    blobs = _sample_blobs(rng)
    intrinsics = (float(image_size), float(image_size), image_size / 2.0, image_size / 2.0)
    poses = [_look_at_origin(_camera_center(i, n_views)) for i in range(n_views)]
    for i, (rot, trans) in enumerate(poses):
        image = _splat(blobs, rot, trans, intrinsics, image_size)
        write_png(dest / "images" / f"view_{i:03d}.png", image)
    model = _sparse_model(rng, blobs, poses, intrinsics, image_size, n_points)
    sparse = dest / "sparse" / "0"
    if fmt == "text":
        _write_colmap_text(sparse, model)
    else:
        _write_colmap_binary(sparse, model)
    return dest


def _sample_blobs(rng: np.random.Generator) -> _Blobs:
    directions = rng.standard_normal((_N_BLOBS, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radii = 1.3 * rng.uniform(0.0, 1.0, _N_BLOBS) ** (1 / 3)  # uniform in a ball
    return _Blobs(
        centers=directions * radii[:, None],
        sigmas=rng.uniform(0.08, 0.22, _N_BLOBS),
        colors=rng.uniform(0.15, 1.0, (_N_BLOBS, 3)),
        opacities=rng.uniform(0.6, 0.95, _N_BLOBS),
    )


def _camera_center(i: int, n_views: int) -> np.ndarray:
    azimuth = 2 * math.pi * i / n_views
    elevation = math.radians(_CAMERA_ELEVATIONS_DEG[i % len(_CAMERA_ELEVATIONS_DEG)])
    return _CAMERA_RADIUS * np.array([
        math.cos(elevation) * math.cos(azimuth),
        math.cos(elevation) * math.sin(azimuth),
        math.sin(elevation),
    ])


def _look_at_origin(center: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World-to-camera (R, t) in COLMAP's convention: x right, y down, z forward; world z up."""
    forward = -center / np.linalg.norm(center)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    rot = np.stack([right, down, forward])
    return rot, -rot @ center


def _project(
    points: np.ndarray, rot: np.ndarray, trans: np.ndarray, intrinsics: tuple[float, float, float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Camera-frame points, pixel coordinates (COLMAP: pixel centres at +0.5) and depths."""
    fx, fy, cx, cy = intrinsics
    cam = points @ rot.T + trans
    z = cam[:, 2]
    uv = np.stack([fx * cam[:, 0] / z + cx, fy * cam[:, 1] / z + cy], axis=1)
    return cam, uv, z


def _splat(
    blobs: _Blobs,
    rot: np.ndarray,
    trans: np.ndarray,
    intrinsics: tuple[float, float, float, float],
    size: int,
) -> np.ndarray:
    """Render the blobs with the 3DGS image model: EWA-projected 2D Gaussians, alpha-blended."""
    fx, fy, _, _ = intrinsics
    cam, uv, z = _project(blobs.centers, rot, trans, intrinsics)
    # Covariance of an isotropic Gaussian is rotation invariant, so Σ2D = σ² J Jᵀ.
    jac = np.zeros((len(z), 2, 3))
    jac[:, 0, 0] = fx / z
    jac[:, 0, 2] = -fx * cam[:, 0] / z**2
    jac[:, 1, 1] = fy / z
    jac[:, 1, 2] = -fy * cam[:, 1] / z**2
    cov = blobs.sigmas[:, None, None] ** 2 * jac @ jac.transpose(0, 2, 1) + _LOW_PASS * np.eye(2)
    inv = np.linalg.inv(cov)
    py, px = np.mgrid[0:size, 0:size] + 0.5
    color = np.zeros((size, size, 3))
    transmittance = np.ones((size, size))
    for b in np.argsort(z, kind="stable"):
        if z[b] <= 0.1:
            continue
        dx, dy = px - uv[b, 0], py - uv[b, 1]
        power = -0.5 * (inv[b, 0, 0] * dx**2 + 2 * inv[b, 0, 1] * dx * dy + inv[b, 1, 1] * dy**2)
        alpha = np.minimum(0.99, blobs.opacities[b] * np.exp(power))
        color += (transmittance * alpha)[..., None] * blobs.colors[b]
        transmittance *= 1.0 - alpha
    return np.round(np.clip(color, 0.0, 1.0) * 255).astype(np.uint8)  # black background


def _sparse_model(
    rng: np.random.Generator,
    blobs: _Blobs,
    poses: list[tuple[np.ndarray, np.ndarray]],
    intrinsics: tuple[float, float, float, float],
    size: int,
    n_points: int,
) -> _ColmapModel:
    """Noisy blob samples as 3D points, observed (with pixel noise) in every view they fall in."""
    owner = np.arange(n_points) % _N_BLOBS
    xyz = blobs.centers[owner] + blobs.sigmas[owner, None] * rng.standard_normal((n_points, 3))
    rgb = np.clip(np.round(blobs.colors[owner] * 255 + rng.normal(0.0, 8.0, (n_points, 3))), 0, 255)
    point_ids = np.arange(1, n_points + 1, dtype=np.int64)
    tracks: list[list[tuple[int, int]]] = [[] for _ in range(n_points)]
    residuals: list[list[float]] = [[] for _ in range(n_points)]
    images = []
    for i, (rot, trans) in enumerate(poses):
        image_id = i + 1
        _, uv, z = _project(xyz, rot, trans, intrinsics)
        observed = uv + rng.normal(0.0, _OBSERVATION_NOISE_PX, uv.shape)
        visible = np.flatnonzero((z > 0.1) & np.all((observed >= 0) & (observed < size), axis=1))
        for idx, p in enumerate(visible):
            tracks[p].append((image_id, idx))
            residuals[p].append(float(np.linalg.norm(observed[p] - uv[p])))
        images.append(
            _ColmapImage(
                image_id=image_id,
                qvec=_rotmat_to_qvec(rot),
                tvec=trans,
                name=f"view_{i:03d}.png",
                xys=observed[visible],
                point3d_ids=point_ids[visible],
            )
        )
    fx, fy, cx, cy = intrinsics
    return _ColmapModel(
        width=size,
        height=size,
        params=(fx, fy, cx, cy),
        images=images,
        point_ids=point_ids,
        xyz=xyz,
        rgb=rgb.astype(np.uint8),
        errors=np.array([np.mean(r) if r else 0.0 for r in residuals]),
        tracks=tracks,
    )


def _rotmat_to_qvec(rot: np.ndarray) -> np.ndarray:
    """Unit quaternion (qw, qx, qy, qz) of a rotation matrix, with qw >= 0 (Shepperd's method)."""
    m = rot
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    if trace > 0:
        s = 2.0 * math.sqrt(trace + 1.0)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    qvec = np.array(q) / np.linalg.norm(q)
    return -qvec if qvec[0] < 0 else qvec


def _fmt(values: Any) -> str:
    """Space-separated shortest round-trip reprs, so text and binary models hold equal numbers."""
    return " ".join(repr(float(v)) for v in np.ravel(values))


def _points(model: _ColmapModel) -> zip[tuple[Any, ...]]:
    return zip(model.point_ids, model.xyz, model.rgb, model.errors, model.tracks)


def _write_colmap_text(sparse: Path, model: _ColmapModel) -> None:
    """``cameras.txt``, ``images.txt``, ``points3D.txt`` in COLMAP's TEXT model format."""
    sparse.mkdir(parents=True, exist_ok=True)
    cameras = [
        "# Camera list with one line of data per camera:",
        "#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]",
        "# Number of cameras: 1",
        f"1 PINHOLE {model.width} {model.height} {_fmt(model.params)}",
    ]
    n_obs = sum(len(im.xys) for im in model.images)
    per_image, per_point = n_obs / len(model.images), n_obs / len(model.point_ids)
    images = [
        "# Image list with two lines of data per image:",
        "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME",
        "#   POINTS2D[] as (X, Y, POINT3D_ID)",
        f"# Number of images: {len(model.images)}, mean observations per image: {per_image!r}",
    ]
    for im in model.images:
        images.append(f"{im.image_id} {_fmt(im.qvec)} {_fmt(im.tvec)} 1 {im.name}")
        images.append(" ".join(f"{_fmt(xy)} {pid}" for xy, pid in zip(im.xys, im.point3d_ids)))
    points = [
        "# 3D point list with one line of data per point:",
        "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)",
        f"# Number of points: {len(model.point_ids)}, mean track length: {per_point!r}",
    ]
    for pid, xyz, rgb, err, track in _points(model):
        fields = [str(pid), _fmt(xyz), " ".join(str(int(c)) for c in rgb), _fmt(err)]
        fields += [f"{image_id} {idx}" for image_id, idx in track]
        points.append(" ".join(fields))
    for name, lines in (("cameras.txt", cameras), ("images.txt", images), ("points3D.txt", points)):
        (sparse / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_colmap_binary(sparse: Path, model: _ColmapModel) -> None:
    """``cameras.bin``, ``images.bin``, ``points3D.bin`` in COLMAP's little-endian BINARY format."""
    sparse.mkdir(parents=True, exist_ok=True)
    cameras = struct.pack("<Q", 1) + struct.pack(
        "<iiQQ4d", 1, _PINHOLE_MODEL_ID, model.width, model.height, *model.params
    )
    images = [struct.pack("<Q", len(model.images))]
    for im in model.images:
        images.append(struct.pack("<i4d3di", im.image_id, *im.qvec, *im.tvec, 1))
        images.append(im.name.encode("utf-8") + b"\x00")
        images.append(struct.pack("<Q", len(im.xys)))
        for (x, y), pid in zip(im.xys, im.point3d_ids):
            images.append(struct.pack("<ddq", x, y, pid))
    points = [struct.pack("<Q", len(model.point_ids))]
    for pid, xyz, rgb, err, track in _points(model):
        points.append(struct.pack("<Q3d3BdQ", pid, *xyz, *rgb, err, len(track)))
        points.extend(struct.pack("<ii", image_id, idx) for image_id, idx in track)
    (sparse / "cameras.bin").write_bytes(cameras)
    (sparse / "images.bin").write_bytes(b"".join(images))
    (sparse / "points3D.bin").write_bytes(b"".join(points))
