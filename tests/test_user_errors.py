"""One user-error type: every error det_lab raises for a user's mistake is a ``UserError``, which the
entry point prints as one ``error:`` line; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import det_lab
from det_lab.errors import UserError

# Exceptions det_lab defines that are NOT a user's to fix, so they keep their traceback.
INTERNAL = {
    # control flow inside the rsl_rl stand-in learner: a stop after a save, caught a few lines below
    "det_lab.rl.standin.StopAfterSave",
    # the trial's own failure, raised inside the trial process with the child's last log lines
    # (many lines); its traceback in the trial log is what the user reads (tests/test_isaac.py)
    "det_lab.rl.supervisor.ChildFailed",
    # an MLflow server's error answer, handled by error_code inside the tracking sender; an HTTP 400
    # can be det_lab's own malformed request, whose traceback we want
    "det_lab.tracking.mlflow_backend.MlflowError",
    # private to the config checker: always caught and re-raised as PreflightError (a UserError)
    "det_lab.trials.validate._Fail",
}


def _defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(det_lab.__path__, "det_lab."):
        module = importlib.import_module(info.name)  # a module that does not import fails here, loudly
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_error_det_lab_defines_is_a_user_error_unless_listed_internal() -> None:
    found = _defined_exceptions()
    assert len(found) > 30  # the walk reached the packages, not just det_lab/__init__
    not_user = sorted(name for name, cls in found.items() if not issubclass(cls, UserError) and name not in INTERNAL)
    assert not_user == [], f"error classes that are neither a UserError nor listed as internal: {not_user}"
    stale = sorted(name for name in INTERNAL if name not in found or issubclass(found[name], UserError))
    assert stale == [], f"INTERNAL lists classes that are gone or are UserErrors now: {stale}"
