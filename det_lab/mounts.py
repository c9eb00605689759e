"""This machine's mounts, from ``/proc/mounts``: which mount holds a path, and whether it is NFS.
A leaf module: it imports nothing of det_lab."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NETWORK_FS = {"nfs", "nfs4"}


@dataclass(frozen=True)
class Mount:
    device: str
    mountpoint: Path
    fstype: str
    options: tuple[str, ...]


def parse_mounts(text: str) -> list[Mount]:
    """Parse /proc/mounts (octal escapes such as ``\\040`` for spaces included)."""
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mounts.append(Mount(_unescape(parts[0]), Path(_unescape(parts[1])), parts[2], tuple(parts[3].split(","))))
    return mounts


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape")


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount that holds ``path``: the last-mounted one with the longest matching mountpoint."""
    path = path.resolve()
    best: Mount | None = None
    for m in mounts:
        if path == m.mountpoint or m.mountpoint in path.parents:
            if best is None or len(m.mountpoint.parts) >= len(best.mountpoint.parts):
                best = m
    return best
