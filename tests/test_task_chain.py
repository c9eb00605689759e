"""A trial container started by tests/standin/task_run.py runs Determined 0.38.1's own launch chain:
ship-logs.sh, ship_logs.py, entrypoint.sh and task-setup.sh, the master's harness wheel pip-installed
into PYTHONUSERBASE, ``determined.exec.prep_container`` and ``determined.exec.launch``.

The master here is a small HTTP server serving only what that chain calls (each handler names the
Determined call). One probe trial runs per module; each test checks one thing it saw and names the
Determined source (determined-ai/determined v0.38.1, ``path:line``) it follows.
"""

from __future__ import annotations

import base64
import grp
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.standin.task_config import LinkedUser
from tests.standin.task_env import agent_env, master_env, trial_allocation
from tests.standin.task_image import make_image
from tests.standin.task_run import DETERMINED_VERSION, run_allocation
from tests.test_shared_volume import _add_user

REPO = Path(__file__).resolve().parents[1]

NO_SANDBOX = (os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("useradd")) and (
    "needs root, useradd and bubblewrap (Debian's bubblewrap) for a linked non-root task user")


# --- the master: only the endpoints the launch chain calls -----------------------------------------

class Master(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.contexts: dict[str, bytes] = {}  # task id -> the context tarball
        self.logs: list[dict] = []
        self.calls: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Master

    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.calls.append(f"GET {self.path}")
        if self.path == "/api/v1/me":  # ship_logs.py:422-429 try_reaching_master
            return self._reply({"user": {"id": 2, "username": "probe", "active": True, "admin": False}})
        m = re.fullmatch(r"/api/v1/tasks/([^/]+)/context_directory", self.path)
        if m:  # prep_container.py:29 bindings.get_GetTaskContextDirectory (master api_experiment.go:2319-2350)
            return self._reply({"b64Tgz": base64.b64encode(self.server.contexts.get(m.group(1), b"")).decode()})
        if re.fullmatch(r"/api/v1/allocations/[^/]+/resources/[^/]+/rendezvous", self.path):
            # prep_container.py:52-59 do_rendezvous_rm_provided: one container, rank 0
            return self._reply({"rendezvousInfo": {"addresses": ["127.0.1.1"], "rank": 0, "slots": [1]}})
        self._reply({"error": f"not served here: {self.path}"}, 404)

    def do_POST(self) -> None:
        self.server.calls.append(f"POST {self.path}")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/api/v1/task/logs":  # ship_logs.py:275,343 (api.proto:955 PostTaskLogs)
            self.server.logs.extend(body["logs"])
            return self._reply({})
        if re.fullmatch(r"/api/v1/allocations/[^/]+/acceleratorData", self.path):  # prep_container.py:416-430
            return self._reply({})
        self._reply({"error": f"not served here: {self.path}"}, 404)


def packed_context(context: Path) -> bytes:
    """The context as the master stores it: the CLI's v1 files (harness/determined/common/context.py
    read_v1_context, honouring .detignore), turned into a tar.gz item by item as the master does
    (master/internal/api_tensorboard.go:56-71 filesToArchive; core_experiment.go:394 ToTarGz;
    master/pkg/archive/archive.go:150-216 tarArchive)."""
    from determined.common import context as det_context

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in det_context.read_v1_context(context):
            content = base64.b64decode(f.content) if f.content else b""
            info = tarfile.TarInfo(f.path)
            info.type, info.mode, info.uid, info.gid = bytes([f.type]), f.mode, f.uid, f.gid
            info.mtime, info.size = int(f.mtime), len(content) if info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(content) if info.type == tarfile.REGTYPE else None)
    return buf.getvalue()


# --- the probe trial ---------------------------------------------------------------------------

