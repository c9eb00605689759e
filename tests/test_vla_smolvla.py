"""SmolVLA fine-tuned from its base in the lab's model store, checked against LeRobot itself, offline.

A tiny random SmolVLA base and the SmolVLM it names (tests/tiny_smolvla.py: the same files as
``lerobot/smolvla_base`` and ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``, a few thousand
parameters) are imported with ``det-lab models import`` as a user imports downloaded snapshots;
``det-lab run vla --local --exp-config smolvla.yaml`` (the shipped config, shrunk with ``--set``)
fine-tunes it with the hub ids resolved from the store under ``HF_HUB_OFFLINE=1``. A child process
with a run's environment (LeRobot reads ``HF_HOME`` at import) steps det_lab and LeRobot's own
loop side by side and loads the run's checkpoint with LeRobot. The shipped smolvla.yaml and
pi05.yaml pass det_lab's config checks and LeRobot's policy config factory.

One module fixture drives it all, overlapping the run with the child's steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.child_talk import expect, finish
from tests.conftest import VENV_BIN, Lab
from tests.lerobot_writer import skip_without_lerobot
from tests.smolvla_models import child_env, run_sets
from tests.tiny_smolvla import BASE_CAMERA, BASE_ID, BASE_KEYS, CAMERA, VLM_ID

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "experiment_templates" / "vla"
SHIM = REPO / "tests" / "torchvision_shim.py"
#: the same operations in the same order (measured: identical to the last bit)
TOL = dict(rtol=1e-6, atol=1e-7)
RUN_SETS = ("--set", f"entrypoint=python3 -m determined.launch.torch_distributed python3 {SHIM} train.py",
            *run_sets())

pytestmark = [skip_without_lerobot(),
              pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m in ("transformers", "num2words")),
                                 reason="needs transformers and num2words (SmolVLA's VLM): pip install -e '.[test]'")]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _run(lab: Lab, env: dict[str, str], name: str, *sets: str) -> subprocess.Popen:
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", "vla", "--local", "--exp-config",
                             str(TEMPLATE / "smolvla.yaml"), "--run", name, *sets], env={**lab.env, **env},
                            cwd=lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def smolvla(demo_lab: Lab, tmp_path_factory) -> dict[str, Any]:
    """What the user's path and the child saw: a run before the import (the base missing), the
    imports, the fine-tune's run, the child's steps and checkpoint loads."""
    import torch

    from det_lab.data import pull
    from det_lab.settings import load_settings

    work = tmp_path_factory.mktemp("smolvla")
    settings = load_settings(demo_lab.config, env={})
    env = {**child_env(settings.data_root, work), "DET_LAB_CONFIG": str(demo_lab.config)}
    log = work / "child.log"
    with open(log, "w") as err:
        child = subprocess.Popen([sys.executable, "-m", "tests.tiny_smolvla", str(work)], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        before = _tree(demo_lab.root)
        missing = _run(demo_lab, {}, "smolvla-missing", *RUN_SETS)
        out = {"missing": {"output": missing.communicate(timeout=300)[0], "code": missing.returncode,
                           "written": sorted(set(_tree(demo_lab.root)) - set(before))}}
        expect(child, "made", log)
        for src, name in (("vlm", VLM_ID), ("base", BASE_ID)):
            demo_lab.cli("models", "import", str(work / src), name, check=True)
        run = _run(demo_lab, {}, "smolvla", *RUN_SETS)
        child.stdin.write("go\n")
        child.stdin.flush()
        expect(child, "stepped", log)
        out["run"] = {"output": run.communicate(timeout=500)[0], "code": run.returncode}
        run_dir = demo_lab.root / "outputs" / "vla" / "local-runs" / "smolvla"
        state = json.loads((run_dir / "run.json").read_text())
        checkpoint = demo_lab.root / "checkpoints" / "vla" / (state.get("latest_checkpoint") or "none")
        dataset = pull("vla-demo", settings, progress=False).path
        request = {"checkpoint": str(checkpoint), "hparams": state["hparams"], "dataset": str(dataset)}
        finish(child, json.dumps(request) if checkpoint.is_dir() else "", log)
    finally:
        if child.poll() is None:
            child.kill()
    out.update(state=state, run_dir=run_dir, checkpoint=checkpoint,
               seen=torch.load(work / "seen.pt", weights_only=False))
    return out


# --- the fine-tune: det_lab's steps are LeRobot's -------------------------------------------------


def test_first_fine_tune_steps_give_lerobots_losses_and_parameters(smolvla):
    """Three steps from the stored base through det_lab (its reader, build and step) against
    LeRobot's own loop on LeRobot's reader, same seed: the same losses and parameters within
    ``TOL``; the neighbouring step's loss is far outside it, and the steps moved the weights."""
    import torch

    seen = smolvla["seen"]
    ours, theirs = seen["det_lab"]["losses"], seen["lerobot_losses"]
    print(f"\nsmolvla: losses {ours}, LeRobot's {theirs}")
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == pytest.approx(b, **{"rel": TOL["rtol"], "abs": TOL["atol"]}), step
    for step in range(len(ours) - 1):
        assert ours[step] != pytest.approx(theirs[step + 1], rel=TOL["rtol"], abs=TOL["atol"]), step
        assert ours[step + 1] != pytest.approx(theirs[step], rel=TOL["rtol"], abs=TOL["atol"]), step
    assert {"loss", "grad_norm", "lr"} <= set(seen["det_lab"]["metric_keys"])
    mine, initial = seen["det_lab"]["params"], seen["det_lab"]["initial"]
    assert sorted(mine) == sorted(seen["lerobot_params"])
    for name, value in seen["lerobot_params"].items():
        torch.testing.assert_close(mine[name], value, **TOL, msg=name)
    moved = [n for n in mine if not torch.equal(mine[n], initial[n])]
    assert any(n.startswith("model.vlm_with_expert.lm_expert.") for n in moved), moved  # the action expert trained
    assert not any(".vision_model." in n for n in moved)  # the frozen vision encoder did not


