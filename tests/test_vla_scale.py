"""Scaling a LeRobot policy run: gradient accumulation that keeps the global batch, bf16 autocast
over fp32 weights, and searches over the policy's own keys (Determined's searcher, Optuna on Slurm).

LeRobot's own ACT at a tiny size, in this process, on the dataset LeRobot itself wrote
(tests/test_vla_policies.py's fixtures). Multi-slot runs are tests/test_trials_distributed.py's and
the Slurm tests'; bf16's speed needs a GPU and was not measured here.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import yaml

from tests import expconf
from tests.lerobot_writer import skip_without_lerobot
from tests.lerobot_loop import collate
from tests.test_vla_policies import BATCHES, SPECS, TEMPLATE, offline, written  # noqa: F401 (fixtures)

pytestmark = skip_without_lerobot()

#: ACT with nothing random in its training forward (no dropout, no VAE latent sample), so that one
#: batch and its micro-batches see the same computation
DETERMINISTIC_ACT = {**SPECS["act"], "dropout": 0.0, "use_vae": False}
SEARCH = TEMPLATE / "act-search.yaml"


def _training(root, spec: dict[str, Any], accumulation: int = 1):
    from lerobot.utils.random_utils import set_seed

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, build_training, dataset_meta, parse_policy

    frames = LeRobotDataset(root)
    set_seed(0)
    training = build_training(parse_policy(spec), dataset_meta(frames), total_steps=10, accumulation=accumulation)
    return training, PolicyFrames(frames, training.delta_indices)


# --- gradient accumulation ------------------------------------------------------------------------


def _state(training) -> dict[str, Any]:
    """Everything a step starts from: weights, the optimizer's moments, the scheduler's count."""
    import copy

    return copy.deepcopy({"policy": training.policy.state_dict(), "optimizer": training.optimizer.state_dict(),
                          "scheduler": training.scheduler.state_dict() if training.scheduler else None})


def _steps(training, batches, starts: list[dict] | None = None) -> tuple[list[float], list[dict], list[dict], list[dict]]:
    """Each step's loss, its gradients before clipping (ACT's clipping to norm 10 would hide a wrong
    scale), the parameters after it, and the state it started from; with ``starts``, step ``i`` starts
    from ``starts[i]`` (another run's state at that point) instead of where step ``i - 1`` left off."""
    grads: list[dict] = []

    def step_optimizer(optimizer, clip) -> None:
        grads.append({n: p.grad.clone() for n, p in training.policy.named_parameters() if p.grad is not None})
        clip(None)
        optimizer.step()
        optimizer.zero_grad()

    losses, states, before = [], [], []
    for i, batch in enumerate(batches):
        if starts is not None:
            training.policy.load_state_dict(starts[i]["policy"])
            training.optimizer.load_state_dict(starts[i]["optimizer"])
            if training.scheduler:
                training.scheduler.load_state_dict(starts[i]["scheduler"])
        before.append(_state(training))
        losses.append(float(training.train_step(batch, step_optimizer=step_optimizer)["loss"]))
        states.append({k: v.detach().clone() for k, v in training.policy.state_dict().items()})
    return losses, grads, states, before


def _close(a: dict, b: dict, **tol) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.allclose(a[n], b[n], **tol) for n in a)


