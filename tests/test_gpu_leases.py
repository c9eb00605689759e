"""GPU leases for ``det-lab run --local`` on a machine whose GPUs are the NVML stand-in
(``tests/nvml_shim.c``, loaded by nvidia-ml-py as the driver's library): real ``det-lab run``
processes, real trials (``det_lab.core``), root and a second Unix user, holders killed with -9.

Each trial writes the ``CUDA_VISIBLE_DEVICES`` it saw and when it ran; the leases are read back from
the journal's raw lines on the volume, so a GPU given twice, a trial on a GPU its lease does not
name, a lease left behind or a total that is not the leases' durations fails. What the stand-in
cannot show: that CUDA honours ``CUDA_VISIBLE_DEVICES`` by UUID (it does: CUDA's documented form).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import VENV_BIN
from tests.test_shared_volume import Team, team  # noqa: F401  (a fixture: two real Unix users of one group)
from tests.test_shared_volume import finish as finish_as
from tests.test_monitoring_nvml import build_shim

UUIDS = ["GPU-0c3e5a71-2b4d-4e8f-9a10-5d6c7b8e9f01", "GPU-1f9d8c7b-6a5e-4d3c-8b2a-19f8e7d6c5b4",
         "GPU-2a8e7d6c-5b4a-4c3b-9d2e-1f0a9b8c7d6e", "GPU-3b9f8e7d-6c5b-4d4c-8e3f-2a1b0c9d8e7f"]

TRIAL = """\
import json, os, time
import det_lab.core

