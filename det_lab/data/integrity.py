"""Is a snapshot still what was verified? A cheap check on every use, a full one on demand.

A snapshot's marker records the size and modification time of every file as it was published.
Comparing them costs one ``stat`` per file (no reads), so every pull does it; it catches a file
that was deleted, or rewritten after ``chmod u+w``. Only hashing catches content changed with its
size and mtime restored: that is ``det-lab data verify``. Snapshot files are hard links into the
shared DVC cache, so a changed snapshot file is a changed cache object as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SNAPSHOT_MARKER = "snapshot.json"
READ_ONLY_DIR_MODE = 0o2555
_OBJECT = re.compile(r"^[0-9a-f]{2}/[0-9a-f]{30}(\.dir)?$")


def read_marker(snap: Path) -> dict[str, Any] | None:
    """The snapshot's marker, or None when the snapshot is absent or incomplete."""
    try:
        return json.loads((snap / SNAPSHOT_MARKER).read_text())
    except (OSError, ValueError):
        return None


def file_stats(snap: Path, relpaths: Iterable[str]) -> dict[str, list]:
    """What :func:`changed_files` compares against: parallel lists, compact to store and parse."""
    paths, sizes, mtimes = [], [], []
    for rel in relpaths:
        st = os.stat(snap / rel)
        paths.append(rel)
        sizes.append(st.st_size)
        mtimes.append(st.st_mtime_ns)
    return {"paths": paths, "sizes": sizes, "mtimes": mtimes}


def changed_files(snap: Path, marker: dict[str, Any]) -> list[str] | None:
    """Files of ``snap`` whose size or mtime differ from its marker, or that are gone.

    None when the marker predates these records (the snapshot was never checked this way).
    """
    stats = marker.get("stat")
    if stats is None:
        return None
    base = f"{snap}{os.sep}"
    changed = []
    stat = os.stat
    for rel, size, mtime in zip(stats["paths"], stats["sizes"], stats["mtimes"]):
        try:
            st = stat(base + rel)
        except OSError:
            changed.append(rel)
            continue
        if st.st_size != size or st.st_mtime_ns != mtime:
            changed.append(rel)
    return changed


def md5_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def hash_mismatches(pairs: Iterable[tuple[Path, str]]) -> list[Path]:
    """The paths whose md5 is not the expected one (missing files included)."""
    bad = []
    for path, md5 in pairs:
        try:
            ok = md5_of(path) == md5
        except OSError:
            ok = False
        if not ok:
            bad.append(path)
    return bad


def cache_objects(cache: Path) -> list[tuple[Path, str]]:
    """Every object in a DVC cache with the md5 its name promises."""
    root = cache / "files" / "md5"
    out = []
    for path in root.glob("*/*") if root.is_dir() else []:
        rel = f"{path.parent.name}/{path.name}"
        if _OBJECT.match(rel):
            out.append((path, rel.replace("/", "").removesuffix(".dir")))
    return out


def replace_with_link(obj: Path, dest: Path) -> None:
    """Make ``dest`` a hard link to (or a copy of) ``obj`` in one atomic rename: a reader sees the
    old file or the whole new one. The read-only parent is opened for the rename only."""
    parent = dest.parent
    mode = parent.stat().st_mode & 0o7777
    os.chmod(parent, mode | 0o700)
    tmp = parent / f".repair-{dest.name}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            os.link(obj, tmp)
        except OSError:
            shutil.copyfile(obj, tmp)
            os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        os.chmod(parent, mode)


def write_marker(snap: Path, marker: dict[str, Any]) -> None:
    """Replace the marker of a published (read-only) snapshot atomically."""
    from det_lab.volume import atomic_write_text

    mode = snap.stat().st_mode & 0o7777
    os.chmod(snap, mode | 0o700)
    try:
        atomic_write_text(snap / SNAPSHOT_MARKER, json.dumps(marker) + "\n", mode=0o444)
    finally:
        os.chmod(snap, mode)
