"""The trial's distributed context when it runs off-cluster under ``torchrun`` (a Slurm job of
several GPUs, or a local run started by hand with ``torchrun``).

On a cluster Determined's launch layer sets up the process group itself. Off-cluster its
``pytorch.init``/``core.init`` pass no distributed context, so every process would believe it is
rank 0 of 1: all of them would write checkpoints, records and tracker points.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import determined as det

log = logging.getLogger("det_lab.trials")


def off_cluster_distributed(on_cluster: bool) -> det.core.DistributedContext | None:
    """``torch.distributed``'s context when ``torchrun`` started more than one process here, else None."""
    if on_cluster or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    # What Determined's launch layer tells its PyTorchTrial controller (determined 0.38.1,
    # determined/launch/torch_distributed.py:81): wrap the model in DDP. Without it the controller
    # refuses a world of several ranks ("Must use horovod or torch for distributed training").
    os.environ["USE_TORCH_DISTRIBUTED"] = "True"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return det.core.DistributedContext.from_torch_distributed()


def wrap_model_finding_unused(context: Any, model: Any) -> Any:
    """``context.wrap_model(model)``, its DistributedDataParallel built with ``find_unused_parameters=True``.

    ``lerobot-train`` prepares every policy so (lerobot 0.4.4, ``scripts/lerobot_train.py:175-179``):
    a policy may leave trainable parameters out of a step's loss. SmolVLA with
    ``train_expert_only: false`` leaves its VLM's last layer and final norm out (LeRobot's own
    freezing of them, ``smolvlm_with_expert.py:149-164``, matches transformers' older parameter
    names only), and DDP without the flag stops the second step with "Expected to have finished
    reduction in the prior iteration". Determined 0.38.1 builds its DDP with no options
    (``harness/determined/pytorch/_pytorch_context.py:297`` and ``:1057-1066``): for this one call
    the context's wrapper class is one that passes the flag (det_lab/runs/harness.py, which checks
    that name against the pinned package). On one process nothing changes.
    """
    from det_lab.runs.harness import wrap_model_with_ddp_options

    wrapped = wrap_model_with_ddp_options(context, model, find_unused_parameters=True)
    if wrapped is None:  # a harness without that class: its own DDP, which may stop on unused parameters
        log.warning("this Determined harness builds DDP itself: a policy that leaves parameters unused "
                    "may stop at its second step under several slots")
        wrapped = context.wrap_model(model)
    return wrapped