with det_lab.core.init() as ctx:
    t0 = time.time()
    while time.time() < t0 + float(os.environ.get("TRIAL_SECONDS", "1")) and not ctx.preempt.should_preempt():
        time.sleep(0.1)
    ctx.train.report_training_metrics(1, {"loss": 1.0})
    ctx.train.report_validation_metrics(1, {"val_loss": 1.0})
    (ctx.outputs_dir / "gpus.json").write_text(json.dumps(
        {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": t0, "end": time.time()}))
"""


def trial_config(slots: int | None = 1) -> dict:
    conf = {"name": "gpu-trial", "entrypoint": "python3 train.py",
            "searcher": {"name": "single", "metric": "val_loss", "smaller_is_better": True},
            "hyperparameters": {}, "max_restarts": 0,
            "data": {"det_lab": {"project": "vla", "max_length": {"batches": 1}}}}
    if slots is not None:
        conf["resources"] = {"slots_per_trial": slots}
    return conf


def gpu_lines(n: int, procs: dict[int, list[int]] | None = None) -> str:
    """The stand-in's config: ``n`` GPUs, ``procs[i]`` the pids NVML lists on GPU i (distinct memory each)."""
    out = []
    for i in range(n):
        out.append(f"gpu {UUIDS[i]} {10 + i} {5 + i} {1_000_000 + i} {40_000_000_000 + i} NVIDIA A100 #{i}\n")
        out += [f"proc {pid} {(k + 1) * 1_048_576_000 + i}\n" for k, pid in enumerate((procs or {}).get(i, []))]
    return "".join(out)


class Machine:
    """A lab on a GPU machine: the stand-in's GPUs, a lease directory, a trial template, det-lab to run."""

    def __init__(self, base: Path, nvml: dict[str, Path], data: Path, config: Path, bin_dir: Path = VENV_BIN) -> None:
        self.base, self.nvml, self.data, self.config, self.bin = base, nvml, data, config, bin_dir
        self.state = base / "gpu-state"
        self.state.mkdir(mode=0o777)
        self.state.chmod(0o777)
        self.trial = base / "gpu-trial"
        self.trial.mkdir()
        (self.trial / "train.py").write_text(TRIAL)
        self.write_trial(1)
        self.trial.chmod(0o755)

    def write_trial(self, slots: int | None) -> None:
        (self.trial / "const.yaml").write_text(yaml.safe_dump(trial_config(slots)))

    def set_gpus(self, text: str) -> None:
        tmp = self.nvml["config"].with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(self.nvml["config"])

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "NVML_SHIM_", "LD_", "MLFLOW_",
                                                                          "SLURM_", "DET_TASK", "CUDA_"))}
        env.update(DET_LAB_CONFIG=str(self.config), LD_LIBRARY_PATH=str(self.nvml["lib"]),
                   NVML_SHIM_CONFIG=str(self.nvml["config"]), DET_LAB_GPU_STATE_DIR=str(self.state), COLUMNS="200",
                   XDG_CONFIG_HOME=str(self.base / "xdg"), **extra)
        return env

    def start(self, *args: str, **extra: str) -> subprocess.Popen:
        return subprocess.Popen([str(self.bin / "det-lab"), *args], env=self.env(**extra), cwd=self.base,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def cli(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "det-lab"), *args], env=self.env(**extra), cwd=self.base,
                              capture_output=True, text=True, timeout=300)

    def run(self, *args: str, **extra: str) -> subprocess.Popen:
        return self.start("run", str(self.trial), "--local", *args, **extra)

    def status(self) -> dict:
        out = self.cli("gpus", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_for(self, what, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = what(self.status())
            if found:
                return found
            time.sleep(0.3)
        raise AssertionError(f"not reached in {timeout} s: {self.status()}")

    def leases(self) -> dict[str, dict]:
        """Every lease in the journal's raw lines, start joined with its end."""
        out: dict[str, dict] = {}
        ends: dict[str, dict] = {}
        for path in (self.data / ".det-lab/gpus/journal").glob("*.jsonl"):
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "start":
                    out[e["lease"]] = e
                else:
                    ends.setdefault(e["lease"], e)
        for lease, end in ends.items():
            out[lease]["end"], out[lease]["how"] = end["at"], end["how"]
        return out

    def runs(self) -> dict[str, dict]:
        """Each run's run.json and what its trial saw (``gpus.json``, None before it ran)."""
        out = {}
        for d in (self.data / "outputs/vla/local-runs").iterdir():
            if d.name.startswith("."):
                continue
            seen = d / "gpus.json"
            out[d.name] = {"state": json.loads((d / "run.json").read_text()),
                           "trial": json.loads(seen.read_text()) if seen.exists() else None}
        return out


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def shim():
    base = Path(tempfile.mkdtemp(prefix="det-lab-nvml-"))
    base.chmod(0o755)  # a second user loads the library too
    nvml = build_shim(base)
    nvml["config"].chmod(0o644)
    yield nvml
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def machine(tmp_path, shim) -> Machine:
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(tmp_path / "data"),
                                                       "tracking": {"backend": "none"}}))
    m = Machine(tmp_path, shim, tmp_path / "data", tmp_path / "lab.yaml")
    m.set_gpus(gpu_lines(2))
    assert m.cli("init").returncode == 0
    return m


@pytest.fixture
def sleeper():
    """Real processes to list on a GPU, as someone's plain ``python train.py`` is."""
    procs: list[subprocess.Popen] = []

    def start(user: str | None = None) -> int:
        kw = {"user": user, "group": "nogroup", "extra_groups": []} if user else {}
        procs.append(subprocess.Popen(["sleep", "600"], cwd="/", **kw))
        return procs[-1].pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_trial_sees_its_lease_and_the_lease_ends_with_the_run(machine):
    """One run on 1 GPU, then one on 2: each trial sees CUDA_VISIBLE_DEVICES = its lease's UUIDs, the
    lease covers the trial and ends with the run; nothing is held afterwards."""
    t0 = time.time()
    first = finish(machine.run())
    machine.write_trial(2)
    second = finish(machine.run())
    t1 = time.time()
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    leases = sorted(machine.leases().values(), key=lambda e: e["since"])
    assert [[g["uuid"] for g in e["gpus"]] for e in leases] == [[UUIDS[0]], [UUIDS[0], UUIDS[1]]]
    runs = sorted(machine.runs().values(), key=lambda r: r["trial"]["start"])
    for lease, run in zip(leases, runs):
        assert run["state"]["status"] == "finished"
        assert lease["run"] == run["state"]["name"] and lease["how"] == "released"
        assert run["trial"]["cuda"] == ",".join(g["uuid"] for g in lease["gpus"])
        assert t0 < lease["since"] < run["trial"]["start"] < run["trial"]["end"] < lease["end"] < t1
    assert [g["holder"] for g in machine.status()["gpus"]] == [None, None]


