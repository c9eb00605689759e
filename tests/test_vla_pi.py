"""pi0 and pi0.5 trained by det_lab, checked against LeRobot 0.6.1 itself, offline.

LeRobot 0.4.4 (the newest for Python 3.11, the main test environment's) runs pi0/pi0.5 only on
its transformers fork; 0.5+ runs them on PyPI's transformers and needs Python 3.12. So these run
in the second environment tests/setup.sh makes (``.venv-lerobot06``: Python 3.12, LeRobot 0.6.1,
transformers 5.5, PyPI's torch 2.13.0): a child process (tests/pi_child.py) with a run's
environment (a lab's model store as ``HF_HOME``, offline), and ``det-lab run`` from that
environment. The policies are LeRobot's own code at a tiny size (tests/tiny_pi.py: its variant
table and the PaliGemma config it fills shrunk, nothing else changed), the PaliGemma tokenizer and
a pi0.5 base made by the tests and imported into the store with ``det-lab models import``, the
dataset written by LeRobot 0.6.1's own writer and imported with ``det-lab data import``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.child_talk import expect, finish
from tests.conftest import new_lab

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv-lerobot06" / "bin"
TINY = REPO / "tests" / "tiny_pi.py"
#: the same operations in the same order (measured: identical to the last bit)
TOL = dict(rtol=1e-6, atol=1e-7)
#: the shipped pi05.yaml shrunk for a test run (its dtype, gradient checkpointing and base kept): 3
#: steps at batch 4, a validation and a checkpoint at step 3, an LR that moves each step
RUN_SETS = [arg for item in (
    f"entrypoint=python3 -m determined.launch.torch_distributed python3 {TINY} train.py",
    "data.det_lab.dataset=pi-demo", "data.det_lab.max_length.batches=3", "min_validation_period.batches=3",
    "min_checkpoint_period.batches=3", "hyperparameters.global_batch_size=4", "hyperparameters.val_episodes=1",
    "hyperparameters.num_workers=0", "hyperparameters.torch_threads=1", "data.det_lab.reporting_batches=1",
    "hyperparameters.policy.optimizer_lr=0.001", "hyperparameters.policy.scheduler_warmup_steps=1",
    "hyperparameters.policy.scheduler_decay_steps=6") for arg in ("--set", item)]

pytestmark = pytest.mark.skipif(not (BIN / "python").is_file(), reason=(
    "needs LeRobot 0.6.1 on Python 3.12 in .venv-lerobot06, which bash tests/setup.sh makes where a "
    "Python 3.12 is installed"))


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, Any]:
    """What the child saw (its comparisons, the run's checkpoint loaded by LeRobot) and the run's record."""
    import torch

    from det_lab.models import run_environment

    work = tmp_path_factory.mktemp("pi")
    lab = new_lab(work, DET_LAB_TEMPLATES=str(REPO / "experiment_templates"))
    env = lab.env = {k: v for k, v in lab.env.items() if not k.startswith("HF_")}  # a run's own: run_environment
    child_env = {**env, "PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", "TQDM_DISABLE": "1",
                 "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 **run_environment(lab.root, writable_cache=work / "cache", env={})}
    log = work / "child.log"
    with open(log, "w") as err:
        child = subprocess.Popen([str(BIN / "python"), "-m", "tests.pi_child", str(work)], cwd=REPO, env=child_env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    run: subprocess.Popen | None = None
    try:
        lab.cli("init", check=True)
        expect(child, "made", log)
        lab.cli("models", "import", str(work / "tokenizer"), "google/paligemma-3b-pt-224", check=True)
        lab.cli("data", "import", str(work / "dataset"), "pi-demo", "--project", "vla", check=True)
        child.stdin.write("go\n")
        child.stdin.flush()
        expect(child, "base", log)
        lab.cli("models", "import", str(work / "base"), "lerobot/pi05_base", check=True)
        run = subprocess.Popen([str(BIN / "det-lab"), "run", "vla", "--local", "--exp-config",
                                str(REPO / "experiment_templates" / "vla" / "pi05.yaml"), "--run", "pi05", *RUN_SETS],
                               env={**env, "PATH": child_env["PATH"]}, cwd=work, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
        expect(child, "stepped", log)
        output = run.communicate(timeout=500)[0]
        run_dir = lab.root / "outputs" / "vla" / "local-runs" / "pi05"
        state = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
        checkpoint = lab.root / "checkpoints" / "vla" / (state.get("latest_checkpoint") or "none")
        finish(child, str(checkpoint) if checkpoint.is_dir() else "", log)
    finally:
        if child.poll() is None:
            child.kill()
        if run is not None and run.poll() is None:  # a failed wait: the run and its trial go too
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    out = torch.load(work / "seen.pt", weights_only=False)
    out.update(run={**out.get("run", {}), "code": run.returncode, "output": output, "state": state,
                    "metrics": run_dir / "metrics.jsonl"})
    return out


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_batches_equal_lerobot_0_6s_items(seen, kind):
    """det_lab's reader on a dataset LeRobot 0.6.1 wrote, with the policy's action chunk: every
    item's keys, tensors (dtype, shape, values) and task string are LeRobot's reader's."""
    batches = seen[kind]["batches"]
    assert batches["items"] == (38, 38)
    assert batches["differ"] == []
    assert batches["padded"] >= 4  # each episode's last frames pad their chunk: the masks were compared


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_first_steps_give_lerobot_0_6s_losses_and_parameters(seen, kind):
    """Three steps through det_lab against LeRobot 0.6.1's own loop on its reader, same seed: the
    same losses and parameters within ``TOL``; the neighbouring step's loss is far outside it, and
    the action expert moved (the comparison can tell a step that did nothing)."""
    import torch

    ours, theirs = seen[kind]["det_lab"]["losses"], seen[kind]["lerobot_losses"]
    print(f"\n{kind}: losses {ours}, LeRobot 0.6.1's {theirs}")
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == pytest.approx(b, rel=TOL["rtol"], abs=TOL["atol"]), step
    for step in range(len(ours) - 1):
        assert ours[step] != pytest.approx(theirs[step + 1], rel=TOL["rtol"], abs=TOL["atol"]), step
    assert {"loss", "grad_norm", "lr"} <= set(seen[kind]["det_lab"]["metric_keys"])
    mine, initial = seen[kind]["det_lab"]["params"], seen[kind]["det_lab"]["initial"]
    assert sorted(mine) == sorted(seen[kind]["lerobot_params"])
    for name, value in seen[kind]["lerobot_params"].items():
        torch.testing.assert_close(mine[name], value, **TOL, msg=name)
    moved = [n for n in mine if not torch.equal(mine[n], initial[n])]
    assert any(".gemma_expert." in n for n in moved), moved


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_exported_checkpoint_loads_with_lerobot_and_acts_as_the_trained_model(seen, kind):
    """det_lab's ``pretrained_model/`` through ``PI0Policy``/``PI05Policy.from_pretrained`` and
    LeRobot's processor loader: the trained weights to the bit, and the same action chunk on the
    same observations and noise, in the robot's units; the untrained model's chunk differs."""
    import torch

    loaded, ours = seen[kind]["loaded"], seen[kind]["det_lab"]
    assert loaded["type"] == kind
    assert sorted(loaded["params"]) == sorted(ours["params"])
    assert all(torch.equal(loaded["params"][n], ours["params"][n]) for n in ours["params"])
    assert loaded["chunk"].shape == (3, 4, 2)  # three observations, chunk_size 4, the dataset's 2 action values
    torch.testing.assert_close(loaded["chunk"], ours["chunk"], rtol=0, atol=0)
    assert ours["observation"]["task"] == ["pick up the red block", "pick up the blue block", "pick up the blue block"]


    assert not torch.allclose(ours["initial_chunk"], ours["chunk"], rtol=1e-4, atol=1e-5)


def test_pi05_on_a_dataset_without_quantiles_is_one_line_before_the_build(seen):
    """pi0.5 normalises state and action by the 1st and 99th percentiles; LeRobot's normaliser
    fails at the first batch without them (a ValueError deep in the step, after the model is
    built). det_lab refuses first, in one line naming the feature, the statistics and the fix."""
    refused = seen["no_quantiles"]
    assert refused and "\n" not in refused, refused
    assert "observation.state" in refused and "q01 or q99" in refused, refused
    assert "augment_dataset_quantile_stats" in refused, refused


# --- the shipped pi05.yaml as a run: fine-tuned from the store's base, offline -------------------------


def test_pi05_yaml_fine_tunes_the_stored_base_offline_on_python_3_12(seen):
    """``det-lab run vla --local --exp-config pi05.yaml`` from the LeRobot 0.6.1 environment,
    shrunk with ``--set`` (its bf16 ``dtype`` and gradient checkpointing kept): 3 steps reported
    once each, a validation and a checkpoint at step 3; the lineage names the base's and the
    tokenizer's revisions in the store."""
    run = seen["run"]
    assert run["code"] == 0, run["output"][-4000:]
    state = run["state"]
    assert state["status"] == "finished" and state["latest_checkpoint_step"] == 3
    assert state["hparams"]["policy"]["pretrained"] == "lerobot/pi05_base"
    records = [json.loads(line) for line in run["metrics"].read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["group"] == "training" and "loss" in r["metrics"]) == [1, 2, 3]
    (validation,) = [r["metrics"] for r in records if r["group"] == "validation"]
    assert {"val_loss", "val_action_l1", "val_action_l1_first"} <= set(validation)
    named = {m["name"]: m["revision"] for m in state["lineage"]["models"]}
    assert set(named) == {"lerobot/pi05_base", "google/paligemma-3b-pt-224"}


def test_the_runs_checkpoint_loads_with_pi05policy_as_trained(seen):
    """The run's checkpoint through ``PI05Policy.from_pretrained`` offline: the trial's own weights
    to the bit, in the config's bf16; the action expert and the vision tower moved from the base
    (pi0.5's defaults train the whole model); an action chunk of the trained size for the
    dataset's 2 action values."""
    loaded = seen["run"]
    assert loaded["same_keys"] and loaded["differ"] == [], loaded["differ"][:5]
    assert loaded["dtype"] == "bfloat16" and loaded["pretrained_path"] == "lerobot/pi05_base"
    assert any(".gemma_expert." in k for k in loaded["moved"]), loaded["moved"][:5]
    assert any(".vision_tower." in k for k in loaded["moved"]), loaded["moved"][:5]
    assert loaded["chunk_shape"] == [1, 4, 2] and loaded["chunk_finite"]
