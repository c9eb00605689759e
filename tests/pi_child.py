"""pi0 and pi0.5 through det_lab beside LeRobot 0.6.1's own loop: the child of tests/test_vla_pi.py.

LeRobot 0.5+ (the first with pi0/pi0.5 on PyPI's transformers) needs Python 3.12, so this runs in
the second environment tests/setup.sh makes (``.venv-lerobot06``), with a run's environment
(``det_lab.models.run_environment``: ``HF_HOME`` at a lab's model store, offline; LeRobot reads
``HF_HOME`` at import, so the child starts with it and the store is filled while it waits):

1. it writes the tiny PaliGemma tokenizer and a tiny random pi0.5 base (tests/tiny_pi.py) and a
   LeRobot v3.0 dataset with LeRobot 0.6.1's own writer; the test imports them into a lab
   (``det-lab models import``, ``det-lab data import``) and starts ``det-lab run`` with pi05.yaml;
2. for pi0 and pi0.5 at the tiny sizes: det_lab's batches and LeRobot's reader's items, det_lab's
   three steps and LeRobot's (``update_policy`` in lerobot-train's order), det_lab's checkpoint
   export loaded with ``PI0Policy``/``PI05Policy.from_pretrained`` and LeRobot's processor loader
   and its action chunk beside the trained model's; a dataset without the quantiles pi0.5 normalises by;
3. the run's checkpoint through ``PI05Policy.from_pretrained``.

    python -m tests.pi_child WORKDIR      # the stages: see main()
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from tests.lerobot_loop import collate, lerobot_reader, scratch_steps
from tests.tiny_pi import KEYS, install, write_tiny_base, write_tiny_tokenizer
from tests.tiny_smolvla import BATCHES, CAMERA, SEED, write_dataset

#: the policy keys of each run (policy.* in an experiment config): a short schedule whose LR moves each step
SPECS = {kind: {"name": kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in KEYS.items()},
                "optimizer_lr": 1e-3, "scheduler_warmup_steps": 1, "scheduler_decay_steps": 6}
         for kind in ("pi0", "pi05")}


def _keys(kind: str) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in SPECS[kind].items() if k != "name"}


def _batches(root: Path, kind: str) -> dict[str, Any]:
    """Items det_lab's reader serves against LeRobot's, for ``kind``'s offsets: the keys and
    tensors that differ (none expected), and how many items have padded action steps."""
    import torch

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, dataset_meta, parse_policy
    from det_lab.policies.training import delta_indices, make_config

    cfg = make_config(parse_policy(SPECS[kind]), "cpu")
    frames = LeRobotDataset(root)
    ours, theirs = PolicyFrames(frames, delta_indices(cfg, dataset_meta(frames))), lerobot_reader(root, "local/smolvla", cfg)
    differ, padded = [], 0
    for i in range(len(theirs)):
        a, b = ours[i], theirs[i]
        if sorted(a) != sorted(b):
            differ.append((i, "keys", sorted(set(a) ^ set(b))))
            continue
        for key, value in b.items():
            same = (a[key].dtype == value.dtype and a[key].shape == value.shape and torch.equal(a[key], value)
                    if isinstance(value, torch.Tensor) else a[key] == value)
            if not same:
                differ.append((i, key))
        padded += int(b["action_is_pad"].any())
    return {"items": (len(ours), len(theirs)), "differ": differ, "padded": padded}


def _det_lab(root: Path, kind: str, out: Path) -> dict[str, Any]:
    """det_lab's build and three steps on its reader, seeded as LeRobot's loop is; its checkpoint
    export into ``out``; the trained model's action chunk on three observations (noise seeded)."""
    from lerobot.utils.random_utils import set_seed

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, build_training, dataset_meta, parse_policy

    frames = LeRobotDataset(root)
    set_seed(SEED)
    training = build_training(parse_policy(SPECS[kind]), dataset_meta(frames), total_steps=10)
    initial = {k: v.detach().clone() for k, v in training.policy.state_dict().items()}
    items = PolicyFrames(frames, training.delta_indices)  # every frame: index i is dataset index i
    observation = _observation(collate([items[i] for i in (0, 17, 33)]))
    initial_chunk = _chunk(training.preprocessor, training.policy, training.postprocessor, observation)
    losses, keys = [], set()
    for indices in BATCHES:
        metrics = training.train_step(collate([items[i] for i in indices]))
        losses.append(float(metrics["loss"]))
        keys |= set(metrics)
    return {"losses": losses, "metric_keys": sorted(keys), "initial": initial,
            "params": {k: v.detach().clone() for k, v in training.policy.state_dict().items()},
            "chunk": _chunk(training.preprocessor, training.policy, training.postprocessor, observation),
            "initial_chunk": initial_chunk, "observation": observation, "exported": str(training.export(out))}


