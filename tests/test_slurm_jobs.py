"""Apptainer definitions and the GitLab CI template, each checked up to what runs here.

Apptainer does not install here: the definition files are read back by spython's Singularity
recipe parser, and a job whose config names an image runs through the real test Slurm with an
``apptainer`` stand-in on PATH that records its arguments and runs the command on the node. The
CI file is validated against GitLab's CI schema (as vendored by check-jsonschema) and its smoke
and train jobs' scripts run against the test Slurm.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from spython.main.parse.parsers import SingularityParser

from tests.conftest import VENV_BIN, Lab
from tests.slurm_cluster import TINY, SlurmCluster, make_slurm_lab, slurm_cluster, slurm_volume  # noqa: F401 (fixtures)

# runs the command after the image, as apptainer exec would inside it, after noting its argv
FAKE_APPTAINER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_APPTAINER_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[2:]
while args and args[0].startswith("--"):
    args = args[2:] if args[0] in ("--bind", "--env", "--pwd") else args[1:]
image, command = args[0], args[1:]
if command[0] == "python3":
    command[0] = sys.executable
os.execv(command[0] if os.path.isabs(command[0]) else "/usr/bin/env", command if os.path.isabs(command[0]) else ["env", *command])
"""


@pytest.fixture(scope="module")
def jobs_lab(tmp_path_factory, slurm_cluster: SlurmCluster, slurm_volume: Path) -> Lab:
    """A lab on the Slurm tests' volume; no tracking (the image and CI jobs are about what runs where)."""
    return make_slurm_lab(tmp_path_factory.mktemp("slurm-jobs"), None, slurm_cluster, slurm_volume)


