"""Which Determined harness det_lab's tasks run under (the audit's R1).

A master copies its own version's harness wheel into every task container
(``master/pkg/tasks/copy.go`` l.35-75, the glob ``*<version>*.whl``) and ``task-setup.sh`` l.26-27
``pip install --user``s it, shadowing the image's ``determined``. det_lab's trials call (and patch a
few private names of) Determined 0.38's harness, so det_lab supports 0.38 masters; under the
community fork's 0.40-0.42 master a task ends at its start, in one line, unless the experiment opts in.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_task_standin import TEMPLATES, _entrypoint_sourcing

HOOK = TEMPLATES / "vla" / "startup-hook.sh"


def _hook_with_master_wheel(tmp_path: Path, wheel: str | None, **env: str):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    if wheel:
        (wheels / wheel).write_bytes(b"")
    venv_bin = Path(os.sys.executable).parent
    return _entrypoint_sourcing(HOOK, {"PATH": f"{venv_bin}:/usr/bin:/bin", "DET_LAB_DATA_ROOT": "/nonexistent",
                                       "DET_LAB_HARNESS_WHEELS": str(wheels), **env})


@pytest.mark.parametrize("wheel", ["determined-0.38.1-py3-none-any.whl", None])
def test_a_038_master_or_none_goes_on_to_the_trial(tmp_path, wheel):
    proc = _hook_with_master_wheel(tmp_path, wheel)
    assert proc.returncode == 0 and "launch: options=" in proc.stdout, proc.stderr


def test_a_fork_master_ends_the_task_at_its_start_in_one_line(tmp_path):
    proc = _hook_with_master_wheel(tmp_path, "determined-0.42.0-py3-none-any.whl")
    assert proc.returncode != 0 and "launch:" not in proc.stdout
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("startup-hook.sh:")]
    assert "determined-0.42.0-py3-none-any.whl" in line and "0.38" in line and "DET_LAB_UNTESTED_HARNESS=1" in line


def test_an_experiment_may_opt_in_to_an_untested_harness(tmp_path):
    proc = _hook_with_master_wheel(tmp_path, "determined-0.42.0-py3-none-any.whl", DET_LAB_UNTESTED_HARNESS="1")
    assert proc.returncode == 0 and "launch: options=" in proc.stdout, proc.stderr
