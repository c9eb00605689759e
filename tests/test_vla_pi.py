"""pi0 and pi0.5 trained by det_lab, checked against LeRobot 0.6.1 itself, offline.

LeRobot 0.4.4 (the newest for Python 3.11, the main test environment's) runs pi0/pi0.5 only on
its transformers fork; 0.5+ runs them on PyPI's transformers and needs Python 3.12. So these run
in a child process in the second environment tests/setup.sh makes (``.venv-lerobot06``: Python
3.12, LeRobot 0.6.1, transformers 5.5, PyPI's torch 2.13.0), with a run's environment (the
model store of a lab as ``HF_HOME``, offline): tests/pi_child.py. The policies are LeRobot's own
code at a tiny size (tests/tiny_pi.py: its variant table and the PaliGemma config it fills shrunk,
nothing else changed), the PaliGemma tokenizer a word-level one made by the tests and imported
into the store by det_lab, the dataset written by LeRobot 0.6.1's own writer.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-lerobot06" / "bin" / "python"
#: the same operations in the same order (measured: identical to the last bit)
TOL = dict(rtol=1e-6, atol=1e-7)

pytestmark = pytest.mark.skipif(not PYTHON.is_file(), reason=(
    "needs LeRobot 0.6.1 on Python 3.12 in .venv-lerobot06, which bash tests/setup.sh makes where a "
    "Python 3.12 is installed"))


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, Any]:
    import torch

    from det_lab.models import run_environment

    work = tmp_path_factory.mktemp("pi")
    data_root = work / "data"
    env = {"PATH": f"{PYTHON.parent}:/usr/bin:/bin", "HOME": str(work / "home"), "TQDM_DISABLE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **run_environment(data_root, writable_cache=work / "cache", env={})}
    done = subprocess.run([str(PYTHON), "-m", "tests.pi_child", str(work), str(data_root)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-4000:]
    return torch.load(work / "seen.pt", weights_only=False)


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
