"""The datasets on the volume as tables: per project, registered, snapshots, a dataset's revisions."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from det_lab.settings import LabSettings, load_settings
from det_lab.volume import VolumeLayout, human_bytes

if TYPE_CHECKING:
    import pandas as pd


def volume_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """One row per project: bytes in its DVC remote, shared cache and snapshots, and its datasets."""
    import pandas as pd

    from det_lab import data

    rows = []
    for p in data.list_volume(settings or load_settings()):
        rows.append({
            "project": p.project, "datasets": ", ".join(sorted(p.registered)) or "-",
            "snapshots": len(p.snapshots), "remote": human_bytes(p.remote_bytes),
            "cache": human_bytes(p.cache_bytes), "snapshot_extra": human_bytes(p.snapshot_bytes),
            "remote_bytes": p.remote_bytes, "cache_bytes": p.cache_bytes, "snapshot_bytes": p.snapshot_bytes,
        })
    return pd.DataFrame(rows)


def registry_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """The registered datasets: name, project, git repo, DVC path, revision."""
    import pandas as pd

    from det_lab import data

    reg = data.load_registry(settings or load_settings())
    return pd.DataFrame([{"name": n, "project": s.project, "repo": s.repo, "path": s.path, "rev": s.rev}
                         for n, s in sorted(reg.items())], columns=["name", "project", "repo", "path", "rev"])


def snapshots_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """Every verified snapshot on the volume with its identity (the lineage trials record)."""
    import pandas as pd

    from det_lab import data

    settings = settings or load_settings()
    layout = VolumeLayout.from_settings(settings)
    names = {(s.project, s.repo, s.path): n for n, s in data.load_registry(settings).items()}
    rows = []
    for p in data.list_volume(settings):
        for ident in p.snapshots:
            rows.append({"dataset": names.get((ident.project, ident.repo, ident.path), "-"),
                         "project": ident.project, "rev": ident.rev, "commit": ident.commit[:12],
                         "md5": ident.md5, "files": ident.nfiles, "size": human_bytes(ident.size),
                         "size_bytes": ident.size,
                         "dir": str(layout.snapshots(ident.project) / ident.md5.removesuffix(".dir"))})
    return pd.DataFrame(rows, columns=["dataset", "project", "rev", "commit", "md5", "files", "size",
                                       "size_bytes", "dir"])


def dataset_revisions(name: str, settings: LabSettings | None = None) -> pd.DataFrame:
    """The git history of a registered dataset's ``<path>.dvc``: one row per revision, with its
    DVC hash and size, its tags, and whether a snapshot of it is on the volume."""
    import pandas as pd

    from det_lab import data
    from det_lab.data.git import git

    settings = settings or load_settings()
    spec = data.load_registry(settings)[name]
    snap_root = VolumeLayout.from_settings(settings).snapshots(spec.project)
    rows = []
    with tempfile.TemporaryDirectory(prefix="det-lab-revs-") as tmp:
        bare = Path(tmp) / "repo.git"
        git("clone", "--quiet", "--bare", spec.repo, str(bare), trust=[spec.repo])  # .dvc files only: small
        log = git("log", "--all", "--format=%H%x09%aI%x09%s", "--", f"{spec.path}.dvc", cwd=bare)
        for line in log.splitlines():
            commit, date, subject = line.split("\t", 2)
            out = (yaml.safe_load(git("show", f"{commit}:{spec.path}.dvc", cwd=bare)) or {}).get("outs", [{}])[0]
            md5 = str(out.get("md5", ""))
            tags = git("tag", "--points-at", commit, cwd=bare).split()
            rows.append({"commit": commit[:12], "date": date, "subject": subject, "tags": ", ".join(tags),
                         "md5": md5, "files": out.get("nfiles", 1), "size": human_bytes(int(out.get("size", 0))),
                         "on_volume": (snap_root / md5.removesuffix(".dir")).is_dir()})
    return pd.DataFrame(rows, columns=["commit", "date", "subject", "tags", "md5", "files", "size", "on_volume"])


