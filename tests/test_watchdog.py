"""``det-lab watchdog`` end to end: the NVML stand-in (tests/nvml_shim.c, its utilization scripted over
time by rewriting its config) and the real one-node Slurm test cluster (two fake GPUs), a webhook
receiver on 127.0.0.1, a sendmail stand-in that keeps each message, and a real det_lab run.

Windows and grace periods are seconds long (the lab config's ``watchdog:`` section). What the
stand-ins cannot show: that the real driver's utilization is what the GPUs do, and a Determined
master's own answer to the kill (its endpoint's path, method and auth follow Determined's source).
"""

from __future__ import annotations

import datetime as dt
import email
import email.policy
import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from tests.conftest import VENV_BIN, Lab
from tests.sendmail_standin import write_sendmail
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (a fixture)
from tests.test_monitoring_nvml import build_shim

TOTAL = 80_000_000_000
UUIDS = ("GPU-7a1c0e52-93d4-4b1f-8e6a-0c5d2f9b3a71", "GPU-e4b29f0d-1c7a-4f3e-b5d8-6a9c0e2f4b13")
INTERVAL, WINDOW, GRACE = 0.4, 3.0, 3.0


def set_gpus(nvml: dict[str, Path], *gpus: tuple[float, int], procs: dict[int, list[int]] | None = None) -> None:
    """The stand-in's GPUs now: (utilization %, memory used) each; ``procs``: GPU index -> pids on it."""
    text = "reload\n"
    for i, (util, used) in enumerate(gpus):
        text += f"gpu {UUIDS[i]} {util:g} 0 {used} {TOTAL} NVIDIA A100-SXM4-80GB\n"
        text += "".join(f"proc {pid} 1000000000\n" for pid in (procs or {}).get(i, []))
    tmp = nvml["config"].with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(nvml["config"])


class Receiver(BaseHTTPRequestHandler):
    """A webhook receiver (Mattermost's incoming webhook takes a JSON POST) that keeps what it got."""

    got: ClassVar[list[tuple[str, str, dict]]] = []

    def do_POST(self):  # http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).got.append((self.path, self.headers.get("Content-Type", ""), json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    Receiver.got = []
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hooks/lab-gpus", Receiver.got
    server.shutdown()


@pytest.fixture
def nvml(tmp_path):
    (tmp_path / "nvml").mkdir()
    return build_shim(tmp_path / "nvml")