def test_no_gpus_zero_slots_and_scheduled_tasks_take_no_lease(machine):
    """A machine without GPUs trains on the CPU as before (the trial's environment untouched); 0
    slots on a GPU machine hides the GPUs; inside a Slurm job the run keeps the GPUs it was given."""
    machine.set_gpus("")
    assert finish(machine.run(CUDA_VISIBLE_DEVICES="kept-as-given")).returncode == 0
    machine.set_gpus(gpu_lines(2))
    machine.write_trial(0)
    assert finish(machine.run()).returncode == 0
    machine.write_trial(1)
    assert finish(machine.run(SLURM_JOB_ID="4242", CUDA_VISIBLE_DEVICES="GPU-given-by-slurm")).returncode == 0
    seen = [r["trial"]["cuda"] for r in sorted(machine.runs().values(), key=lambda r: r["trial"]["start"])]
    assert seen == ["kept-as-given", "", "GPU-given-by-slurm"]
    assert machine.leases() == {}


def test_bad_input_is_one_line_and_starts_nothing(machine):
    """``--gpus 7`` on a 2-GPU machine, a malformed ``--gpus``, a negative or too large slot count, a
    failing driver: one error line each, no run directory, no lease."""
    cases = [(("--gpus", "7"), "no GPU 7"), (("--gpus", "0,x"), "--gpus 0,x"),
             (("--set", "resources.slots_per_trial=-1"), "slots_per_trial"),
             (("--set", "resources.slots_per_trial=3"), "this machine has 2 GPU(s)")]
    for args, words in cases:
        out = finish(machine.run(*args))
        assert out.returncode != 0, args
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (args, out.stderr)
    machine.set_gpus("init_error 18\n" + gpu_lines(2))  # a driver upgraded without a reboot: not a CPU machine
    out = finish(machine.run())
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "error: NVML cannot read this machine's GPUs" \
        in out.stderr, out.stderr
    runs = machine.data / "outputs/vla/local-runs"
    assert not runs.exists() or not list(runs.iterdir())
    assert machine.leases() == {}


def _held(machine: Machine, run: subprocess.Popen, index: int):
    def check(status):
        h = status["gpus"][index]["holder"]
        return h if h and h["kind"] == "lease" and h["pid"] == run.pid else None
    return check


