"""Every place det_lab's trial layer depends on Determined's internals, in one module.

Determined is pinned at 0.38.1 (its last open-source release). Nothing in the installed
``determined`` package is edited: the shims below are applied while a det_lab trial runs and
restored after; the interception wraps methods of one trial's Core API context only.
:data:`PRIVATE_NAMES` lists each private name used, with the upstream line it depends on;
``tests/test_trials_harness.py`` fails when the pinned package changes underneath one of them.

Shims (:func:`harness_shims`) for what Determined 0.38.1's harness gets wrong on today's stack:

1. Resume fails under torch >= 2.6: ``torch.load`` defaults to ``weights_only=True`` and the
   harness's ``state_dict.pth`` holds numpy RNG state. We allow exactly the numpy types involved
   (:func:`allow_harness_unpickling`) instead of turning weights-only loading off.
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
6. A shuffling ``det.pytorch.DataLoader`` draws each epoch's order from the global torch RNG
   (``RandomSampler`` without a generator), which the harness restores from the checkpoint
   before the first batch: a resumed trial, on a cluster too, trains on other batches than an
   uninterrupted one. Such a sampler gets its own generator seeded with the trial seed; the
   harness's batch skipping then replays its epochs exactly.

Interception (:func:`intercept`): four methods of a trial's ``det.core.Context`` are wrapped,
calling the original first so Determined gets what it did before:

- ``train._report_trial_metrics``: the one funnel of training, validation and custom metrics;
- ``checkpoint.store_path``: checkpoint metadata gains the trial's lineage, and the hooks hear
  when the files are written, before the ``metadata.json`` that makes them a checkpoint;
- ``checkpoint._report_checkpoint``: called once a checkpoint is complete (after upload);
- ``preempt.should_preempt``: off-cluster, SIGTERM asks the trial to checkpoint and stop.

Reading (:func:`trial_config`, :func:`core_context_of`): the experiment config of a cluster
trial and the Core API context inside a ``PyTorchTrialContext`` have no public accessor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from det_lab.volume import share_tree


@dataclass(frozen=True)
class PrivateName:
    """One private name of the pinned ``determined`` (or numpy) that det_lab uses."""

    owner: str  # importable dotted path of the module or class
    name: str
    params: tuple[str, ...] | None  # a callable's parameters (without self); None: an attribute
    upstream: str  # file:line in determined 0.38.1
    why: str


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("determined.core.TrainContext", "_report_trial_metrics",
                ("group", "steps_completed", "metrics", "batch_metrics"), "determined/core/_train.py:96",
                "the one call every metric group goes through (training, validation, custom)"),
    PrivateName("determined.core.DummyTrainContext", "_report_trial_metrics",
                ("group", "steps_completed", "metrics", "batch_metrics"), "determined/core/_train.py:314",
                "its off-cluster twin"),
    PrivateName("determined.core.CheckpointContext", "_report_checkpoint",
                ("storage_id", "resources", "metadata"), "determined/core/_checkpoint.py:709",
                "called only once a checkpoint is complete: the moment it may become the run's latest"),
    PrivateName("determined.core.DummyCheckpointContext", "_report_checkpoint",
                ("storage_id", "resources", "metadata"), "determined/core/_checkpoint.py:756",
                "its off-cluster twin"),
    PrivateName("determined.pytorch", "_PyTorchTrialController",
                ("trial_inst", "context", "checkpoint_period", "validation_period", "reporting_period",
                 "smaller_is_better", "steps_completed", "latest_checkpoint", "local_training", "test_mode",
                 "searcher_metric_name", "checkpoint_policy", "step_zero_validation", "max_length",
                 "global_batch_size", "profiling_enabled"),
                "determined/pytorch/_pytorch_trial.py:41 (built by _trainer.py:222; "
                "steps_completed = 0 off-cluster at _trainer.py:168)",
                "shim 5: subclassed to pass the checkpoint's steps_completed on a local resume"),
    PrivateName("determined.TrialInfo", "_config", None, "determined/_info.py:96",
                "a cluster trial's experiment config (the master's copy, with defaults filled in)"),
    PrivateName("determined.pytorch.PyTorchTrialContext", "_core", None,
                "determined/pytorch/_pytorch_context.py:67",
                "the Core API context a PyTorchTrial trains with, to instrument it"),
    PrivateName("determined.core.PreemptContext", "_watcher", None, "determined/core/_preempt.py:165-168",
                "the chief's preemption watcher, whose flag a searcher's early stop raises (trials/searcher_stop.py)"),
    PrivateName("determined.core._preempt._PreemptionWatcher", "_should_preempt", None,
                "determined/core/_preempt.py:42", "the flag should_preempt() answers (and broadcasts) on the chief"),
    PrivateName("determined.pytorch.PyTorchTrialContext", "_PyTorchDistributedDataParallel", None,
                "determined/pytorch/_pytorch_context.py:297, :1057-1066",
                "the DDP class wrap_model builds with no options (trials/distributed.py passes one)"),
    PrivateName("numpy._core.multiarray", "_reconstruct", None, "numpy (not determined)",
                "shim 1: what the harness's pickled numpy RNG state refers to"),
)


def _resolve(dotted: str) -> Any:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def check_private_names() -> list[str]:
    """What no longer matches :data:`PRIVATE_NAMES` in the installed packages ([] when all do)."""
    import inspect

    problems = []
    for p in PRIVATE_NAMES:
        try:
            owner = _resolve(p.owner)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{p.owner}: cannot import ({exc})")
            continue
        if p.params is None:
            if isinstance(owner, type) and p.name not in vars(owner):
                # an instance attribute (not one of the class's own): assigned in __init__
                if f"self.{p.name} =" not in inspect.getsource(owner.__init__):
                    problems.append(f"{p.owner}.__init__ no longer sets self.{p.name} ({p.upstream})")
            elif not hasattr(owner, p.name):
                problems.append(f"{p.owner}.{p.name} is gone ({p.upstream})")
            continue
        target = getattr(owner, p.name, None)
        if target is None:
            problems.append(f"{p.owner}.{p.name} is gone ({p.upstream})")
            continue
        params = tuple(n for n in inspect.signature(target).parameters if n != "self")
        if params != p.params:
            problems.append(f"{p.owner}.{p.name}{params}: expected {p.params} ({p.upstream})")
    return problems


# --- reading -----------------------------------------------------------------------------------------


def trial_config(info: Any) -> dict[str, Any]:
    """The experiment config of the cluster trial described by ``det.get_cluster_info()``."""
    return info.trial._config


def raise_preemption_flag(preempt: Any) -> bool:
    """Make ``preempt.should_preempt()`` answer yes on the chief, as a preemption signal would (and the
    chief's answer is what every worker is given); False where this rank has no watcher."""
    watcher = getattr(preempt, "_watcher", None)
    if watcher is None:
        return False
    watcher._should_preempt = True
    return True


def core_context_of(pytorch_context: Any) -> Any:
    """The ``det.core.Context`` a ``PyTorchTrialContext`` trains with."""
    return pytorch_context._core


def wrap_model_with_ddp_options(pytorch_context: Any, model: Any, **options: Any) -> Any | None:
    """``pytorch_context.wrap_model(model)``, the DistributedDataParallel it builds on several slots
    given ``options``; None, with nothing wrapped, where the harness has no such class to swap."""
    base = getattr(type(pytorch_context), "_PyTorchDistributedDataParallel", None)
    if base is None:
        return None
    pytorch_context._PyTorchDistributedDataParallel = functools.partial(base, **options)
    try:
        return pytorch_context.wrap_model(model)
    finally:
        del pytorch_context._PyTorchDistributedDataParallel


# --- interception ------------------------------------------------------------------------------------


class Interceptor(Protocol):
    """What :func:`intercept` calls; :class:`det_lab.trials.session.LabSession` implements it."""

    def on_metrics(self, group: str, step: int, metrics: dict[str, Any]) -> None: ...

    def checkpoint_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]: ...

    def checkpoint_written(self, path: Path) -> None: ...

    def on_checkpoint(self, storage_id: str, metadata: dict[str, Any]) -> None: ...

    def on_should_preempt(self, answer: bool) -> bool: ...


