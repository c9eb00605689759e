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
from pathlib import Path

import pytest
import yaml

from det_lab.settings import load_settings
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
    lab.cli("init", "--demo", check=True)
    publish_tiny_data(load_settings(lab.config, env={}), tmp)
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


def runs_of(lab: Lab, project: str, prefix: str) -> set[Path]:
    return {p.parent for p in (lab.root / "outputs" / project / "local-runs").glob(f"{prefix}-*/run.json")}


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


def new_run(lab: Lab, project: str, prefix: str, before: set[Path], proc: subprocess.Popen) -> Path:
    return wait_for(lambda: next(iter(runs_of(lab, project, prefix) - before), None), proc, 120, "a run directory")


def checkpoint_after(run_dir: Path, step: int, proc: subprocess.Popen) -> int:
    """Wait until the run has a checkpoint past ``step``; returns its step."""
    return wait_for(lambda: (state(run_dir).get("latest_checkpoint_step") or 0) > step
                    and state(run_dir)["latest_checkpoint_step"], proc, 180, f"a checkpoint after step {step}")


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
    after a crash mid-checkpoint the replayed steps are recorded once."""
    lab = runs_lab
    total = 360  # 0.04 s a batch: long enough for each stop to land mid-run on a loaded machine
    config = write_config(lab, TINY / "const.yaml", "tiny-long", lambda c: (
        c["hyperparameters"].update(sleep_per_batch=0.04), c.update(min_checkpoint_period={"batches": 20}),
        c["data"]["det_lab"].update(max_length={"batches": total})))
    host = socket.gethostname()
    before = runs_of(lab, "vla", "tiny")

    # 1. SIGHUP (the terminal closed): the trial checkpoints and stops; det-lab records "stopped"
    proc = start(lab, str(TINY), "--config", str(config))
    run_dir = new_run(lab, "vla", "tiny", before, proc)
    name = run_dir.name
    checkpoint_after(run_dir, 0, proc)
    trial = trial_of(proc)
    # a second trainer on the same run is refused, naming the live one, and changes nothing
    second = lab.cli("run", str(TINY), "--local", "--resume", "--run", name)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"run {name} is still training as pid {trial} on host {host}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "resumed" not in state(run_dir)
    proc.send_signal(signal.SIGHUP)
    out = finish(proc)
    assert proc.returncode == 0, out
    wait_for(lambda: not alive(trial), None, 10, "the trial to end")
    st = state(run_dir)
    assert st["status"] == "stopped" and st["latest_checkpoint_step"] >= trained_to(run_dir), st

    # 2. SIGTERM (a scheduler stopping the job): the same
    mark = st["latest_checkpoint_step"]
    proc = start(lab, str(TINY), "--resume", "--run", name)
    checkpoint_after(run_dir, mark, proc)
    trial = trial_of(proc)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    wait_for(lambda: not alive(trial), None, 10, "the trial to end")
    st = state(run_dir)
    assert st["status"] == "stopped" and st["latest_checkpoint_step"] >= trained_to(run_dir), st

    # 3. kill -9 of det-lab run: the trial notices, checkpoints, stops and records the outcome itself
    mark = st["latest_checkpoint_step"]
    proc = start(lab, str(TINY), "--resume", "--run", name)
    checkpoint_after(run_dir, mark, proc)
    trial = trial_of(proc)
    proc.kill()
    finish(proc)
    wait_for(lambda: not alive(trial), None, 30, "the orphaned trial to stop")
    st = state(run_dir)
    assert trained_to(run_dir) < total, "the trial trained on without its det-lab run"
    assert st["status"] == "stopped" and st["latest_checkpoint_step"] >= trained_to(run_dir), st
    assert not (run_dir / LOCK_NAME).exists()

    # 4. a trainer on another host (another UTS namespace): refused while its heartbeat is fresh ...
    holder = subprocess.Popen(["unshare", "--uts", "sh", "-c", f'hostname node-b && exec "{sys.executable}" -c "$0" "$1"',
                               FOREIGN_HOLDER, str(run_dir / LOCK_NAME)], stdout=subprocess.PIPE, text=True, env=lab.env)
    try:
        foreign_pid = int(holder.stdout.readline())
        time.sleep(4)  # longer than its 3 s lifetime: only its heartbeat keeps it
        refused = lab.cli("run", str(TINY), "--local", "--resume", "--run", name)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"run {name} is still training as pid {foreign_pid} on host node-b" in refused.stderr
    finally:
        holder.kill()
        holder.wait()
    # ... and broken with a warning once its heartbeat stopped long enough ago
    old = time.time() - 120
    os.utime(run_dir / LOCK_NAME, (old, old))
    mark = st["latest_checkpoint_step"]
    proc = start(lab, str(TINY), "--resume", "--run", name, env={"TINY_CRASH_ON_CHECKPOINT": "1"})
    out = finish(proc, 180)  # 5. the trial dies while writing its next checkpoint, holding the lock
    assert proc.returncode != 0, out
    assert "stale" in out and f"pid {foreign_pid} on host node-b" in out, out
    st = state(run_dir)
    assert st["status"] == "failed" and st["latest_checkpoint_step"] == mark
    assert trained_to(run_dir) > mark  # steps past the checkpoint were reported: the resume replays them

    # 6. the dead trainer's lock (this host) is broken with a warning; the run finishes; every
    # (group, key, step) is recorded once although steps were replayed after each stop and the crash
    dead = int((run_dir / LOCK_NAME).read_text().split("|")[2])  # <lock path>|host|pid|random: flufl.lock's claim
    proc = start(lab, str(TINY), "--resume", "--run", name)
    out = finish(proc, 180)
    assert proc.returncode == 0, out
    assert "stale" in out and f"pid {dead} on host {host}" in out, out
    st = state(run_dir)
    assert st["status"] == "finished" and st["resumed"] == 4 and st["latest_checkpoint_step"] == total
    assert sorted(series(run_dir, "training")) == list(range(10, total + 1, 10))
    assert sorted(series(run_dir, "validation")) == list(range(20, total + 1, 20))
    assert not (run_dir / LOCK_NAME).exists()


# --- exact resume on the templates ---------------------------------------------------------------


def _compare_stopped_with_straight(lab: Lab, template: str, project: str, prefix: str, base: Path, edit) -> tuple[Path, Path]:
    """Train a config uninterrupted and, at the same time, a copy Ctrl-C'd once it has a
    checkpoint and then resumed to the end; returns both run directories."""
    straight_cfg = write_config(lab, base, f"{prefix}-straight", edit)
    stopped_cfg = write_config(lab, base, f"{prefix}-stopped", edit)
    before = runs_of(lab, project, prefix)
    straight = start(lab, template, "--config", str(straight_cfg))
    proc = start(lab, template, "--config", str(stopped_cfg))
    run_dir = wait_for(lambda: next((d for d in runs_of(lab, project, prefix) - before
                                     if state(d)["config"] == str(stopped_cfg)), None), proc, 120, "a run directory")
    checkpoint_after(run_dir, 0, proc)
    proc.send_signal(signal.SIGINT)
    out = finish(proc)
    assert proc.returncode == 0 and state(run_dir)["status"] == "stopped", out
    assert state(run_dir)["latest_checkpoint_step"] < state(run_dir)["max_length"]
    resumed = lab.cli("run", template, "--local", "--resume", "--run", run_dir.name)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + (run_dir / "train.log").read_text()[-3000:]
    assert state(run_dir)["status"] == "finished"
    out = finish(straight, 300)
    assert straight.returncode == 0, out
    (straight_dir,) = (d for d in runs_of(lab, project, prefix) - before if d != run_dir)
    return straight_dir, run_dir


def _assert_same(straight: Path, resumed: Path, group: str, keys: tuple[str, ...]) -> None:
    expected, got = series(straight, group), series(resumed, group)
    assert sorted(got) == sorted(expected)
    for step in expected:
        for key in keys:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (group, key, step)


def test_vla_resume_is_exact_with_a_shuffled_loader_and_dropout(runs_lab):
    """The VLA template shuffles its training data (12 batches an epoch here) and uses dropout: a
    run stopped after its first checkpoint and resumed reports the uninterrupted run's losses."""

    def tiny(c):
        c["hyperparameters"].update(global_batch_size=32, warmup_batches=4)
        c["hyperparameters"]["model"].update(d_model=32, n_layers=1, dropout=0.1)
        c["min_validation_period"] = {"batches": 10}
        c["min_checkpoint_period"] = {"batches": 10}
        c["data"]["det_lab"].update(max_length={"batches": 40}, reporting_batches=2)

    straight, resumed = _compare_stopped_with_straight(runs_lab, "vla", "vla", "vla",
                                                       TEMPLATES / "vla" / "const.yaml", tiny)
    _assert_same(straight, resumed, "training", ("loss", "action_l1"))
    _assert_same(straight, resumed, "validation", ("val_loss", "val_action_l1"))


def test_3dgs_resume_is_exact(runs_lab):
    """3DGS reports the mean loss of a window of iterations: a stop inside a window must not
    shorten it. A stopped-and-resumed run reports what an uninterrupted one does."""

    def tiny(c):
        hp = c["hyperparameters"]
        hp.update(validate_every=20, checkpoint_every=10, densify_from=5, densify_until=30, densify_every=5,
                  opacity_reset_every=1000, sh_degree_every=15)
        hp["densify"]["max_gaussians"] = 400
        c["data"]["det_lab"].update(max_length={"batches": 40}, reporting_batches=5)

    straight, resumed = _compare_stopped_with_straight(runs_lab, "3dgs", "3dgs", "gaussian_splatting",
                                                       TEMPLATES / "gaussian_splatting" / "const.yaml", tiny)
    _assert_same(straight, resumed, "training", ("loss", "num_gaussians", "sh_degree", "lr_means"))
    _assert_same(straight, resumed, "validation", ("psnr", "ssim", "num_gaussians"))