def test_a_holder_killed_with_9_frees_its_gpu_at_once(machine, monkeypatch):
    """``det-lab run`` killed with -9 while its trial trains: its GPU is free for the very next run
    while the holder is still an unreaped zombie (no waiting for a timeout), and the journal ends its
    lease. ``active_leases`` (what the watchdog reads) names the lease while it is held, not after."""
    from det_lab.gpus import active_leases
    from det_lab.settings import load_settings

    monkeypatch.setenv("DET_LAB_GPU_STATE_DIR", str(machine.state))
    settings = load_settings(machine.config, env={})
    run = machine.run("--gpus", "1", TRIAL_SECONDS="120")
    holder = machine.wait_for(_held(machine, run, 1))
    (lease,) = active_leases(settings)
    assert (lease.gpu_index, lease.gpu_uuid, lease.user, lease.run, lease.pid, lease.since, lease.checked) == \
        (1, UUIDS[1], "root", holder["run"], run.pid, holder["since"], True)
    run.send_signal(signal.SIGKILL)
    stat = Path(f"/proc/{run.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie until this test reaps it
        time.sleep(0.05)
    assert machine.status()["gpus"][1]["holder"] is None
    assert active_leases(settings) == []
    run.wait()
    after = finish(machine.run("--gpus", "1"))
    assert after.returncode == 0, after.stderr
    leases = machine.leases()
    assert leases[holder["lease"]]["how"] == "holder gone"
    assert sorted(e["how"] for e in leases.values()) == ["holder gone", "released"]


def test_a_process_outside_det_lab_keeps_its_gpu(machine, sleeper):
    """nobody's plain process on GPU 0: a run takes GPU 1; asking for GPU 0 is refused naming the
    process (user, pid, command, memory); so is a run when both GPUs are busy."""
    pid = sleeper("nobody")
    machine.set_gpus(gpu_lines(2, {0: [pid]}))
    out = finish(machine.run())
    assert out.returncode == 0, out.stderr
    (run,) = machine.runs().values()
    assert run["trial"]["cuda"] == UUIDS[1]
    refused = finish(machine.run("--gpus", "0"))
    assert refused.returncode != 0
    assert f"nobody's pid {pid} (sleep 600, 1,000 MiB)" in refused.stderr, refused.stderr
    machine.set_gpus(gpu_lines(2, {0: [pid], 1: [pid]}))
    refused = finish(machine.run())
    assert "both GPUs held" in refused.stderr and "--queue" in refused.stderr, refused.stderr
    assert len(machine.runs()) == 1


def test_gpus_taken_by_a_run_are_refused_naming_it(machine):
    """``--gpus 0`` while a run holds GPU 0: refused with the holder's user, run and since; ``--gpus 1``
    beside it runs."""
    run = machine.run("--gpus", "0", TRIAL_SECONDS="120")
    try:
        holder = machine.wait_for(_held(machine, run, 0))
        refused = finish(machine.run("--gpus", "0"))
        since = time.strftime("%H:%M", time.localtime(holder["since"]))
        assert refused.returncode != 0
        assert f"GPU 0 held by root {holder['run']} since {since}" in refused.stderr, refused.stderr
        beside = finish(machine.run("--gpus", "1"))
        assert beside.returncode == 0, beside.stderr
    finally:
        run.send_signal(signal.SIGTERM)
        finish(run)


def test_limits_and_a_waiting_run_listed_and_cancelled(machine):
    """root's gpu_limit of 1 (slurm.yaml's accounting.members, as for Slurm): a 2-GPU run is refused;
    a second run with --queue waits on the limit, though a GPU is free, is listed as waiting in
    words by runs list, and runs cancel ends it (cancelled, never started)."""
    slurm = machine.data / ".det-lab" / "slurm.yaml"
    slurm.write_text(yaml.safe_dump({"accounting": {"members": [{"user": "root", "projects": ["vla"], "gpu_limit": 1}]}}))
    two = finish(machine.run("--set", "resources.slots_per_trial=2"))
    assert two.returncode != 0 and "root may hold at most 1 GPU(s)" in two.stderr, two.stderr
    first = machine.run(TRIAL_SECONDS="120")
    try:
        machine.wait_for(_held(machine, first, 0))
        queued = machine.run("--queue")
        machine.wait_for(lambda s: s["queue"] and "limit of 1" in s["queue"][0]["waiting"])
        listed = [json.loads(line) for line in machine.cli("runs", "list", "--json").stdout.splitlines()]
        waiting = [r for r in listed if r["status"] == "waiting"]
        assert len(waiting) == 1 and "root's limit of 1 GPU(s) at once is reached" in waiting[0]["waiting"]
        plain = machine.cli("runs", "list").stdout
        assert plain.count("waiting: root's limit of 1 GPU(s) at once is reached") == 1, plain
        from det_lab.runs.record import open_record

        record = open_record(Path(waiting[0]["dir"]))  # what runs delete / prune ask before deleting
        assert record.scheduled(record.state()) == f"it waits for GPUs as pid {queued.pid} on host {os.uname().nodename.split('.')[0]}"
        assert machine.cli("runs", "cancel", waiting[0]["name"]).returncode == 0
        out = finish(queued)
        assert out.returncode != 0 and "cancelled while it waited" in out.stderr
        assert machine.runs()[waiting[0]["name"]]["state"]["status"] == "cancelled"
        assert machine.runs()[waiting[0]["name"]]["trial"] is None
        assert record.scheduled(record.state()) is None
        assert machine.status()["queue"] == []
    finally:
        first.send_signal(signal.SIGTERM)
        finish(first)


def test_eight_runs_of_two_users_on_two_gpus_share_none_and_go_in_fair_order(team: Team, shim, sleeper):
    """Two members start eight runs at once on 2 GPUs (a's four first), while processes outside det-lab
    hold both: they wait in line; once the GPUs free, b's four go first (a used 10 GPU-hours in the
    last hour; first come, first served would start a's), no GPU ever has two runs, every trial sees
    its own lease's GPU, all finish; det-lab usage's GPU-hours per member are the leases' durations."""
    (team.base / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(team.data), "group": team.group,
                                                        "tracking": {"backend": "none"}}))
    m = Machine(team.base, shim, team.data, team.base / "lab.yaml")
    assert team.det_lab(team.a, "init").returncode == 0
    journal = team.data / ".det-lab/gpus/journal"
    journal.mkdir(parents=True)
    for d in (journal, journal.parent):
        os.chown(d, 0, team.gid)
        d.chmod(0o2775)
    past = time.time() - 3600  # a's 5 hours on 2 GPUs of another machine, ended an hour ago
    (journal / f"otherbox.{team.a.name}.jsonl").write_text(
        json.dumps({"event": "start", "lease": "old0", "host": "otherbox", "user": team.a.name, "run": "old",
                    "project": "vla", "template": "gpu-trial", "gpus": [{"index": 0, "uuid": "GPU-x"},
                                                                         {"index": 1, "uuid": "GPU-y"}],
                    "pid": 1, "since": past - 5 * 3600}) + "\n"
        + json.dumps({"event": "end", "lease": "old0", "at": past, "how": "released"}) + "\n")
    m.set_gpus(gpu_lines(2, {0: [sleeper()], 1: [sleeper()]}))
    extra = {k: v for k, v in m.env().items() if k in ("LD_LIBRARY_PATH", "NVML_SHIM_CONFIG", "DET_LAB_GPU_STATE_DIR")}
    procs = []
    for user in [team.a] * 4 + [team.b] * 4:
        procs.append(team.start(user, "run", str(m.trial), "--local", "--queue", env=extra))
        time.sleep(0.3)
    line = m.wait_for(lambda s: s["queue"] if len(s["queue"]) == 8 else None, timeout=240)
    assert [q["user"] for q in line] == [team.b.name] * 4 + [team.a.name] * 4
    assert all("both GPUs held" in q["waiting"] for q in line), line

    def ahead() -> list[str]:  # what runs list says of each waiting run, past the GPUs' holders
        rows = [json.loads(r) for r in m.cli("runs", "list", "--json").stdout.splitlines()]
        return sorted(r["waiting"].rpartition(")")[2] for r in rows if r["status"] == "waiting")

    want = sorted([""] + ["; 1 run ahead"] + [f"; {k} runs ahead" for k in range(2, 8)])
    deadline = time.monotonic() + 60
    while ahead() != want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ahead() == want
    m.set_gpus(gpu_lines(2))
    done = [finish_as(p) for p in procs]
    assert [d.returncode for d in done] == [0] * 8, [d.stderr[-500:] for d in done if d.returncode]

    leases = {k: e for k, e in m.leases().items() if k != "old0"}
    assert len(leases) == 8 and {e["how"] for e in leases.values()} == {"released"}
    started = sorted(leases.values(), key=lambda e: e["since"])
    assert [e["user"] for e in started] == [team.b.name] * 4 + [team.a.name] * 4
    for uuid in UUIDS[:2]:
        spans = sorted((e["since"], e["end"]) for e in leases.values() if e["gpus"][0]["uuid"] == uuid)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    runs = m.runs()
    for e in leases.values():
        run = runs[e["run"]]
        assert run["state"]["status"] == "finished"
        assert run["trial"]["cuda"] == e["gpus"][0]["uuid"]
        assert e["since"] < run["trial"]["start"] < run["trial"]["end"] < e["end"]

    usage = m.cli("usage", "--json", "--by", "user")
    assert usage.returncode == 0, usage.stderr
    hours = {r["user"]: r["gpu_hours"] for r in json.loads(usage.stdout)["summary"]}
    for user, seeded in ((team.a, 10.0), (team.b, 0.0)):
        want = seeded + sum(e["end"] - e["since"] for e in leases.values() if e["user"] == user.name) / 3600
        assert hours[user.name] == pytest.approx(want, abs=2e-6)


