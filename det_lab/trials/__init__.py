"""Trial base classes: subclass, and get the dataset pulled, checkpoints on the volume, every
metric mirrored to MLflow/Aim with lineage, correct resume, on a cluster and on a laptop.

- :class:`det_lab.trials.pytorch.LabPyTorchTrial` with :func:`det_lab.trials.pytorch.run`
  (script entrypoint) or the legacy ``module:Class`` entrypoint;
- :func:`det_lab.core.init` for training loops that are not PyTorchTrials.

Both offer the same names to trial code (:mod:`.surface`), composed by :mod:`.session` over the run
layer (:mod:`det_lab.runs`). This package holds only what a trial's code sees; the run's record and
the volume's lifecycle moved out in 0.2.0 (:mod:`det_lab.runs`, :mod:`det_lab.lifecycle`). Their old
paths (``det_lab.trials.record`` and the rest) keep working until 0.3.0, with one
``DeprecationWarning`` naming the new one: the same module object, so patches and ``isinstance`` hold.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    **{name: f"det_lab.runs.{name}" for name in (
        "base_models", "cachefile", "expconf", "fence", "harness", "identity", "lineage", "listing", "local",
        "record", "retention", "run_guard", "run_state", "validate")},
    **{name: f"det_lab.lifecycle.{name}" for name in ("prune", "space", "storage", "trees")},
}
"""The modules that moved out of this package in 0.2.0 (old name → new path); the aliases go in 0.3.0."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``det_lab.trials.<old>`` as the moved module itself, warning once per name."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:  # noqa: ARG002
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        # importlib's own frames are skipped: the warning points at the user's import line
        warnings.warn(f"{spec.name} moved to {new} in det_lab 0.2.0; the old path goes in 0.3.0: "
                      f"import {new} instead", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the moved module, already executed: importlib set its __spec__ to the old path's, put its own back
        module.__spec__ = self._specs[module.__name__]


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