def _observation(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k.startswith("observation.") or k == "task"}


def _chunk(pre: Any, policy: Any, post: Any, observation: dict[str, Any]) -> Any:
    import torch

    policy.eval()
    with torch.random.fork_rng(), torch.no_grad():  # training's random stream is left as it was
        torch.manual_seed(0)  # the flow's starting noise
        return post(policy.predict_action_chunk(pre(dict(observation))))


def _loaded(kind: str, pretrained: Path, observation: dict[str, Any]) -> dict[str, Any]:
    """The exported ``pretrained_model/`` through LeRobot's ``from_pretrained`` and processor loader."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    policy = {"pi0": PI0Policy, "pi05": PI05Policy}[kind].from_pretrained(pretrained)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(pretrained))
    return {"chunk": _chunk(pre, policy, post, observation), "type": policy.config.type,
            "params": {k: v.detach().clone() for k, v in policy.state_dict().items()}}


def _without_quantiles(root: Path) -> str:
    """det_lab's build of pi0.5 on ``root``'s metadata with the quantiles taken out of its stats."""
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyError, build_training, dataset_meta, parse_policy

    meta = dataset_meta(LeRobotDataset(root))
    stats = {key: {s: v for s, v in value.items() if not s.startswith("q")} for key, value in meta.stats.items()}
    try:
        build_training(parse_policy(SPECS["pi05"]), dataclasses.replace(meta, stats=stats), total_steps=1)
    except PolicyError as exc:
        return str(exc)
    return ""


def _from_run(checkpoint: Path, base: Path) -> dict[str, Any]:
    """A run's checkpoint through ``PI05Policy.from_pretrained`` and LeRobot's processor loader,
    offline from the store: whether its weights are the trial's own (``state_dict.pth``) to the
    bit, which of the base's moved, and the action chunk it gives for an observation."""
    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from safetensors.torch import load_file

    from det_lab.policies import PRETRAINED_DIR

    pretrained = checkpoint / PRETRAINED_DIR
    policy = PI05Policy.from_pretrained(pretrained)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(pretrained))
    loaded = policy.state_dict()
    saved = torch.load(checkpoint / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
    start = load_file(base / "model.safetensors")
    observation = {"task": ["pick up the red block"], "observation.state": torch.rand(1, 3),
                   CAMERA: torch.rand(1, 3, 24, 32)}
    chunk = _chunk(pre, policy, post, observation)
    return {"same_keys": sorted(loaded) == sorted(saved),
            "differ": [k for k in saved if k not in loaded or not torch.equal(loaded[k], saved[k])],
            "moved": sorted(k for k in start if k in loaded and not torch.equal(start[k].to(loaded[k]), loaded[k])),
            "dtype": policy.config.dtype, "pretrained_path": str(policy.config.pretrained_path),
            "chunk_shape": list(chunk.shape), "chunk_finite": bool(torch.isfinite(chunk).all())}


def main(work: Path) -> None:
    """The stages, one line each way: writes the tokenizer and the dataset (``made``); waits for
    ``go`` (the tokenizer imported into the store), writes the tiny base (``base``), compares
    det_lab and LeRobot (``stepped``); waits for a run's checkpoint directory (or a blank line), loads it
    (``done``), having saved what it saw to ``WORKDIR/seen.pt``."""
    import torch

    talk, sys.stdout = sys.stdout, sys.stderr  # LeRobot prints; stdout carries the protocol only

    def say(word: str) -> None:
        print(word, file=talk, flush=True)

    write_tiny_tokenizer(work / "tokenizer")
    install()
    root = write_dataset(work / "dataset")
    say("made")
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")
    # its preprocessor loads the tokenizer by hub id: from the store, once it is there
    write_tiny_base(work / "base", {"observation.state": (3,), CAMERA: (3, 32, 32), "action": (2,)})
    say("base")
    seen: dict[str, Any] = {}
    for kind in ("pi0", "pi05"):
        ours = _det_lab(root, kind, work / kind)
        seen[kind] = {"batches": _batches(root, kind), "det_lab": ours,
                      "loaded": _loaded(kind, Path(ours["exported"]), ours["observation"])}
        seen[kind]["lerobot_losses"], seen[kind]["lerobot_params"] = scratch_steps(
            root, "local/smolvla", kind, _keys(kind), BATCHES, SEED, 10)
    seen["no_quantiles"] = _without_quantiles(root)
    say("stepped")
    line = sys.stdin.readline().strip()
    if line:
        seen["run"] = _from_run(Path(line), work / "base")
    torch.save(seen, work / "seen.pt")
    say("done")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
