"""Turning a directory into a versioned dataset on the volume: a git + DVC repo per dataset,
its objects pushed to the project's DVC remote (``datasets/<project>``), registered by name.

This is what ``det-lab init --demo`` uses; teams with their own git server do the same by hand
(see the README) and only ``det-lab data register`` the result.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from det_lab.data.errors import DataError
from det_lab.data.git import git
from det_lab.data.pull import DatasetSpec
from det_lab.data.registry import load_registry, register
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout


def dataset_repo(settings: LabSettings, project: str, name: str) -> Path:
    """Where a dataset's git repository lives on the volume."""
    return VolumeLayout.from_settings(settings).datasets(project) / "git" / f"{name}.git"


def publish_directory(settings: LabSettings, project: str, name: str, src: Path, message: str) -> DatasetSpec:
    """Version ``src`` as dataset ``name`` of ``project`` and push it to the volume.

    A new revision is committed on top of an existing repository; ``src`` is copied, not moved.
    """
    layout = VolumeLayout.from_settings(settings)
    remote = layout.datasets(project)
    bare = dataset_repo(settings, project, name)
    data_path = f"data/{name}"
    with tempfile.TemporaryDirectory(prefix="det-lab-publish-") as tmp:
        ws = Path(tmp) / "ws"
        if bare.exists():
            git("clone", "--quiet", str(bare), str(ws))
        else:
            bare.parent.mkdir(parents=True, exist_ok=True)
            git("init", "--quiet", "--bare", "--shared=group", "--initial-branch=main", str(bare))
            git("init", "--quiet", "--initial-branch=main", str(ws))
            _dvc(ws, "init", "--quiet")
            _dvc(ws, "remote", "add", "--default", "volume", str(remote))
            _dvc(ws, "config", "core.autostage", "true")
        target = ws / data_path
        if target.exists():
            _dvc(ws, "remove", "--outs", f"{data_path}.dvc")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, target)
        _dvc(ws, "add", "--quiet", data_path)
        git("add", "--all", cwd=ws)
        git(*_identity(ws), "commit", "--quiet", "--allow-empty", "-m", message, cwd=ws)
        _dvc(ws, "push", "--quiet")
        git("push", "--quiet", str(bare), "HEAD:main", cwd=ws)
    spec = DatasetSpec(project=project, repo=str(bare), path=data_path, rev="main")
    if name not in load_registry(settings):
        register(settings, name, spec)
    return spec


def _dvc(ws: Path, *args: str) -> None:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise DataError(f"dvc {args[0]} failed: {lines[-1] if lines else proc.returncode}")


def _identity(ws: Path) -> list[str]:
    """``-c user.*`` options when git has no identity configured (fresh machines, CI)."""
    try:
        git("config", "user.email", cwd=ws)
        return []
    except DataError:
        user = getpass.getuser()
        return ["-c", f"user.name={user}", "-c", f"user.email={user}@{socket.gethostname()}"]
