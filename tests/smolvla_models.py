"""The tiny SmolVLA (tests/tiny_smolvla.py) for a lab's model store, and its checkpoints read back by LeRobot.

What tests/test_vla_smolvla.py (locally), tests/test_slurm_run.py (a Slurm job) and
tests/test_determined_templates.py (``det experiment create``) share:

    with ModelsChild(workdir, data_root) as tiny:       # a child writes the base and its VLM
        for src, name in tiny.models():                 # ... imported as a user imports snapshots
            det-lab models import src name
        ... det-lab run vla --slurm --exp-config smolvla.yaml *run_sets()   (or apply_overrides(conf, RUN_ASSIGNMENTS))
        seen = tiny.load([checkpoint, ...])             # LeRobot's from_pretrained, in the child

The child (``python -m tests.smolvla_models WORKDIR``) runs with a run's environment
(:func:`child_env`: ``HF_HOME`` at the lab's store, ``HF_HUB_OFFLINE=1``), as the robot's computer
would load a checkpoint: LeRobot reads ``HF_HOME`` once, at import, so a test process cannot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.tiny_smolvla import BASE_CAMERA, BASE_ID, CAMERA, IMAGE_SIZE, VLM_ID

REPO = Path(__file__).resolve().parents[1]
#: the shipped smolvla.yaml shrunk for a test run (``--set KEY=VALUE``; det_lab.templates.apply_overrides):
#: 3 steps at batch 4, a validation and a checkpoint at step 3, an LR that moves each step, and the
#: demo dataset's camera mapped to the base's
RUN_ASSIGNMENTS = (
    "data.det_lab.max_length.batches=3", "min_validation_period.batches=3", "min_checkpoint_period.batches=3",
    "hyperparameters.global_batch_size=4", "hyperparameters.val_episodes=1", "hyperparameters.num_workers=0",
    "hyperparameters.torch_threads=1", "data.det_lab.reporting_batches=1",
    "hyperparameters.policy.optimizer_lr=0.001", "hyperparameters.policy.scheduler_warmup_steps=1",
    "hyperparameters.policy.scheduler_decay_steps=6", f"hyperparameters.policy.rename_map={{{CAMERA}: {BASE_CAMERA}}}")
SMOLVLA_YAML = REPO / "experiment_templates" / "vla" / "smolvla.yaml"


def run_sets() -> list[str]:
    """:data:`RUN_ASSIGNMENTS` as ``det-lab run`` arguments."""
    return [arg for item in RUN_ASSIGNMENTS for arg in ("--set", item)]


def child_env(data_root: Path, work: Path) -> dict[str, str]:
    """A run's environment (the store at ``data_root``, offline), with caches and home under ``work``."""
    from det_lab import models

    env = {k: v for k, v in os.environ.items() if k not in models.SHADOWING}
    env.update(models.run_environment(data_root), HOME=str(work / "home"), HF_DATASETS_CACHE=str(work / "hf-datasets"),
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    return env


class ModelsChild:
    """The child that writes the tiny base and VLM under ``work`` and loads checkpoints with LeRobot."""

    def __init__(self, work: Path, data_root: Path, timeout: float = 120) -> None:
        self.work, self.timeout = work, timeout
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "child.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.smolvla_models", str(work)], cwd=REPO,
                                         env=child_env(data_root, work), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)

    def __enter__(self) -> ModelsChild:
        self._expect("made")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def models(self) -> list[tuple[Path, str]]:
        """(snapshot directory, hub id) to import, the VLM first."""
        return [(self.work / "vlm", VLM_ID), (self.work / "base", BASE_ID)]

    def load(self, checkpoints: list[Path]) -> dict[str, dict[str, Any]]:
        """What LeRobot made of each checkpoint directory (:func:`_load`), by its path."""
        self.proc.stdin.write(json.dumps([str(c) for c in checkpoints]) + "\n")
        self.proc.stdin.close()
        line = self._expect(None)
        assert self.proc.wait(timeout=self.timeout) == 0, self.log.read_text()[-3000:]
        return json.loads(line)

    def _expect(self, word: str | None) -> str:
        line = self.proc.stdout.readline().strip()
        assert line and (word is None or line == word), f"the child said {line!r}:\n{self.log.read_text()[-3000:]}"
        return line