def test_definition_files_parse_as_apptainer_recipes(lab, tmp_path):
    proc = lab.cli("slurm", "image", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    wheels = f"{lab.root}/.det-lab/wheels"

    task = SingularityParser(str(tmp_path / "det-lab-task.def")).recipe["spython-base"]
    assert task.fromHeader.startswith("nvcr.io/nvidia/pytorch:")
    assert task.files == [f"{wheels} /opt/det-lab-wheels"]
    post = "\n".join(task.install)
    assert "--find-links /opt/det-lab-wheels det-lab" in post
    # gsplat's kernels are compiled during the build, for the listed GPU architectures
    assert 'TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"' in post and "from gsplat.cuda._backend import _C" in post
    assert f"DET_LAB_DATA_ROOT={lab.root}" in task.environ

    isaac = SingularityParser(str(tmp_path / "isaac-lab.def")).recipe["spython-base"]
    assert isaac.fromHeader.startswith("nvcr.io/nvidia/isaac-lab:")
    assert {"ACCEPT_EULA=Y", "PRIVACY_CONSENT=Y", "OMNI_KIT_ACCEPT_EULA=YES"} <= set(isaac.environ)
    post = "\n".join(isaac.install)
    assert "/isaac-sim/python.sh -m pip install" in post and "mkdir -p /det-lab-cache" in post


def test_a_config_naming_an_image_runs_its_trial_under_apptainer(jobs_lab, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "apptainer").write_text(FAKE_APPTAINER)
    (fake_bin / "apptainer").chmod(0o755)
    sif = jobs_lab.root / ".det-lab" / "images" / "isaac-lab.sif"
    sif.parent.mkdir(parents=True)
    sif.write_bytes(b"SIF stand-in")
    (jobs_lab.root / ".det-lab" / "slurm.yaml").write_text(yaml.safe_dump(
        {"images": {"isaac-lab-base:latest": str(sif)}, "nodes": [{"name": "n", "gpus": 2, "gpu_kind": "fake"}]}))
    cache = tmp_path / "isaac-cache"
    conf = yaml.safe_load((TINY / "const.yaml").read_text())
    conf["environment"] = {"image": {"cuda": "isaac-lab-base:latest"},
                           "environment_variables": ["ACCEPT_EULA=Y", "PRIVACY_CONSENT=Y"]}
    conf["bind_mounts"] = [{"host_path": str(cache), "container_path": "/det-lab-cache", "read_only": False}]
    config = tmp_path / "image.yaml"
    config.write_text(yaml.safe_dump(conf))
    log = tmp_path / "apptainer.log"
    env = {**jobs_lab.env, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_APPTAINER_LOG": str(log)}
    try:
        proc = subprocess.run([str(VENV_BIN / "det-lab"), "run", str(TINY), "--slurm", "--wait", "--exp-config",
                               str(config)], env=env, capture_output=True, text=True, timeout=300)
    finally:
        (jobs_lab.root / ".det-lab" / "slurm.yaml").unlink()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (argv,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert argv[:4] == ["exec", "--nv", "--writable-tmpfs", "--pwd"]
    binds = argv[argv.index("--bind") + 1].split(",")
    assert f"{jobs_lab.root}:{jobs_lab.root}" in binds and f"{cache}:/det-lab-cache" in binds
    assert f"{TINY}:{TINY}" in binds
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert envs == ["ACCEPT_EULA=Y", "PRIVACY_CONSENT=Y"]
    assert argv[argv.index(str(sif)) + 1:] == ["python3", "train.py"]  # the image's python, not the host's
    name = proc.stdout.split()[1].rstrip(":")
    st = json.loads((jobs_lab.root / "outputs" / "vla" / "slurm-runs" / name / "run.json").read_text())
    assert st["status"] == "finished" and st["slurm"]["image"] == str(sif)


def test_an_image_that_was_not_built_is_one_line_before_anything_is_created(jobs_lab, tmp_path):
    (jobs_lab.root / ".det-lab" / "slurm.yaml").write_text(yaml.safe_dump(
        {"images": {"default": "/nowhere/task.sif"}, "nodes": [{"name": "x"}]}))
    before = set((jobs_lab.root / "outputs" / "vla" / "slurm-runs").glob("*"))
    try:
        proc = jobs_lab.cli("run", str(TINY), "--slurm", "--partition", "fake")
    finally:
        (jobs_lab.root / ".det-lab" / "slurm.yaml").unlink()
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "images.default: /nowhere/task.sif does not exist" in line and "det-lab slurm image" in line
    assert set((jobs_lab.root / "outputs" / "vla" / "slurm-runs").glob("*")) == before


def _start(argv: list[str], out: Path, **kwargs) -> subprocess.Popen:
    """``argv`` in the background, its stdout and stderr into ``out``.stdout/.stderr (no pipe to fill up)."""
    with open(out.with_suffix(".stdout"), "w") as stdout, open(out.with_suffix(".stderr"), "w") as stderr:
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, **kwargs)


def _finish(proc: subprocess.Popen, out: Path) -> tuple[int, str, str]:
    proc.wait(timeout=300)
    return proc.returncode, out.with_suffix(".stdout").read_text(), out.with_suffix(".stderr").read_text()


def test_gitlab_ci_template_passes_gitlab_schema_and_its_jobs_run_on_slurm(jobs_lab, tmp_path):
    ci = tmp_path / ".gitlab-ci.yml"
    jobs_lab.cli("slurm", "ci", "--out", str(ci.parent), "--template", str(TINY), "--lab-config", str(jobs_lab.config),
                 check=True)
    pipeline = yaml.safe_load(ci.read_text())
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump({**pipeline, "train": {**pipeline["train"], "when": "sometimes"}}))
    variables = {k: v["value"] if isinstance(v, dict) else v for k, v in pipeline["variables"].items()}
    env = {**jobs_lab.env, **variables, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}  # the runner has det-lab
    # the schema checks and the two jobs (each job's script in one shell, as the runner runs it) side by side
    started = {name: _start([str(VENV_BIN / "check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", str(path)],
                            tmp_path / name) for name, path in (("schema-ok", ci), ("schema-broken", broken))}
    started |= {job: _start(["bash", "-ec", "\n".join(pipeline[job]["script"])], tmp_path / job, env=env, cwd=TINY)
                for job in ("smoke", "train")}
    code, out, err = _finish(started["schema-ok"], tmp_path / "schema-ok")
    assert code == 0, out + err
    assert _finish(started["schema-broken"], tmp_path / "schema-broken")[0] != 0  # the schema rejects a bad job
    for job in ("smoke", "train"):
        code, out, err = _finish(started[job], tmp_path / job)
        assert code == 0, f"{job}: {pipeline[job]['script']}\n{out}\n{err}"
        assert ("Slurm job" in out) == (job == "train"), out
        assert "finished" in out
    assert shlex.split(pipeline["train-determined"]["script"][0])[:3] == ["det", "experiment", "create"]
