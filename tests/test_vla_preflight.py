"""What a run loads from the volume's model store, checked before it starts (det_lab/runs/base_models.py).

``det-lab run``'s preflight (``local.prepare``, the same for ``--slurm`` on the login node) refuses a
missing base model, pretrained policy or backbone weight file in one line naming its ``det-lab models
import``, before the GPU lease and before any run directory; a pretrained policy whose state or action
size differs from the dataset's is refused there and in the trial (``build_training``), before the
weights load; a global batch that slots x grad_accumulation does not divide is refused there too.
The Slurm and Determined sides: tests/test_slurm_run.py, tests/test_determined_templates.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import Lab
from tests.lerobot_writer import skip_without_lerobot
from tests.test_vla_policies import SPECS, TEMPLATE, _ours, offline, written  # noqa: F401 (fixtures)

pytestmark = skip_without_lerobot()



def _prepare(lab: Lab, *sets: str) -> list[tuple]:
    """``det-lab run vla --local --exp-config act.yaml --set ...``'s checks (local.prepare), stopped at
    the GPU lease: returns the lease requests it reached (none when a check refused the run first)."""
    from det_lab.settings import load_settings
    from det_lab.runs import local

    asked: list[tuple] = []

    class Leased(Exception):
        pass

    def gpu_check(*args: object) -> None:
        asked.append(args)
        raise Leased

    try:
        local.prepare(load_settings(lab.config, env={}), str(TEMPLATE), TEMPLATE / "act.yaml", False,
                      overrides=list(sets), name=f"preflight-{len(sets)}", gpu_check=gpu_check)
    except Leased:
        pass
    return asked


def test_a_base_model_backbone_or_pretrained_policy_missing_from_the_volume_is_one_line_before_the_gpus(demo_lab):
    """policy.pretrained as a hub id, data.det_lab.base_model and the backbone's ImageNet weights are
    read offline from the volume's model store: each missing one is refused by det-lab run's preflight
    with the line naming its import, before the GPU lease and before any run directory exists."""
    from det_lab.runs.validate import PreflightError

    runs = demo_lab.root / "outputs" / "vla" / "local-runs"
    before = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    cases = {
        "hyperparameters.policy.pretrained=lab/act-absent":
            ("hyperparameters.policy.pretrained: base model lab/act-absent is not on the volume",
             "det-lab models import DIR lab/act-absent"),
        "data.det_lab.base_model=HuggingFaceTB/SmolVLM2-absent":
            ("data.det_lab.base_model: base model HuggingFaceTB/SmolVLM2-absent is not on the volume",
             "det-lab models import DIR HuggingFaceTB/SmolVLM2-absent"),
        "hyperparameters.policy.pretrained_backbone_weights=ResNet18_Weights.IMAGENET1K_V1":
            ("hyperparameters.policy.pretrained_backbone_weights: torch hub weights resnet18-f37072fd.pth",
             "det-lab models import ~/.cache/torch/hub/checkpoints/resnet18-f37072fd.pth"),
    }
    for assignment, (what, fix) in cases.items():
        with pytest.raises(PreflightError) as err:
            _prepare(demo_lab, assignment)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"{TEMPLATE / 'act.yaml'}: {what}") and fix in msg, msg
    assert (sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []) == before  # nothing written
    # the neighbours pass the check and reach the GPU lease: no backbone weights, no base model
    assert len(_prepare(demo_lab, "hyperparameters.policy.pretrained_backbone_weights=null")) == 1


def test_a_dataset_whose_sizes_differ_from_the_pretrained_policys_is_one_line_and_writes_nothing(written, demo_lab,
                                                                                                    tmp_path):
    """A det_lab checkpoint's pretrained_model/ (state 3, action 2) fine-tuned on the demo dataset
    (state 4, action 4): refused in the trial (build_training, before the weights load) and in
    det-lab run's preflight (the dataset is on the volume), one line each; a same-sized dataset trains."""
    from det_lab.data import pull
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyError, build_training, dataset_meta, parse_policy
    from det_lab.settings import load_settings
    from det_lab.runs.validate import PreflightError

    training, _ = _ours(written, "act")
    pretrained = training.export(tmp_path / "checkpoint")
    demo = LeRobotDataset(pull("vla-demo", load_settings(demo_lab.config, env={}), progress=False).path)
    choice = parse_policy({**SPECS["act"], "pretrained": str(pretrained)})
    files = sorted(tmp_path.rglob("*"))
    with pytest.raises(PolicyError) as err:
        build_training(choice, dataset_meta(demo), total_steps=1)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{demo.root}: the dataset's observation.state has size [4], but "
                                              f"the pretrained model {pretrained} was trained with state size [3]"), msg
    assert sorted(tmp_path.rglob("*")) == files
    with pytest.raises(PreflightError, match=r"observation.state has size \[4\], .* state size \[3\]") as err:
        _prepare(demo_lab, f"hyperparameters.policy.pretrained={pretrained}")
    assert "\n" not in str(err.value)
    # the dataset it was trained on: built from the pretrained weights, which it holds
    again = build_training(choice, dataset_meta(LeRobotDataset(written)), total_steps=1)
    assert all(a.equal(b) for a, b in zip(again.policy.state_dict().values(), training.policy.state_dict().values()))


def test_det_lab_run_takes_the_scale_keys_with_set_and_refuses_an_uneven_split_before_the_gpus(demo_lab):
    """``det-lab run vla --local --exp-config act.yaml --set ...``'s checks: grad_accumulation 2 and
    policy.precision bf16 reach the GPU lease; grad_accumulation 3 of act.yaml's batch of 8 is one
    line before it, and no run directory is written."""
    from det_lab.runs.validate import PreflightError

    runs = demo_lab.root / "outputs" / "vla" / "local-runs"
    before = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    assert len(_prepare(demo_lab, "hyperparameters.grad_accumulation=2", "hyperparameters.policy.precision=bf16",
                        "hyperparameters.policy.pretrained_backbone_weights=null")) == 1
    with pytest.raises(PreflightError) as err:
        _prepare(demo_lab, "hyperparameters.grad_accumulation=3")
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"{TEMPLATE / 'act.yaml'}: hyperparameters.global_batch_size 8 must be a multiple of slots_per_trial x "
        "grad_accumulation = 1 x 3 = 3"), str(err.value)
    assert (sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []) == before
