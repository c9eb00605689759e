"""Real (tiny) trials through Determined's harness on CPU: a PyTorchTrial, a Core API loop and
the legacy module:Class form, each with a DVC dataset, checkpoints on the data root, metrics in
a real MLflow server, resume, preemption and a crash mid-checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from det_lab.settings import load_settings
from det_lab.trials.local import entry_command, sample_hparams
from det_lab.volume import init_volume
from tests.conftest import VENV_BIN, publish_tiny_data

TINY = Path(__file__).parent / "fixtures" / "tiny"


@pytest.fixture
def tiny_lab(lab, mlflow_server, tmp_path):
    """A lab with the tiny regression dataset published and MLflow as its tracker."""
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": mlflow_server.uri})
    lab.env["HOME"] = str(tmp_path / "home")  # to see that nothing lands in ~/.local/share/determined
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp_path)
    lab.mlflow = MlflowClient(mlflow_server.uri)
    return lab


def config_copy(lab, name: str, **det_lab_overrides) -> Path:
    """A copy of a fixture config with some data.det_lab or hyperparameter values changed."""
    import yaml

    conf = yaml.safe_load((TINY / name).read_text())
    for key, value in det_lab_overrides.items():
        if key in conf["hyperparameters"]:
            conf["hyperparameters"][key] = value
        else:
            conf["data"]["det_lab"][key] = value
    path = lab.config.parent / f"edited-{name}"
    path.write_text(yaml.safe_dump(conf))
    return path


def only_run(lab) -> Path:
    runs = list((lab.root / "outputs" / "vla" / "local-runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def run_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def metrics(run_dir: Path, group: str) -> list[tuple[int, dict]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["metrics"]) for m in lines if m["group"] == group]


def mlflow_run(lab, run_dir: Path):
    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    (backend,) = summary["backends"]
    assert backend["pending"] == 0, summary
    return lab.mlflow.get_run(backend["run_id"])


def history(lab, run_id: str, key: str) -> list[int]:
    return [m.step for m in sorted(lab.mlflow.get_metric_history(run_id, key), key=lambda m: m.step)]


def start_run(lab, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", *args], env=lab.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir_parent: Path, step: int, proc: subprocess.Popen, timeout: float = 120,
                  exclude: tuple[Path, ...] = ()) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for run_dir in run_dir_parent.glob("*/"):
            if run_dir in exclude or run_dir.name.startswith("."):
                continue
            ckpts = run_state(run_dir).get("checkpoints", []) if (run_dir / "run.json").exists() else []
            if any(c["step"] >= step for c in ckpts):
                return run_dir
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} within {timeout} s")


def test_pytorch_trial_end_to_end(tiny_lab):
    assert importlib.util.find_spec("tensorboard") is None  # the harness's report path must not need it
    proc = tiny_lab.cli("run", str(TINY), "--local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished" in proc.stdout
    run_dir = only_run(tiny_lab)
    state = run_state(run_dir)

    # checkpoints on the data root, not in ~/.local/share/determined, every min_checkpoint_period
    # (not at every validation, Determined's local fallback for checkpoint_policy "best")
    assert [c["step"] for c in state["checkpoints"]] == [40, 80]
    latest = tiny_lab.root / "checkpoints" / "vla" / state["latest_checkpoint"]
    assert (latest / "state_dict.pth").is_file()
    assert not (Path(tiny_lab.env["HOME"]) / ".local" / "share" / "determined").exists()
    # the checkpoint's code/ is the template, without the data volume or earlier checkpoints
    assert (latest / "code" / "train.py").is_file() and not (latest / "code" / "data").exists()

    # lineage in the checkpoint metadata
    meta = json.loads((latest / "metadata.json").read_text())
    lineage = meta["det_lab"]
    assert meta["steps_completed"] == 80
    assert lineage["dataset"]["path"] == "data/tiny-data" and lineage["dataset"]["md5"].endswith(".dir")
    assert lineage["determined_version"] == "0.38.1" and lineage["run_key"] == state["run_key"]

    # metrics kept locally and mirrored to MLflow, with lineage tags and checkpoint ids
    train = metrics(run_dir, "training")
    val = metrics(run_dir, "validation")
    assert [s for s, _ in train] == list(range(10, 81, 10))
    assert val[-1][1]["val_loss"] < val[0][1]["val_loss"]
    run = mlflow_run(tiny_lab, run_dir)
    assert history(tiny_lab, run.info.run_id, "training/loss") == list(range(10, 81, 10))
    assert history(tiny_lab, run.info.run_id, "validation/val_loss") == [20, 40, 60, 80]
    assert run.data.params["lr"] == "0.05"
    assert run.data.tags["dataset.md5"] == lineage["dataset"]["md5"]
    assert run.data.tags["det_lab.checkpoint.latest"] == state["latest_checkpoint"]
    assert run.info.status == "FINISHED"


def test_preempt_then_resume_continues_same_step_and_tracker_run(tiny_lab):
    config = config_copy(tiny_lab, "const.yaml", sleep_per_batch=0.05)
    proc = start_run(tiny_lab, "--config", str(config))
    run_dir = wait_for_step(tiny_lab.root / "outputs" / "vla" / "local-runs", 20, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: det-lab asks the trial to checkpoint and stop
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    stopped = run_state(run_dir)
    stop_step = stopped["latest_checkpoint_step"]
    assert 20 <= stop_step < 80
    first_run = mlflow_run(tiny_lab, run_dir)
    assert first_run.info.status == "KILLED"

    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = run_state(run_dir)
    assert resumed["latest_checkpoint_step"] == 80 and resumed["resumed"] == 1
    # training metrics continue after the checkpoint: each reported step once, in one tracker run
    run = mlflow_run(tiny_lab, run_dir)
    assert run.info.run_id == first_run.info.run_id and run.info.status == "FINISHED"
    steps = history(tiny_lab, run.info.run_id, "training/loss")
    assert steps == sorted(set(steps)) and steps[-1] == 80
    assert [s for s, _ in metrics(run_dir, "training") if s > stop_step][0] <= stop_step + 10


def test_resumed_losses_equal_an_uninterrupted_run(tiny_lab):
    """Same seed: a run stopped midway and resumed reports exactly the uninterrupted losses."""
    proc = tiny_lab.cli("run", str(TINY), "--local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (straight,) = list((tiny_lab.root / "outputs" / "vla" / "local-runs").iterdir())

    config = config_copy(tiny_lab, "const.yaml", sleep_per_batch=0.05)
    proc = start_run(tiny_lab, "--config", str(config))
    stopped = wait_for_step(straight.parent, 20, proc, exclude=(straight,))
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert run_state(stopped)["latest_checkpoint_step"] < 80
    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume", "--run", stopped.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected = {s: m[key] for s, m in metrics(straight, group)}
        got = {s: m[key] for s, m in metrics(stopped, group)}
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one_latest(tiny_lab):
    tiny_lab.env["TINY_CRASH_ON_CHECKPOINT"] = "2"  # dies after writing checkpoint 2's files
    proc = tiny_lab.cli("run", str(TINY), "--local")
    assert proc.returncode != 0
    assert "resume with" in proc.stdout  # the summary says how to go on
    run_dir = only_run(tiny_lab)
    state = run_state(run_dir)
    assert state["latest_checkpoint_step"] == 40 and len(state["checkpoints"]) == 1
    written = [p for p in (tiny_lab.root / "checkpoints" / "vla").iterdir()]
    assert len(written) == 2  # the half-finished checkpoint exists but is not taken as latest

    del tiny_lab.env["TINY_CRASH_ON_CHECKPOINT"]
    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_state(run_dir)["latest_checkpoint_step"] == 80
    # the crashed run validated at 20..80; the resumed one redoes 60 and 80 from checkpoint 40,
    # and the record keeps one value per step
    assert [s for s, _ in metrics(run_dir, "validation")] == [20, 40, 60, 80]


def test_core_api_loop_with_preemption_and_resume(tiny_lab):
    config = config_copy(tiny_lab, "core.yaml", sleep_per_step=0.05)
    proc = start_run(tiny_lab, "--config", str(config))
    run_dir = wait_for_step(tiny_lab.root / "outputs" / "vla" / "local-runs", 20, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    stop_step = run_state(run_dir)["latest_checkpoint_step"]
    assert 20 <= stop_step < 60

    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = run_state(run_dir)
    assert state["latest_checkpoint_step"] == 60
    run = mlflow_run(tiny_lab, run_dir)
    steps = history(tiny_lab, run.info.run_id, "training/loss")
    assert steps == sorted(set(steps)) and steps[-1] == 60
    ckpt = tiny_lab.root / "checkpoints" / "vla" / state["latest_checkpoint"]
    assert json.loads((ckpt / "state.json").read_text())["step"] == 60
    assert json.loads((ckpt / "metadata.json").read_text())["det_lab"]["dataset"]["nfiles"] == 2


def test_legacy_module_class_entrypoint(tiny_lab):
    proc = tiny_lab.cli("run", str(TINY), "--local", "--config", str(TINY / "legacy.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = run_state(only_run(tiny_lab))
    assert [c["step"] for c in state["checkpoints"]] == [20, 40]


def test_bad_input_is_one_line(tiny_lab, tmp_path):
    cases = [
        (["run", "no-such-template", "--local"], "no template or directory 'no-such-template'"),
        (["run", str(TINY)], "pass --local (here) or --slurm"),
        (["run", str(TINY), "--local", "--resume"], "no earlier local run"),
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nentrypoint: python3 train.py\ndata: {det_lab: {project: vla}}\n")
    cases.append((["run", str(TINY), "--local", "--config", str(bad)], "data.det_lab.max_length is missing"))
    bad2 = tmp_path / "bad2.yaml"
    bad2.write_text("name: x\nentrypoint: python3 train.py\ndata: {det_lab: {project: vla, datset: x}}\n")
    cases.append((["run", str(TINY), "--local", "--config", str(bad2)], "data.det_lab.datset"))
    for args, message in cases:
        proc = tiny_lab.cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_entrypoints_and_hyperparameter_samples():
    import random
    import sys

    assert entry_command("python3 -m determined.launch.torch_distributed python3 train.py --x 1") == \
        [sys.executable, "train.py", "--x", "1"]
    assert entry_command(["python3", "core_loop.py"]) == [sys.executable, "core_loop.py"]
    assert entry_command("model_def:MyTrial")[-2:] == ["det_lab.trials.legacy", "model_def:MyTrial"]
    space = {"lr": {"type": "log", "base": 10, "minval": -4, "maxval": -2}, "layers": {"type": "int", "minval": 2, "maxval": 4},
             "act": {"type": "categorical", "vals": ["relu", "gelu"]}, "fixed": {"type": "const", "val": 7},
             "optimizer": {"momentum": {"type": "double", "minval": 0.8, "maxval": 0.99}}, "plain": 3}
    hp = sample_hparams(space, random.Random(0))
    assert 1e-4 <= hp["lr"] <= 1e-2 and hp["layers"] in (2, 3, 4) and hp["act"] in ("relu", "gelu")
    assert hp["fixed"] == 7 and hp["plain"] == 3 and 0.8 <= hp["optimizer"]["momentum"] <= 0.99
    assert sample_hparams(space, random.Random(0)) == hp  # the same seed samples the same trial


def test_fixture_configs_pass_determined_schema():
    validator = Path(__file__).resolve().parents[2] / "shared" / "tools" / "validate-expconf"
    if not validator.exists():
        pytest.skip("Determined's validator (../shared/tools/validate-expconf) is not beside this checkout")
    proc = subprocess.run([str(validator), *map(str, sorted(TINY.glob("*.yaml")))], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": str(VENV_BIN / "python")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
