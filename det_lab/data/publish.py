"""Turning a directory into a versioned dataset on the volume: a git + DVC repo per dataset,
its objects pushed to the project's DVC remote (``datasets/<project>``), registered by name.

This is what ``det-lab init --demo`` uses; teams with their own git server do the same by hand
(see the README) and only ``det-lab data register`` the result.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
            git("clone", "--quiet", str(bare), str(ws), trust=[bare])
        else:
            bare.parent.mkdir(parents=True, exist_ok=True)
            git("init", "--quiet", "--bare", "--shared=group", "--initial-branch=main", str(bare))
            git("init", "--quiet", "--initial-branch=main", str(ws))
            with _dvc("init"):
                _repo_class().init(str(ws)).close()
            with _dvc("config", ws) as repo, repo.config.edit("repo") as conf:  # dvc remote add --default; dvc config
                conf["remote"]["volume"] = {"url": str(remote)}
                conf["core"]["remote"] = "volume"
                conf["core"]["autostage"] = "true"  # as `dvc config core.autostage true` writes it
        target = ws / data_path
        if target.exists():
            with _dvc("remove", ws) as repo:
                repo.remove(str(ws / f"{data_path}.dvc"), outs=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, target)
        with _dvc("add", ws) as repo:
            repo.add([str(target)])
        git("add", "--all", cwd=ws)
        git(*_identity(ws), "commit", "--quiet", "--allow-empty", "-m", message, cwd=ws)
        with _dvc("push", ws) as repo:
            repo.push()
        git("push", "--quiet", str(bare), "HEAD:main", cwd=ws, trust=[bare])
    spec = DatasetSpec(project=project, repo=str(bare), path=data_path, rev="main")
    if name not in load_registry(settings):
        register(settings, name, spec)
    return spec


def _repo_class() -> Any:
    from dvc.repo import Repo

    return Repo


@contextlib.contextmanager
def _dvc(command: str, ws: Path | None = None) -> Iterator[Any]:
    """DVC's own ``Repo`` of ``ws`` (None without ``ws``), what its commands call, in this process: a
    ``python -m dvc`` per command paid DVC's import each time (~0.5 s of CPU; five per new dataset).
    Quiet as ``--quiet`` (its log and progress bars off); its error is one line naming the command."""
    from dvc.exceptions import DvcException

    log = logging.getLogger("dvc")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        if ws is None:
            yield None
        else:
            with _repo_class()(str(ws)) as repo:
                yield repo
    except DvcException as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        raise DataError(f"dvc {command} failed: {lines[-1] if lines else type(exc).__name__}") from None
    finally:
        log.setLevel(level)


def _identity(ws: Path) -> list[str]:
    """``-c user.*`` options when git has no identity configured (fresh machines, CI)."""
    try:
        git("config", "user.email", cwd=ws)
        return []
    except DataError:
        user = getpass.getuser()
        return ["-c", f"user.name={user}", "-c", f"user.email={user}@{socket.gethostname()}"]


def publish_demos(settings: LabSettings) -> list[str]:
    """Generate and publish the embedded demo datasets not yet registered (``det-lab init
    --demo``): ``vla-demo`` (LeRobot v3) and ``3dgs-demo`` (COLMAP). Returns the names published."""
    from det_lab.data.demo import make_3dgs_demo, make_vla_demo

    demos = {"vla-demo": ("vla", make_vla_demo), "3dgs-demo": ("3dgs", make_3dgs_demo)}
    registered = load_registry(settings)
    published = []
    for name, (project, make) in demos.items():
        if name in registered:
            continue
        with tempfile.TemporaryDirectory(prefix=f"det-lab-{name}-") as tmp:
            src = make(Path(tmp) / name)
            publish_directory(settings, project, name, src, f"{name}: generated by det-lab init --demo")
        published.append(name)
    return published

