"""VLA policy training as a det_lab PyTorchTrial.

Entrypoint (cluster and ``det-lab run vla --local``)::

    python3 -m determined.launch.torch_distributed python3 train.py

det_lab's base class pulls the dataset named in ``data.det_lab.dataset`` (read-only snapshot at
``self.dataset_path``), mirrors every metric to MLflow/Aim and records the dataset's identity in
each checkpoint's metadata. Determined handles checkpoints, resume, validation periods, the
searcher and distributed data parallelism (``resources.slots_per_trial``).

``hyperparameters.policy.name`` picks the policy: ``det_lab`` (the default: ``model.py``, sized by
``hyperparameters.model``) or any type LeRobot's factory builds (``act``, ``diffusion``, ...: built,
stepped and exported by :mod:`det_lab.policies` as ``lerobot-train`` does; ``act.yaml``). LeRobot
is imported only then. Each checkpoint of a LeRobot policy also holds LeRobot's ``pretrained_model/``.
A LeRobot policy scales with ``resources.slots_per_trial`` (each slot trains ``global_batch_size /
slots`` samples a step, Determined's rule), ``hyperparameters.grad_accumulation`` (those samples in
that many equal micro-batches, one optimizer step: the global batch is kept) and
``hyperparameters.policy.precision: bf16`` (bf16 autocast over fp32 weights).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
from contextlib import nullcontext
from typing import Any

import determined as det
import torch
from determined import pytorch

from dataset import CachedPolicyFrames, collate_batch, load_splits
from det_lab.errors import UserError
from det_lab.policies.choice import parse_policy
from det_lab.trials.distributed import wrap_model_finding_unused
from det_lab.trials.pytorch import LabPyTorchTrial, run
from device_feed import OneBatchLate, to_device
from frame_cache import resolve_cache_dir
from model import VLAConfig, VLAPolicy, apply_speed_switches, build_optimizer

POLICY_FILE = "vla_policy.json"


class SavePolicyConfig(pytorch.PyTorchCallback):
    """Writes the policy's shapes and sizes next to the weights, so a checkpoint is self-describing."""

    def __init__(self, description: dict[str, Any]) -> None:
        self.description = description

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        with open(f"{checkpoint_dir}/{POLICY_FILE}", "w") as f:
            json.dump(self.description, f, indent=2)


class ExportPretrained(pytorch.PyTorchCallback):
    """Writes LeRobot's ``pretrained_model/`` into each checkpoint (``PolicyClass.from_pretrained`` loads it)."""

    def __init__(self, training: Any) -> None:
        self.training = training

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self.training.export(checkpoint_dir)


