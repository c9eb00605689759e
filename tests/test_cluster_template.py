"""`cluster/notebook-template.yaml` and `det-lab cluster template --apply`, run as Determined runs
them: the template's own commands in a command task's shell, and the real ``det`` CLI against a
loopback stand-in of the master's template API (tests/det_template_master.py, which names the
master source it follows)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from tests.conftest import VENV_BIN
from tests.det_template_master import TemplateMaster

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "cluster" / "notebook-template.yaml"
ADMIN_PASSWORD = "Standin-Admin-Pass-1"


def header_commands(path: Path) -> list[str]:
    """The commands the template's header comment tells a user to run (its ``#   ...`` lines)."""
    lines = path.read_text().splitlines()
    header = [ln for ln in lines[:next(i for i, ln in enumerate(lines) if not ln.startswith("#"))]]
    return [m.group(1) for ln in header if (m := re.match(r"#   (\S.*)$", ln))]


def lab_template(root: Path, mlflow_uri: str = "http://gpu-box-1:5000") -> dict:
    """The template det_lab renders for data root ``root`` (the shipped copy is this for /mnt/data,
    tests/test_notebooks.py checks), with the lab config a task's ``DET_LAB_CONFIG`` names written."""
    from det_lab import notebook as nb
    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings, TrackingSettings

    lab = LabSettings(data_root=root, tracking=TrackingSettings(mlflow_uri=mlflow_uri))
    template = nb.det_template(lab, ClusterSettings())
    for var in template["environment"]["environment_variables"]:
        name, _, value = var.partition("=")
        if name == "DET_LAB_CONFIG" and not Path(value).exists():
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            Path(value).write_text(yaml.safe_dump({"data_root": str(root),
                                                   "tracking": {"mlflow_uri": mlflow_uri}}))
    return template


def task_env(template: dict, workdir: Path, **extra: str) -> dict[str, str]:
    """A task's environment as Determined composes it: nothing from the submitting shell
    (``master/pkg/tasks/task.go`` ~l.194-245, ``agent/internal/containers/spec.go`` ~l.205-226),
    the template's ``environment_variables``, and Determined's own ``DET_*`` ones in ``extra``."""
    env = dict(v.split("=", 1) for v in template["environment"]["environment_variables"])
    env.update(PATH=f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", HOME=str(workdir), **extra)
    return env


def run_as_command_task(command: str, env: dict[str, str], workdir: Path) -> subprocess.CompletedProcess:
    """``master/static/srv/command-entrypoint.sh`` l.19-23 (a notebook's terminal is the same
    shell): a single-string command runs as ``exec /bin/sh -c "$@"`` in the working directory
    (``/run/determined/workdir``, ``master/pkg/tasks/task.go`` ~l.27)."""
    return subprocess.run(["/bin/sh", "-c", command], env=env, cwd=workdir, capture_output=True,
                          text=True, timeout=120)


def test_the_templates_own_render_command_runs_in_a_task_and_renders_the_template(tmp_path):
    """The header's render command, run in a task the template itself configures, writes the
    template back (it was `from det_lab.notebook import det_template_yaml`: an ImportError)."""
    template = lab_template(tmp_path / "data")
    render = [c for c in header_commands(SHIPPED) if "--apply" not in c]
    assert render, "the header names no command to render the template"
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    for command in render:
        proc = run_as_command_task(command, task_env(template, workdir), workdir)
        assert proc.returncode == 0, f"{command!r}: {proc.stderr}"
    written = [p for p in workdir.glob("*.yaml")]
    assert len(written) == 1, "the render command wrote no template into the working directory"
    assert yaml.safe_load(written[0].read_text()) == template


def test_apply_twice_creates_then_updates_the_template_on_a_master_that_refuses_duplicates(tmp_path):
    """The header's `--apply`, run twice (the second after the MLflow server moved): the master
    refuses a second create of a name (api.go PostTemplate ~l.167-204, the stand-in's 500), so
    the second run updates the config (det template set-value config, api.go PatchTemplateConfig)."""
    rendered = lab_template(tmp_path / "data")
    [apply] = [c for c in header_commands(SHIPPED) if "--apply" in c]
    master = TemplateMaster(ADMIN_PASSWORD)
    try:
        workdir = tmp_path / "workdir"
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        (private / "admin-password").write_text(ADMIN_PASSWORD)
        os.chmod(private / "admin-password", 0o600)
        # DET_MASTER: what Determined sets in every task (master/pkg/tasks/task.go)
        extra = {"DET_MASTER": master.url, "DET_LAB_CLUSTER_DIR": str(private)}
        workdir.mkdir()
        first = run_as_command_task(apply, task_env(rendered, workdir, **extra), workdir)
        assert first.returncode == 0, first.stderr
        assert master.templates["det-lab"]["config"] == rendered
        moved = task_env(rendered, workdir, **extra)
        moved["MLFLOW_TRACKING_URI"] = "http://gpu-box-2:5000"
        second = run_as_command_task(apply, moved, workdir)
        assert second.returncode == 0, second.stderr
        assert "updated template 'det-lab'" in second.stdout
        config = master.templates["det-lab"]["config"]
        assert "MLFLOW_TRACKING_URI=http://gpu-box-2:5000" in config["environment"]["environment_variables"]
        assert config["bind_mounts"] == rendered["bind_mounts"]
        assert ("POST", "/api/v1/templates/det-lab") in master.requests
        assert ("PATCH", "/api/v1/templates/det-lab") in master.requests
    finally:
        master.close()


def test_apply_with_a_wrong_admin_password_fails_in_one_line(tmp_path):
    """A create that the master refuses for another reason is not retried as an update."""
    master = TemplateMaster(ADMIN_PASSWORD)
    try:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        (private / "admin-password").write_text("Not-The-Password-9")
        os.chmod(private / "admin-password", 0o600)
        env = {**task_env(lab_template(tmp_path / "data"), tmp_path), "DET_MASTER": master.url,
               "DET_LAB_CLUSTER_DIR": str(private)}
        proc = run_as_command_task("det-lab cluster template --apply", env, tmp_path)
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("warning: ")]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: det template create det-lab:"), lines
        assert master.templates == {}
    finally:
        master.close()
