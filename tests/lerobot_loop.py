"""LeRobot's own training steps, written out from its functions in ``lerobot-train``'s order (0.4.4,
``lerobot/scripts/lerobot_train.py``): the optimizer and scheduler presets, ``accelerator.prepare``,
then per batch the preprocessor and ``update_policy``. The reference det_lab's steps are compared with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def lerobot_steps(policy: Any, cfg: Any, preprocessor: Any, dataset: Any, batches: Sequence[Sequence[int]],
                  collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
                  total_steps: int) -> tuple[list[float], dict[str, Any]]:
    """The loss of each step over ``batches`` (indices into ``dataset``) and the weights after them."""
    from accelerate import Accelerator
    from lerobot.scripts.lerobot_train import update_policy
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    optimizer_cfg, scheduler_cfg = cfg.get_optimizer_preset(), cfg.get_scheduler_preset()
    optimizer = optimizer_cfg.build(policy.get_optim_params())
    scheduler = scheduler_cfg.build(optimizer, total_steps) if scheduler_cfg is not None else None
    accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=True)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    tracker = MetricsTracker(len(batches[0]), dataset.num_frames, dataset.num_episodes,
                             {"loss": AverageMeter("loss"), "grad_norm": AverageMeter("grdn"), "lr": AverageMeter("lr"),
                              "update_s": AverageMeter("updt_s")}, accelerator=accelerator)
    losses = []
    for indices in batches:
        batch = preprocessor(collate([dataset[i] for i in indices]))
        tracker, _ = update_policy(tracker, policy, batch, optimizer, optimizer_cfg.grad_clip_norm,
                                   accelerator=accelerator, lr_scheduler=scheduler)
        losses.append(tracker.loss.val)
    return losses, {k: v.detach().clone() for k, v in accelerator.unwrap_model(policy).state_dict().items()}
