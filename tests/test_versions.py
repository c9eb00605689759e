"""What a lab reads to know what changed under it: the version, the changelog, deprecations."""

from __future__ import annotations

import re
import subprocess
import warnings
from pathlib import Path

import det_lab
from tests.conftest import VENV_BIN

REPO = Path(__file__).resolve().parents[1]


def test_the_changelogs_newest_release_is_the_packages_version():
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == det_lab.__version__
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split("."))), reverse=True)
    assert det_lab.__version__ != "0.1.0"  # raised with this wave's user-visible changes
    assert 'version = "' not in (REPO / "pyproject.toml").read_text().split("[project]")[1].split("\n[")[0]


def test_version_names_det_labs_determineds_and_the_trackers_versions():
    from importlib.metadata import version

    proc = subprocess.run([str(VENV_BIN / "det-lab"), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"det-lab {det_lab.__version__}"
    assert f"determined {version('determined')}" in lines and f"mlflow {version('mlflow')}" in lines
    assert any(line.startswith("aim ") for line in lines)


def test_the_old_dataset_module_still_imports_with_one_warning_naming_the_new_one():
    import importlib
    import sys

    for name in [m for m in sys.modules if m == "det_lab.datasets" or m.startswith("det_lab.datasets.")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("det_lab.datasets")
        from det_lab.datasets.lerobot import LeRobotDataset as old_class
    from det_lab.formats import LeRobotDataset

    assert old.LeRobotDataset is LeRobotDataset and old_class is LeRobotDataset
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    message = str(deprecations[0].message)
    assert "det_lab.formats" in message and "0.3.0" in message