def intercept(core: Any, hooks: Interceptor) -> None:
    """Wrap ``core``'s metric, checkpoint and preemption calls (see the module docstring)."""
    train, ckpt, preempt = core.train, core.checkpoint, core.preempt
    report_metrics, store_path = train._report_trial_metrics, ckpt.store_path
    report_checkpoint, should_preempt = ckpt._report_checkpoint, preempt.should_preempt

    def _report_trial_metrics(group, steps_completed, metrics, batch_metrics=None):
        result = report_metrics(group, steps_completed, metrics, batch_metrics)
        hooks.on_metrics(group, steps_completed, metrics)
        return result

    @contextlib.contextmanager
    def _store_path(metadata=None, *args, **kwargs):
        with store_path(hooks.checkpoint_metadata(dict(metadata or {})), *args, **kwargs) as stored:
            yield stored
            hooks.checkpoint_written(Path(stored[0]))  # the files are there; metadata.json comes next

    def _report_checkpoint(storage_id, resources=None, metadata=None):
        result = report_checkpoint(storage_id, resources, metadata)
        hooks.on_checkpoint(storage_id, metadata or {})
        return result

    def _should_preempt(*args, **kwargs):
        return hooks.on_should_preempt(should_preempt(*args, **kwargs))

    train._report_trial_metrics = _report_trial_metrics
    ckpt.store_path = _store_path
    ckpt._report_checkpoint = _report_checkpoint
    preempt.should_preempt = _should_preempt


