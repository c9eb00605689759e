"""LeRobot's ACT through ``det experiment create``: on one slot (its scalars at the master, LeRobot's
pretrained_model/ in each checkpoint), on two ranks through Determined's ``torch_distributed`` launcher,
and the checks only a trial makes (a config that ``det experiment create`` sends past det-lab's preflight).

Determined 0.38.1's whole chain in the task stand-in (tests/test_determined_templates.py's
:class:`DetCluster`: the master stand-in, one agent of five CPU slots, bubblewrap, the 0.38.1 harness):
``resources.slots_per_trial: 2`` starts two processes under torchrun (gloo on CPU);
``PyTorchTrialContext.wrap_model`` wraps the policy in DistributedDataParallel
(harness/determined/pytorch/_pytorch_context.py:285-299), each rank reads ``global_batch_size / 2``
samples of every global batch (pytorch/samplers.py:74-119 DistributedBatchSampler), and only the chief
reports metrics and writes checkpoints (pytorch/_pytorch_trial.py:586-593, 233-262). The reference is
the same experiment with one slot: the global batch of 8 on one process. ACT here has nothing random in its
training forward (no dropout, no VAE latent sample: the ranks draw from one seed, one process from
one stream), so the two runs compute the same thing in another summation order.

The Slurm path (``det-lab run --slurm`` with ``slots_per_trial: 2``: det_lab/slurm/job.py starts the
same ``train.py`` under torchrun, :func:`det_lab.trials.distributed.off_cluster_distributed`) trains the
same ``VLATrial`` code under the same harness controller; its ranks and chief are
tests/test_slurm_run.py's ``test_two_slots_train_one_run_as_two_ranks``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests import torchvision_shim
from tests.lerobot_writer import skip_without_lerobot
from tests.test_determined_templates import (
    DET,
    DetCluster,
    _check_one_trial,
    _checkpoint_dirs,
    _expconf,
    _master_metrics,
    _mlflow_history,
)
from tests.test_task_chain import harness_wheels  # noqa: F401  (a fixture: the 0.38.1 harness wheel)
from tests.test_task_standin import lab  # noqa: F401  (a fixture: the lab, its users and volume)

pytestmark = skip_without_lerobot()

STEPS = 3
#: parameters: the two-rank run within this of the one-process run at the same step, while the
#: one-process run's neighbouring step is further (Adam moves each weight ~lr = 3e-4 a step)
PARAM_TOL = 3e-5  # measured: 3.2e-6 (an attention bias), against 3.0e-4 to the reference's step 2
LOSS_TOL = 1e-5  # relative; measured 1.0e-7, while one step's loss differs from the next by 1.8 % or more


def _act(slots: int, checkpoint_every: int, **hparams: Any) -> dict[str, Any]:
    """act.yaml, shrunk, deterministic, on ``slots`` slots: STEPS steps, every training report kept."""
    conf = _expconf("vla", "act.yaml", dataset="grasp-frames", max_length={"batches": STEPS}, reporting_batches=1)
    conf["min_validation_period"], conf["min_checkpoint_period"] = {"batches": STEPS}, {"batches": checkpoint_every}
    conf["resources"]["slots_per_trial"] = slots
    conf["reproducibility"] = {"experiment_seed": 7}  # the same trial seed for both runs
    conf["hyperparameters"].update(val_episodes=1, torch_threads=1, **hparams)
    conf["hyperparameters"]["policy"].update(dim_model=32, dim_feedforward=64, n_encoder_layers=1,
                                             dropout=0.0, use_vae=False)
    return conf


@pytest.fixture(scope="module")
def cluster(lab, harness_wheels, shared_mlflow_server):  # noqa: F811
    if not DET.exists():
        pytest.skip("needs Determined's det CLI")
    cluster = DetCluster(lab, harness_wheels, shared_mlflow_server.uri, slots=5)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def experiments(cluster) -> dict[str, int]:
    """Three experiments submitted together (2 + 1 + 2 slots: side by side on the agent)."""
    confs = {"two": _act(2, STEPS), "one": _act(1, 2), "odd_batch": _act(2, STEPS, global_batch_size=9)}
    return {name: cluster.create("vla", copy.deepcopy(conf)) for name, conf in confs.items()}


def _weights(path: Path) -> dict[str, Any]:
    torchvision_shim.install()  # this process imports LeRobot's ACT too
    from lerobot.policies.act.modeling_act import ACTPolicy

    return ACTPolicy.from_pretrained(path / "pretrained_model").state_dict()


def _losses(cluster: DetCluster, trial: Any) -> list[float]:
    return [values["loss"] for _, values in _master_metrics(cluster, trial)["training"]]


def _gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def test_two_ranks_train_act_to_one_processs_weights_and_only_the_chief_saves_and_mirrors(cluster, experiments):
    """Each step's loss (the ranks' mean, reported by the chief) and the step-3 weights of the two-rank
    trial are the one-process trial's at step 3 (weights within 3e-5, measured 3.2e-6; step 2's
    are 3.0e-4 away); one checkpoint, by the chief, whose pretrained_model/ ACTPolicy.from_pretrained loads to the
    weights Determined saved (DDP's ``module.`` names); every metric once at the master and in MLflow."""
    import torch

    two = _check_one_trial(cluster, experiments["two"], "checkpoints/vla")  # once each, equal to MLflow's
    one = _check_one_trial(cluster, experiments["one"], "checkpoints/vla")
    assert two.seed == one.seed
    logs = cluster.det("trial", "logs", str(two.id)).stdout
    assert "[rank=0]" in logs and "[rank=1]" in logs  # two processes trained (ship_logs.py's rank prefix)

    assert [s for s, _ in _master_metrics(cluster, two)["training"]] == list(range(1, STEPS + 1))
    losses = [_losses(cluster, t) for t in (two, one)]
    assert losses[0] == pytest.approx(losses[1], rel=LOSS_TOL)
    assert losses[0][1:] != pytest.approx(losses[1][:-1], rel=LOSS_TOL)  # the neighbouring step's are not

    (ckpt,) = _checkpoint_dirs(cluster, two, "checkpoints/vla")
    assert ckpt[0].metadata["steps_completed"] == STEPS
    ref = {c.metadata["steps_completed"]: _weights(path) for c, path in _checkpoint_dirs(cluster, one, "checkpoints/vla")}
    assert sorted(ref) == [2, STEPS]
    got = _weights(ckpt[1])
    gap, neighbour = _gap(got, ref[STEPS]), _gap(got, ref[2])
    assert gap <= PARAM_TOL < neighbour, (gap, neighbour)

    # the chief's checkpoint alone: Determined's state dict (DDP-wrapped: module.<name>) is the export's
    saved = torch.load(ckpt[1] / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
    assert sorted(saved) == sorted(f"module.{k}" for k in got)
    assert all(torch.equal(saved[f"module.{k}"], v) for k, v in got.items())
    storage = cluster.lab.data / "checkpoints" / "vla"
    listed = {c.uuid for c in cluster.master.state.checkpoints.values()} | {cluster.master.cluster_id}
    assert {p.name for p in storage.iterdir()} <= listed  # nothing beside the master's checkpoints (and tensorboard's)
    mirrored = _mlflow_history(cluster, two)  # the chief's mirror alone: each step of each metric once
    assert all(len(h) == len({s for s, _ in h}) for h in mirrored.values())
    assert sorted(s for s, _ in mirrored["training/loss"]) == list(range(1, STEPS + 1))


def test_one_slot_act_reports_its_scalars_and_each_checkpoint_holds_lerobots_pretrained_model(cluster, experiments):
    """LeRobot's ACT (act.yaml, shrunk) on one slot through Determined's whole chain: COMPLETED; the
    policy's own scalars (loss, l1_loss; its kld_loss comes with the VAE, off here: the Slurm job and
    tests/test_vla_policies.py report it) with grad_norm and lr in every training report at the master,
    each step once and equal to MLflow's; each checkpoint on the volume holds LeRobot's pretrained_model/,
    which ACTPolicy.from_pretrained loads to exactly the weights Determined saved at that step."""
    import torch

    one = _check_one_trial(cluster, experiments["one"], "checkpoints/vla")
    metrics = _master_metrics(cluster, one)
    assert [s for s, _ in metrics["training"]] == list(range(1, STEPS + 1))
    assert [s for s, _ in metrics["validation"]] == [STEPS]
    for _, values in metrics["training"]:
        assert {"loss", "l1_loss", "grad_norm", "lr"} <= set(values), values
    ckpts = sorted(_checkpoint_dirs(cluster, one, "checkpoints/vla"), key=lambda c: c[0].metadata["steps_completed"])
    assert [c.metadata["steps_completed"] for c, _ in ckpts] == [2, STEPS]
    weights = []
    for ckpt, path in ckpts:
        assert {"pretrained_model/config.json", "pretrained_model/model.safetensors",
                "pretrained_model/policy_preprocessor.json"} <= set(ckpt.resources), sorted(ckpt.resources)
        loaded = _weights(path)
        saved = torch.load(path / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
        assert sorted(loaded) == sorted(saved)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), path
        weights.append(loaded)
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # step 2's and 3's differ


def _refused(cluster: DetCluster, exp_id: int) -> list[str]:
    """The trial ended ERROR before any metric or checkpoint; its ranks' ``error:`` lines."""
    assert cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "ERROR", cluster.task_output(exp_id)
    (trial,) = cluster.trials(exp_id)
    assert not _master_metrics(cluster, trial) and not _checkpoint_dirs(cluster, trial, "checkpoints/vla")
    logs = cluster.det("trial", "logs", str(trial.id)).stdout
    return [ln.split("error: ", 1)[1] for ln in logs.splitlines() if "error: " in ln]


def test_a_global_batch_the_slots_do_not_divide_ends_the_trial_in_one_line(cluster, experiments):
    """det-lab run refuses it before a run; under det experiment create the trial does, from the
    configured batch: Determined itself only warns and trains on 8 (determined/util.py:313-345)."""
    lines = _refused(cluster, experiments["odd_batch"])
    assert lines and set(lines) == {"hyperparameters.global_batch_size 9 must be a multiple of slots_per_trial x "
                                    "grad_accumulation = 2 x 1 = 2 (each slot trains global / slots samples per "
                                    "step, in grad_accumulation equal micro-batches)"}, lines