class VLATrial(LabPyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        hp = context.get_hparams()
        choice = parse_policy(hp.get("policy"))
        _check_scale(hp, choice.is_lerobot, context.distributed.size)  # before the dataset is pulled
        super().__init__(context)
        self.hp = hp
        if hp.get("torch_threads"):  # small CPU models run faster without intra-op threads fighting
            torch.set_num_threads(int(hp["torch_threads"]))
        self.lerobot: Any = None  # a det_lab.policies.LeRobotTraining when policy.type is LeRobot's
        if choice.is_lerobot:
            self._init_lerobot(choice)
            return
        on_volume = self.volume.outputs(self.lab.project) / "frame-cache"
        cache_dir = resolve_cache_dir(hp.get("frame_cache"), on_volume)
        self.splits = load_splits(self.dataset_path, hp, cache_dir, self.dataset.identity.md5 if self.dataset else None,
                                  fallback_dir=on_volume if cache_dir != on_volume else None)
        full = self.splits.full
        shapes = {full.image_shape(k) for k in full.cameras}
        if hp.get("resize"):
            shapes = {(3, int(hp["resize"]), int(hp["resize"]))}
        if len(shapes) != 1:
            raise ValueError(f"cameras have different shapes {sorted(shapes)}: set hyperparameters.resize")
        self.cfg = VLAConfig.from_hparams(hp["model"], state_dim=full.state_dim, action_dim=full.action_dim,
                                          horizon=int(hp["horizon"]), image_shape=shapes.pop(),
                                          n_cameras=len(full.cameras))
        stats = {k: full.norm_stats(k) for k in ("observation.state", "action", *full.cameras) if k in full.stats}
        self.model = context.wrap_model(apply_speed_switches(VLAPolicy(self.cfg, stats, full.cameras), hp))
        self.opt = context.wrap_optimizer(build_optimizer(self.model, hp))
        # lr_schedule_batches fixes the schedule's length, so that a run continued to a longer
        # max_length trains as one run of that length would have (default: this run's length)
        total = int(hp.get("lr_schedule_batches") or self._total_batches())
        warmup = min(int(hp.get("warmup_batches", 0)), total // 2)
        self.sched = context.wrap_lr_scheduler(
            torch.optim.lr_scheduler.LambdaLR(self.opt, _warmup_cosine(warmup, total)),
            step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_BATCH,
        )
        self.bf16 = bool(hp.get("bf16")) and torch.cuda.is_available()
        context.experimental.disable_auto_to_device()  # to_device(): asynchronous copies instead
        self.metrics_late = OneBatchLate()  # the harness never waits for the batch just queued
        self.description = {
            "policy": self.cfg.to_dict(), "cameras": full.cameras, "fps": full.fps,
            "train_episodes": self.splits.train_episodes, "val_episodes": self.splits.val_episodes,
            "dataset": self.lineage.get("dataset"),
        }

    def _init_lerobot(self, choice: Any) -> None:
        from det_lab.formats import LeRobotDataset, split_episodes
        from det_lab.policies import PolicyFrames, build_training, dataset_meta

        hp, ctx = self.hp, self.context
        accumulation = int(hp.get("grad_accumulation") or 1)
        full = LeRobotDataset(self.dataset_path, cameras=hp.get("cameras"))
        train_eps, val_eps = split_episodes(full.episode_indices, val_episodes=int(hp["val_episodes"]),
                                            seed=int(hp.get("split_seed", 0)))
        self.lerobot = build_training(
            choice, dataset_meta(full), device=ctx.device, total_steps=self._total_batches(len(full.select(train_eps))),
            wrap_model=functools.partial(wrap_model_finding_unused, ctx), wrap_optimizer=ctx.wrap_optimizer,
            wrap_scheduler=lambda s: ctx.wrap_lr_scheduler(s, step_mode=pytorch.LRScheduler.StepMode.MANUAL_STEP),
            accumulation=accumulation)
        delta = self.lerobot.delta_indices
        self.lerobot_items = {"train": PolicyFrames(full.select(train_eps), delta, self.lerobot.drop_n_last_frames),
                              "val": PolicyFrames(full.select(val_eps), delta)}
        ctx.experimental.disable_auto_to_device()  # the preprocessor moves batches, as in lerobot-train
        self.description = {
            "policy": {"type": choice.type, **choice.overrides}, "cameras": full.cameras, "fps": full.fps,
            "train_episodes": train_eps, "val_episodes": val_eps, "dataset": self.lineage.get("dataset"),
        }

    def _total_batches(self, n_train: int | None = None) -> int:
        """The run's length in batches (for the LR schedule), from max_length or ASHA's max_time."""
        length = self.training_length
        if length.batches:
            return length.batches
        n_train = len(self.splits.train) if n_train is None else n_train
        per_epoch = n_train // self.context.get_global_batch_size()
        return max(1, length.value * max(1, per_epoch))

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def _loader(self, frames, train: bool) -> pytorch.DataLoader:
        workers = int(self.hp.get("num_workers", 0))
        cached = {"collate_fn": collate_batch} if isinstance(frames, CachedPolicyFrames) else {}
        return pytorch.DataLoader(
            frames, batch_size=self.context.get_per_slot_batch_size(), shuffle=train, drop_last=train,
            num_workers=workers, persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(), **cached,
        )

    def build_training_data_loader(self) -> pytorch.DataLoader:
        if self.lerobot is not None:
            return self._loader(self.lerobot_items["train"], train=True)
        return self._loader(self.splits.train, train=True)

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        if self.lerobot is not None:
            return self._loader(self.lerobot_items["val"], train=False)
        return self._loader(self.splits.val, train=False)

    def _forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        batch = to_device(batch, self.context.device)
        with self._autocast():
            return self.model(batch["images"], batch["state"], batch["text_ids"], batch["text_valid"],
                              batch["action"], batch["action_is_pad"])

    def _step_optimizer(self, optimizer: torch.optim.Optimizer, clip_grads: Any) -> None:
        self.context.step_optimizer(optimizer, clip_grads=clip_grads)

    def train_batch(self, batch: dict[str, Any], epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        if self.lerobot is not None:
            return self.lerobot.train_step(batch, self.context.backward, self._step_optimizer)
        out = self._forward(batch)
        self.context.backward(out["loss"])
        clip = float(self.hp.get("grad_clip", 0) or 0)
        self.context.step_optimizer(
            self.opt, clip_grads=(lambda params: torch.nn.utils.clip_grad_norm_(params, clip)) if clip else None)
        late = self.metrics_late.push({"loss": out["loss"], "action_l1": out["action_l1"]})
        return {**late, "lr": self.sched.get_last_lr()[0]}

    def evaluate_batch(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        if self.lerobot is not None:
            return self.lerobot.evaluate(batch, seed=batch_idx)
        out = self._forward(batch)
        return {"val_loss": out["loss"], "val_action_l1": out["action_l1"],
                "val_action_l1_first": out["action_l1_first"]}

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        callbacks: dict[str, pytorch.PyTorchCallback] = {"policy_config": SavePolicyConfig(self.description)}
        if self.lerobot is not None:
            callbacks["lerobot_pretrained"] = ExportPretrained(self.lerobot)
        return callbacks


def _check_scale(hp: dict[str, Any], lerobot: bool, slots: int) -> None:
    """A trial's own checks, before its dataset is pulled (a config that ``det experiment create``
    sent had no det-lab preflight): each model's own switches, and a global batch that the ranks and
    micro-batches divide. The configured ``global_batch_size``, not the context's: Determined rounds
    that down to a multiple of the slots with only a warning (determined/util.py ``calculate_batch_sizes``)."""
    from det_lab.policies import PolicyError
    from det_lab.runs.expconf import micro_batch_size

    accumulation = int(hp.get("grad_accumulation") or 1)
    if lerobot and hp.get("bf16"):
        raise PolicyError("hyperparameters.bf16 is the det_lab model's switch; for a LeRobot policy set "
                          "hyperparameters.policy.precision: bf16")
    if not lerobot and accumulation != 1:
        raise UserError("hyperparameters.grad_accumulation is for LeRobot policies (policy.name: act, ...); "
                        "the det_lab model trains each global batch in one pass")
    batch = hp.get("global_batch_size")
    if isinstance(batch, int) and not isinstance(batch, bool):  # (Determined refuses a missing one itself)
        micro_batch_size(batch, slots, accumulation)


def _warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    try:
        run(VLATrial)
    except UserError as exc:  # a bad policy choice or dataset: one line in the log, no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