# --- shims -------------------------------------------------------------------------------------------


def allow_harness_unpickling() -> None:
    """Let ``torch.load(weights_only=True)`` read the numpy state the harness saves (shim 1)."""
    import numpy as np
    import torch

    dtype_classes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8, np.bool_)]
    torch.serialization.add_safe_globals([np._core.multiarray._reconstruct, np.ndarray, np.dtype, *dtype_classes])


def tensorboard_available() -> bool:
    """Whether Determined's TensorBoard logging can be enabled (shim 2)."""
    return importlib.util.find_spec("tensorboard") is not None


_ALWAYS_SKIP = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".det-lab"}


def _user_code_ignore(skip: list[Path]) -> Callable[[str, list[str]], set[str]]:
    """A shutil ignore function leaving out ``skip`` paths and VCS/venv dirs (shim 4)."""
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
    """Apply shims 1 and 3-6 for the duration of a trial.

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
            trial = kwargs["trial_inst"] if "trial_inst" in kwargs else args[0]
            trial.build_training_data_loader = seeding_shuffle(trial.build_training_data_loader)
            latest = kwargs.get("latest_checkpoint")
            if kwargs.get("local_training") and latest and not kwargs.get("steps_completed") and checkpoint_dir:
                kwargs["steps_completed"] = _steps_completed(checkpoint_dir / latest)
            super().__init__(*args, **kwargs)

    @functools.wraps(orig_write)
    def write_user_code(path: Path, on_cluster: bool) -> None:
        code_path = Path(path) / "code"
        if on_cluster:
            orig_write(path, on_cluster)
        else:
            if code_path.exists():
                shutil.rmtree(code_path)
            shutil.copytree(".", code_path, ignore=_user_code_ignore([*skip_in_code, Path(path)]))
        share_tree(code_path)  # Determined makes code/ 0755 (and copies modes): the group could not delete it

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


def seeding_shuffle(build: Callable[[], Any]) -> Callable[[], Any]:
    """Shim 6: a shuffling ``det.pytorch.DataLoader`` whose sampler has no generator gets one."""

    def build_training_data_loader() -> Any:
        import torch
        from determined import pytorch

        loader = build()
        sampler = getattr(loader, "sampler", None)
        if isinstance(loader, pytorch.DataLoader) and isinstance(sampler, torch.utils.data.RandomSampler) \
                and sampler.generator is None:
            # torch.initial_seed() is the trial seed here (Determined's on a cluster, det_lab's locally)
            sampler.generator = torch.Generator().manual_seed(torch.initial_seed())
        return loader

    return build_training_data_loader


def _steps_completed(checkpoint: Path) -> int:
    try:
        return int(json.loads((checkpoint / "metadata.json").read_text())["steps_completed"])
    except (OSError, ValueError, KeyError):
        return 0
