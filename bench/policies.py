"""A LeRobot policy's training step through det_lab against the same step in LeRobot's own loop.

    python bench/policies.py [--steps 5] [--repeats 5] [--batch 8] [--policies act diffusion]
    .venv-lerobot06/bin/python bench/policies.py --policies pi0 pi05    # LeRobot 0.5+ (Python 3.12)

One process, one batch (det_lab's reader over a dataset LeRobot's own writer made: a 64x64 camera,
state 6, action 6), per policy at a small size:

  a. LeRobot: ``make_policy`` / ``make_pre_post_processors`` / the presets, ``accelerator.prepare``,
     then per step the preprocessor and ``lerobot.scripts.lerobot_train.update_policy`` (its loop's
     step: forward, backward, clipping, optimizer and scheduler, ``policy.update()``);
  b. det_lab: ``det_lab.policies.build_training`` and ``LeRobotTraining.train_step`` (preprocessor
     included), as a trial runs it off Determined (plain ``loss.backward()`` and ``optimizer.step()``).

Arms are interleaved (``--steps`` of a, then of b, ``--repeats`` times) so machine load hits both
alike; the figure is the median seconds per step and the ratio b/a (target: at most 1.05).
LeRobot's ResNet backbones need torchvision: where PyPI's wheel does not import beside the local
torch, the tests' ``tests/torchvision_shim.py`` declares its ops first. pi0 and pi0.5 (LeRobot 0.5+,
whose pi0/pi0.5 run on PyPI's transformers) run at the tests' tiny size (``tests/tiny_pi.py``: about
250 k parameters, its word-level PaliGemma tokenizer in a temporary model store), SmolVLA from scratch
on the tests' tiny SmolVLM (``tests/tiny_smolvla.py``), where det_lab's own work weighs the most
against the step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECS: dict[str, dict[str, Any]] = {
    "act": dict(name="act", pretrained_backbone_weights=None, dim_model=128, n_heads=4, dim_feedforward=512,
                n_encoder_layers=2, n_decoder_layers=1, n_vae_encoder_layers=2, latent_dim=16, chunk_size=20,
                n_action_steps=20),
    "diffusion": dict(name="diffusion", pretrained_backbone_weights=None, crop_shape=None, horizon=16,
                      n_action_steps=8, down_dims=[64, 128], diffusion_step_embed_dim=64, num_inference_steps=10),
}
SEED = 0
#: LeRobot's pi0/pi0.5 at the tests' tiny size (tests/tiny_pi.py KEYS, set in main())
PI = ("pi0", "pi05")
#: SmolVLA at the tests' tiny size (tests/tiny_smolvla.py, set in main())
TINY_VLA = ("smolvla",)
REPO = Path(__file__).resolve().parents[1]


def write_dataset(root: Path, episodes: int = 3, length: int = 40) -> Path:
    """A LeRobot v3.0 dataset written by LeRobot itself: a 64x64 camera, state 6, action 6."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotWriter

    features = {"observation.state": {"dtype": "float32", "shape": (6,), "names": None},
                "action": {"dtype": "float32", "shape": (6,), "names": None},
                "observation.images.front": {"dtype": "image", "shape": (64, 64, 3),
                                             "names": ["height", "width", "channels"]}}
    ds = LeRobotWriter.create("local/bench", fps=10, features=features, root=root, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        for _ in range(length):
            ds.add_frame({"observation.state": rng.normal(size=6).astype(np.float32),
                          "action": rng.normal(size=6).astype(np.float32), "task": "pick the block",
                          "observation.images.front": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)})
        ds.save_episode()
    ds.finalize()
    return root


class LeRobotArm:
    """LeRobot's own loop, from its functions in ``lerobot-train``'s order."""

    def __init__(self, root: Path, kind: str, total_steps: int) -> None:
        from accelerate import Accelerator
        from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata
        from lerobot.policies.factory import make_policy, make_policy_config, make_pre_post_processors
        from lerobot.utils.logging_utils import AverageMeter, MetricsTracker
        from lerobot.utils.random_utils import set_seed

        keys = {k: tuple(v) if isinstance(v, list) else v for k, v in SPECS[kind].items() if k != "name"}
        set_seed(SEED)
        cfg = make_policy_config(kind, device="cpu", **keys)
        meta = LeRobotDatasetMetadata("local/bench", root=root)
        policy = make_policy(cfg, ds_meta=meta)
        self.preprocessor, _ = make_pre_post_processors(policy_cfg=cfg, dataset_stats=meta.stats)
        opt_cfg, sched_cfg = cfg.get_optimizer_preset(), cfg.get_scheduler_preset()
        optimizer = opt_cfg.build(policy.get_optim_params())
        scheduler = sched_cfg.build(optimizer, total_steps) if sched_cfg is not None else None
        self.accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=True)
        self.policy, self.optimizer, self.scheduler = self.accelerator.prepare(policy, optimizer, scheduler)
        self.clip = opt_cfg.grad_clip_norm
        meters = {"loss": AverageMeter("loss"), "grad_norm": AverageMeter("grdn"), "lr": AverageMeter("lr"),
                  "update_s": AverageMeter("updt_s")}
        self.tracker = MetricsTracker(8, meta.total_frames, meta.total_episodes, meters, accelerator=self.accelerator)

    def step(self, batch: dict[str, Any]) -> float:
        from lerobot.scripts.lerobot_train import update_policy

        self.tracker, _ = update_policy(self.tracker, self.policy, self.preprocessor(dict(batch)), self.optimizer,
                                        self.clip, accelerator=self.accelerator, lr_scheduler=self.scheduler)
        return float(self.tracker.loss.val)


