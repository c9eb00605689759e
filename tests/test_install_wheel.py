"""A wheel built from this tree (not an editable install), installed into a new venv and used
from outside the checkout: the templates and notebooks come with it, `det-lab templates` lists
and copies them, and `det-lab run vla --local` trains from the installed copy."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_DIRS = {"vla": "vla", "3dgs": "gaussian_splatting", "isaac": "isaac_lab"}


def _sh(*args: str | Path, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the working tree (tracked and new, unignored files)."""
    src = tmp_path_factory.mktemp("src")
    files = _sh("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).stdout
    for rel in filter(None, files.split("\0")):
        path = REPO / rel
        if path.is_file():  # a tracked file deleted in the working tree is skipped
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(path.read_bytes())
            (src / rel).chmod(path.stat().st_mode)
    out = tmp_path_factory.mktemp("dist")
    build = _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", out, src)
    # a newcomer's `pip install -e .` printed this for every template folder, sixty lines in all
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    return next(out.glob("det_lab-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed. Its dependencies are borrowed from the test venv
    (a .pth line, so the install takes seconds); det_lab itself must come from the wheel. The
    venv gets no pip of its own (ensurepip takes longer than the rest): the test venv's pip
    installs into it with --python."""
    root = tmp_path_factory.mktemp("venv")
    _sh(sys.executable, "-m", "venv", "--without-pip", root)
    purelib = Path(_sh(root / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "zz_borrowed_deps.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    _sh(sys.executable, "-m", "pip", "--python", root / "bin/python", "install", "--no-deps", "--no-index", "-q", wheel)
    return root


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(DET_LAB_DATA_ROOT=str(tmp / "lab-data"), DET_LAB_CONFIG=str(tmp / "lab.yaml"),
               XDG_DATA_HOME=str(tmp / "xdg-data"), DET_LAB_TRACKING="mlflow")
    (tmp / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(tmp / "lab-data")}))
    return env


def test_the_wheel_carries_templates_and_notebooks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for d in TEMPLATE_DIRS.values():
        for f in ("const.yaml", "train.py", "README.md", ".detignore", "startup-hook.sh"):
            assert f"det_lab/_templates/{d}/{f}" in names
    assert {p.name for p in (REPO / "notebooks").glob("*.ipynb")} == \
        {Path(n).name for n in names if n.startswith("det_lab/_notebooks/") and n.endswith(".ipynb")}
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_installed_det_lab_lists_copies_and_runs_its_templates(venv, wheel, tmp_path):
    env, bin_ = _env(tmp_path), venv / "bin"
    # the demo datasets are published while the templates are listed and copied (nothing shared)
    init = subprocess.Popen([bin_ / "det-lab", "init", "--demo"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    imported = _sh(bin_ / "python", "-c", "import det_lab; print(det_lab.__file__)", cwd=tmp_path, env=env).stdout
    assert Path(imported.strip()).is_relative_to(venv), f"det_lab came from {imported}, not the wheel"
    packaged = Path(imported.strip()).parent

    listing = _sh(bin_ / "det-lab", "templates", "list", cwd=tmp_path, env=env).stdout
    for name, d in TEMPLATE_DIRS.items():
        line = next(line for line in listing.splitlines() if line.split()[:1] == [name])
        assert str(packaged / "_templates" / d) in line  # a whole path, though stdout is a pipe
    assert str(packaged / "_notebooks") in listing

    _sh(bin_ / "det-lab", "templates", "copy", "3dgs", "my-splats", cwd=tmp_path, env=env)
    assert (tmp_path / "my-splats/train.py").read_bytes() == (packaged / "_templates/gaussian_splatting/train.py").read_bytes()
    assert os.access(tmp_path / "my-splats/startup-hook.sh", os.X_OK)
    _sh(bin_ / "det-lab", "templates", "copy", "notebooks", "nb", cwd=tmp_path, env=env)
    assert sorted(p.name for p in (tmp_path / "nb").iterdir()) == sorted(p.name for p in (packaged / "_notebooks").iterdir())
    again = subprocess.run([bin_ / "det-lab", "templates", "copy", "vla", "my-splats"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "already exists" in again.stderr
    assert not (tmp_path / "my-splats/const.yaml").read_text().startswith("# A tiny VLA")

    init_out, _ = init.communicate(timeout=600)
    assert init.returncode == 0, init_out
    run = _sh(bin_ / "det-lab", "run", "vla", "--local", "--set", "data.det_lab.max_length.batches=20",
              "--set", "min_validation_period.batches=10", "--set", "min_checkpoint_period.batches=10",
              "--set", "checkpoint_storage.save_trial_latest=2",  # keep both (retention: tests/test_retention.py)
              cwd=tmp_path, env=env).stdout
    assert "finished" in run and "20 of 20 batches" in run, run
    ckpt_root = tmp_path / "lab-data/checkpoints/vla"
    ckpts = [p for p in ckpt_root.iterdir() if (p / "metadata.json").is_file()]
    assert len(ckpts) == 2  # at batches 10 and 20
    # the summary names where everything is, whole, though stdout is a pipe
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in run.splitlines() if line.count("│") == 3}
    latest = max(ckpts, key=lambda p: p.stat().st_mtime)
    assert rows["checkpoints"] == f"2 in {ckpt_root}; latest {latest} (step 20)"
    store = f"sqlite:///{tmp_path}/xdg-data/det-lab/mlflow.db"
    assert f"open it: mlflow ui --backend-store-uri {store}" in run
    assert "resume with" not in run
    # nothing but interpreter caches was written into the installed template (site-packages
    # may be read-only for the user)
    assert sorted(p.name for p in (packaged / "_templates/vla").iterdir() if p.name != "__pycache__") == \
        sorted(n.removeprefix("det_lab/_templates/vla/") for n in zipfile.ZipFile(wheel).namelist()
               if n.startswith("det_lab/_templates/vla/"))
