"""`cluster up` / `agent-up` / `link-users`: dry-run plans, preflight, no Docker, and the real
deploy path run against a recording stand-in for the Docker daemon (the one thing that cannot
run here): Determined's own master_up/agent_up code executes unchanged on top of it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import yaml
from typer.testing import CliRunner

from det_lab.cli.app import app

from det_lab.cluster import deploy
from det_lab.cluster.settings import load_cluster_settings
from det_lab.compat import import_deploy
from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.conftest import VENV_BIN

DET_LAB = str(VENV_BIN / "det-lab")


def invoke(lab, *args: str, **env: str):
    """det-lab in this process (fast); the subprocess tests cover the installed console script."""
    return CliRunner().invoke(app, list(args), env={**lab.env, **env})


def init(lab) -> None:
    init_volume(load_settings(lab.config, env={}))


def dry_run(lab, *args: str) -> dict:
    proc = invoke(lab, "cluster", *args, "--dry-run", "--json")
    assert proc.exit_code == 0, proc.stderr
    return json.loads(proc.stdout)


def by_role(plan: dict) -> dict[str, dict]:
    return {c["role"]: c for c in plan["containers"]}


def test_up_dry_run_plan(lab):
    plan = dry_run(lab, "up", "--agent-id", "gpu-a")
    c = by_role(plan)
    assert c["database"]["image"] == "postgres:14" and "10.14" not in json.dumps(plan["containers"])
    assert c["database"]["name"] == "determined_determined-db_1" and c["database"]["network"] == "determined_default"
    assert c["master"]["image"] == "determinedai/determined-master:0.38.1"
    assert c["master"]["ports"] == {"8080": 8080}
    targets = {m["target"]: m for m in c["master"]["mounts"]}
    assert targets["/determined_shared_fs"]["source"] == str(lab.root)
    private = lab.root.parent / "xdg-config" / "det-lab" / "cluster"
    assert targets["/etc/determined/master.yaml"]["source"] == str(private / "master.yaml")
    assert c["agent"]["name"] == "gpu-a" and c["agent"]["network_mode"] == "host"
    assert c["agent"]["env"]["DET_RESOURCE_POOL"] == "default"
    assert plan["networks"] == ["determined_default"] and plan["volumes"] == ["determined_determined-db-volume"]
    # secrets: only where they come from, never a value; every planned file in the private dir is
    # owner-only; the lab config tasks read is on the volume, readable, and holds no secret
    assert c["master"]["env"] == {"DET_DB_PASSWORD": f"<from {private / 'db-password'}>"}
    assert all(f["mode"] == "0600" for f in plan["files"] if f["path"].startswith(str(private)))
    files = {f["path"]: f for f in plan["files"]}
    assert files[f"{lab.root}/.det-lab/lab.yaml"]["mode"] == "0644" and not files[f"{lab.root}/.det-lab/lab.yaml"]["secret"]
    task = {m["container_path"]: m for m in plan["task_mounts"]}
    assert task[f"{lab.root}/datasets"]["read_only"] and task[f"{lab.root}/outputs"]["read_only"] is False
    # a dry run creates nothing
    assert not private.exists() and not lab.root.exists()


def test_plan_uses_det_deploy_local_names():
    from det_lab.cluster import plan

    dep = import_deploy()
    for name in ("NETWORK_NAME", "DB_NAME", "MASTER_NAME", "VOLUME_NAME"):
        assert getattr(plan, name) == getattr(dep, name)


def test_up_dry_run_text(lab):
    proc = invoke(lab, "cluster", "up", "--dry-run")
    assert proc.exit_code == 0, proc.stderr
    for text in ("container determined_determined-master_1", "image postgres:14", "port    8080 -> 8080",
                 "(ro, rslave)", "mode 0600 (secret)"):
        assert text in proc.stdout


def test_agent_up_dry_run_plan(lab):
    (lab.root / ".det-lab").mkdir(parents=True)
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({
        "pools": [{"name": "default", "agents": ["gpu-a"]}, {"name": "a6000", "agents": ["gpu-b"]}],
    }))
    plan = dry_run(lab, "agent-up", "gpu-a.lab:9090", "--agent-id", "gpu-b")
    (agent,) = plan["containers"]
    assert agent["image"] == "determinedai/determined-agent:0.38.1" and agent["network_mode"] == "host"
    assert agent["env"] == {"DET_MASTER_HOST": "gpu-a.lab", "DET_MASTER_PORT": "9090",
                            "DET_AGENT_ID": "gpu-b", "DET_RESOURCE_POOL": "a6000"}
    assert {m["target"] for m in agent["mounts"]} == {"/var/run/docker.sock", "/etc/determined/agent.yaml"}
    assert agent["labels"]["determined.cluster"] == "determined"
    assert plan["master_url"] == "http://gpu-a.lab:9090"
    forced = invoke(lab, "cluster", "agent-up", "gpu-a.lab", "--agent-id", "gpu-b", "--pool", "default", "--dry-run")
    assert forced.exit_code == 0 and "env     DET_RESOURCE_POOL=default" in forced.stdout
    bad = invoke(lab, "cluster", "agent-up", "gpu-a.lab", "--pool", "h100", "--dry-run")
    assert bad.exit_code == 2 and "--pool 'h100': the cluster config defines no such pool" in bad.stderr


def test_up_refuses_when_doctor_fails(lab):
    proc = invoke(lab, "cluster", "up")  # the data root was never created
    assert proc.exit_code == 2 and "Traceback" not in proc.stderr
    assert f"fail  data root: {lab.root} does not exist" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: refusing to start: 1 doctor check(s) failed (data root); fix them and re-run")
    assert not (lab.root.parent / "xdg-config" / "det-lab").exists()
    agent = invoke(lab, "cluster", "agent-up", "gpu-a")  # an agent machine without the volume
    assert agent.exit_code == 2 and f"fail  data root: {lab.root} does not exist" in agent.stderr
    assert agent.stderr.strip().splitlines()[-1].startswith("error: refusing to start")


def test_up_without_docker_fails_in_one_line_and_creates_nothing(lab):
    init(lab)
    env = dict(lab.env, DOCKER_HOST=f"unix://{lab.root.parent}/no-docker.sock")
    proc = subprocess.run([DET_LAB, "cluster", "up"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: tracking")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("error: no Docker daemon reachable at unix://") and "no such socket" in lines[0]
    assert "install Docker Engine" in lines[0]
    assert not (lab.root.parent / "xdg-config" / "det-lab").exists()  # no secrets, no configs
    for cmd in (("down",), ("status",), ("logs",), ("agent-up", "gpu-a")):
        other = invoke(lab, "cluster", *cmd, DOCKER_HOST=env["DOCKER_HOST"])
        assert other.exit_code == 2 and other.stderr.startswith("error: no Docker daemon"), (cmd, other.stderr)
        assert len(other.stderr.strip().splitlines()) == 1 and other.stdout == ""
    assert not (lab.root.parent / "xdg-config" / "det-lab").exists()


def test_link_users_dry_run(lab):
    lab.write_config(master_url="http://gpu-a.lab:8080")
    (lab.root / ".det-lab").mkdir(parents=True)
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({"users": {
        "alice": {"uid": 1001, "gid": 2000, "user": "alice", "group": "robots"},
        "bob": {"uid": 1002, "gid": 2000, "user": "bob", "group": "robots"},
    }}))
    proc = invoke(lab, "cluster", "link-users", "--dry-run")
    assert proc.exit_code == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "det -m http://gpu-a.lab:8080 user link-with-agent-user alice --agent-uid 1001 --agent-gid 2000 "
        "--agent-user alice --agent-group robots",
        "det -m http://gpu-a.lab:8080 user link-with-agent-user bob --agent-uid 1002 --agent-gid 2000 "
        "--agent-user bob --agent-group robots",
    ]


def test_link_users_refuses_root_and_unknown_users(lab):
    (lab.root / ".det-lab").mkdir(parents=True)
    cfg = lab.root / ".det-lab" / "cluster.yaml"
    for users, message in (({"admin": "root"}, "maps to uid 0 (root)"),
                           ({"zed": "no-such-unix-user-xyz"}, "Unix user 'no-such-unix-user-xyz' does not exist"),
                           (None, "no users to link")):
        if users is None:
            cfg.unlink()
        else:
            cfg.write_text(yaml.safe_dump({"users": users}))
        result = invoke(lab, "cluster", "link-users", "--dry-run")
        assert result.exit_code == 2 and message in result.stderr, result.stderr


# --- the real deploy path, Docker replaced at its API boundary -------------------------------------

class _Container:
    def __init__(self, name: str, kwargs: dict):
        self.name, self.kwargs, self.labels, self.status = name, kwargs, kwargs.get("labels") or {}, "running"

    def logs(self, **_):
        return b"ready\n"


class RecordingDocker:
    """Answers the calls cluster_utils and det_lab make, and records every container it 'runs'."""

    def __init__(self):
        self.runs: list[dict] = []
        self.networks_created: list[str] = []
        docker = self

        class Containers:
            def run(self, **kw):
                docker.runs.append(kw)
                return _Container(kw["name"], kw)

            def list(self, **_):
                return []

            def get(self, name):
                return _Container(name, {})

        class Networks:
            def create(self, name, **_):
                docker.networks_created.append(name)

            def list(self, **_):
                return []

        class Api:
            def inspect_container(self, name):
                return {"State": {"Status": "running", "Health": {"Status": "healthy"}}}

            def create_endpoint_config(self, **kw):
                return {"Aliases": kw.get("aliases")}

        self.containers, self.networks, self.api = Containers(), Networks(), Api()

    def ping(self):
        return True


@pytest.fixture
def master_info():
    """A stand-in master answering /info, as det deploy local's health check polls it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path.rstrip("/").endswith("info") else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"version": "0.38.1"}')

        def log_message(self, *_):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_up_runs_determined_deploy_code_without_leaking_the_password(lab, tmp_path, monkeypatch, capsys, master_info):
    init(lab)
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump(
        {"master_host": "127.0.0.1", "master_port": master_info, "agent": {"gpu": False},
         "tasks": {"local_cache": str(tmp_path / "agent-cache")}}))  # not the host's /var/cache/det-lab
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))  # where master_up would drop its temp config
    dep = import_deploy()
    monkeypatch.setattr(dep, "_docker_client", None)
    original_db_up = dep.db_up
    lab_settings = load_settings(lab.config, env={})
    cluster = load_cluster_settings(lab_settings)
    private = tmp_path / "private"
    fake = RecordingDocker()

    prepared = deploy.up(lab_settings, cluster, private, "gpu-a", client=fake)

    assert dep.db_up is original_db_up  # the postgres patch is undone after the call
    runs = {r["name"]: r for r in fake.runs}
    db, master, agent = runs["determined_determined-db_1"], runs["determined_determined-master_1"], runs["gpu-a"]
    assert db["image"] == "postgres:14" and not any("10.14" in str(r) for r in fake.runs)
    assert db["networking_config"]["determined_default"]["Aliases"] == ["determined-db"]
    assert "-d determined" in db["healthcheck"]["test"][1]
    assert master["image"] == "determinedai/determined-master:0.38.1" and master["ports"] == {"8080": str(master_info)}
    assert f"{private / 'master.yaml'}:/etc/determined/master.yaml" in master["volumes"]
    assert f"{lab.root}:/determined_shared_fs" in master["volumes"]
    assert agent["environment"]["DET_RESOURCE_POOL"] == "default" and agent["network_mode"] == "host"
    assert agent["labels"]["determined.cluster"] == "determined" and agent["device_requests"] is None

    admin, db_pw = prepared.secrets.admin.value, prepared.secrets.db.value
    # master_up used our file as is: no det-deploy-local-master-config-* temp file anywhere
    assert list(scratch.iterdir()) == []
    conf = yaml.safe_load(prepared.master_yaml.read_text())
    assert conf["security"]["initial_user_password"] == admin and "password" not in conf["db"]
    assert master["environment"]["DET_DB_PASSWORD"] == db_pw
    assert admin not in json.dumps(fake.runs, default=str)  # the admin password is in no container env
    # every file holding a secret is owner-only; nothing world-readable holds one
    holders = []
    for base in (tmp_path, lab.root):
        for path in base.rglob("*"):
            if path.is_file() and not path.is_symlink():
                text = path.read_text(errors="ignore")
                if admin in text or db_pw in text:
                    holders.append(path)
                    assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert set(holders) == {private / "admin-password", private / "db-password", private / "master.yaml"}
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    out = capsys.readouterr()
    assert admin not in out.out + out.err and db_pw not in out.out + out.err  # deploy itself never prints it


