"""Datasets that are a plain directory on the volume, not DVC-tracked.

A team often has a LeRobot dataset or a COLMAP scene on the volume already. An experiment
config may name it instead of a DVC dataset::

    data:
      det_lab:
        project: 3dgs
        dataset: {dir: teams/scenes/garden}     # relative to the data root, or absolute

Trials read it in place (det_lab never writes into it) and record its content hash in their
lineage, so a run still says exactly which bytes it trained on. The hash is DVC's own hash of a
directory (the md5 of its sorted ``{md5, relpath}`` list, plus ``.dir``): the same directory
later versioned with ``det-lab data import`` has the same ``md5`` in lineage. Each file's md5 is
cached on the volume (``.det-lab/directory-hashes/``) under its size and mtime, so only the
first run hashes the data; later runs stat the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from det_lab.data.errors import DataError
from det_lab.data.identity import DatasetIdentity, PulledDataset
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout, atomic_write_text

__all__ = ["DirectorySpec", "content_hash", "use_directory"]

DIRECTORY_REV = "directory"  # DatasetIdentity.rev of a directory dataset (it has no git revision)


@dataclass(frozen=True)
class DirectorySpec:
    """A directory dataset: ``dir`` is absolute or relative to the data root, and on the volume."""

    project: str
    dir: str

    def resolve(self, settings: LabSettings) -> Path:
        """The directory's real path; a :class:`DataError` when it is missing or off the volume."""
        root = Path(settings.data_root).resolve()
        path = (root / self.dir).resolve()  # an absolute dir replaces root
        if not path.is_dir():
            raise DataError(f"{path}: no such directory (data.det_lab.dataset.dir is relative to the data root {root})")
        if not path.is_relative_to(root):
            raise DataError(f"{path} is not on the volume ({root}): trials on other machines could not read it; "
                            f"move it under {root}, or version it with 'det-lab data import'")
        if path == root or path.is_relative_to(root / ".det-lab"):
            raise DataError(f"{path} is det_lab's own volume directory, not a dataset")
        return path


def use_directory(spec: DirectorySpec, settings: LabSettings) -> PulledDataset:
    """The directory, ready to read in place, with its content hash as lineage."""
    settings.project(spec.project)
    path = spec.resolve(settings)
    md5, size, nfiles = content_hash(path, VolumeLayout.from_settings(settings).state / "directory-hashes")
    identity = DatasetIdentity(project=spec.project, repo=str(path), rev=DIRECTORY_REV, commit=md5.removesuffix(".dir"),
                               path=".", md5=md5, size=size, nfiles=nfiles)
    return PulledDataset(path, identity, fetched=False)


def content_hash(path: Path, cache_dir: Path | None = None) -> tuple[str, int, int]:
    """``(md5, total size, number of files)`` of a directory, as DVC hashes one.

    With ``cache_dir``, the md5 of each file is reused while its size and mtime are unchanged.
    Symbolic links are followed, as DVC does; empty directories do not count.
    """
    cache_file = cache_dir / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json" if cache_dir else None
    cached = _read_cache(cache_file)
    entries, files, total = [], {}, 0
    for rel in _walk(path):
        try:
            st = os.stat(path / rel)
            known = cached.get(rel)
            md5 = known[2] if known and known[:2] == [st.st_size, st.st_mtime_ns] else md5_of(path / rel)
        except OSError as exc:
            raise DataError(f"{path / rel}: cannot read: {exc.strerror or exc}") from None
        files[rel] = [st.st_size, st.st_mtime_ns, md5]
        entries.append({"md5": md5, "relpath": rel})
        total += st.st_size
    if not entries:
        raise DataError(f"{path}: the directory holds no files")
    if cache_file is not None and files != cached:
        _write_cache(cache_file, path, files)
    digest = hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest()
    return f"{digest}.dir", total, len(entries)


def md5_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def _walk(path: Path) -> list[str]:
    """Relative POSIX paths of every file under ``path``, sorted as DVC sorts them."""
    out, seen = [], set()
    for dirpath, dirnames, names in os.walk(path, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symbolic link back up the tree: walk each directory once
            dirnames.clear()
            continue
        seen.add(real)
        rel_dir = Path(dirpath).relative_to(path)
        out.extend((rel_dir / n).as_posix() for n in names)
    return sorted(out)


def _read_cache(cache_file: Path | None) -> dict[str, list]:
    if cache_file is None:
        return {}
    try:
        return json.loads(cache_file.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # none yet, or unreadable: hash again


def _write_cache(cache_file: Path, path: Path, files: dict[str, list]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_file, json.dumps({"dir": str(path), "files": files}))
    except OSError:
        pass  # a read-only volume: the hash is still right, only not remembered
