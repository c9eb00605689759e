"""The task image as the stand-in shows it: which host paths a container sees, its passwd view, and a
Python image without Determined's harness (so the master's wheel is what the task imports).

A Docker container sees its image's root filesystem, the agent's mounts and nothing else of the host.
Here the image is this machine's own system directories (``IMAGE_TOP``: ``/usr``, ``/etc`` and the
``/bin``, ``/lib`` links), read-only, on bubblewrap's fresh root; the host's ``/home``, ``/root``,
``/srv``, ``/mnt``, ``/opt``, ``/var`` and the checkout are not there. An image's Python and packages
that lie elsewhere on the host are named in ``Image.dirs``.
"""

from __future__ import annotations

import grp
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.standin.task_config import WORK_DIR, Image, LinkedUser
from tests.standin.task_env import DOCKER_DEFAULT_PATH

#: the top-level host entries that are the image's (links like /bin -> usr/bin included)
IMAGE_TOP = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: empty in a fresh image, or filled by the container runtime
EMPTY_TOP = ("home", "root", "mnt", "srv", "opt", "media")
#: a base image's own accounts: system ones and nobody; a host's login users are not in an image
_IMAGE_MAX_ID = 1000
_NOBODY = 65534


def image_root_args() -> list[str]:
    """bwrap arguments for the image's files read-only on a fresh root."""
    args: list[str] = []
    for entry in IMAGE_TOP:
        path = f"/{entry}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for entry in EMPTY_TOP:
        args += ["--dir", f"/{entry}"]
    return args + ["--tmpfs", "/var", "--dir", "/var/tmp"]


def _image_entries(path: str) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2].isdigit() and (int(fields[2]) < _IMAGE_MAX_ID or int(fields[2]) == _NOBODY):
            out.append(line)
    return out


def injected_user_files(user: LinkedUser) -> dict[str, str]:
    """master/pkg/tasks/task.go:389-405 injectUserArchive: /run/determined/etc/{passwd,shadow,group}."""
    group = user.group or grp.getgrgid(user.gid).gr_name
    return {"passwd": f"{user.name}:x:{user.uid}:{user.gid}::{WORK_DIR}:/bin/bash\n",  # :390-392
            "shadow": f"{user.name}:*:::::::\n",  # :395
            "group": f"{group}:x:{user.gid}:\n"}  # :396


def passwd_view(user: LinkedUser) -> tuple[str, str]:
    """The task's /etc/passwd and /etc/group as its NSS answers them.

    libnss_determined (in Determined's images) answers from the files ``injected_user_files`` writes,
    after the image's own files; the stand-in has no NSS module, so it shows the image's entries
    followed by the injected ones as the task's /etc/passwd and /etc/group.
    """
    injected = injected_user_files(user)
    image_passwd = "".join(f"{line}\n" for line in _image_entries("/etc/passwd"))
    image_group = "".join(f"{line}\n" for line in _image_entries("/etc/group"))
    return image_passwd + injected["passwd"], image_group + injected["group"]


def make_image(base: Path, *, without: tuple[str, ...] = ("determined",), probe_uid: int | None = None) -> Image:
    """A task image's Python under ``base``: a venv of this machine's system ``python3.X`` with system
    site packages (so ``pip install --user`` works, as in a plain image) whose packages are the test
    venv's, less the distributions ``without`` (each a top-level package and its ``.dist-info``).

    Nothing is downloaded: the image has every dependency of the harness wheel, as the images Determined
    publishes do, so task-setup.sh's install needs no network. ``probe_uid``: a user who must be able to
    run the interpreter (the system one, not a root-only one such as /root/.pyenv).
    """
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    python = next((p for p in (f"/usr/bin/{minor}", f"/usr/local/bin/{minor}") if os.access(p, os.X_OK)), None)
    if python is None:
        raise FileNotFoundError(f"no system {minor} for the task image")
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    venv = base / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    site = base / "site-packages"  # the image's packages: the test venv's, by link
    site.mkdir()
    names = {n.lower().replace("-", "_") for n in without}
    for entry in sorted(purelib.iterdir()):
        stem = entry.name.split("-", 1)[0].lower() if entry.name.endswith(".dist-info") else entry.name.lower()
        if stem.replace("-", "_") in names or entry.name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    venv_site = subprocess.run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (Path(venv_site) / "image_packages.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    for p in [base, *base.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    if probe_uid is not None:
        probe = subprocess.run([venv / "bin/python", "-c", "import pip, requests"], user=probe_uid,
                               capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeError(f"the task image's python does not run as uid {probe_uid}: {probe.stderr[-300:]}")
    # the image's ENV puts its Python first, as a Dockerfile's ENV PATH=/opt/venv/bin:$PATH does
    # and the test session's thread count for torch (tests/conftest.py), as a lab's image sets it with ENV
    threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {}
    return Image(venv / "bin", env={"PATH": f"{venv / 'bin'}:{DOCKER_DEFAULT_PATH}", **threads}, dirs=[base, purelib])
