"""COLMAP's BINARY model files (``cameras.bin``, ``images.bin``, ``points3D.bin``), little-endian."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from det_lab.scenes.colmap_model import (CAMERA_MODELS, Camera, ColmapError, ColmapImage, Points3D, camera_from,
                                         points_from)


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


def read_cameras(path: Path) -> dict[int, Camera]:
    """The cameras file ``path``; a :class:`ColmapError` naming it and what is wrong."""
    r = _Reader(path)
    cameras = {}
    for k in range(r.count("the number of cameras")):
        cid, model, width, height = r.take("iiQQ", f"camera #{k}")
        if model not in CAMERA_MODELS:
            raise ColmapError(f"{path}: camera {cid}: unknown camera model id {model}")
        n = len(CAMERA_MODELS[model][1])
        params = list(r.take(f"{n}d", f"the parameters of camera {cid}"))
        cameras[cid] = camera_from(path, f"camera {cid}", cid, model, width, height, params)
    r.done()
    return cameras


def read_images(path: Path) -> dict[int, ColmapImage]:
    """The images file ``path``; a :class:`ColmapError` naming it and what is wrong."""
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


def read_points(path: Path) -> Points3D:
    """The points3D file ``path``; a :class:`ColmapError` naming it and what is wrong."""
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
    return points_from(ids, xyz, rgb, err, tracks)