PROBE = r'''
import json, os, pwd, socket, subprocess, sys, urllib.request
facts = {"argv0": sys.argv[1], "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
         "id_G": subprocess.run(["id", "-G"], capture_output=True, text=True).stdout.split()}
pw = pwd.getpwuid(os.getuid())
facts["passwd"] = [pw.pw_name, pw.pw_dir]
facts["env"] = {k: v for k, v in os.environ.items() if k.startswith(("DET_", "HOOK_", "TCD_", "HOME", "PYTHONUSERBASE"))}
import determined as det
facts["determined"] = [det.__file__, det.__version__]
facts["image_has_determined"] = subprocess.run([sys.executable, "-s", "-c", "import determined"],
                                               capture_output=True).returncode == 0
info = det.get_cluster_info()
facts["cluster_info"] = None if info is None else {
    "task_id": info.task_id, "allocation_id": info.allocation_id, "trial_id": info.trial.trial_id,
    "experiment_id": info.trial.experiment_id, "hparams": info.trial.hparams,
    "latest_checkpoint": info.latest_checkpoint, "rank": info.container_rank}
facts["visible"] = {p: os.path.exists(p) for p in json.loads(os.environ["PROBE_HIDDEN"])}
facts["root_home"] = sorted(os.listdir("/root")) + sorted(os.listdir("/home"))
facts["workdir"] = {os.path.relpath(os.path.join(d, f), "."): oct(os.stat(os.path.join(d, f)).st_mode & 0o777)
                    for d, _, fs in os.walk(".") for f in fs}
facts["model_copy"] = sorted(os.path.relpath(os.path.join(d, f), "/run/determined/train/model")
                             for d, _, fs in os.walk("/run/determined/train/model") for f in fs)
def reach(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except Exception as e:
        return type(e).__name__
facts["loopback_master"] = reach(f"http://127.0.0.1:{os.environ['PROBE_MASTER_PORT']}/api/v1/me")
facts["det_master"] = reach(os.environ["DET_MASTER"] + "/api/v1/me")
chain, pid = [], os.getpid()
while pid > 1:
    chain.append(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1])
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
facts["chain"] = [[a.decode() for a in c] for c in chain]
print("PROBE " + json.dumps(facts), flush=True)
'''

#: a string entrypoint: launch.py:43-44 runs it as ["sh", "-c", entrypoint]; $0 is then "sh"
ENTRYPOINT = 'test -n "$DET_TRIAL_ID" && python3 probe.py "$0"'
HOOK = 'export HOOK_SHELL_OPTIONS="$-"\nexport HOOK_SAW_PROBE="$(test -f probe.py && echo yes)"\n'


class Chain:
    def __init__(self, base: Path, user, lab_gid: int, image, wheels: Path, master: Master) -> None:
        self.base, self.user, self.lab_gid, self.image, self.wheels, self.master = base, user, lab_gid, image, wheels, master

    def linked(self) -> LinkedUser:
        """The agent user group; the user's lab group rides along as the old run_trial uses it."""
        return LinkedUser(self.user.name, self.user.uid, self.user.gid, groups=[self.lab_gid])

    def master_config(self) -> dict:
        """A master.yaml as det_lab renders it (the keys the task reads), storage on a tmp dir."""
        return {"checkpoint_storage": {"type": "shared_fs", "host_path": str(self.base / "checkpoints")},
                "task_container_defaults": {"shm_size_bytes": 64 * 1024**2, "network_mode": "bridge",
                                            "environment_variables": ["LAB_DEFAULT=1"],
                                            "startup_hook": "export TCD_HOOK_RAN=yes\n"},
                "resource_pools": [{"pool_name": "default"}]}

    def run(self, expconf: dict, context: Path, wheels: Path | None = None, **alloc_kw):
        master = self.master_config()
        alloc = trial_allocation(master, "default", expconf, master_url=self.master.url, det_user="probe-user",
                                 **alloc_kw)
        self.master.contexts[alloc.task_id] = packed_context(context)
        result = run_allocation(alloc, master=master, user=self.linked(), image=self.image,
                                wheel_dir=wheels or self.wheels, timeout=300)
        return alloc, result


