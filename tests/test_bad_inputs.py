"""Bad input through the real ``det-lab`` CLI: one ``error:`` line naming what is wrong and the
fix, exit code 2, and nothing created or changed on the volume."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from det_lab.settings import ENV_VARS
from tests.conftest import VENV_BIN


def assert_refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """The command failed with exactly one ``error:`` line holding every needle."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == code, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: equal before and after = nothing written."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in root.rglob("*") if not p.is_dir()} | {
            str(p.relative_to(root)) + "/": (0, 0) for p in root.rglob("*") if p.is_dir()}


# --- the lab configuration and the environment ------------------------------------------------

def test_config_file_that_is_not_utf8(lab):
    lab.config.write_bytes(f"data_root: {lab.root}\n# caf\xe9 in Latin-1\n".encode("latin-1"))
    assert_refused(lab.cli("init"), str(lab.config), "UTF-8")
    assert not lab.root.exists()


def test_quota_with_two_decimal_points_is_refused(lab):
    lab.write_config(projects={"vla": {"quota": "1.5.5GiB"}})
    assert_refused(lab.cli("init"), str(lab.config), "projects.vla.quota", "1.5.5GiB")
    assert not lab.root.exists()


@pytest.mark.parametrize("name", sorted(n for n, v in ENV_VARS.items() if v.bad_example is not None))
def test_every_unparseable_environment_variable_is_one_line(lab, name):
    bad = ENV_VARS[name].bad_example
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "init"], env={**lab.env, name: bad},
                          cwd=lab.config.parent, capture_output=True, text=True, timeout=120)
    assert_refused(proc, f"{name}={bad}")
    assert not lab.root.exists()


def test_lock_lifetime_is_read_through_the_one_parser(lab):
    env = {**lab.env, "DET_LAB_LOCK_LIFETIME": "soon"}
    proc = subprocess.run([str(VENV_BIN / "python"), "-c", "from det_lab.data.lock import VolumeLock; "
                           "import pathlib, sys; VolumeLock(pathlib.Path(sys.argv[1]))", str(lab.root / "x.lock")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DET_LAB_LOCK_LIFETIME=soon" in proc.stderr
    assert not lab.root.exists()


def test_readme_documents_every_environment_variable():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in ENV_VARS if f"`{name}`" not in readme]
    assert not missing, f"README lacks {missing}"
