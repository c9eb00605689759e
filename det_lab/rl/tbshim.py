"""Make ``torch.utils.tensorboard`` importable without the ``tensorboard`` package.

rsl_rl imports ``torch.utils.tensorboard.SummaryWriter`` at import time (its W&B/Neptune writers
subclass it) and uses it as its default logger. Where ``tensorboard`` is missing (the CPU stand-in
here), :func:`ensure_torch_tensorboard` registers det_lab's scalar-only writer under that name,
in this process only.
"""

from __future__ import annotations

import sys
import types


def ensure_torch_tensorboard() -> str:
    """``"tensorboard"`` if the real module imports, else ``"det_lab"`` after installing the shim."""
    try:
        import torch.utils.tensorboard  # noqa: F401

        return "tensorboard"
    except ImportError:
        pass
    import torch.utils

    from det_lab.rl.tfevents import SummaryWriter

    mod = types.ModuleType("torch.utils.tensorboard")
    mod.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    mod.__doc__ = "det_lab shim: scalar-only SummaryWriter (the tensorboard package is not installed)"
    sys.modules["torch.utils.tensorboard"] = mod
    torch.utils.tensorboard = mod  # type: ignore[attr-defined]
    return "det_lab"
