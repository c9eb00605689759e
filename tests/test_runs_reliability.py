"""Local runs under abuse: det-lab run killed (-9, SIGTERM, SIGHUP), a second trainer on one run,
stale locks from a dead process or another host, a crash mid-checkpoint, and resume exactness
on the templates (shuffled loader and dropout for VLA, 3DGS's loss windows)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from det_lab.data.publish import publish_demos
from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.conftest import VENV_BIN, Lab, publish_tiny_data

REPO = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "fixtures" / "tiny"
TEMPLATES = REPO / "experiment_templates"
LOCK_NAME = "trainer.lock"


@pytest.fixture(scope="module")
def runs_lab(tmp_path_factory) -> Lab:
    """One lab for the module: demo datasets and the tiny regression set, no tracker (the mirror
    has its own tests; these are about processes, locks and the run record)."""
    tmp = tmp_path_factory.mktemp("runs-lab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               DET_LAB_TEMPLATES=str(TEMPLATES), HOME=str(tmp / "home"))
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "none"})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    # what `det-lab init --demo` publishes (its own tests run the command), beside the tiny set:
    # each dataset is its own git + DVC repo, published at once
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(publish_demos, settings), pool.submit(publish_tiny_data, settings, tmp)]:
            done.result()
    return lab


# --- helpers -------------------------------------------------------------------------------------


def write_config(lab: Lab, base: Path, name: str, edit) -> Path:
    conf = yaml.safe_load(base.read_text())
    edit(conf)
    path = lab.config.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


_started: list[tuple[subprocess.Popen, list[int]]] = []


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Whatever a failing test leaves running (det-lab run, its trial) is killed."""
    yield
    while _started:
        proc, trials = _started.pop()
        for pid in [*children(proc.pid), *trials]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start(lab: Lab, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", *args, "--local"], env={**lab.env, **(env or {})},
                            cwd=lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _started.append((proc, []))
    return proc


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def series(run_dir: Path, group: str) -> dict[int, dict]:
    """{step: metrics} of a group; asserts each (key, step) was recorded once."""
    out: dict[int, dict] = {}
    for r in records(run_dir):
        if r["group"] == group:
            twice = set(out.get(r["step"], {})) & set(r["metrics"])
            assert not twice, f"{group} {sorted(twice)} at step {r['step']} recorded twice"
            out.setdefault(r["step"], {}).update(r["metrics"])
    return out


def trained_to(run_dir: Path) -> int:
    return max(series(run_dir, "training"), default=0)


def wait_for(cond, proc: subprocess.Popen | None, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"det-lab run ended before {what}:\n{proc.communicate()[0]}")
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def at_first_checkpoint(runs: dict, act) -> None:
    """Call ``act(key)`` for each run (``key: (det-lab run, run directory)``) as soon as it has a
    checkpoint, watching all of them at once."""
    pending = dict(runs)
    deadline = time.monotonic() + 300  # starting several trials on a loaded machine
    while pending:
        for key, (proc, run_dir) in list(pending.items()):
            if (run_dir / "run.json").exists() and (state(run_dir).get("latest_checkpoint_step") or 0) > 0:
                act(key)
                del pending[key]
            elif proc.poll() is not None:
                raise AssertionError(f"det-lab run ({key}) ended before a checkpoint:\n{proc.communicate()[0]}")
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint within 300 s: {sorted(pending)}")
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trial_of(proc: subprocess.Popen) -> int:
    """The trial process det-lab run started (its only child)."""
    pid = wait_for(lambda: next(iter(children(proc.pid)), None), proc, 60, "the trial process")
    for p, trials in _started:
        if p is proc:
            trials.append(pid)
    return pid


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- one trainer per run, and none without its det-lab run --------------------------------------


FOREIGN_HOLDER = """
import os, sys, time, datetime as dt
from pathlib import Path
from det_lab.data.lock import VolumeLock
lock = VolumeLock(Path(sys.argv[1]), lifetime=dt.timedelta(seconds=3), timeout=30).__enter__()
print(os.getpid(), flush=True)
time.sleep(600)
"""


def test_a_trial_never_outlives_det_lab_run_and_a_run_has_one_trainer(runs_lab):
    """SIGHUP, SIGTERM and kill -9 of det-lab run each stop the trial at a checkpoint with the
    outcome recorded; a second trainer is refused while one lives (here, or on another host whose
    heartbeat is fresh); locks of a dead trainer or an expired heartbeat are broken with a warning;
    after a crash mid-checkpoint, and after each stop, the replayed steps are recorded once."""
    lab = runs_lab
    total = 360  # 0.04 s a batch: long enough for each stop to land mid-run on a loaded machine
    config = write_config(lab, TINY / "const.yaml", "tiny-long", lambda c: (
        c["hyperparameters"].update(sleep_per_batch=0.04), c.update(min_checkpoint_period={"batches": 20}),
        c["data"]["det_lab"].update(max_length={"batches": total})))
    host = socket.gethostname()
    runs = lab.root / "outputs" / "vla" / "local-runs"

    # 1-3. three runs at once, det-lab run stopped by SIGTERM (a scheduler stopping the job), kill -9
    # and SIGHUP (the terminal closed): each trial checkpoints and stops with "stopped" recorded
    # (after kill -9, by the orphaned trial itself)
    procs = {how: start(lab, str(TINY), "--exp-config", str(config), "--run", f"tiny-{how}") for how in ("term", "kill", "hup")}
    trials = {}

    def stop(how: str) -> None:
        trials[how] = trial_of(procs[how])
        if how == "term":
            procs[how].send_signal(signal.SIGTERM)
        elif how == "kill":
            procs[how].kill()

    at_first_checkpoint({how: (proc, runs / f"tiny-{how}") for how, proc in procs.items()}, stop)
    # a second trainer on a run is refused, naming the live one, and changes nothing
    name = "tiny-hup"
    second = lab.cli("run", str(TINY), "--local", "--resume", "--run", name)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"run {name} is still training as pid {trials['hup']} on host {host}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "resumed" not in state(runs / name)
    procs["hup"].send_signal(signal.SIGHUP)
    for how, proc in procs.items():
        out = finish(proc)
        assert proc.returncode == (-signal.SIGKILL if how == "kill" else 0), out
        wait_for(lambda: not alive(trials[how]), None, 30, f"the trial stopped by {how} to end")
        run_dir = runs / f"tiny-{how}"
        st = state(run_dir)
        assert trained_to(run_dir) < total, f"the trial ({how}) trained on to the end"
        assert st["status"] == "stopped" and st["latest_checkpoint_step"] >= trained_to(run_dir), (how, st)
        assert not (run_dir / LOCK_NAME).exists()

    # 3b. two --resume at once both pass det-lab run's check; the trial that then finds the run taken
    # (here by this test process, between the check and the trial's own lock) leaves the record alone
    name, run_dir = "tiny-term", runs / "tiny-term"
    before = state(run_dir)
    late = start(lab, str(TINY), "--resume", "--run", name)
    # det-lab run has checked the lock and counted the resume (its other children, such as git, may
    # come first), and started its trial, which still imports for seconds before taking the lock
    wait_for(lambda: state(run_dir).get("resumed", 0) == before.get("resumed", 0) + 1, late, 60, "the resume")
    trial_of(late)
    from det_lab.runs.run_guard import hold

    lock = hold(run_dir, name)
    try:
        out = finish(late)
    finally:
        lock.__exit__(None, None, None)
    assert late.returncode == 2, out
    assert f"error: run {name} is still training as pid {os.getpid()} on host {host}" in out, out
    assert "resume with" not in out
    after = state(run_dir)
    assert after["status"] == "stopped" and after["latest_checkpoint"] == before["latest_checkpoint"], after
    assert after.get("exit_code") == before.get("exit_code")  # the loser recorded nothing

    # 4. a trainer on another host (another UTS namespace) holds the killed run: refused while its
    # heartbeat is fresh ...
    name, run_dir = "tiny-kill", runs / "tiny-kill"
    holder = subprocess.Popen(["unshare", "--uts", "sh", "-c", f'hostname node-b && exec "{sys.executable}" -c "$0" "$1"',
                               FOREIGN_HOLDER, str(run_dir / LOCK_NAME)], stdout=subprocess.PIPE, text=True, env=lab.env)
    try:
        foreign_pid = int(holder.stdout.readline())
        # its claim, made to look long expired, is renewed by its heartbeat alone
        old = time.time() - 120
        os.utime(run_dir / LOCK_NAME, (old, old))
        wait_for(lambda: (run_dir / LOCK_NAME).stat().st_mtime > time.time(), None, 30, "the holder's heartbeat")
        refused = lab.cli("run", str(TINY), "--local", "--resume", "--run", name)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"run {name} is still training as pid {foreign_pid} on host node-b" in refused.stderr
    finally:
        holder.kill()
        holder.wait()
    # ... and broken with a warning once its heartbeat stopped long enough ago
    old = time.time() - 120
    os.utime(run_dir / LOCK_NAME, (old, old))
    mark = state(run_dir)["latest_checkpoint_step"]
    proc = start(lab, str(TINY), "--resume", "--run", name, env={"TINY_CRASH_ON_CHECKPOINT": "1"})
    out = finish(proc, 180)  # 5. the trial dies while writing its next checkpoint, holding the lock
    assert proc.returncode != 0, out
    assert "stale" in out and f"pid {foreign_pid} on host node-b" in out, out
    st = state(run_dir)
    assert st["status"] == "failed" and st["latest_checkpoint_step"] == mark
    assert trained_to(run_dir) > mark  # steps past the checkpoint were reported: the resume replays them

    # 6. the dead trainer's lock (this host) is broken with a warning; each run resumes to the end
    # (together); every (group, key, step) is recorded once although steps were replayed after
    # the stop (and the crash)
    dead = int((run_dir / LOCK_NAME).read_text().split("|")[2])  # <lock path>|host|pid|random: flufl.lock's claim
    procs = {how: start(lab, str(TINY), "--resume", "--run", f"tiny-{how}") for how in ("kill", "term", "hup")}
    for how, proc in procs.items():
        out = finish(proc, 180)
        assert proc.returncode == 0, out
        assert ("stale" in out and f"pid {dead} on host {host}" in out) == (how == "kill"), out
        run_dir = runs / f"tiny-{how}"
        st = state(run_dir)
        assert st["status"] == "finished" and st["latest_checkpoint_step"] == total, (how, st)
        assert st["resumed"] == (1 if how == "hup" else 2), (how, st)  # term: the attempt in 3b counts
        assert sorted(series(run_dir, "training")) == list(range(10, total + 1, 10)), how
        assert sorted(series(run_dir, "validation")) == list(range(20, total + 1, 20)), how
        assert not (run_dir / LOCK_NAME).exists()


def test_a_local_run_shows_running_while_it_trains_and_died_when_its_processes_vanish(runs_lab):
    """runs list and the exporter say "running" while a trial trains (a resumed run too, not the
    "stopped" of its last end), and "died" once its trial and det-lab run vanished without recording
    how (both frozen, then killed -9: a machine that lost power); --resume brings it to the end."""
    from det_lab.monitoring.source_runs import RunsSource

    lab = runs_lab
    config = write_config(lab, TINY / "const.yaml", "tiny-died", lambda c: (
        c["hyperparameters"].update(sleep_per_batch=0.04), c.update(min_checkpoint_period={"batches": 20}),
        c["data"]["det_lab"].update(max_length={"batches": 400})))
    name, run_dir = "tiny-died", lab.root / "outputs" / "vla" / "local-runs" / "tiny-died"

    def listed() -> str:
        rows = [json.loads(x) for x in lab.cli("runs", "list", "--json", check=True).stdout.splitlines()]
        return next(r["status"] for r in rows if r["name"] == name)

    def exported() -> set[str]:
        (runs,) = [m for m in RunsSource(load_settings(lab.config, env={})).collect() if m.name == "det_lab_runs"]
        return {s.labels["status"] for s in runs.samples if s.labels["template"] == "tiny" and s.value}

    proc = start(lab, str(TINY), "--exp-config", str(config), "--run", name)
    at_first_checkpoint({name: (proc, run_dir)}, lambda _: None)
    assert listed() == "running"
    trial = trial_of(proc)
    for pid in (proc.pid, trial):  # frozen first, so neither records anything as it dies
        os.kill(pid, signal.SIGSTOP)
    for pid in (proc.pid, trial):
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not alive(trial), None, 30, "the trial to die")
    assert state(run_dir)["status"] == "running" and (run_dir / LOCK_NAME).exists()  # what it left
    assert listed() == "died"
    assert "died" in exported() and "running" not in exported()
    died = [m for m in RunsSource(load_settings(lab.config, env={})).collect() if m.name == "det_lab_run_died_seconds"]
    assert [(s.labels["run"], s.labels["user"], s.labels["kind"]) for s in died[0].samples] == [(name, "root", "local")]

    mark = trained_to(run_dir)
    resumed = start(lab, str(TINY), "--resume", "--run", name)
    wait_for(lambda: trained_to(run_dir) > mark, resumed, 120, "the resumed run to train past where it died")
    assert listed() == "running" and "running" in exported()  # 0.04 s a batch: seconds of training left
    out = finish(resumed, 180)
    assert resumed.returncode == 0 and "stale" in out, out
    assert listed() == "finished" and state(run_dir)["latest_checkpoint_step"] == 400


