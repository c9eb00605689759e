"""Real (tiny) trials through Determined's harness on CPU: a PyTorchTrial, a Core API loop and
the legacy module:Class form, each with a DVC dataset, checkpoints on the data root, metrics in
a real MLflow server, resume, preemption and a crash mid-checkpoint."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from det_lab.settings import load_settings
from det_lab.runs.local import entry_command, sample_hparams
from det_lab.volume import init_volume
from tests import expconf
from tests.conftest import VENV_BIN, Lab, publish_tiny_data
from tests.test_bad_inputs import cli as cli_in_process

TINY = Path(__file__).parent / "fixtures" / "tiny"


@pytest.fixture(scope="module")
def tiny_lab(shared_mlflow_server, tmp_path_factory) -> Lab:
    """One lab for the module, the tiny regression dataset published and MLflow as its tracker;
    each test names its own runs (``--run``) and finds them by name."""
    tmp = tmp_path_factory.mktemp("tiny-lab")
    # HOME of its own and no XDG_DATA_HOME: to see that nothing lands in ~/.local/share/determined
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER")) and k != "XDG_DATA_HOME"}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               HOME=str(tmp / "home"))
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": shared_mlflow_server.uri})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    lab.mlflow = MlflowClient(shared_mlflow_server.uri)
    return lab


@pytest.fixture(scope="module")
def straight_run(tiny_lab) -> tuple[subprocess.CompletedProcess, Path]:
    """A PyTorchTrial run of const.yaml from start to end, never interrupted: ``det-lab`` output, run dir."""
    proc = tiny_lab.cli("run", str(TINY), "--local", "--run", "straight")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, runs_dir(tiny_lab) / "straight"


def runs_dir(lab) -> Path:
    return lab.root / "outputs" / "vla" / "local-runs"


def checkpoint_dirs(lab) -> set[Path]:
    root = lab.root / "checkpoints" / "vla"
    return set(root.iterdir()) if root.is_dir() else set()


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


def held_after(lab: Lab, batches: int) -> Lab:
    """``lab`` whose tiny trials wait after ``batches`` until stopped (tests/fixtures/tiny/hold.py):
    a Ctrl-C sent once that checkpoint is recorded lands mid-run, on any machine."""
    return dataclasses.replace(lab, env={**lab.env, "TINY_HOLD_AFTER": str(batches)})


def start_run(lab, *args: str) -> subprocess.Popen:
    """``det-lab run`` in the background, taking Ctrl-C as in a terminal (even where pytest itself
    was started with SIGINT ignored, as a shell's background job is)."""
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", *args], env=lab.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_step(runs: Path, pattern: str, step: int, proc: subprocess.Popen, timeout: float = 240) -> Path:
    """The run directory matching ``pattern`` under ``runs`` once it records a checkpoint at ``step``
    or later (the trial still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for run_dir in runs.glob(pattern):
            ckpts = run_state(run_dir).get("checkpoints", []) if (run_dir / "run.json").exists() else []
            if any(c["step"] >= step for c in ckpts):
                return run_dir
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} within {timeout} s")


def test_pytorch_trial_end_to_end(tiny_lab, straight_run):
    assert importlib.util.find_spec("tensorboard") is None  # the harness's report path must not need it
    proc, run_dir = straight_run
    assert "finished" in proc.stdout
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


def test_preempt_then_resume_continues_same_step_tracker_run_and_losses(tiny_lab, straight_run):
    """Ctrl-C checkpoints and stops; ``--resume`` (the latest run) goes on from that step in the
    same tracker run and, same seed, reports exactly the losses of the uninterrupted run."""
    proc = start_run(held_after(tiny_lab, 40))  # named tiny-<time>-<random>: the other tests name theirs
    run_dir = wait_for_step(runs_dir(tiny_lab), "tiny-*", 40, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: det-lab asks the trial to checkpoint and stop
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    stopped = run_state(run_dir)
    stop_step = stopped["latest_checkpoint_step"]
    assert 40 < stop_step < 80  # a checkpoint of its own on the way out
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

    _, straight = straight_run
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected = {s: m[key] for s, m in metrics(straight, group)}
        got = {s: m[key] for s, m in metrics(run_dir, group)}
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one_latest(tiny_lab):
    crashing = dataclasses.replace(tiny_lab, env={**tiny_lab.env, "TINY_CRASH_ON_CHECKPOINT": "2"})
    before = checkpoint_dirs(tiny_lab)
    proc = crashing.cli("run", str(TINY), "--local", "--run", "crashed")  # dies after writing checkpoint 2's files
    assert proc.returncode != 0
    assert "resume with" in proc.stdout  # the summary says how to go on
    run_dir = runs_dir(tiny_lab) / "crashed"
    state = run_state(run_dir)
    assert state["latest_checkpoint_step"] == 40 and len(state["checkpoints"]) == 1
    # the half-finished checkpoint exists but is not taken as latest
    assert len(checkpoint_dirs(tiny_lab) - before) == 2

    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume", "--run", "crashed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_state(run_dir)["latest_checkpoint_step"] == 80
    # the crashed run validated at 20..80; the resumed one redoes 60 and 80 from checkpoint 40,
    # and the record keeps one value per step
    assert [s for s, _ in metrics(run_dir, "validation")] == [20, 40, 60, 80]


def test_core_api_loop_with_preemption_and_resume(tiny_lab):
    proc = start_run(held_after(tiny_lab, 20), "--exp-config", str(TINY / "core.yaml"), "--run", "core")
    run_dir = wait_for_step(runs_dir(tiny_lab), "core", 20, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    stop_step = run_state(run_dir)["latest_checkpoint_step"]
    assert 20 < stop_step < 60

    proc = tiny_lab.cli("run", str(TINY), "--local", "--resume", "--run", "core")
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
    proc = tiny_lab.cli("run", str(TINY), "--local", "--exp-config", str(TINY / "legacy.yaml"), "--run", "legacy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = run_state(runs_dir(tiny_lab) / "legacy")
    assert [c["step"] for c in state["checkpoints"]] == [20, 40]


def test_bad_input_is_one_line(tiny_lab, tmp_path):
    never_run = tmp_path / "never-run"  # a template with no local run yet
    shutil.copytree(TINY, never_run)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nentrypoint: python3 train.py\ndata: {det_lab: {project: vla}}\n")
    bad2 = tmp_path / "bad2.yaml"
    bad2.write_text("name: x\nentrypoint: python3 train.py\ndata: {det_lab: {project: vla, datset: x}}\n")
    cases = [
        (["run", "no-such-template", "--local"], "no template or directory 'no-such-template'"),
        (["run", str(TINY)], "pass --local (here) or --slurm"),
        (["run", str(never_run), "--local", "--resume"], "no earlier local run"),
        (["run", str(TINY), "--local", "--exp-config", str(bad)], "data.det_lab.max_length is missing"),
        (["run", str(TINY), "--local", "--exp-config", str(bad2)], "data.det_lab.datset"),
    ]
    # the installed console script once (nothing else reaches stderr); the rest in this process
    results = [tiny_lab.cli(*cases[0][0])] + [cli_in_process(tiny_lab, *args) for args, _ in cases[1:]]
    for (args, message), proc in zip(cases, results):
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (runs_dir(tiny_lab) / "never-run").exists() and not list(runs_dir(tiny_lab).glob(".*"))


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
    expconf.assert_valid(sorted(TINY.glob("*.yaml")))
