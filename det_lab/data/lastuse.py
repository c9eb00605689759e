"""When each snapshot was last used, recorded by det_lab itself.

``atime`` cannot say it: NFS volumes are mounted ``noatime`` or ``relatime``, and a trial reads
its files for days. Instead every pull of a snapshot (each trial's start goes through one) and
each checkpoint of a trial touches ``snapshots/<project>/.last-use/<snapshot>``: the file's
modification time is the last use. ``det-lab data gc`` evicts snapshots whose last use is older
than its ``--days``.
"""

from __future__ import annotations

import os
from pathlib import Path

from det_lab.volume import VolumeLayout

LAST_USE_DIR = ".last-use"


def last_use_file(layout: VolumeLayout, project: str, stem: str) -> Path:
    """The file whose modification time is the last use of snapshot ``stem`` of ``project``."""
    return layout.snapshots(project) / LAST_USE_DIR / stem


def note_use(layout: VolumeLayout, project: str, stem: str) -> None:
    """Record that snapshot ``stem`` is used now. Never fails a pull or a trial: a read-only
    volume leaves the record as it was."""
    path = last_use_file(layout, project, stem)
    try:
        try:
            os.utime(path)
        except FileNotFoundError:
            path.parent.mkdir(mode=0o2775, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o664))
            os.utime(path)
    except OSError:
        pass


def last_use(layout: VolumeLayout, project: str, stem: str) -> float | None:
    """The last use of snapshot ``stem`` (Unix time); None when none was ever recorded."""
    try:
        return os.stat(last_use_file(layout, project, stem)).st_mtime
    except OSError:
        return None