def test_accumulated_micro_batches_give_the_whole_batchs_step(written):
    """Two steps of 8 samples, as 4 micro-batches of 2, each from the whole-batch run's state before
    that step (weights, Adam's moments, the schedule), against the steps on the whole batches: the
    same losses, gradients (to 2e-6 of gradients up to ~3; measured: 9.5e-7) and parameters (to
    1e-4, of Adam steps of lr = 1e-3; measured: 1.6e-5), while the neighbouring steps' gradients
    (~3 apart) and parameters (1e-3 apart) fail those tolerances. Parameters need the looser bound:
    where a gradient is rounding noise (an attention key bias's, which softmax ignores), Adam moves
    the weight by lr x g / (|g| + eps) for that noise g, whatever the summation order made it. Each
    step starts from the reference's state because that noise does not stay small: chained, the
    second step's gradients were 2.2e-4 and its parameters 4.5e-4 apart on one torch thread (2.9e-6
    and 2.4e-5 on two), the same drift two ranks showed (experiment_templates/vla/README.md)."""
    whole, items = _training(written, DETERMINISTIC_ACT)
    batches = [collate([items[i] for i in b]) for b in BATCHES]
    losses, grads, states, before = _steps(whole, batches)
    initial = before[0]["policy"]
    grad_tol, param_tol = dict(rtol=1e-5, atol=2e-6), dict(rtol=0, atol=1e-4)
    for k in (4,):  # (2 passes too; 4 is the harder split, and one is enough for the suite's time)
        acc, _ = _training(written, DETERMINISTIC_ACT, accumulation=k)
        acc_losses, acc_grads, acc_states, _ = _steps(acc, batches[:2], starts=before)
        assert acc_losses == pytest.approx(losses[:2], rel=1e-6), k
        for step in range(2):
            assert _close(acc_grads[step], grads[step], **grad_tol), (k, step)
            assert _close(acc_states[step], states[step], **param_tol), (k, step)
            for other in {0, 1, 2} - {step}:  # another step's gradients and parameters are told apart
                assert not _close(acc_grads[step], grads[other], **grad_tol), (k, step, other)
            for other in ([initial] + states)[step], states[step + 1]:
                assert not _close(acc_states[step], other, **param_tol), (k, step)
        assert acc.optimizer.state[acc.policy.model.action_head.weight]["step"] == 2  # one step per batch


def test_global_batch_split_by_slots_and_accumulation_or_one_line():
    """Determined's rule, per slot = global / slots, then / grad_accumulation; a global batch that
    slots x accumulation does not divide is one line, in det_lab's preflight too."""
    from det_lab.runs.expconf import ExpConfError, micro_batch_size
    from det_lab.runs.validate import PreflightError, check_config

    assert micro_batch_size(64, 2, 4) == 8 and micro_batch_size(8, 1, 1) == 8
    with pytest.raises(ExpConfError) as err:
        micro_batch_size(24, 2, 8)
    assert "\n" not in str(err.value) and "multiple of slots_per_trial x grad_accumulation = 2 x 8 = 16" in str(err.value)
    conf = yaml.safe_load(SEARCH.read_text())
    conf["resources"]["slots_per_trial"], conf["hyperparameters"]["grad_accumulation"] = 2, 2
    check_config(conf, "act-search.yaml")  # 8 = 2 slots x 2 micro-batches of 2
    conf["hyperparameters"]["grad_accumulation"] = 3
    with pytest.raises(PreflightError) as err:
        check_config(conf, "act-search.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith(
        "act-search.yaml: hyperparameters.global_batch_size 8 must be a multiple of")


# --- bf16 autocast --------------------------------------------------------------------------------


def test_bf16_autocast_trains_over_fp32_weights(written):
    """policy.precision bf16: the forward's matmuls run in bf16 (a hook sees bf16 activations),
    the weights and Adam's moments stay fp32, the loss is finite and falls over a few steps on one
    batch, and validation runs under autocast too."""
    import torch

    training, items = _training(written, {**SPECS["act"], "precision": "bf16"})
    seen: list[torch.dtype] = []
    training.policy.model.action_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    batch = collate([items[i] for i in BATCHES[0]])
    losses = [float(training.train_step(batch)["loss"]) for _ in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0], losses
    assert set(seen) == {torch.bfloat16}
    assert {p.dtype for p in training.policy.parameters()} == {torch.float32}
    moments = [s["exp_avg"].dtype for s in training.optimizer.state.values()]
    assert moments and set(moments) == {torch.float32}
    seen.clear()
    val = training.evaluate(batch)
    assert seen == [torch.bfloat16] and math.isfinite(float(val["val_action_l1"]))
    fp32, _ = _training(written, SPECS["act"])  # the switch is what turns autocast on
    seen.clear()
    fp32.policy.model.action_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    fp32.train_step(batch)
    assert seen == [torch.float32]