# --- the run: the shipped config fine-tunes from the store, offline --------------------------------


def test_smolvla_yaml_fine_tunes_the_stored_base_offline(smolvla):
    state, run_dir = smolvla["state"], smolvla["run_dir"]
    assert smolvla["run"]["code"] == 0, smolvla["run"]["output"][-3000:]
    assert state["status"] == "finished" and state["latest_checkpoint_step"] == 3
    assert state["hparams"]["policy"]["pretrained"] == BASE_ID
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["group"] == "training" and "loss" in r["metrics"]) == [1, 2, 3]
    (validation,) = [r["metrics"] for r in records if r["group"] == "validation"]
    assert {"val_loss", "val_action_l1", "val_action_l1_first"} <= set(validation)
    # the lineage names the revisions of the base and its VLM the store served
    from det_lab.models import ModelStoreLayout

    named = {m["name"]: m["revision"] for m in state["lineage"]["models"]}
    assert set(named) == {BASE_ID, VLM_ID} and all(len(r) == 40 for r in named.values())
    store = ModelStoreLayout(run_dir.parents[3] / "models")  # <data root>/outputs/vla/local-runs/<run>
    for name, revision in named.items():
        assert (store.repo(name) / "snapshots" / revision / "config.json").is_file()


def test_checkpoint_loads_with_lerobot_and_acts_as_the_trial_did(smolvla):
    """The checkpoint's pretrained_model/ through SmolVLAPolicy.from_pretrained and LeRobot's
    processor loader gives the trial's action chunk (its state_dict.pth through det_lab), to the
    bit, on the same observations and noise; the base's chunk differs (the weights moved)."""
    import torch

    chunks = smolvla["seen"]["checkpoint"]
    assert chunks["loaded"].shape == (3, BASE_KEYS["chunk_size"], 4)
    torch.testing.assert_close(chunks["loaded"], chunks["trial"], rtol=0, atol=0)
    assert not torch.allclose(chunks["base"], chunks["trial"], rtol=1e-4, atol=1e-5)


def test_checkpoint_names_the_base_and_its_vlm_by_hub_id(smolvla):
    """Portable: no local path (the store, the volume, a temporary directory) in the files
    LeRobot reads back; the VLM and its tokenizer by hub id, resolved on the robot's computer."""
    pretrained = smolvla["checkpoint"] / "pretrained_model"
    config = json.loads((pretrained / "config.json").read_text())
    assert config["type"] == "smolvla" and config["vlm_model_name"] == VLM_ID
    assert config["pretrained_path"] == BASE_ID
    steps = json.loads((pretrained / "policy_preprocessor.json").read_text())["steps"]
    (tokenizer,) = [s["config"] for s in steps if s.get("registry_name") == "tokenizer_processor"]
    assert tokenizer["tokenizer_name"] == VLM_ID

    def strings(node: Any):
        if isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str):
            yield node

    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        paths = [s for s in strings(json.loads((pretrained / name).read_text())) if s.startswith(("/", "~", "."))]
        assert paths == [], (name, paths)


