"""COLMAP's TEXT model files (``cameras.txt``, ``images.txt``, ``points3D.txt``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from det_lab.scenes.colmap_model import Camera, ColmapError, ColmapImage, Points3D, camera_from, points_from


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


def read_cameras(path: Path) -> dict[int, Camera]:
    """The cameras file ``path``; a :class:`ColmapError` naming it and what is wrong."""
    cameras = {}
    for lineno, line in _data_lines(path):
        if not line:
            continue
        tok = line.split()
        if len(tok) < 4:
            raise ColmapError(f"{path}: line {lineno}: expected CAMERA_ID MODEL WIDTH HEIGHT PARAMS[], got {line[:80]!r}")
        cid, width, height = _numbers(path, lineno, [tok[0], tok[2], tok[3]], int, "camera id or size")
        params = _numbers(path, lineno, tok[4:], float, "camera parameters")
        cameras[cid] = camera_from(path, f"line {lineno}", cid, tok[1], width, height, params)
    return cameras


def read_images(path: Path) -> dict[int, ColmapImage]:
    """The images file ``path``; a :class:`ColmapError` naming it and what is wrong."""
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


def read_points(path: Path) -> Points3D:
    """The points3D file ``path``; a :class:`ColmapError` naming it and what is wrong."""
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
    return points_from(ids, xyz, rgb, err, tracks)