def make_lab(tmp_path: Path, webhook_url: str | None = None, **watchdog) -> Lab:
    sendmail = write_sendmail(tmp_path / "sendmail", tmp_path / "mail")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp_path / "lab.yaml"), XDG_CONFIG_HOME=str(tmp_path / "xdg"), COLUMNS="200",
               DET_LAB_GPU_STATE_DIR=str(tmp_path / "gpu-state"))  # this test's GPU leases: not another test's
    lab = Lab(root=tmp_path / "data", config=tmp_path / "lab.yaml", env=env)
    section = {"interval": INTERVAL, "rule": {"window": WINDOW, "grace": GRACE},
               "mail": {"domain": "lab.example", "sendmail": str(sendmail)}, **watchdog}
    if webhook_url:
        section["webhook"] = {"url": webhook_url, "kind": "mattermost"}
    lab.write_config(watchdog=section, tracking={"backend": "none"})
    lab.root.mkdir()
    return lab


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_watchdog_left():
    """A test that fails mid-way leaves no watchdog acting on the next test's jobs."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def start_watchdog(lab: Lab, nvml, cluster, *args: str) -> subprocess.Popen:
    env = {**lab.env, "LD_LIBRARY_PATH": str(nvml["lib"]), "NVML_SHIM_CONFIG": str(nvml["config"]),
           **(cluster.env if cluster else {})}
    node = cluster.node if cluster else "nonode"
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "watchdog", "--node", node, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    return proc


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    return out


def journal(lab: Lab) -> list[dict]:
    path = lab.root / ".det-lab" / "watchdog" / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(what, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the watchdog exited {proc.returncode}: {proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s")


def salloc(cluster, name: str) -> str:
    """A forgotten ``salloc``: an interactive allocation of one GPU with nothing running on it."""
    proc = cluster.run("salloc", "--no-shell", "-N1", "--gres=gpu:1", "-J", name)
    return re.search(r"Granted job allocation (\d+)", proc.stderr + proc.stdout).group(1)


def gpu_of(cluster, job: str) -> int:
    """The GPU index Slurm gave ``job`` on the node (``scontrol -d``'s ``GRES=gpu...(IDX:n)``)."""
    text = cluster.run("scontrol", "-d", "-o", "show", "job", job).stdout
    return int(re.search(r"GRES=\S*\(IDX:(\d+)", text).group(1))


def job_state(cluster, job: str) -> str:
    return cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip() or "GONE"


def kept_samples(lab: Lab, holder: str, busy: bool = False) -> int:
    """How many samples of ``holder`` (only those at non-zero utilization with ``busy``) the watchdog keeps."""
    try:
        kept = json.loads(next((lab.root / ".det-lab" / "watchdog").glob("samples-*.json")).read_text())
    except (StopIteration, ValueError, OSError):
        return 0
    return sum(1 for per_gpu in kept.get(holder, {}).values() for _, util, _ in per_gpu if util > 0 or not busy)


def events(entries: list[dict], holder: str) -> list[str]:
    return [e["event"] for e in entries if e.get("holder") == holder]


def test_idle_salloc_warned_then_cancelled_busy_and_exempt_left_alone(slurm_cluster, nvml, webhook, tmp_path):
    """An idle ``salloc`` (an exemption of its user that expired yesterday does not save it) is warned
    (journal, webhook, mail) and cancelled after the grace period; a busy batch job beside it, then an
    idle one whose name an exemption in force names, are left alone. A watchdog killed mid-grace and
    started again neither warns twice nor moves the deadline: every action is in the journal once."""
    url, got = webhook
    today = dt.date.today()
    lab = make_lab(tmp_path, url, exemptions=[
        {"user": "root", "until": str(today - dt.timedelta(days=1)), "reason": "benchmarks last week"},
        {"job_name": "exempt-*", "until": str(today + dt.timedelta(days=2)), "reason": "demo"}])
    idle = salloc(slurm_cluster, "idle-salloc")
    busy = slurm_cluster.run("sbatch", "--parsable", "--gres=gpu:1", "-J", "busy", "-o", "/dev/null",
                             "--wrap", "sleep 300").stdout.strip()
    try:
        wait_for(lambda: job_state(slurm_cluster, busy) == "RUNNING", 30)
        g_idle, g_busy = gpu_of(slurm_cluster, idle), gpu_of(slurm_cluster, busy)
        assert {g_idle, g_busy} == {0, 1}
        util = {g_idle: (0, 0), g_busy: (87, 31_000_000_000)}
        set_gpus(nvml, util[0], util[1])
        started = time.monotonic()
        dog = start_watchdog(lab, nvml, slurm_cluster)
        warned = wait_for(lambda: [e for e in journal(lab) if e["event"] == "warned"], WINDOW + 45, dog)
        # its webhook post and mail follow the journal line: killed after them (mid-grace, not mid-mail;
        # killed between the two, the warning's mail is never sent: the next watchdog finds it journaled)
        wait_for(lambda: got and list((tmp_path / "mail").glob("*.eml")), 30, dog)
        stop(dog, signal.SIGKILL)  # mid-grace: the next one keeps the first one's deadline
        dog = start_watchdog(lab, nvml, slurm_cluster)
        wait_for(lambda: job_state(slurm_cluster, idle) == "GONE", GRACE + 45, dog)
        time.sleep(3 * INTERVAL)
        entries = journal(lab)
        assert events(entries, f"slurm:{idle}") == ["warned", "acted"]
        assert events(entries, f"slurm:{busy}") == []
        (w,) = warned
        acted = next(e for e in entries if e["event"] == "acted")
        assert w["holder"] == f"slurm:{idle}" and w["user"] == "root" and w["gpus"] == [g_idle]
        assert w["mean_utilization"] == 0 and acted["at"] >= w["deadline"] > w["at"]
        assert f"Slurm job {idle}" in w["message"] and "cancelled at" in w["message"]
        assert f"det-lab watchdog snooze {idle} 2h" in w["message"]
        assert job_state(slurm_cluster, busy) == "RUNNING"

        # the webhook got the warning and the action, each once, in Mattermost's shape (the action's
        # post may land after its journal line, as its mail may)
        wait_for(lambda: len(got) >= 2, 30)
        assert [(path, ctype) for path, ctype, _ in got] == [("/hooks/lab-gpus", "application/json")] * 2
        assert [set(body) for _, _, body in got] == [{"text", "username"}] * 2
        assert got[0][2]["text"] == f"det-lab watchdog: {w['message']}"
        assert got[1][2]["text"] == f"det-lab watchdog: {acted['message']}"
        # the action's mail may land after its journal line: wait for it, not for a fixed time
        wait_for(lambda: len(list((tmp_path / "mail").glob("*.eml"))) >= 2, 30)
        mails = [email.message_from_bytes(p.read_bytes(), policy=email.policy.default) for p in sorted((tmp_path / "mail").glob("*.eml"))]
        assert sorted(m["To"] for m in mails) == ["root@lab.example"] * 2
        assert sorted(m.get_content().strip() for m in mails) == sorted([w["message"], acted["message"]])

        # idle GPU-hours (det-lab usage): the idle salloc's time, not the busy job's beside it (both root's)
        from det_lab.watchdog import idle_gpu_hours

        idle_s = idle_gpu_hours(lab.root, today - dt.timedelta(days=1))["root"] * 3600
        assert WINDOW + GRACE - 2 < idle_s < time.monotonic() - started + 1

        # an exemption in force: idle as long as it likes
        exempt = salloc(slurm_cluster, "exempt-notebook")
        set_gpus(nvml, (0, 0), (87, 31_000_000_000)) if gpu_of(slurm_cluster, exempt) == 0 else \
            set_gpus(nvml, (87, 31_000_000_000), (0, 0))
        # judged idle for a whole window and a grace period (the samples kept span window + 2 intervals)
        wait_for(lambda: kept_samples(lab, f"slurm:{exempt}") >= WINDOW / INTERVAL, 60, dog)
        time.sleep(GRACE + 2)
        assert job_state(slurm_cluster, exempt) == "RUNNING"
        assert events(journal(lab), f"slurm:{exempt}") == []
        stop(dog)
    finally:
        slurm_cluster.run("scancel", idle, busy, check=False)
        slurm_cluster.run("scancel", "-n", "exempt-notebook", check=False)


def test_used_for_a_while_then_idle_is_caught(slurm_cluster, nvml, tmp_path):
    """A job busy (40 %) for its first seconds, then idle: warned while the busy samples are still in
    the window (its mean under the threshold; "every sample 0" would never have caught it), then cancelled."""
    lab = make_lab(tmp_path, rule={"window": 5.0, "grace": 2.0, "utilization_below": 10})
    job = salloc(slurm_cluster, "used-once")
    try:
        gpu = gpu_of(slurm_cluster, job)
        busy, idle = (40, 2_000_000_000), (0, 2_000_000_000)
        set_gpus(nvml, *[busy if i == gpu else (0, 0) for i in range(2)])
        dog = start_watchdog(lab, nvml, slurm_cluster)
        wait_for(lambda: kept_samples(lab, f"slurm:{job}", busy=True) >= 3, 60, dog)  # the job's first seconds, busy
        set_gpus(nvml, *[idle if i == gpu else (0, 0) for i in range(2)])
        (w,) = wait_for(lambda: [e for e in journal(lab) if e["event"] == "warned"], 60, dog)
        assert w["holder"] == f"slurm:{job}"
        assert w["max_utilization"] == 40 and 0 < w["mean_utilization"] < 10
        wait_for(lambda: job_state(slurm_cluster, job) == "GONE", 30, dog)
        stop(dog)
    finally:
        slurm_cluster.run("scancel", job, check=False)


def test_snooze_then_warned_when_it_ends_and_dry_run_changes_nothing(slurm_cluster, nvml, tmp_path):
    """``--dry-run`` says it would warn and writes, sends and cancels nothing; a snooze keeps the job from
    being warned until it ends, and one over the limit is one error line."""
    lab = make_lab(tmp_path, snooze_limit="1m", rule={"window": 2.0, "grace": 60.0})
    job = salloc(slurm_cluster, "snoozer")
    try:
        set_gpus(nvml, (0, 0), (0, 0))
        dry = start_watchdog(lab, nvml, slurm_cluster, "--dry-run", "--passes", "12")
        out = dry.communicate(timeout=60)[0]
        assert f"dry run: would journal warned: interactive Slurm job {job} (snoozer)" in out
        assert not (lab.root / ".det-lab").exists() and job_state(slurm_cluster, job) == "RUNNING"

        refused = lab.cli("watchdog", "snooze", job, "2h")
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            (f"error: snooze {job} 2h: at most 60 s (watchdog.snooze_limit in {lab.config}); ask an admin for an "
             "exemption")]
        lab.cli("watchdog", "snooze", job, "8s", check=True)
        (snoozed,) = [e for e in journal(lab) if e["event"] == "snoozed"]
        assert snoozed["target"] == job and snoozed["by"] == "root"
        dog = start_watchdog(lab, nvml, slurm_cluster)
        (w,) = wait_for(lambda: [e for e in journal(lab) if e["event"] == "warned"], 60, dog)
        assert w["holder"] == f"slurm:{job}" and w["at"] >= snoozed["until"] > snoozed["at"] + 7
        stop(dog)
        status = json.loads(lab.cli("watchdog", "status", "--json", check=True).stdout)
        assert [(h["holder"], h["event"]) for h in status["holders"]] == [(f"slurm:{job}", "warned")]
    finally:
        slurm_cluster.run("scancel", job, check=False)