def test_old_postgres_volume_is_refused_with_a_migration_hint():
    class Exited(RecordingDocker):
        def __init__(self):
            super().__init__()
            self.api.inspect_container = lambda name: {"State": {"Status": "exited", "Health": {"Status": "unhealthy"}}}

            class Containers:
                def get(self, name):
                    c = _Container(name, {})
                    c.logs = lambda **_: (b"initdb: ...\nFATAL:  database files are incompatible with server\n"
                                          b"DETAIL:  The data directory was initialized by PostgreSQL version 10")
                    return c

            self.containers = Containers()

    with pytest.raises(deploy.DeployError) as exc:
        deploy.wait_healthy(Exited(), "determined_determined-db_1", timeout=5)
    msg = str(exc.value)
    assert "\n" not in msg and "determined_determined-db_1 exited: FATAL:  database files are incompatible" in msg
    assert "pg_dump" in msg


# --- images named by tag or pinned by digest (the community fork's images on ghcr.io) ----------------

MASTER_DIGEST, AGENT_DIGEST = "sha256:" + "1f" * 32, "sha256:" + "a2" * 32


def test_pinned_fork_images_reach_the_containers_det_deploy_local_runs(lab, tmp_path, monkeypatch, master_info):
    init(lab)
    (lab.root / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({
        "master_host": "127.0.0.1", "master_port": master_info, "agent": {"gpu": False},
        "tasks": {"local_cache": str(tmp_path / "agent-cache")},
        "images": {"repo_prefix": "ghcr.io/wu-cvgl", "version": "0.42.0",
                   "master_digest": MASTER_DIGEST, "agent_digest": AGENT_DIGEST}}))
    dep = import_deploy()
    monkeypatch.setattr(dep, "_docker_client", None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    lab_settings = load_settings(lab.config, env={})
    fake = RecordingDocker()
    deploy.up(lab_settings, load_cluster_settings(lab_settings), tmp_path / "private", "gpu-a", client=fake)
    runs = {r["name"]: r for r in fake.runs}
    assert runs["determined_determined-master_1"]["image"] == f"ghcr.io/wu-cvgl/determined-master:0.42.0@{MASTER_DIGEST}"
    assert runs["gpu-a"]["image"] == f"ghcr.io/wu-cvgl/determined-agent:0.42.0@{AGENT_DIGEST}"
    # the dry-run plan names the same references and has nothing left to pin
    plan = dry_run(lab, "up", "--agent-id", "gpu-a")
    roles = by_role(plan)
    assert roles["master"]["image"] == runs["determined_determined-master_1"]["image"]
    assert roles["agent"]["image"] == runs["gpu-a"]["image"]
    assert not any("named by tag only" in n for n in plan["notes"])


def test_images_named_by_tag_say_how_to_pin(lab):
    plan = dry_run(lab, "up", "--agent-id", "gpu-a")
    pins = [n for n in plan["notes"] if "named by tag only" in n]
    assert len(pins) == 2 and "images.master_digest" in pins[0] and "images.agent_digest" in pins[1]
    assert "docker buildx imagetools inspect determinedai/determined-master:0.38.1" in pins[0]
    agent_pins = [n for n in dry_run(lab, "agent-up", "gpu-a.lab")["notes"] if "named by tag only" in n]
    assert len(agent_pins) == 1 and "images.agent_digest" in agent_pins[0]


@pytest.mark.parametrize("images, message", [
    ({"version": "0.42.0@sha256:abc"}, "images.version: '0.42.0@sha256:abc' is not an image tag"),
    ({"version": "latest tag"}, "images.version: 'latest tag' is not an image tag"),
    ({"master_digest": "sha256:1234"}, "images.master_digest: 'sha256:1234' is not an image digest"),
    ({"agent_digest": "md5:" + "a" * 32}, "images.agent_digest:"),
    ({"master_digest": "SHA256:" + "A" * 64}, "images.master_digest:"),
    ({"repo_prefix": "https://ghcr.io/wu-cvgl"}, "images.repo_prefix:"),
])
def test_bad_image_tag_or_digest_is_one_line(lab, images, message):
    cfg = lab.root / ".det-lab" / "cluster.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump({"images": images}))
    for cmd in (("cluster", "up", "--dry-run"), ("cluster", "agent-up", "gpu-a.lab", "--dry-run"), ("cluster", "config")):
        proc = invoke(lab, *cmd)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.exit_code == 2 and len(lines) == 1 and message in lines[0] and str(cfg) in lines[0], proc.stderr
