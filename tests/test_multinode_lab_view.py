"""One lab view over several hosts (tests/multihost.py: three namespace hosts, Slurm with slurmdbd,
the lab volume at one path), each GPU host with two GPUs of the NVML stand-in (tests/nvml_shim.c,
one config file per host): ``det-lab gpus`` on the login node shows every host's leases, and one
whose holder was killed stops counting as held; the idle watchdog, one per node, on a Slurm job
with GPUs on two nodes.

What the stand-in cannot show: real GPUs' utilization (the watchdog's figures are the stand-in's).
Windows and grace periods are seconds long; the lock lifetime (the heartbeat's) is 6 s.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import multinode_steps as mn
from tests.conftest import VENV_BIN
from tests.multihost import Bed, Host, multihost  # noqa: F401 (fixture)
from tests.sendmail_standin import write_sendmail
from tests.test_gpu_leases import TRIAL, trial_config
from tests.test_monitoring_nvml import build_shim

TOTAL = 80_000_000_000
LIFETIME = 6.0  # DET_LAB_LOCK_LIFETIME: a lease's holder beats every 2 s, silent after 6 s
INTERVAL, WINDOW, GRACE = 0.4, 3.0, 3.0


class View:
    """The bed with this module's lab: a watchdog section, mail kept by a sendmail stand-in, the NVML
    stand-in with one config and one lease directory per host (all under the bed's directory: the
    hosts' /tmp is their own)."""

    def __init__(self, bed: Bed) -> None:
        self.bed, self.c, self.lab = bed, bed.cluster, bed.lab
        self.dir = Path(tempfile.mkdtemp(prefix="lab-view-", dir=self.c.dir))
        self.dir.chmod(0o755)
        self.nvml = build_shim(self.dir)
        sendmail = write_sendmail(self.dir / "sendmail", self.dir / "mail")
        self.lab.write_config(tracking={"backend": "none"}, watchdog={
            "interval": INTERVAL, "rule": {"window": WINDOW, "grace": GRACE},
            "mail": {"domain": "lab.example", "sendmail": str(sendmail)}})
        self.trial = self.dir / "gpu-trial"
        self.trial.mkdir()
        (self.trial / "train.py").write_text(TRIAL)
        (self.trial / "const.yaml").write_text(json.dumps(trial_config(1)))
        for h in self.c.nodes:
            self.set_gpus(h, 0, 0)

    def set_gpus(self, host: Host, util0: float, util1: float) -> None:
        """``host``'s two GPUs now (utilization %, no memory in use), written whole."""
        text = "reload\n" + "".join(f"gpu GPU-{host.name}-{g} {u:g} 0 0 {TOTAL} NVIDIA A100-SXM4-80GB\n"
                                     for g, u in enumerate((util0, util1)))
        tmp = self.dir / f"{host.name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.dir / f"{host.name}.conf")

    def env(self, host: Host | None) -> dict[str, str]:
        """det-lab's environment on ``host`` (None: the login node, which has no GPU)."""
        env = {**self.lab.env, "DET_LAB_LOCK_LIFETIME": f"{LIFETIME:g}", "TRIAL_SECONDS": "600",
               "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
               "DET_LAB_GPU_STATE_DIR": str(self.dir / f"state-{host.name if host else 'login'}")}
        if host is not None:
            env.update(LD_LIBRARY_PATH=str(self.nvml["lib"]), NVML_SHIM_CONFIG=str(self.dir / f"{host.name}.conf"))
        return env

    def start(self, host: Host, *args: str) -> subprocess.Popen:
        """``det-lab ARGS`` as a process of ``host``, its output in a file (``_stop`` reads it back)."""
        log = tempfile.NamedTemporaryFile(dir=self.dir, prefix=f"{args[0]}-{host.name}-", suffix=".log", delete=False)
        proc = subprocess.Popen(self.c.host_argv(host, [str(VENV_BIN / "det-lab"), *args]), env=self.env(host),
                                cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        proc.log = Path(log.name)  # type: ignore[attr-defined]
        return proc

    def gpus(self, host: Host | None = None, *args: str) -> subprocess.CompletedProcess:
        """``det-lab gpus ARGS`` on ``host`` (None: the login node)."""
        argv = [str(VENV_BIN / "det-lab"), "gpus", *args]
        proc = subprocess.run(argv if host is None else self.c.host_argv(host, argv), env=self.env(host),
                              cwd=self.dir, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def status(self, host: Host | None = None) -> dict:
        return json.loads(self.gpus(host, "--json").stdout)

    def journal(self, name: str) -> list[dict]:
        path = self.lab.root / ".det-lab" / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def mails(self) -> list[email.message.EmailMessage]:
        return [email.message_from_bytes(p.read_bytes(), policy=email.policy.default)
                for p in sorted((self.dir / "mail").glob("*.eml"))]


@pytest.fixture(scope="module")
def view(multihost: Bed) -> View:  # noqa: F811 (the fixture imported above)
    return View(multihost)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> str:
    """Signal ``proc`` (started by :meth:`View.start`), wait for it; its output."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.log.read_text(errors="replace")  # type: ignore[attr-defined]


def test_det_lab_gpus_shows_every_host_s_holders_and_a_killed_one_s_lease_goes_silent(view: View):
    """A local run holding a GPU on each of two hosts: ``det-lab gpus`` on the login node (no GPU of
    its own) shows both holders from the volume (user, run, GPU, since, heartbeat). The first run's
    ``det-lab run`` killed with -9 on its host: within a lock lifetime the login node and the other
    host show its lease as silent (not held), while the other stays held; nothing was written for it.
    Once the second run ends, neither is held."""
    c = view.c
    a, b = c.nodes
    started = time.time()
    runs = {a.name: view.start(a, "run", str(view.trial), "--local", "--run", f"left-{a.name}"),
            b.name: view.start(b, "run", str(view.trial), "--local", "--run", f"right-{b.name}")}
    try:
        def both_held():  # journaled and beating (a lease is listed from its start, before its first beat)
            s = view.status()
            return s if len(s["other_hosts"]) == 2 and all("heartbeat" in o for o in s["other_hosts"]) else None

        s = mn.wait_for(both_held, 120, "both hosts' leases on the login node")
        assert s["gpus"] == [] and s["host"] not in (a.name, b.name)
        held = {o["host"]: o for o in s["other_hosts"]}
        now = time.time()
        for h, run in ((a, f"left-{a.name}"), (b, f"right-{b.name}")):
            o = held[h.name]
            assert (o["user"], o["run"], o["gpus"]) == ("root", run, [0]) and started <= o["since"] <= now

        # the first run's holder killed with -9 on its host (its pid as the journal names it)
        lease_a = held[a.name]["lease"]
        (start_a,) = [e for e in view.journal(f"gpus/journal/{a.name}.root.jsonl") if e["event"] == "start"]
        os.kill(start_a["pid"], signal.SIGKILL)
        killed = time.time()
        last: list[dict] = []

        def silent():
            last[:] = [view.status()]
            return last[0] if [o["lease"] for o in last[0].get("silent", [])] == [lease_a] else None

        try:
            s = mn.wait_for(silent, LIFETIME + 30, "the killed holder's lease to go silent")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: det-lab gpus on the login node still says {last[0]}") from None
        gone_after = time.time() - killed
        assert [o["host"] for o in s["other_hosts"]] == [b.name]  # the live one: still held, its holder beating
        assert now - LIFETIME <= held[b.name]["heartbeat"] <= now + 1
        assert time.time() - LIFETIME <= s["other_hosts"][0]["heartbeat"] <= time.time() + 1
        (gone,) = s["silent"]
        assert (gone["host"], gone["run"], gone["gpus"]) == (a.name, f"left-{a.name}", [0])
        assert held[a.name]["heartbeat"] <= gone["silent_since"] <= killed + 0.5
        assert gone_after <= LIFETIME + 10, gone_after  # a lifetime, and a det-lab gpus on a loaded machine
        plain = view.gpus().stdout
        assert re.search(rf"{b.name}: GPU 0 held by root run right-{b.name} since \S+ \S+ \(heartbeat \d+ s ago\)",
                         plain), plain
        assert re.search(rf"{a.name}: GPU 0 of root run left-{a.name} \(since \S+ \S+\): no heartbeat since "
                         rf"\d\d:\d\d:\d\d: its holder died, or {a.name} is down or cut off; not counted as held",
                         plain), plain
        # the other host sees its own lease (checked there) and the silent one
        on_b = view.status(b)
        assert on_b["gpus"][0]["holder"]["run"] == f"right-{b.name}" and on_b["other_hosts"] == []
        assert [o["lease"] for o in on_b["silent"]] == [lease_a]
        # derived, not written: nobody on a has looked, so the journal has no end for it
        assert [e["event"] for e in view.journal(f"gpus/journal/{a.name}.root.jsonl")] == ["start"]
    finally:
        for proc in runs.values():
            _stop(proc)
    s = view.status()
    assert s["other_hosts"] == [] and [o["lease"] for o in s["silent"]] == [lease_a]
    assert not (view.lab.root / ".det-lab" / "gpus" / "live" / held[b.name]["lease"]).exists()
    print(f"\nlab view: killed holder's lease silent after {gone_after:.1f} s (lifetime {LIFETIME:g} s)")


def _gpu_on(c, job: str) -> dict[str, int]:
    """The GPU index Slurm gave ``job`` on each node (``scontrol -d``: ``Nodes=.. GRES=gpu..(IDX:n)``)."""
    text = c.run("scontrol", "-d", "-o", "show", "job", job).stdout
    out: dict[str, int] = {}
    for nodes, idx in re.findall(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=\S*\(IDX:(\d+)\)", text):
        for n in nodes.split(","):
            out[n] = int(idx)
    return out


def _covered(view: View, host: Host, key: str) -> bool:
    """Whether the samples ``host``'s watchdog kept of ``key`` span a whole window."""
    try:
        kept = json.loads((view.lab.root / ".det-lab" / "watchdog" / f"samples-{host.name}.json").read_text())
    except (OSError, ValueError):
        return False
    per_gpu = kept.get(key, {})
    return bool(per_gpu) and all(v and v[0][0] <= time.time() - WINDOW for v in per_gpu.values())


def test_the_watchdogs_of_a_two_node_job_warn_and_act_once_and_only_when_every_node_is_idle(view: View):
    """An interactive job with a GPU on each of two nodes, one watchdog per node: while the job's GPU
    on the second node is busy, nothing (its GPU on the first node idle for a whole window and a
    grace period); once it is idle too, one warning naming both nodes, one cancel, one mail each,
    all from the job's first node."""
    c = view.c
    a, b = c.nodes
    out = c.run("salloc", "--no-shell", "-N2", "--gres=gpu:1", "-J", "idle-2n")
    job = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout).group(1)
    dogs: list[subprocess.Popen] = []
    try:
        gpu = _gpu_on(c, job)
        assert set(gpu) == {a.name, b.name}, gpu
        key = f"slurm:{job}"
        view.set_gpus(a, 0, 0)
        view.set_gpus(b, *[87 if g == gpu[b.name] else 0 for g in range(2)])
        before = {e.get("holder") for e in view.journal("watchdog/journal.jsonl")}
        mails_before = len(view.mails())
        assert key not in before
        dogs = [view.start(h, "watchdog", "--node", h.name) for h in (a, b)]
        # busy on b: both windows covered, then a grace period more, and the job is left alone
        mn.wait_for(lambda: all(_covered(view, h, key) for h in (a, b)), 60,
                    "both nodes' windows covered", poll=0.2)
        time.sleep(GRACE + 3 * INTERVAL)
        assert [e["event"] for e in view.journal("watchdog/journal.jsonl") if e.get("holder") == key] == []
        assert len(view.mails()) == mails_before and mn.job(c, job)[0] == "RUNNING"

        view.set_gpus(b, 0, 0)
        idle_from = time.time()
        mn.wait_for(lambda: mn.job(c, job)[0] == "", WINDOW + GRACE + 60, "the job cancelled", poll=0.2)
        mn.wait_for(lambda: len(view.mails()) >= mails_before + 2, 30, "the action's mail")
        time.sleep(4 * INTERVAL)  # the other node's watchdog had its passes too
        entries = [e for e in view.journal("watchdog/journal.jsonl") if e.get("holder") == key]
        assert [e["event"] for e in entries] == ["warned", "acted"], entries
        w, acted = entries
        assert w["host"] == acted["host"] == a.name  # the job's first node decided
        assert w["nodes"] == {a.name: [gpu[a.name]], b.name: [gpu[b.name]]}
        assert (f"interactive Slurm job {job} (idle-2n) of root on {a.name}, {b.name} (GPU {gpu[a.name]} on "
                f"{a.name}; GPU {gpu[b.name]} on {b.name}) has been idle for 3 s") in w["message"]
        # judged once b's busy samples had left the window: its mean under 5 %
        assert w["mean_utilization"] < 5 and w["at"] >= idle_from + WINDOW * (1 - 5 / 87) - 2 * INTERVAL
        assert acted["at"] >= w["deadline"] and f"cancelled Slurm job {job}" in acted["message"]
        mails = view.mails()[mails_before:]
        assert len(mails) == 2 and [m["To"] for m in mails] == ["root@lab.example"] * 2
        assert sorted(m.get_content().strip() for m in mails) == sorted([w["message"], acted["message"]])
    finally:
        for proc in dogs:
            out = _stop(proc)
            assert "Traceback" not in out, out[-3000:]
        c.run("scancel", job, check=False)
