"""Keeping the GPU fed inside Determined's harness.

Determined's ``PyTorchTrial`` loop synchronises with the GPU twice a batch: it copies each batch
to the device with a blocking ``.to(device)`` (which waits for the previous batch's kernels), and
it turns the metrics ``train_batch`` returns into numpy (which waits for this batch's kernels).
Either way the host cannot queue batch i+1 while the GPU runs batch i, and the GPU idles while
Python launches the next step. Here:

- :func:`to_device` copies pinned batches with ``non_blocking=True`` (the trial turns the
  harness's own copy off with ``context.experimental.disable_auto_to_device()``);
- :class:`OneBatchLate` hands the harness the metrics of the *previous* batch, copied to host
  asynchronously, so reading them waits for a batch the GPU has already finished. Training
  metrics are therefore one batch late: the first batch's values are reported twice and the last
  batch's are not reported (1 % of a 100-batch reporting window).
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in dicts/lists) on ``device``, copied asynchronously from pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class OneBatchLate:
    """``push(metrics)`` -> the previous batch's metrics as host tensors (see the module doc).
    Off CUDA it returns ``metrics`` as they are: nothing runs asynchronously there."""

    def __init__(self) -> None:
        self._pending: tuple[dict[str, torch.Tensor], torch.cuda.Event] | None = None

    def push(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not any(v.is_cuda for v in metrics.values()):
            return metrics
        host = {k: v.detach().to("cpu", non_blocking=True) for k, v in metrics.items()}
        done = torch.cuda.Event()
        done.record()
        previous, self._pending = self._pending, (host, done)
        if previous is None:
            previous = self._pending
        previous[1].synchronize()
        return previous[0]