def assert_loads_as_trained(seen: dict[str, Any], chunk_size: int) -> None:
    """A checkpoint LeRobot loads offline from the store (``ModelsChild.load``'s answer for it) to
    the trial's own weights to the bit; the action expert moved from the base, the frozen vision
    encoder did not; the VLM named by hub id; an action chunk of the trained size."""
    assert seen["same_keys"] and seen["bit_equal"], seen
    assert any(k.startswith("model.vlm_with_expert.lm_expert.") for k in seen["moved"]), seen["moved"]
    assert not any(".vision_model." in k for k in seen["moved"]), seen["moved"]
    assert seen["vlm_model_name"] == VLM_ID
    assert seen["chunk_shape"][:2] == [1, chunk_size] and seen["chunk_finite"], seen

def _load(checkpoint: Path, base: Path) -> dict[str, Any]:
    """``checkpoint/pretrained_model`` through ``SmolVLAPolicy.from_pretrained`` and LeRobot's
    processor loader, offline from the store: whether its weights are the trial's own
    (``state_dict.pth``) to the bit, which of the base's moved, the names it loads its VLM by,
    and the shape of the action chunk it gives for an observation of its features."""
    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from safetensors.torch import load_file

    from det_lab.policies import PRETRAINED_DIR

    pretrained = checkpoint / PRETRAINED_DIR
    policy = SmolVLAPolicy.from_pretrained(pretrained)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(pretrained))
    loaded = policy.state_dict()
    saved = torch.load(checkpoint / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
    saved = {k.removeprefix("module."): v for k, v in saved.items()}  # several slots: Determined saves DDP's names
    start = load_file(base / "model.safetensors")
    # the dataset's sizes, as its normaliser holds them (the config keeps the base's padded ones)
    sizes = {k: tuple(torch.as_tensor(v["mean"]).shape) for step in pre.steps for k, v in
             (getattr(step, "stats", None) or {}).items() if "mean" in v}
    observation: dict[str, Any] = {"task": ["pick up the red block"]}
    for key, feature in policy.config.input_features.items():
        observation[key] = torch.rand(1, *sizes.get(key, feature.shape))
    policy.eval()
    with torch.no_grad():
        chunk = post(policy.predict_action_chunk(pre(observation)))
    return {"same_keys": sorted(loaded) == sorted(saved),
            "bit_equal": [k for k in saved if k in loaded and torch.equal(loaded[k], saved[k])] == list(saved),
            "moved": sorted(k for k in start if k in loaded and not torch.equal(start[k], loaded[k])),
            "vlm_model_name": policy.config.vlm_model_name, "chunk_shape": list(chunk.shape),
            "chunk_finite": bool(torch.isfinite(chunk).all())}


def _child(work: Path) -> None:
    from tests import torchvision_shim
    from tests.tiny_smolvla import write_tiny_base, write_tiny_vlm

    talk, sys.stdout = sys.stdout, sys.stderr  # LeRobot prints; stdout carries the protocol only
    torchvision_shim.install()
    vlm = write_tiny_vlm(work / "vlm")
    write_tiny_base(work / "base", vlm, VLM_ID, {"observation.state": (6,), BASE_CAMERA: (3, IMAGE_SIZE, IMAGE_SIZE),
                                                 "action": (6,)})
    print("made", file=talk, flush=True)
    line = sys.stdin.readline()
    seen = {c: _load(Path(c), work / "base") for c in (json.loads(line) if line.strip() else [])}
    print(json.dumps(seen), file=talk, flush=True)


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