@pytest.fixture(scope="session")
def harness_wheels():
    """The master's harness wheel (copy.go:35-79 ships *<version>*.whl), from the package index."""
    d = Path(tempfile.mkdtemp(prefix="det-harness-"))
    try:
        d.chmod(0o755)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              f"determined=={DETERMINED_VERSION}", "-d", str(d)], capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot download the harness wheel determined=={DETERMINED_VERSION}: {got.stderr[-300:]}")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def chain(request):
    if NO_SANDBOX:
        pytest.skip(NO_SANDBOX)
    harness_wheels = request.getfixturevalue("harness_wheels")
    tag = uuid.uuid4().hex[:6]
    group = f"dlchain{tag}"
    base = Path(tempfile.mkdtemp(prefix="det-lab-chain-"))
    base.chmod(0o755)
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    user = None
    master = Master()
    try:
        user = _add_user(f"dlch{tag}", group, base)
        (base / "checkpoints").mkdir()
        os.chown(base / "checkpoints", user.uid, user.gid)
        image = make_image(base / "image", probe_uid=user.uid)
        yield Chain(base, user, grp.getgrnam(group).gr_gid, image, harness_wheels, master)
    finally:
        master.shutdown()
        if user is not None:
            subprocess.run(["userdel", user.name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def probe(chain):
    """One trial of the probe: its context has a .detignore, an executable, a subdirectory, a hook."""
    ctx = chain.base / "context"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "ignored").mkdir()
    (ctx / "probe.py").write_text(PROBE)
    (ctx / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "run.sh").chmod(0o755)
    (ctx / "sub" / "data.txt").write_text("data")
    (ctx / "ignored" / "big.bin").write_text("big")
    (ctx / "weights.ckpt").write_text("w")
    (ctx / ".detignore").write_text("ignored/\n*.ckpt\n")
    (ctx / "startup-hook.sh").write_text(HOOK)
    hidden = chain.base / "hidden"
    hidden.mkdir()
    (hidden / "secret.txt").write_text("not the task's")
    expconf = {"entrypoint": ENTRYPOINT, "hyperparameters": {"lr": {"type": "const", "val": 0.5}, "layers": 3},
               "searcher": {"name": "single", "metric": "loss", "max_length": 1},
               "environment": {"environment_variables": [
                   f"PROBE_HIDDEN={json.dumps([str(hidden / 'secret.txt'), str(REPO / 'pyproject.toml'), str(REPO / 'det_lab')])}",
                   f"PROBE_MASTER_PORT={chain.master.server_address[1]}"]}}
    ckpt = str(uuid.uuid4())
    alloc, result = chain.run(expconf, ctx, latest_checkpoint=ckpt, trial_id=7, experiment_id=3)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert result.exit_code == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    return alloc, json.loads(lines[-1][len("PROBE "):]), result


# --- the tests -----------------------------------------------------------------------------------

def test_the_harness_wheel_is_installed_into_pythonuserbase_and_imported_from_there(probe):
    """task-setup.sh:26-27 pip-installs /opt/determined/wheels/determined*.whl --user; PYTHONUSERBASE is
    /run/determined/pythonuserbase (task.go:198); the image itself has no determined."""
    _, facts, _ = probe
    path, version = facts["determined"]
    assert path.startswith("/run/determined/pythonuserbase/lib/python3") and version == DETERMINED_VERSION, facts
    assert facts["image_has_determined"] is False


def test_a_missing_harness_wheel_is_one_clear_line(chain, tmp_path):
    """copy.go:37-43 ships what matches *<version>*.whl; with none the stand-in starts no container."""
    empty = Path(tempfile.mkdtemp(prefix="det-no-wheel-"))
    try:
        calls = len(chain.master.calls)
        alloc, result = chain.run({"entrypoint": "true"}, tmp_path, wheels=empty)
        assert result.exit_code != 0
        assert result.stderr.count("\n") == 1 and "harness wheel" in result.stderr and str(empty) in result.stderr
        assert len(chain.master.calls) == calls, "the task reached the master"
    finally:
        shutil.rmtree(empty)


def test_the_task_runs_as_the_linked_uid_and_gid_alone_with_the_injected_passwd_entry(probe, chain):
    """task.go:408-413 User "uid:gid" (no supplementary groups); task.go:389-392 the passwd entry whose
    home is the workdir, which task-setup.sh:49-55 makes HOME."""
    _, facts, _ = probe
    assert (facts["uid"], facts["gid"]) == (chain.user.uid, chain.user.gid)
    assert facts["id_G"] == [str(chain.user.gid)] and facts["groups"] in ([], [chain.user.gid])
    assert chain.lab_gid not in facts["groups"] and "65534" not in facts["id_G"]
    assert facts["passwd"] == [chain.user.name, "/run/determined/workdir"]
    assert facts["env"]["HOME"] == "/run/determined/workdir"


def test_host_paths_outside_the_image_are_not_visible(probe):
    """A container sees its image, the run archives and the configured mounts (task_trial.go:146-159)."""
    _, facts, _ = probe
    assert not any(facts["visible"].values()), facts["visible"]
    assert facts["root_home"] == []


def test_the_trial_variables_are_the_allocations(probe):
    """task_trial.go:114-126 and task.go:208-210: DET_EXPERIMENT_CONFIG, DET_HPARAMS,
    DET_LATEST_CHECKPOINT, DET_USER from the allocation; the experiment's variables after the
    defaults' (task.go:272); the TCD hook and the context's hook sourced under set -e (entrypoint.sh:7-14)."""
    alloc, facts, _ = probe
    env = facts["env"]
    assert json.loads(env["DET_EXPERIMENT_CONFIG"]) == alloc.config
    assert json.loads(env["DET_HPARAMS"]) == {"lr": 0.5, "layers": 3} == alloc.hparams
    assert env["DET_LATEST_CHECKPOINT"] == alloc.latest_checkpoint
    assert env["DET_USER"] == "probe-user" and env["DET_TRIAL_ID"] == "7" and env["DET_SLOT_IDS"] == "[]"
    assert env["TCD_HOOK_RAN"] == "yes" and env["HOOK_SAW_PROBE"] == "yes" and "e" in env["HOOK_SHELL_OPTIONS"]


def test_the_cluster_info_names_the_trial(probe):
    """prep_container.py:357-366 writes info/*.json from the environment; det.get_cluster_info() reads them."""
    alloc, facts, _ = probe
    assert facts["cluster_info"] == {
        "task_id": alloc.task_id, "allocation_id": alloc.allocation_id, "trial_id": 7, "experiment_id": 3,
        "hparams": alloc.hparams, "latest_checkpoint": alloc.latest_checkpoint, "rank": 0}


def test_prep_container_extracts_what_the_cli_packed(probe, chain):
    """prep_container.py:28-40: the master's tarball into the workdir and /run/determined/train/model;
    what .detignore names was never packed (detignore.py:49-96), file modes come along."""
    alloc, facts, _ = probe
    packed = {"probe.py", "run.sh", "sub/data.txt", "startup-hook.sh"}
    assert set(facts["workdir"]) == packed and set(facts["model_copy"]) == packed
    assert facts["workdir"]["run.sh"] == "0o755"
    assert f"GET /api/v1/tasks/{alloc.task_id}/context_directory" in chain.master.calls


def test_the_chain_is_ship_logs_then_entrypoint_then_launch_then_sh_c(probe, chain):
    """task.go:249-258 + task_trial.go:112: ship-logs.sh ship_logs.py entrypoint.sh (ship-logs.sh:21 execs
    ship_logs.py; entrypoint.sh:20 execs determined.exec.launch); launch.py:43-44 runs a string
    entrypoint as sh -c; ship_logs.py posts the output to /api/v1/task/logs."""
    alloc, facts, _ = probe
    assert facts["argv0"] == "sh"
    chain_ = facts["chain"]
    assert chain_[1] == ["sh", "-c", ENTRYPOINT], chain_
    assert chain_[2][1:] == ["-m", "determined.exec.launch"], chain_
    assert chain_[3][1:] == ["/run/determined/ship_logs.py", "/run/determined/train/entrypoint.sh"], chain_
    shipped = [entry for entry in chain.master.logs if entry["log"].startswith("PROBE ")
               and entry.get("allocation_id") == alloc.allocation_id]
    assert shipped and shipped[0]["stdtype"] == "stdout" and shipped[0]["task_id"] == alloc.task_id


def test_loopback_is_the_tasks_own_and_det_master_reaches_the_master(probe):
    """network_mode bridge (task_container_defaults.go:80-84; task.go:274-277): the container's own
    network namespace; DET_MASTER is the agent's container_master_host (spec.go:210-221)."""
    _, facts, _ = probe
    assert facts["loopback_master"] == "URLError", facts["loopback_master"]
    assert facts["det_master"] == 200
    assert not facts["env"]["DET_MASTER"].startswith("http://127.0.0.1")


def test_two_slots_start_one_process_per_slot_through_the_torch_distributed_launcher(chain, tmp_path):
    """launch/torch_distributed.py:75-98: one process per slot of DET_SLOT_IDS (spec.go:144-153); ship_logs.py
    parses the launcher's [rank=N] prefixes (:207-213)."""
    pytest.importorskip("torch")
    (tmp_path / "show.py").write_text("import os; print('RANK', os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    alloc, result = chain.run({"entrypoint": "python3 -m determined.launch.torch_distributed python3 show.py",
                               "resources": {"slots_per_trial": 2}}, tmp_path, slot_ids=[0, 1])
    assert result.exit_code == 0, result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if "RANK" in line) == [
        "[rank=0] RANK 0 2", "[rank=1] RANK 1 2"]
    shipped = {(e.get("rank_id"), e["log"]) for e in chain.master.logs if e.get("allocation_id") == alloc.allocation_id
               and e["log"].startswith("RANK")}
    assert shipped == {(0, "RANK 0 2\n"), (1, "RANK 1 2\n")}