def test_the_exporter_labels_leased_gpus_and_exports_the_line(machine, sleeper):
    """``det-lab exporter --source gpus``: the GPU a run holds is labelled with its user, run and lease;
    a run waiting in line counts in the queue length, and its wait in the oldest wait."""
    import urllib.request

    from tests.test_monitoring import samples, start_exporter, stop_exporter

    machine.set_gpus(gpu_lines(2, {1: [sleeper()]}))
    holder = machine.run(TRIAL_SECONDS="120")
    queued = None
    url, exporter = start_exporter(machine.env(), "gpus")
    try:
        held = machine.wait_for(_held(machine, holder, 0))
        queued = machine.run("--queue")
        machine.wait_for(lambda s: len(s["queue"]) == 1)
        time.sleep(1.0)
        with urllib.request.urlopen(url, timeout=30) as resp:
            text = resp.read().decode()
        leases = [(lb["gpu"], lb["uuid"], lb["user"], lb["run"], lb["lease"], lb["pid"])
                  for lb, _ in samples(text, "det_lab_gpu_lease_info")]
        assert leases == [("0", UUIDS[0], "root", held["run"], held["lease"], str(holder.pid))]
        assert [v for _, v in samples(text, "det_lab_gpu_queue_length")] == [1]
        (wait,) = [v for _, v in samples(text, "det_lab_gpu_queue_oldest_wait_seconds")]
        assert wait >= 1.0
    finally:
        stop_exporter(exporter)
        for proc in (queued, holder):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                finish(proc)


