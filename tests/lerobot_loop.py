"""LeRobot's own training steps, written out from its functions in ``lerobot-train``'s order (0.4.4
and 0.6.1, ``lerobot/scripts/lerobot_train.py``): the optimizer and scheduler presets,
``accelerator.prepare``, then per batch the preprocessor and ``update_policy``. The reference
det_lab's steps are compared with; :func:`scratch_steps` builds a policy from scratch first, on
LeRobot's own reader (:func:`lerobot_reader`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """PyTorch's default collate: what LeRobot's and det_lab's loaders both use."""
    import torch

    return torch.utils.data.default_collate(items)


def lerobot_reader(root: Any, repo_id: str, cfg: Any) -> Any:
    """LeRobot's own reader over ``root`` with the offsets ``cfg`` asks for (``make_dataset``'s way)."""
    from lerobot.datasets.factory import resolve_delta_timestamps
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    meta = LeRobotDatasetMetadata(repo_id, root=root)
    return LeRobotDataset(repo_id, root=root, delta_timestamps=resolve_delta_timestamps(cfg, meta))


def scratch_steps(root: Any, repo_id: str, kind: str, keys: dict[str, Any], batches: Sequence[Sequence[int]],
                  seed: int, total_steps: int) -> tuple[list[float], dict[str, Any]]:
    """LeRobot's own loop from scratch on its reader: ``set_seed`` -> make_policy_config ->
    make_policy -> make_pre_post_processors -> :func:`lerobot_steps`."""
    from lerobot.policies.factory import make_policy, make_policy_config, make_pre_post_processors
    from lerobot.utils.random_utils import set_seed

    set_seed(seed)
    cfg = make_policy_config(kind, device="cpu", **keys)
    dataset = lerobot_reader(root, repo_id, cfg)
    policy = make_policy(cfg, ds_meta=dataset.meta)
    preprocessor, _ = make_pre_post_processors(policy_cfg=cfg, dataset_stats=dataset.meta.stats)
    return lerobot_steps(policy, cfg, preprocessor, dataset, batches, collate, total_steps)


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