def test_runs_cancel_stops_a_local_run_at_a_checkpoint(runs_lab):
    """`det-lab runs cancel` works on a local run as on a Slurm one: its trial checkpoints and stops."""
    lab, total = runs_lab, 400
    config = write_config(lab, TINY / "const.yaml", "tiny-cancel", lambda c: (
        c["hyperparameters"].update(sleep_per_batch=0.04), c.update(min_checkpoint_period={"batches": 20}),
        c["data"]["det_lab"].update(max_length={"batches": total})))
    name = "tiny-cancel"
    run_dir = lab.root / "outputs" / "vla" / "local-runs" / name
    proc = start(lab, str(TINY), "--exp-config", str(config), "--run", name)
    cancelled = {}
    at_first_checkpoint({name: (proc, run_dir)}, lambda key: cancelled.update(cli=lab.cli("runs", "cancel", name)))
    assert cancelled["cli"].returncode == 0, cancelled["cli"].stdout + cancelled["cli"].stderr
    assert f"asked run {name}'s trial" in cancelled["cli"].stdout and "--resume --run tiny-cancel" in cancelled["cli"].stdout
    out = finish(proc)
    assert proc.returncode == 0, out
    st = state(run_dir)
    assert st["status"] == "stopped" and trained_to(run_dir) < total
    assert st["latest_checkpoint_step"] >= trained_to(run_dir)  # it checkpointed as it stopped
    again = lab.cli("runs", "cancel", name)
    assert again.returncode == 2 and "already ended (stopped)" in again.stderr