@pytest.fixture(scope="module")
def tiny_volume(tmp_path_factory) -> Path:
    """A data root with the tiny regression dataset (tests/fixtures/tiny trains on it)."""
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume
    from tests.conftest import publish_tiny_data

    tmp = tmp_path_factory.mktemp("tiny-volume")
    (tmp / "lab.yaml").write_text(f"data_root: {tmp / 'data'}\n")
    settings = load_settings(tmp / "lab.yaml", env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    return tmp / "data"


def test_idle_det_lab_run_checkpointed_stopped_and_resumed_to_the_same_losses(nvml, tiny_volume, tmp_path):
    """A det_lab run whose trial stops using its GPU (parked after 40 batches, its process still on the
    GPU) is warned (runs list says so), then stopped as on a preemption: checkpointed, 'stopped', and
    resumed it trains to the same losses as a run never stopped."""
    from tests.test_trials_local import (
        TINY,
        held_after,
        metrics,
        run_state,
        start_run,
        wait_for_step,
    )

    lab = make_lab(tmp_path)
    lab = Lab(root=tiny_volume, config=lab.config, env=lab.env)
    # a grace long enough to list the runs in, on a loaded machine
    lab.write_config(watchdog={"interval": INTERVAL, "rule": {"window": 2.0, "grace": 20.0}}, tracking={"backend": "none"})
    runs = tiny_volume / "outputs" / "vla" / "local-runs"
    straight = lab.cli("run", str(TINY), "--local", "--run", "never-stopped")
    assert straight.returncode == 0, straight.stdout + straight.stderr

    set_gpus(nvml, (0, 0), (0, 0))
    proc = start_run(held_after(lab, 40), "--run", "parked")
    dog = None
    try:
        run_dir = wait_for_step(runs, "parked", 40, proc)
        from det_lab.runs.run_guard import trainer

        pid = trainer(run_dir).pid
        set_gpus(nvml, (0, 1_500_000_000), (0, 0), procs={0: [pid]})  # on GPU 0, doing nothing
        dog = start_watchdog(lab, nvml, None)
        (w,) = wait_for(lambda: [e for e in journal(lab) if e["event"] == "warned"], 60, dog)
        assert w["holder"] == "run:parked" and w["kind"] == "run" and w["gpus"] == [0]
        assert "stopped (checkpointed, resumable) at" in w["message"]
        listing = lab.cli("runs", "list", check=True).stdout
        assert re.search(r"parked .*running \(idle GPU: warned \d\d:\d\d, stops at \d\d:\d\d\)", listing), listing
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + err
    finally:
        if proc.poll() is None:
            proc.kill()
        if dog is not None:
            stop(dog)
    state = run_state(run_dir)
    assert state["status"] == "stopped" and 40 <= state["latest_checkpoint_step"] < 80  # a preemption checkpoint
    assert events(journal(lab), "run:parked") == ["warned", "acted"]
    shown = lab.cli("runs", "show", "parked", check=True).stdout
    assert re.search(r"watchdog +│ idle GPU: stopped by the watchdog \d{4}-\d\d-\d\d \d\d:\d\d, resumable", shown), shown

    resumed = lab.cli("run", str(TINY), "--local", "--resume", "--run", "parked")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert run_state(run_dir)["status"] == "finished"
    assert metrics(run_dir, "training") == metrics(runs / "never-stopped", "training")
    assert metrics(run_dir, "validation") == metrics(runs / "never-stopped", "validation")


class Master(BaseHTTPRequestHandler):
    """A Determined master's kill endpoints as its source defines them: ``POST
    /api/v1/notebooks/{notebook_id}/kill`` (proto/src/determined/api/v1/api.proto:1443) and ``POST
    /api/v1/shells/{shell_id}/kill`` (api.proto:1492), a bearer token required
    (master/internal/grpcutil/auth.go:98: "Bearer " or unauthenticated)."""

    token = "s3ss10n-t0ken"
    killed: ClassVar[list[str]] = []

    def do_POST(self):
        auth = self.headers.get("Authorization", "")
        if auth != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        m = re.fullmatch(r"/api/v1/(notebooks|shells)/([\w.-]+)/kill", self.path)
        if not m:
            self.send_response(404)
            self.end_headers()
            return
        type(self).killed.append(f"{m.group(1)}/{m.group(2)}")
        body = b"{}"  # KillNotebookResponse: {"notebook": {...}}; the watchdog reads only the status
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_idle_determined_notebook_killed_through_the_master(nvml, tmp_path):
    """A Determined notebook's process (DET_TASK_ID, DET_TASK_TYPE=NOTEBOOK, DET_USER as the master sets
    them: master/pkg/tasks/task.go:199, master/internal/api_notebook.go:296) idle on GPU 1 is warned,
    then killed through the master's API with the token file's bearer token; a trial's task beside it on
    GPU 0, idle too, is warned only."""
    Master.killed = []
    server = HTTPServer(("127.0.0.1", 0), Master)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "det-master.token"
    token.write_text(Master.token + "\n")
    lab = make_lab(tmp_path, master_token_file=str(token))
    cfg = json.loads(json.dumps(__import__("yaml").safe_load(lab.config.read_text())))
    cfg["master_url"] = f"http://127.0.0.1:{server.server_port}"
    lab.config.write_text(__import__("yaml").safe_dump(cfg))
    notebook = subprocess.Popen(["sleep", "120"], env={"DET_TASK_ID": "nb-2f7c", "DET_TASK_TYPE": "NOTEBOOK",
                                                        "DET_USER": "alice"})
    trial = subprocess.Popen(["sleep", "120"], env={"DET_TASK_ID": "7.1a9e", "DET_TASK_TYPE": "TRIAL",
                                                     "DET_USER": "bob"})
    dog = None
    try:
        set_gpus(nvml, (0, 0), (0, 0), procs={0: [trial.pid], 1: [notebook.pid]})
        dog = start_watchdog(lab, nvml, None)
        wait_for(lambda: Master.killed, WINDOW + GRACE + 45, dog)
        time.sleep(3 * INTERVAL)
    finally:
        if dog is not None:
            stop(dog)
        notebook.kill()
        trial.kill()
        server.shutdown()
    assert Master.killed == ["notebooks/nb-2f7c"]
    entries = journal(lab)
    assert events(entries, "determined:nb-2f7c") == ["warned", "acted"]
    assert events(entries, "determined:7.1a9e") == ["warned"]
    (tw,) = [e for e in entries if e["holder"] == "determined:7.1a9e"]
    assert tw["user"] == "bob" and "It is not stopped" in tw["message"]


def test_monitor_config_renders_the_watchdog_service(lab, tmp_path):
    """``det-lab monitor config`` writes the watchdog's systemd unit: run as root (it reads other users'
    process environments and stops their jobs), restarted on failure, with the lab's config."""
    lab.cli("monitor", "config", "--out", str(tmp_path / "mon"), "--machine", "gpu1", check=True)
    unit = (tmp_path / "mon" / "systemd" / "det-lab-watchdog.service").read_text()
    assert re.search(r"\nExecStart=\S*det-lab watchdog\n", unit) and "\nUser=root\n" in unit
    assert "\nRestart=on-failure\n" in unit and "WantedBy=multi-user.target" in unit
