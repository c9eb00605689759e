"""`agent-up`, `up` and `doctor` check that every host path a task bind-mounts exists on this
machine: Determined passes each to Docker as a mount of type ``bind``
(``master/pkg/tasks/mounts.go`` l.12-30; the shared_fs storage's ``host_path`` in
``master/pkg/tasks/task_trial.go`` l.152-157), and Docker refuses a bind mount whose source is
missing, so every task on that agent would fail at container creation."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import yaml

from det_lab.cluster import deploy
from det_lab.cluster.settings import load_cluster_settings
from det_lab.compat import import_deploy
from det_lab.settings import load_settings
from tests.test_cluster_deploy import DET_LAB, RecordingDocker, init, invoke, master_info  # noqa: F401


def _doctor(lab) -> list[dict]:
    import subprocess

    proc = subprocess.run([DET_LAB, "doctor", "--json"], env=lab.env, capture_output=True, text=True, timeout=120)
    return [c for c in json.loads(proc.stdout)["checks"] if c["name"] == "bind mounts"]


def test_agent_up_refuses_a_missing_bind_source_before_starting_anything(lab, tmp_path, monkeypatch, master_info):
    """The cluster config named on the command line only (doctor's preflight does not read it):
    agent-up's own check names the path, and no container is created."""
    init(lab)
    assets = tmp_path / "isaac-assets"
    conf = tmp_path / "elsewhere.yaml"
    conf.write_text(yaml.safe_dump({"master_host": "127.0.0.1", "master_port": master_info, "agent": {"gpu": False},
                                    "bind_mounts": [{"host_path": str(assets)}],
                                    "tasks": {"local_cache": str(tmp_path / "agent-cache")}}))
    settings = load_settings(lab.config, env={})
    cluster = load_cluster_settings(settings, conf)
    dep = import_deploy()
    monkeypatch.setattr(dep, "_docker_client", None)
    fake = RecordingDocker()
    with pytest.raises(deploy.DeployError) as raised:
        deploy.agent_up(settings, cluster, tmp_path / "private", "gpu-a", client=fake)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"bind mount source {assets} does not exist on this machine")
    assert f"remove it from bind_mounts in {conf}" in message
    assert fake.runs == []
    # through the CLI, without Docker: the mount is what is said, in one line
    proc = invoke(lab, "cluster", "--cluster-config", str(conf), "agent-up", "127.0.0.1", "--agent-id", "gpu-a",
                  DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("warning: ")]
    assert proc.exit_code == 2 and len(lines) == 1 and str(assets) in lines[0], proc.stderr
    # once the path exists, agent-up goes on to start the agent
    assets.mkdir()
    deploy.agent_up(settings, cluster, tmp_path / "private", "gpu-a", client=fake)
    assert "gpu-a" in {r["name"] for r in fake.runs}


def test_doctor_names_each_missing_bind_source_and_its_fix(lab, tmp_path):
    init(lab)
    assets = tmp_path / "isaac-assets"
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({
        "pools": [{"name": "default", "agents": [socket.gethostname()]}],
        "bind_mounts": [{"host_path": str(assets)}]}))
    shutil.rmtree(lab.root / "outputs")  # a volume tree gone on this machine
    checks = [c for c in _doctor(lab) if str(tmp_path) in c["detail"]]
    assert [(c["status"], c["detail"].split(" (")[0]) for c in checks] == [
        ("fail", f"bind mount source {lab.root / 'outputs'} does not exist on this machine"),
        ("fail", f"bind mount source {assets} does not exist on this machine"),
    ]
    assert "mount the shared volume" in checks[0]["fix"]
    assert checks[1]["fix"] == f"create it here, or remove it from bind_mounts in {lab.root / '.det-lab' / 'cluster.yaml'}"
    init(lab)
    assets.mkdir()
    assert not [c for c in _doctor(lab) if str(tmp_path) in c["detail"]]


def test_doctor_only_warns_on_a_machine_outside_the_cluster(lab, tmp_path):
    init(lab)
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({
        "master_host": "det-master.invalid", "pools": [{"name": "default", "agents": ["gpu-z.invalid"]}],
        "bind_mounts": [{"host_path": str(tmp_path / "only-on-agents")}]}))
    assert [c["status"] for c in _doctor(lab) if str(tmp_path) in c["detail"]] == ["warn"]