# --- exact resume on the templates ---------------------------------------------------------------


def _assert_same(straight: Path, resumed: Path, group: str, keys: tuple[str, ...]) -> None:
    expected, got = series(straight, group), series(resumed, group)
    assert sorted(got) == sorted(expected), (straight.name, group)
    for step in expected:
        for key in keys:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (straight.name, group, key, step)


def _tiny_vla(c: dict) -> None:
    c["hyperparameters"].update(global_batch_size=32, warmup_batches=4)
    c["hyperparameters"]["model"].update(d_model=32, n_layers=1, dropout=0.1)
    c["min_validation_period"] = {"batches": 10}
    c["min_checkpoint_period"] = {"batches": 10}
    c["data"]["det_lab"].update(max_length={"batches": 40}, reporting_batches=2)


def _tiny_3dgs(c: dict) -> None:
    hp = c["hyperparameters"]
    hp.update(validate_every=20, checkpoint_every=10, densify_from=5, densify_until=30, densify_every=5,
              opacity_reset_every=1000, sh_degree_every=15)
    hp["densify"]["max_gaussians"] = 400
    c["data"]["det_lab"].update(max_length={"batches": 40}, reporting_batches=5)


def test_vla_and_3dgs_runs_stopped_and_resumed_report_what_uninterrupted_runs_do(runs_lab):
    """The VLA template shuffles its training data (12 batches an epoch here) and uses dropout;
    3DGS reports the mean loss of a window of iterations, which a stop inside the window must not
    shorten. For each, a run Ctrl-C'd after its first checkpoint and resumed reports the losses of
    an uninterrupted run of the same config (all four trained at once)."""
    lab = runs_lab
    templates = {"vla": ("vla", "vla", _tiny_vla, ("loss", "action_l1"), ("val_loss", "val_action_l1")),
                 "3dgs": ("3dgs", "gaussian_splatting", _tiny_3dgs, ("loss", "num_gaussians", "sh_degree", "lr_means"),
                          ("psnr", "ssim", "num_gaussians"))}
    procs, dirs = {}, {}
    for t, (project, folder, edit, _, _) in templates.items():
        for kind in ("straight", "stopped"):
            cfg = write_config(lab, TEMPLATES / folder / "const.yaml", f"{t}-{kind}", edit)
            procs[t, kind] = start(lab, t, "--exp-config", str(cfg), "--run", f"{t}-{kind}")
            dirs[t, kind] = lab.root / "outputs" / project / "local-runs" / f"{t}-{kind}"
    at_first_checkpoint({t: (procs[t, "stopped"], dirs[t, "stopped"]) for t in templates},
                        lambda t: procs[t, "stopped"].send_signal(signal.SIGINT))
    for t in templates:
        proc, run_dir = procs[t, "stopped"], dirs[t, "stopped"]
        out = finish(proc)
        assert proc.returncode == 0 and state(run_dir)["status"] == "stopped", out
        assert state(run_dir)["latest_checkpoint_step"] < state(run_dir)["max_length"]
        procs[t, "resumed"] = start(lab, t, "--resume", "--run", run_dir.name)
    for t in templates:
        out = finish(procs[t, "resumed"], 300)
        run_dir = dirs[t, "stopped"]
        assert procs[t, "resumed"].returncode == 0, out + (run_dir / "train.log").read_text()[-3000:]
        assert state(run_dir)["status"] == "finished"
        out = finish(procs[t, "straight"], 300)
        assert procs[t, "straight"].returncode == 0, out
    for t, (_, _, _, train_keys, val_keys) in templates.items():
        _assert_same(dirs[t, "straight"], dirs[t, "stopped"], "training", train_keys)
        _assert_same(dirs[t, "straight"], dirs[t, "stopped"], "validation", val_keys)


def test_runs_list_prints_every_run_of_the_module_in_aligned_columns(runs_lab):
    """After the runs above: the table and --json list the same runs, oldest first, each row's
    status and progress where the header puts them."""
    rows = [json.loads(line) for line in runs_lab.cli("runs", "list", "--json", check=True).stdout.splitlines()]
    assert len(rows) >= 3 and {"finished", "stopped"} & {r["status"] for r in rows}
    lines = runs_lab.cli("runs", "list", check=True).stdout.splitlines()
    header, body = lines[0], lines[1:]
    assert header.split() == ["run", "kind", "status", "progress", "last", "validation", "where"]
    assert [line.split()[0] for line in body] == [r["name"] for r in rows]
    at = {col: header.index(col) for col in ("kind", "status", "progress")}
    for line, r in zip(body, rows):
        assert line[at["kind"]:].split()[0] == r["kind"]
        assert line[at["status"]:].split()[0] == r["status"]
        assert line[at["progress"]:].split()[0] == f"{r['step']}/{r['of']}"
