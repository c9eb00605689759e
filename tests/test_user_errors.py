"""One user-error type: every error det_lab raises for a user's mistake is a ``UserError``, which the
entry point prints as one ``error:`` line; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys

import pytest

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
    "det_lab.runs.validate._Fail",
    # a stale copy of a run (a partitioned node's) stopping itself: nothing for a user to fix
    "det_lab.runs.fence.StaleAttempt",
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


# --- what a user sees: one line for their mistake, a traceback for det_lab's ---------------------

def _invoke(lab, *args: str):
    """``det-lab ARGS`` through typer's runner (no interpreter start) in ``lab``'s environment."""
    from typer.testing import CliRunner

    from det_lab.cli.app import app

    full = {k: None for k in os.environ if k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    return CliRunner().invoke(app, list(args), env={**full, **lab.env})


def _one_error_line(result, code: int = 2) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# Bad input that det_lab used to raise as a bare ValueError, caught by the CLI as a user error.
@pytest.mark.parametrize("args, needles", [
    (("exporter", "--source", "queue"), ("unknown source 'queue'", "gpus, slurm")),
    (("monitor", "report", "--since", "soon"), ("--since", "'soon' is not a period")),
    (("runs", "list", "--project", "nope"), ("unknown project 'nope'",)),
    (("runs", "prune", "--older-than", "soon"), ("--older-than soon", "30d")),
    (("templates", "copy", "nope", "/nonexistent/copy"), ("no template or directory 'nope'",)),
])
def test_bad_input_is_one_error_line(lab, args, needles):
    line = _one_error_line(_invoke(lab, *args))
    for needle in needles:
        assert needle in line, line


def _bug(*_args, **_kwargs):
    raise ValueError("a det_lab bug")


# A genuine bug (a ValueError from inside the function the command calls) under a command whose
# CLI used to catch ValueError as a user error: it must surface as the exception, not an error line.
@pytest.mark.parametrize("args, module, name", [
    (("exporter", "--source", "gpus"), "det_lab.monitoring.exporter", "build_sources"),
    (("monitor", "report", "--since", "7d"), "det_lab.monitoring.report", "parse_duration"),
    (("data", "pull", "demo"), "det_lab.data", "pull"),
    (("runs", "diff", "a", "b"), "det_lab.reproduce.find", "locate"),
    (("run", "vla", "--local"), "det_lab.runs.local", "prepare"),
])
def test_a_bug_keeps_its_traceback(lab, monkeypatch, args, module, name):
    monkeypatch.setattr(importlib.import_module(module), name, _bug)
    result = _invoke(lab, *args)
    assert "error:" not in result.stderr, result.stderr
    assert isinstance(result.exception, ValueError) and str(result.exception) == "a det_lab bug", \
        (result.exception, result.stderr)


def test_the_entry_point_prints_a_user_error_as_one_line_and_lets_a_bug_through(lab, monkeypatch, capsys):
    """``main()`` as the console script calls it: exit 2 with one line for a UserError; a bug's
    exception propagates (Python prints its traceback)."""
    from det_lab.cli.app import main

    for key in [k for k in os.environ if k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))]:
        monkeypatch.delenv(key)
    for key, value in lab.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(os, "umask", lambda mask: 0o022)  # main() shares files with the group: not this process
    monkeypatch.setattr(sys, "argv", ["det-lab", "exporter", "--source", "queue"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown source 'queue'"), err

    monkeypatch.setattr(sys, "argv", ["det-lab", "exporter", "--source", "gpus"])
    monkeypatch.setattr(importlib.import_module("det_lab.monitoring.exporter"), "build_sources", _bug)
    with pytest.raises(ValueError, match="a det_lab bug"):
        main()
    assert "error:" not in capsys.readouterr().err