def test_gpu_slots_get_the_cuda_variables_after_the_determined_ones():
    """task.go:267-272: the experiment's variables For(device type of the first device), appended after
    EnvVars (task.go:194-245); the agent's after those (spec.go:30-33)."""
    master = {"task_container_defaults": {"environment_variables": {"cpu": ["ON=cpu"], "cuda": ["ON=cuda", "T=d"]}}}
    expconf = {"entrypoint": "true", "environment": {"environment_variables": {"cuda": ["T=exp"]}}}
    for slot_type, slots, seen in (("cpu", [], ["ON=cpu"]), ("cuda", [0, 1], ["ON=cuda", "T=d", "T=exp"])):
        alloc = trial_allocation(master, "default", expconf, master_url="http://127.0.0.1:1", det_user="u",
                                 slot_ids=slots, slot_type=slot_type)
        entries = master_env(alloc, alloc.task_container_defaults) + agent_env(
            alloc, {"master_host": "m", "master_port": 8080, "agent_id": "a"}, cluster_id="c", master_id="i")
        names = [e.split("=", 1)[0] for e in entries]
        assert [e for e in entries if e.split("=", 1)[0] in ("ON", "T")] == seen
        assert names.index("DET_TRIAL_ID") < names.index("ON") < names.index("DET_MASTER")
        assert f"DET_SLOT_IDS=[{','.join(map(str, slots))}]" in entries and "DET_MASTER=http://m:8080" in entries