# --- bad input: one line, nothing written -----------------------------------------------------------


def test_a_base_missing_from_the_store_is_one_line_naming_the_import(smolvla):
    missing = smolvla["missing"]
    assert missing["code"] not in (0, None)
    lines = [line for line in missing["output"].splitlines() if line.strip()]
    assert len(lines) == 1, missing["output"]
    assert BASE_ID in lines[0] and "det-lab models import" in lines[0], lines[0]
    assert missing["written"] == []


def test_state_and_action_wider_than_the_base_takes_are_one_line(smolvla):
    refused = smolvla["seen"]["det_lab"]["refused"]["wide"]
    assert refused and "\n" not in refused, refused
    assert "observation.state" in refused and BASE_ID in refused and "[9]" in refused, refused


def test_cameras_named_otherwise_than_the_bases_without_a_rename_map_are_one_line(smolvla):
    """The fine-tune above maps the dataset's camera to the base's (policy.rename_map); without
    the map LeRobot's make_policy would refuse it with a traceback: det_lab says it first, in one line."""
    refused = smolvla["seen"]["det_lab"]["refused"]["cameras"]
    assert refused and "\n" not in refused, refused
    assert CAMERA in refused and BASE_CAMERA in refused and "rename_map" in refused, refused


# --- the shipped configs ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smolvla.yaml", "pi05.yaml"])
def test_shipped_vla_configs_pass_det_labs_checks_and_lerobots_config_factory(smolvla, name):
    """det_lab's config checks (Determined's rules, det_lab's section; what a run loads from the
    store, named before it starts) and LeRobot's ``make_policy_config`` taking the policy keys (the
    dataclass only: no 450 M or 4 B model is built). smolvla.yaml's keys also apply over the
    stored base's config.json, as a run applies them."""
    from det_lab.policies import parse_policy
    from det_lab.runs.base_models import needs_of
    from det_lab.runs.validate import check_config

    conf = yaml.safe_load((TEMPLATE / name).read_text())
    check_config(conf, name)
    choice = parse_policy(conf["hyperparameters"]["policy"])
    kind = {"smolvla.yaml": "smolvla", "pi05.yaml": "pi05"}[name]
    assert choice.type == kind and isinstance(choice.pretrained, str)  # a hub id, served by the store
    needed = {n.name for n in needs_of(conf)}
    assert {choice.pretrained, *conf["data"]["det_lab"]["base_model"]} <= needed
    if kind == "pi05":
        assert "google/paligemma-3b-pt-224" in needed  # its processor's fixed tokenizer
    seen = smolvla["seen"]["configs"][name]
    assert seen["type"] == kind and set(choice.overrides) <= set(seen["fields"])
    for key, value in choice.overrides.items():
        assert seen["keys"][key] == value, key
        if kind == "smolvla":
            assert seen["from_store"][key] == value, key
    if kind == "smolvla":
        assert seen["from_store"]["vlm_model_name"] == VLM_ID and seen["from_store"]["pretrained_path"] == BASE_ID


def test_pi05_yaml_without_lerobots_transformers_fork_is_refused_in_one_line_before_a_run_starts():
    """LeRobot 0.4.4's pi0/pi0.5 build only on its transformers fork; with PyPI's, LeRobot fails
    after building the whole model ("An incorrect transformer version is used, please create an
    issue"). det-lab run's requirement check (local and --slurm, before the GPU lease or sbatch)
    names the install instead, for pi05.yaml's sampled hyperparameters; SmolVLA and ACT need no fork."""
    import importlib.util
    import random

    from det_lab.runs.local import sample_hparams
    from det_lab.templates import missing_requirements

    def missing(name: str) -> list[str]:
        conf = yaml.safe_load((TEMPLATE / name).read_text())
        return missing_requirements(TEMPLATE, sample_hparams(conf["hyperparameters"], random.Random(0)))

    try:
        has_fork = importlib.util.find_spec("transformers.models.siglip.check") is not None
    except ModuleNotFoundError:
        has_fork = False
    if has_fork:
        assert missing("pi05.yaml") == []
    else:  # PyPI's transformers, as on det_lab's test machines
        (line,) = missing("pi05.yaml")
        assert "transformers.models.siglip.check" in line and "fix/lerobot_openpi" in line, line
    assert missing("smolvla.yaml") == [] and missing("act.yaml") == []