def test_another_machines_leases_are_shown_and_counted(machine):
    """A lease another machine journaled without an end: det-lab gpus shows it (not checked from here)
    and det-lab usage counts it up to now, by user, project and template, beside this machine's."""
    journal = machine.data / ".det-lab/gpus/journal"
    journal.mkdir(parents=True, exist_ok=True)
    since = time.time() - 1800
    (journal / "otherbox.bob.jsonl").write_text(json.dumps(
        {"event": "start", "lease": "far0", "host": "otherbox", "user": "bob", "run": "3dgs-garden", "project": "3dgs",
         "template": "gaussian_splatting", "gpus": [{"index": 2, "uuid": "GPU-far"}, {"index": 3, "uuid": "GPU-far2"}],
         "pid": 4242, "since": since}) + "\n")
    assert finish(machine.run()).returncode == 0
    status = machine.status()
    assert status["other_hosts"] == [{"host": "otherbox", "gpus": [2, 3], "user": "bob", "run": "3dgs-garden",
                                      "since": since, "lease": "far0"}]
    plain = machine.cli("gpus").stdout
    assert "otherbox: GPU 2,3 held by bob run 3dgs-garden" in plain and "not checked from here" in plain
    (mine,) = [e for k, e in machine.leases().items() if k != "far0"]
    before = time.time()
    by = {}
    for key in ("user", "project", "template"):
        out = machine.cli("usage", "--json", "--by", key)
        assert out.returncode == 0, out.stderr
        by[key] = {r[key]: r["gpu_hours"] for r in json.loads(out.stdout)["summary"]}
    mine_h = (mine["end"] - mine["since"]) / 3600
    assert by["user"]["root"] == pytest.approx(mine_h, abs=2e-6)
    assert by["user"]["bob"] == pytest.approx(2 * (before - since) / 3600, abs=2 * 30 / 3600)
    assert by["project"]["vla"] == pytest.approx(mine_h, abs=2e-6) and "3dgs" in by["project"]
    assert by["template"]["gpu-trial"] == pytest.approx(mine_h, abs=2e-6) and "gaussian_splatting" in by["template"]
