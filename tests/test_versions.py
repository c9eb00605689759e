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


def test_the_modules_moved_out_of_trials_import_by_their_old_paths_with_one_warning_each(tmp_path):
    """A user's code written against 0.1.0 (``from det_lab.trials import record``, ``import
    det_lab.trials.prune``, a patch of ``det_lab.trials.record.X``), in a fresh interpreter: the same
    module objects, one DeprecationWarning per old path naming the new one, pointing at the user's line."""
    user = tmp_path / "user_code.py"
    user.write_text(
        "import warnings, json, sys\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from det_lab.trials import record, retention\n"
        "    import det_lab.trials.prune\n"
        "    from det_lab.trials.record import LocalRunRecord\n"
        "    import det_lab.trials.record as again\n"
        "import det_lab.runs.record, det_lab.runs.retention, det_lab.lifecycle.prune\n"
        "same = [record is det_lab.runs.record, retention is det_lab.runs.retention,\n"
        "        det_lab.trials.prune is det_lab.lifecycle.prune, again is record,\n"
        "        LocalRunRecord is det_lab.runs.record.LocalRunRecord,\n"
        "        record.__spec__.name == 'det_lab.runs.record']\n"
        "print(json.dumps({'same': same, 'warnings': [[str(w.message), w.filename, w.lineno] for w in caught\n"
        "                  if issubclass(w.category, DeprecationWarning)]}))\n")
    proc = subprocess.run([str(VENV_BIN / "python"), str(user)], capture_output=True, text=True, check=True)
    import json

    out = json.loads(proc.stdout)
    assert out["same"] == [True] * 6
    assert [(m.split(" moved to ")[0], f, line) for m, f, line in out["warnings"]] == [
        ("det_lab.trials.record", str(user), 5), ("det_lab.trials.retention", str(user), 5),
        ("det_lab.trials.prune", str(user), 6)]
    assert all("0.3.0" in m and f"import {m.split(' moved to ')[1].split(' ')[0]} instead" in m
               for m, _, _ in out["warnings"])


def test_trials_holds_only_what_a_trials_code_sees():
    """The folders say what the layers contract enforces: the run layer and the volume's lifecycle
    are packages of their own."""
    from det_lab.trials import MOVED

    here = {p.stem for p in (REPO / "det_lab/trials").glob("*.py")} - {"__init__"}
    assert here == {"distributed", "gpu_sampler", "legacy", "pytorch", "searcher_stop", "session", "surface"}
    for old, new in MOVED.items():
        assert (REPO / (new.replace(".", "/") + ".py")).is_file() and old not in here


def test_every_moved_module_is_a_recorded_deprecation_and_the_reference_lists_it():
    from det_lab.public import DEPRECATED
    from det_lab.trials import MOVED

    for old, new in MOVED.items():
        assert DEPRECATED[f"det_lab.trials.{old}"][:3] == (new, "0.2.0", "0.3.0")
    reference = (REPO / "docs/reference/public-api.md").read_text()
    assert all(f"det_lab.trials.{old}" in reference for old in MOVED)