class DetLabArm:
    """det_lab's build and step (det_lab.policies)."""

    def __init__(self, root: Path, kind: str, total_steps: int) -> None:
        from lerobot.utils.random_utils import set_seed

        from det_lab.formats import LeRobotDataset
        from det_lab.policies import build_training, dataset_meta, parse_policy

        set_seed(SEED)
        self.training = build_training(parse_policy(SPECS[kind]), dataset_meta(LeRobotDataset(root)),
                                       total_steps=total_steps)

    def step(self, batch: dict[str, Any]) -> float:
        return float(self.training.train_step(dict(batch))["loss"])


def one_batch(root: Path, kind: str, size: int) -> dict[str, Any]:
    """``size`` items of det_lab's reader (LeRobot's items: tests/test_vla_policies.py), collated."""
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, dataset_meta, parse_policy
    from det_lab.policies.training import delta_indices, make_config

    frames = LeRobotDataset(root)
    items = PolicyFrames(frames, delta_indices(make_config(parse_policy(SPECS[kind]), "cpu"), dataset_meta(frames)))
    picks = np.linspace(0, len(items) - 1, size).astype(int)
    return torch.utils.data.default_collate([items[int(i)] for i in picks])


def timed(arm: Any, batch: dict[str, Any], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        arm.step(batch)
    return (time.perf_counter() - start) / steps


def test_module(name: str) -> Any:
    """``tests/<name>.py`` loaded by path (``bench/`` is no package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"det_lab_bench_{name}", REPO / "tests" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # a Library must live on
    spec.loader.exec_module(module)
    return module


def shim() -> None:
    """tests/torchvision_shim.py's ``install``: it declares torchvision's ops where PyPI's wheel does
    not load beside this torch, and does nothing elsewhere."""
    test_module("torchvision_shim").install()


def tiny_smolvla(tmp: Path) -> None:
    """SmolVLA from scratch on the tests' tiny SmolVLM (tests/tiny_smolvla.py: its config,
    word-level tokenizer and processor, written under ``tmp`` and named by path)."""
    tiny = test_module("tiny_smolvla")
    vlm = tiny.write_tiny_vlm(tmp / "vlm")
    SPECS["smolvla"] = {"name": "smolvla", "vlm_model_name": str(vlm),
                        **{k: list(v) if isinstance(v, tuple) else v for k, v in tiny.BASE_KEYS.items()}}


def tiny_pi(tmp: Path) -> None:
    """pi0/pi0.5 at the tests' tiny size in this process, their tokenizer in a model store under
    ``tmp`` that ``HF_HOME`` names (before transformers is imported)."""
    from det_lab.models import ModelStoreLayout, run_environment
    from det_lab.models.store import import_model

    os.environ.update(run_environment(tmp / "data", writable_cache=tmp / "cache"))
    tiny = test_module("tiny_pi")
    import_model(ModelStoreLayout(tmp / "data" / "models"), tiny.write_tiny_tokenizer(tmp / "tokenizer"),
                 tiny.TOKENIZER_ID)
    tiny.install()
    for kind in PI:
        SPECS[kind] = {"name": kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in tiny.KEYS.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(SPECS), choices=[*SPECS, *TINY_VLA, *PI],
                    help="pi0/pi0.5 need LeRobot 0.5+ (Python 3.12)")
    args = ap.parse_args()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TQDM_DISABLE",
                "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")
    warnings.filterwarnings("ignore", message="Cannot enable progress bars")  # LeRobot asks; the variable wins
    torch.set_num_threads(args.threads)
    total = args.repeats * args.steps + 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-policies-") as tmp:
        shim()  # imports torch only: HF_HOME may still move (tiny_pi)
        if set(args.policies) & set(PI):
            tiny_pi(Path(tmp))
        if set(args.policies) & set(TINY_VLA):
            tiny_smolvla(Path(tmp))
        import lerobot
        from lerobot.utils.random_utils import set_seed

        root = write_dataset(Path(tmp) / "dataset")
        for kind in args.policies:
            batch = one_batch(root, kind, args.batch)
            theirs, ours = LeRobotArm(root, kind, total), DetLabArm(root, kind, total)
            first = []
            for arm in (theirs, ours):  # warm-up, from the same RNG state: the same loss is the same step
                set_seed(SEED)
                first.append(arm.step(batch))
            times: dict[str, list[float]] = {"lerobot": [], "det_lab": []}
            for _ in range(args.repeats):
                times["lerobot"].append(timed(theirs, batch, args.steps))
                times["det_lab"].append(timed(ours, batch, args.steps))
            a, b = statistics.median(times["lerobot"]), statistics.median(times["det_lab"])
            params = sum(p.numel() for p in ours.training.policy.parameters())
            rows.append((kind, params, a, b, first))
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{when}; {platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}), torch {torch.__version__}, "
          f"lerobot {lerobot.__version__}, {args.threads} threads; batch {args.batch}, 64x64 camera, state 6, "
          f"action 6; median of {args.repeats} x {args.steps} steps, interleaved\n")
    print(f"{'policy':<10} {'params':>8} {'LeRobot s/step':>15} {'det_lab s/step':>15} {'ratio':>7} {'first loss equal':>17}")
    for kind, params, a, b, (la, lb) in rows:
        print(f"{kind:<10} {params / 1e6:>7.2f}M {a:>15.4f} {b:>15.4f} {b / a:>6.3f}x {str(la == lb):>17}")


if __name__ == "__main__":
    main()
