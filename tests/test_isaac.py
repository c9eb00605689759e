"""The Isaac Lab template's supervisor on the CPU stand-in (real rsl_rl PPO), end to end through
``det-lab run --local`` with a real MLflow server, plus parsing of rsl_rl's output layout."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from det_lab.rl import commands, log_parsers, tfevents
from det_lab.rl.supervisor import Restore
from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests import expconf
from tests.conftest import VENV_BIN

TEMPLATE = Path(__file__).resolve().parents[1] / "experiment_templates" / "isaac_lab"
needs_rsl_rl = pytest.mark.skipif(
    importlib.util.find_spec("rsl_rl") is None or importlib.util.find_spec("tensordict") is None,
    reason="rsl-rl-lib (and tensordict) not installed: pip install tensordict 'rsl-rl-lib>=5,<6' --no-deps",
)


@pytest.fixture
def isaac_lab(lab, shared_mlflow_server):
    from mlflow.tracking import MlflowClient

    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": shared_mlflow_server.uri})
    init_volume(load_settings(lab.config, env={}))
    lab.mlflow = MlflowClient(shared_mlflow_server.uri)
    return lab


def short_config(lab, iterations: int, **standin) -> Path:
    """const.yaml, shorter: ``iterations`` iterations, a save every 5, stand-in options."""
    conf = yaml.safe_load((TEMPLATE / "const.yaml").read_text())
    conf["data"]["det_lab"]["max_length"] = {"batches": iterations}
    conf["hyperparameters"]["save_interval"] = 5
    conf["hyperparameters"]["standin"].update({"num_envs": 32, **standin})
    path = lab.config.parent / "isaac-test.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def runs_root(lab) -> Path:
    return lab.root / "outputs" / "isaac" / "local-runs"


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def made(st: dict) -> list[int]:
    """The steps of every checkpoint a run made: those kept and those retention deleted."""
    return sorted(c["step"] for c in st["checkpoints"] + st.get("checkpoints_deleted", []))


def steps(run_dir: Path, group: str) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return [m["step"] for m in map(json.loads, lines) if m["group"] == group]


def wait_until(cond, proc: subprocess.Popen, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        assert proc.poll() is None, f"det-lab run ended before {what}: {proc.communicate()}"
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout} s: {what}")


def mlflow_history(lab, run_name: str, key: str) -> list[int]:
    exp = lab.mlflow.get_experiment_by_name("det_lab/isaac")
    if exp is None:
        return []
    found = lab.mlflow.search_runs([exp.experiment_id], f"tags.\"det.local_run\" = '{run_name}'")
    if not found:
        return []
    return sorted(m.step for m in lab.mlflow.get_metric_history(found[0].info.run_id, key))


@needs_rsl_rl
def test_streams_registers_preempts_and_resumes(isaac_lab):
    lab = isaac_lab
    config = short_config(lab, 30, iteration_sleep=0.25)
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TEMPLATE), "--local", "--exp-config", str(config)],
                            env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = wait_until(lambda: next(iter(runs_root(lab).glob("[!.]*/run.json")), None), proc, 60, "a run").parent

    # metrics and checkpoints arrive while the child trains, in det-lab's progress file and in MLflow
    wait_until(lambda: any(c["step"] >= 5 for c in state(run_dir)["checkpoints"]), proc, 120, "checkpoint 5")
    mid = steps(run_dir, "training")
    assert mid and max(mid) < 30 and proc.poll() is None
    assert wait_until(lambda: mlflow_history(lab, run_dir.name, "training/Train/mean_reward"), proc, 30, "MLflow points")
    assert steps(run_dir, "validation")  # mean_reward at each checkpoint (the searcher metric)

    proc.send_signal(signal.SIGINT)  # Ctrl-C: preempt; the child stops right after its next save
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, out + err
    first = state(run_dir)
    stop = first["latest_checkpoint_step"]
    # model_<i>.pt after i + 1 iterations (rsl_rl counts from 0): steps_completed i + 1
    assert 6 <= stop < 30 and made(first) == list(range(1, stop + 1, 5))
    log = (run_dir / "train.log").read_text()
    assert f"stop requested: stopped after saving model_{stop - 1}.pt" in log
    (child_run,) = log_parsers.run_dirs(run_dir / "work" / "logs" / "rsl_rl")
    assert log_parsers.latest_model(child_run)[0] == stop - 1  # nothing trained past the save
    assert "Isaac Lab is not installed here: running the CPU stand-in" in log

    proc = lab.cli("run", str(TEMPLATE), "--local", "--exp-config", str(config), "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "30 of 30 batches" in proc.stdout  # the summary counts iterations done, not the last index
    done = state(run_dir)
    assert done["latest_checkpoint_step"] == 30 and done["resumed"] == 1  # 30 of 30 iterations
    assert made(done)[len(made(first)):] == \
        [s + 1 for s in (*range(0, 30, 5), 29) if s + 1 > stop]
    log = (run_dir / "train.log").read_text()
    assert f"--resume --load_run det-lab-restore-{first['latest_checkpoint'][:8]} --checkpoint model_{stop - 1}.pt" in log
    train = steps(run_dir, "training")
    assert train == sorted(set(train)) and train[-1] == 30  # each iteration once, continuing after `stop`
    assert [s for s in train if s > stop][0] == stop + 1

    # the checkpoint: the rsl_rl model, its params, lineage
    ckpt = lab.root / "checkpoints" / "isaac" / done["latest_checkpoint"]
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["steps_completed"] == 30 and meta["rsl_rl"]["iteration"] == 29
    assert meta["det_lab"]["run_key"] == done["run_key"] and meta["det_lab"]["determined_version"] == "0.38.1"
    assert (ckpt / "params" / "agent.yaml").is_file()
    import torch

    assert torch.load(ckpt / "model_29.pt", weights_only=False)["iter"] == 29

    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    run = lab.mlflow.get_run(summary["backends"][0]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["det_lab.step"].startswith("iterations completed: rsl_rl iteration i is step i + 1")
    history = mlflow_history(lab, run_dir.name, "training/Loss/value")
    assert history == sorted(set(history)) and history[-1] == 30


@needs_rsl_rl
def test_crashing_child_is_a_failed_trial_with_its_last_lines(isaac_lab):
    lab = isaac_lab
    config = short_config(isaac_lab, 30, metrics="tfevents")  # rsl_rl's own TensorBoard writer this time
    lab.env["DET_LAB_STANDIN_CRASH_AT"] = "12"
    proc = lab.cli("run", str(TEMPLATE), "--local", "--exp-config", str(config))
    assert proc.returncode != 0
    assert "simulated crash at iteration 12" in proc.stdout  # the child's traceback, in the summary
    (run_dir,) = runs_root(lab).iterdir()
    st = state(run_dir)
    assert st["latest_checkpoint_step"] == 11 and made(st) == [1, 6, 11]
    assert steps(run_dir, "training") == list(range(1, 13))  # iterations 0-11, from the events files
    log = (run_dir / "train.log").read_text()
    assert "ChildFailed: training command exited with 1 (latest checkpoint: iteration 10)" in log
    assert "metrics from tfevents" in log


def _write_model(path: Path, it: int) -> None:
    import torch

    torch.save({"iter": it, "actor_state_dict": {}}, path)


def test_parses_real_rsl_rl_layout(tmp_path):
    logs = tmp_path / "logs" / "rsl_rl"
    a = logs / "anymal_d_flat" / "2025-03-01_10-00-00"
    b = logs / "anymal_d_flat" / "2025-03-02_09-30-00_finetune"
    c = logs / "franka_lift" / "2025-02-01_08-00-00"
    for d, its in ((a, (0, 50, 100)), (b, (9, 10)), (c, (5,))):
        (d / "params").mkdir(parents=True)
        (d / "params" / "agent.yaml").write_text("seed: 42\n")
        for it in its:
            _write_model(d / f"model_{it}.pt", it)
    (logs / "anymal_d_flat" / "det-lab-restore-1234abcd").mkdir()  # not a run: no timestamp
    (d / "model_best.pt").write_text("not an iteration")

    assert log_parsers.run_dirs(logs) == [c, a, b]
    assert log_parsers.latest_run(logs) == b and log_parsers.latest_run(logs, "anymal_d_flat") == b
    assert log_parsers.latest_model(a) == (100, a / "model_100.pt")
    assert log_parsers.latest_model(b)[0] == 10  # by iteration, not by name
    assert log_parsers.model_complete(a / "model_50.pt")
    half = a / "model_150.pt"
    half.write_bytes((a / "model_100.pt").read_bytes()[:200])  # torch.save still writing
    assert not log_parsers.model_complete(half)
    # Isaac Lab's --load_run / --checkpoint regex semantics
    assert log_parsers.checkpoint_path(logs / "anymal_d_flat", "2025-03-01", "model_50.pt") == a / "model_50.pt"
    assert log_parsers.checkpoint_path(logs / "anymal_d_flat", "2025-03-0.*", r"model_\d+.pt") == b / "model_10.pt"
    with pytest.raises(FileNotFoundError, match="no run directory"):
        log_parsers.checkpoint_path(logs / "anymal_d_flat", "2024")

    # TensorBoard scalars as rsl_rl logs them (simple_value), a TF2-style tensor scalar, and a /time axis
    w = tfevents.SummaryWriter(str(a), flush_secs=10)
    for it in range(3):
        w.add_scalar("Loss/value_function", 1.0 / (it + 1), it)
        w.add_scalar("Loss/surrogate", -0.01 * it, it)
        w.add_scalar("Train/mean_reward", 10.0 * it, it)
        w.add_scalar("Perf/total_fps", 50000 + it, it)
        w.add_scalar("Train/mean_reward/time", 10.0 * it, 7 * it)
    w.add_scalar("Episode_Reward/track_lin_vel_xy_exp", 0.75, 2, new_style=True)
    w.close()
    points = log_parsers.scalars(a)
    last = log_parsers.last_values(points)
    assert last["Loss/value_function"] == (2, pytest.approx(1 / 3))
    assert last["Train/mean_reward"] == (2, 20.0) and last["Perf/total_fps"] == (2, 50002.0)
    assert last["Train/mean_reward/time"] == (14, 20.0)
    assert last["Episode_Reward/track_lin_vel_xy_exp"] == (2, 0.75)
    assert len(points) == 16

    # tailing: a record half written is not read until it is whole; a corrupt one stops the tail
    (events,) = a.glob("events.out.tfevents.*")
    grow = b / events.name
    data = events.read_bytes()
    tail = tfevents.EventsTail(grow)
    grow.write_bytes(data[:-10])
    first = tail.poll()
    assert len(first) == 15
    grow.write_bytes(data)
    assert [(p.tag, p.step) for p in tail.poll()] == [("Episode_Reward/track_lin_vel_xy_exp", 2)]
    bad = c / events.name
    bad.write_bytes(data[:30] + bytes([data[30] ^ 0xFF]) + data[31:])
    src = log_parsers.TfEventsSource(c)
    src.poll()
    assert src.problems and "checksum" in src.problems[0]

    # det_lab's writer file: whole lines only
    jsonl = a / log_parsers.JSONL_NAME
    jsonl.write_text('{"kind": "scalar", "tag": "Loss/value_function", "value": 0.5, "step": 3}\n{"kind": "model", "iter": 3}\n{"kind": "sca')
    src = log_parsers.JsonlSource(a)
    pts, saved = src.poll()
    assert [(p.tag, p.step, p.value) for p in pts] == [("Loss/value_function", 3, 0.5)] and saved == [3]
    with open(jsonl, "a") as f:
        f.write('lar", "tag": "Train/mean_reward", "value": 1.5, "step": 4}\n')
    assert [(p.tag, p.step) for p in src.poll()[0]] == [("Train/mean_reward", 4)]


def test_isaac_lab_command_and_cache_slots(tmp_path, monkeypatch):
    root = tmp_path / "isaaclab"
    (root / commands.ISAACLAB_TRAIN).parent.mkdir(parents=True)
    (root / "isaaclab.sh").write_text("#!/bin/bash\n")
    (root / commands.ISAACLAB_TRAIN).write_text("")
    monkeypatch.delenv("ISAACLAB_PATH", raising=False)
    assert commands.isaaclab_root(str(root)) == root
    hp = {"task": "Isaac-Velocity-Flat-Anymal-D-v0", "num_envs": 4096, "save_interval": 50, "device": "cuda:0"}
    restore = Restore(tmp_path / "det-lab-restore-abcd1234", tmp_path / "det-lab-restore-abcd1234" / "model_100.pt",
                      100, "anymal_d_flat", "abcd1234-...")
    cmd = commands.isaaclab_command(root, hp, restore, 399)
    argv = " ".join(cmd.argv)
    assert argv.startswith(f"{root}/isaaclab.sh -p {root}/scripts/reinforcement_learning/rsl_rl/train.py")
    assert "--headless" in argv and "--device cuda:0" in argv and "--num_envs 4096" in argv
    assert "--max_iterations 400" in argv  # rsl_rl re-runs the restored iteration
    assert "--resume --load_run det-lab-restore-abcd1234 --checkpoint model_100.pt" in argv
    assert cmd.argv[-1] == "agent.save_interval=50" and cmd.metrics == "tfevents"
    assert cmd.env["ACCEPT_EULA"] == "Y" and cmd.env["PRIVACY_CONSENT"] == "Y"
    fresh = commands.isaaclab_command(root, hp, None, 1500)
    assert "--max_iterations 1500" in " ".join(fresh.argv) and "--resume" not in fresh.argv

    # one cache slot per concurrent job on a host; a released slot is taken again
    slot0 = commands.acquire_cache_slot(tmp_path / "cache", slots=2)
    slot1 = commands.acquire_cache_slot(tmp_path / "cache", slots=2)
    assert (slot0.name, slot1.name) == ("slot-0", "slot-1")
    with pytest.raises(RuntimeError, match="all 2 Isaac cache slots"):
        commands.acquire_cache_slot(tmp_path / "cache", slots=2)
    os.close(commands._held_locks.pop(0))
    assert commands.acquire_cache_slot(tmp_path / "cache", slots=2) == slot0
    kit = tmp_path / "isaac-sim" / "kit" / "cache"
    kit.mkdir(parents=True)
    (kit / "from-image").write_text("x")
    lines = commands.link_caches(slot0, {str(kit): "kit", str(tmp_path / "home" / ".nv" / "ComputeCache"): "compute"})
    assert kit.resolve() == slot0 / "kit" and (kit.parent / "cache.image" / "from-image").exists() and len(lines) == 2
    while commands._held_locks:
        os.close(commands._held_locks.pop())


def test_template_configs_pass_determined_schema():
    configs = sorted(TEMPLATE.glob("*.yaml"))
    assert len(configs) == 2
    expconf.assert_valid(configs)
