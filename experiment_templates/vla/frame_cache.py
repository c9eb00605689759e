"""Decoded camera frames of a LeRobot dataset, cached once as one uint8 array on disk.

Decoding PNG/JPEG/video frames and resizing them per item is what starves a GPU: the cache
does it once per dataset revision and serves ``(rows, cameras, C, H, W)`` uint8 through
``np.load(mmap_mode="r")``, so every loader worker (and every trial on the machine) shares the
page cache and a batch is one fancy-indexing copy. uint8 is also a quarter of float32's bytes
through pinned memory to the GPU, where :class:`model.Normalize` scales it.

The file name is a hash of the dataset's revision (the DVC md5 of a pulled snapshot, else a
fingerprint of its files), the cameras and the resize, so a new revision gets a new file and
never reads a stale one. A cache file only appears by ``os.replace`` of a completely written and
flushed temporary file: a reader sees a whole cache or none, also after a builder was killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from det_lab.data.lock import pid_alive
from det_lab.formats import LeRobotDataset

log = logging.getLogger("vla.frame_cache")

FORMAT = 1  # bump when the layout of the cached array changes
SHM_DIR = Path("/dev/shm/det-lab-frames")
_BUILD_CHUNK = 256  # frames resized per call


def resolve_cache_dir(where: str | None, volume_dir: Path) -> Path | None:
    """``frame_cache`` hyperparameter -> directory: ``shm`` (this machine's shared memory),
    ``volume`` (``volume_dir``, shared by every machine), an absolute path, or None/``none`` (off)."""
    if where in (None, "none", False):
        return None
    if where == "shm":
        return SHM_DIR
    if where == "volume":
        return volume_dir
    path = Path(str(where))
    if not path.is_absolute():
        raise ValueError(f"hyperparameters.frame_cache must be shm, volume, none or an absolute path, not {where!r}")
    return path


def dataset_fingerprint(root: Path) -> str:
    """A revision stand-in for a dataset directory: every file's path, size and mtime."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cache_key(revision: str, cameras: Sequence[str], resize: int | None) -> str:
    spec = json.dumps({"format": FORMAT, "revision": revision, "cameras": list(cameras), "resize": resize})
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def open_frames(reader: LeRobotDataset, cache_dir: Path, *, resize: int | None = None,
                revision: str | None = None, fallback_dir: Path | None = None) -> np.ndarray:
    """The ``(rows, cameras, C, H, W)`` uint8 frames of every row of ``reader``'s dataset (row =
    position in the episode-sorted frame table), memory-mapped; built first if not cached.

    ``revision`` names the dataset's content (pass the DVC md5 of a pulled snapshot); without it
    the files' sizes and modification times stand in. A cache that would not fit where it goes is
    built in ``fallback_dir`` instead (with a warning), or refused in one line: writing a memory map
    past a full tmpfs (a task container's /dev/shm: 4 GiB unless raised) kills the trial with SIGBUS.
    """
    revision = revision or dataset_fingerprint(reader.root)
    name = f"frames-{cache_key(revision, reader.cameras, resize)}.npy"
    final = Path(cache_dir) / name
    if not final.is_file():
        needed = _cache_bytes(reader, resize)
        free = _free_bytes(final.parent)
        if free < needed:
            where = (f"{cache_dir} has {free / 2**20:.1f} MiB free and the frame cache needs {needed / 2**20:.1f} MiB"
                     + ("; raise the task's shm size (resources.shm_size, or tasks.shm_size in cluster.yaml)"
                        if Path(cache_dir) == SHM_DIR else ""))
            if fallback_dir is None:
                raise OSError(f"frame cache: {where}")
            log.warning("frame cache: %s; building it in %s instead", where, fallback_dir)
            final = Path(fallback_dir) / name
        if not final.is_file():
            _build(reader, final, resize)
    return np.load(final, mmap_mode="r")


def _cache_bytes(reader: LeRobotDataset, resize: int | None) -> int:
    c, h, w = (3, resize, resize) if resize else reader.image_shape(reader.cameras[0])
    return len(reader.select(reader.episode_indices)) * len(reader.cameras) * c * h * w + 4096  # + .npy header


def _free_bytes(directory: Path) -> int:
    path = Path(directory)
    while not path.exists():  # the cache directory itself is made by the build
        path = path.parent
    return shutil.disk_usage(path).free


def _build(reader: LeRobotDataset, final: Path, resize: int | None) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builders(final)
    full = reader.select(reader.episode_indices)  # item i is row i: episodes sorted, frames in order
    c, h, w = (3, resize, resize) if resize else full.image_shape(full.cameras[0])
    tmp = final.with_name(f".{final.stem}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    log.info("building the frame cache %s (%d frames x %d cameras)", final, len(full), len(full.cameras))
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(full), len(full.cameras), c, h, w))
        for start in range(0, len(full), _BUILD_CHUNK):
            rows = range(start, min(start + _BUILD_CHUNK, len(full)))
            items = [full[i] for i in rows]
            for j, key in enumerate(full.cameras):
                out[rows.start:rows.stop, j] = to_uint8(torch.from_numpy(np.stack([it[key] for it in items])), resize)
        out.flush()
        del out
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def to_uint8(images: torch.Tensor, resize: int | None) -> np.ndarray:
    """(N, C, H, W) float images in [0, 1] -> uint8, resized as the uncached path does."""
    if resize:
        images = F.interpolate(images, size=(resize, resize), mode="bilinear", align_corners=False, antialias=True)
    return images.mul(255.0).round_().clamp_(0, 255).to(torch.uint8).numpy()


def _remove_dead_builders(final: Path) -> None:
    """Temporary files of builders on this host that no longer run (killed mid-build)."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f".{final.stem}.{host}.*.tmp"):
        pid = tmp.name.split(".")[-3]
        if pid.isdigit() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