def test_unsupported_precisions_are_one_line(written):
    """fp16, bf16 on the det_lab model, and bf16 autocast over a pi0.5 whose weights are bf16
    (policy.dtype bfloat16): one line each, refused before any policy is built."""
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyError, build_training, dataset_meta, parse_policy

    with pytest.raises(PolicyError, match=r"^hyperparameters.policy.precision must be fp32 or bf16 .*'fp16'$"):
        parse_policy({"name": "act", "precision": "fp16"})
    with pytest.raises(PolicyError, match="precision is for LeRobot policies; the det_lab model's switch is "
                                          "hyperparameters.bf16"):
        parse_policy({"name": "det_lab", "precision": "bf16"})
    with pytest.raises(PolicyError) as err:
        build_training(parse_policy({"name": "pi05", "dtype": "bfloat16", "precision": "bf16"}),
                       dataset_meta(LeRobotDataset(written)), total_steps=1)
    assert "\n" not in str(err.value) and "pi05's dtype: bfloat16 keeps them in bf16" in str(err.value)


# --- searches over the policy's keys --------------------------------------------------------------


def _act_config(policy: dict[str, Any]) -> Any:
    from det_lab.policies import parse_policy
    from det_lab.policies.training import make_config

    return make_config(parse_policy(policy), "cpu")


def test_act_search_samples_reach_lerobots_act_config(offline):
    """act-search.yaml passes det_lab's checks and Determined 0.38.1's validator; the master
    stand-in's adaptive ASHA samples policy.chunk_size and policy.optimizer_lr, and each sample
    parsed as the trial parses it builds an ACTConfig (and optimizer preset) carrying them; so does
    the one sample of ``det-lab run --local``."""
    from det_lab.runs.local import sample_hparams
    from det_lab.runs.validate import check_config
    from tests.standin.searcher import Create, make_searcher

    expconf.assert_valid([SEARCH])
    conf = yaml.safe_load(SEARCH.read_text())
    check_config(conf, str(SEARCH))
    creates = [a for a in make_searcher(conf, 11).start() if isinstance(a, Create)]
    assert creates
    sampled = set()
    for create in creates:
        policy = create.hparams["policy"]
        cfg = _act_config(policy)
        assert type(cfg).__name__ == "ACTConfig"
        assert cfg.chunk_size == policy["chunk_size"] and 5 <= cfg.chunk_size <= 20
        assert cfg.optimizer_lr == policy["optimizer_lr"] and 10 ** -4.5 <= cfg.optimizer_lr <= 1e-3
        assert cfg.get_optimizer_preset().lr == policy["optimizer_lr"]
        assert cfg.dim_model == 64 and cfg.n_action_steps == 5  # the constants too
        sampled.add((cfg.chunk_size, cfg.optimizer_lr))
    assert len(sampled) == len(creates) > 1  # samples, not the config's defaults
    local = sample_hparams(conf["hyperparameters"], random.Random(5))["policy"]  # det-lab run --local's one sample
    cfg = _act_config(local)
    assert (cfg.chunk_size, cfg.optimizer_lr) == (local["chunk_size"], local["optimizer_lr"]) not in sampled


def test_optuna_search_on_slurm_takes_policy_keys_as_dimensions(offline):
    """det_lab's Optuna translation (det_lab/slurm/search.py) of act-search.yaml: the policy's keys
    are dimensions named by their dotted path, and the suggested values reach ACTConfig."""
    import optuna

    from det_lab.slurm.search import check_searcher, pruner_for, suggest

    conf = yaml.safe_load(SEARCH.read_text())
    searcher = check_searcher(conf, str(SEARCH))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3), pruner=pruner_for(searcher))
    seen = set()
    for _ in range(3):
        trial = study.ask()
        hparams = suggest(trial, conf["hyperparameters"])
        assert set(trial.params) == {"policy.chunk_size", "policy.optimizer_lr"}
        cfg = _act_config(hparams["policy"])
        assert cfg.chunk_size == trial.params["policy.chunk_size"] and 5 <= cfg.chunk_size <= 20
        assert cfg.optimizer_lr == trial.params["policy.optimizer_lr"] and 10 ** -4.5 <= cfg.optimizer_lr <= 1e-3
        assert hparams["policy"]["name"] == "act" and hparams["global_batch_size"] == 8
        seen.add((cfg.chunk_size, cfg.optimizer_lr))
    assert len(seen) == 3
