"""What the watchdog does to an idle holder once the grace period is over.

- a det_lab run (local-style): SIGTERM to its trainer, as ``det-lab runs cancel`` sends: the trial
  checkpoints and stops as on a preemption, and ``det-lab run --resume`` continues it;
- a Slurm job: ``scancel``, for an interactive one (``salloc``, ``srun --pty``) and a det_lab run's
  job (its trial checkpoints and stops on Slurm's SIGTERM); another tool's batch job only where the
  rule's ``cancel_batch_jobs`` says so;
- a Determined notebook or shell: ``POST /api/v1/notebooks/{id}/kill`` or ``/api/v1/shells/{id}/kill``
  on the master (proto/src/determined/api/v1/api.proto, KillNotebook and KillShell), with the bearer
  token of ``watchdog.master_token_file``; other Determined tasks and leases are warned only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from det_lab.errors import UserError
from det_lab.settings import LabSettings
from det_lab.watchdog.holders import Holder
from det_lab.watchdog_settings import IdleRule

KILL_PATHS = {"NOTEBOOK": "/api/v1/notebooks/{id}/kill", "SHELL": "/api/v1/shells/{id}/kill"}


@dataclass(frozen=True)
class Plan:
    """What would be done to a holder: ``verb`` ('' when it is warned only) and why not, if not."""

    verb: str  # "checkpoint and stop", "cancel", "kill", ""
    why_not: str = ""


def plan(holder: Holder, rule: IdleRule, det_lab_job: bool) -> Plan:
    """The action for ``holder`` under ``rule`` (``det_lab_job``: a Slurm job a det_lab run submitted)."""
    if not rule.act:
        return Plan("", "the rule warns only (act: false)")
    if holder.kind == "run":
        return Plan("checkpoint and stop")
    if holder.kind == "slurm":
        if holder.interactive:
            return Plan("cancel")
        if det_lab_job:
            return Plan("checkpoint and stop")
        if rule.cancel_batch_jobs:
            return Plan("cancel")
        return Plan("", "another tool's batch job: cancelled only with cancel_batch_jobs: true")
    if holder.kind == "determined" and holder.task_type in KILL_PATHS:
        return Plan("kill")
    return Plan("", "the watchdog stops det_lab runs, Slurm jobs and Determined notebooks and shells; this is warned only")


class ActionError(UserError, RuntimeError):
    """An action that did not happen (journaled as not done; tried again at the next pass)."""


def act(holder: Holder, settings: LabSettings, slurm_env: Mapping[str, str] | None = None) -> str:
    """Do :func:`plan`'s action; returns what was done, in words; :class:`ActionError` when it failed."""
    if holder.kind == "run":
        return _stop_run(holder)
    if holder.kind == "slurm":
        proc = subprocess.run(["scancel", holder.job_id], capture_output=True, text=True, timeout=60, check=False,
                              env=None if slurm_env is None else {**os.environ, **slurm_env})
        if proc.returncode != 0:
            raise ActionError(f"scancel {holder.job_id}: {proc.stderr.strip() or proc.returncode}")
        return f"cancelled Slurm job {holder.job_id}"
    if holder.kind == "determined":
        return _kill_task(holder, settings)
    raise ActionError(f"nothing to do to {holder.what}")


def _stop_run(holder: Holder) -> str:
    """SIGTERM to the run's trainer on this machine (the pid holding its trainer lock)."""
    from det_lab.runs import run_guard

    trainer = run_guard.trainer(Path(holder.run_dir))
    if trainer is None or trainer.stale or not trainer.here:
        raise ActionError(f"run {holder.name} has no live trainer on this machine")
    try:
        os.kill(trainer.pid, signal.SIGTERM)
    except OSError as exc:
        raise ActionError(f"run {holder.name}: cannot signal pid {trainer.pid}: {exc.strerror}") from None
    return f"asked run {holder.name}'s trial (pid {trainer.pid}) to checkpoint and stop"


def _kill_task(holder: Holder, settings: LabSettings) -> str:
    token_file = settings.watchdog.master_token_file
    if not settings.master_url or token_file is None:
        raise ActionError("no master_url or watchdog.master_token_file to kill Determined tasks with")
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise ActionError(f"{token_file}: {exc.strerror}") from None
    path = KILL_PATHS[holder.task_type].format(id=holder.name)
    req = urllib.request.Request(settings.master_url.rstrip("/") + path, data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30):  # the configured master
            pass
    except urllib.error.HTTPError as exc:
        raise ActionError(f"the master refused POST {path} (HTTP {exc.code})") from None
    except OSError as exc:
        raise ActionError(f"the master did not answer POST {path}: {getattr(exc, 'reason', exc)}") from None
    return f"killed Determined {holder.task_type.lower()} {holder.name}"
