"""Narrow fixes for what Determined 0.38.1's harness gets wrong on today's stack.

Each is applied only while a det_lab trial runs (:func:`harness_shims`) and restored after;
nothing in the installed ``determined`` package is edited.

1. Resume fails under torch >= 2.6: ``torch.load`` defaults to ``weights_only=True`` and the
   harness's ``state_dict.pth`` holds numpy RNG state (``numpy._core.multiarray._reconstruct``).
   We allow exactly the numpy types involved (:func:`allow_harness_unpickling`) instead of
   turning weights-only loading off.
2. Metric reports fail without the ``tensorboard`` package (``enable_tensorboard_logging``
   defaults to True): :func:`tensorboard_available` tells callers whether to enable it.
3. Off-cluster checkpoints go to ``~/.local/share/determined``: ``core.init`` is given the
   lab's checkpoint directory.
4. Off-cluster checkpoints copy the whole working directory into ``code/``: when the data root
   or the checkpoint directory lies inside it, every checkpoint copies the datasets and the
   earlier checkpoints (recursively). We leave those paths, ``.git`` and venvs out.
5. Off-cluster resume restarts the training data from its first batch: ``Trainer.fit`` passes
   ``steps_completed=0`` to the trial controller in local mode (on a cluster the master supplies
   it), so a resumed trial trains on different batches than an uninterrupted one. We pass the
   checkpoint's own ``steps_completed``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def allow_harness_unpickling() -> None:
    """Let ``torch.load(weights_only=True)`` read the numpy state the harness saves."""
    import torch

    dtype_classes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8, np.bool_)]
    torch.serialization.add_safe_globals([np._core.multiarray._reconstruct, np.ndarray, np.dtype, *dtype_classes])


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


_ALWAYS_SKIP = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".det-lab"}


def _user_code_ignore(cwd: Path, skip: list[Path]):
    """A shutil ignore function leaving out ``skip`` paths (if under ``cwd``) and VCS/venv dirs."""
    from determined.common import detignore

    base = detignore.make_shutil_ignore(Path("."))  # upstream's own call, relative to the cwd
    skip_resolved = {p.resolve() for p in skip}

    def ignore(directory: str, names: list[str]) -> set[str]:
        out = set(base(directory, names))
        d = Path(directory).resolve()
        for name in names:
            if name in _ALWAYS_SKIP or (d / name) in skip_resolved:
                out.add(name)
        return out

    return ignore


@contextlib.contextmanager
def harness_shims(checkpoint_dir: Path | None, skip_in_code: list[Path]) -> Iterator[None]:
    """Apply the shims for the duration of a trial.

    ``checkpoint_dir`` (off-cluster only) is where checkpoints go; ``skip_in_code`` are paths
    never copied into a checkpoint's ``code/``.
    """
    import determined as det
    from determined import core, pytorch, util

    allow_harness_unpickling()
    orig_init, orig_write = core.init, util.write_user_code
    orig_controller = pytorch._PyTorchTrialController

    class Controller(orig_controller):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            latest = kwargs.get("latest_checkpoint")
            if kwargs.get("local_training") and latest and not kwargs.get("steps_completed") and checkpoint_dir:
                kwargs["steps_completed"] = _steps_completed(checkpoint_dir / latest)
            super().__init__(*args, **kwargs)

    @functools.wraps(orig_write)
    def write_user_code(path: Path, on_cluster: bool) -> None:
        if on_cluster:
            return orig_write(path, on_cluster)
        code_path = Path(path) / "code"
        if code_path.exists():
            shutil.rmtree(code_path)
        cwd = Path(".").resolve()
        shutil.copytree(".", code_path, ignore=_user_code_ignore(cwd, [*skip_in_code, Path(path)]))
        os.chmod(code_path, 0o755)

    @functools.wraps(orig_init)
    def init(*args, **kwargs):
        if det.get_cluster_info() is None and checkpoint_dir is not None and kwargs.get("checkpoint_storage") is None:
            kwargs["checkpoint_storage"] = str(checkpoint_dir)
        return orig_init(*args, **kwargs)

    core.init, util.write_user_code, pytorch._PyTorchTrialController = init, write_user_code, Controller
    try:
        yield
    finally:
        core.init, util.write_user_code, pytorch._PyTorchTrialController = orig_init, orig_write, orig_controller


def _steps_completed(checkpoint: Path) -> int:
    import json

    try:
        return int(json.loads((checkpoint / "metadata.json").read_text())["steps_completed"])
    except (OSError, ValueError, KeyError):
        return 0
