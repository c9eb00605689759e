"""A run as ``det-lab runs`` and ``det-lab usage`` show it, whatever ran it: its live status (run.json's,
corrected by Slurm and by the trainer lock), why it waits, where it ran.

Above the schedulers and the accounting wing: a Slurm run's status is asked of Slurm, a pending
job's reason is explained by Slurm accounting's limits (:func:`det_lab.accounting.limits.pending_words`)
and a local run's place in line by :mod:`det_lab.gpus`. Finding runs is the trials layer's
(:func:`det_lab.runs.listing.all_runs`, :func:`~det_lab.runs.listing.find_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from det_lab.errors import UserError
from det_lab.settings import LabSettings
from det_lab.runs.record import VolumeRunRecord
from det_lab.runs.run_state import ENDED, RunState, RunStatus

#: what :func:`live_status` says of a run that ended (run.json's or Slurm's word for it)
FINAL: frozenset[str] = ENDED | {"completed", "cancelled", "gone", "failed", "timeout"}

class NotCancelled(UserError):
    """A run that ``det-lab runs cancel`` cannot stop from here (ended, gone, another machine's or user's)."""


#: statuses whose runs may carry a watchdog notice (it warns a run holding idle GPUs, or stopped one)
WATCHED = frozenset({RunStatus.RUNNING.value, RunStatus.STOPPED.value, RunStatus.CANCELLED.value})

#: "not asked yet": live_status and waiting ask Slurm themselves
_ASK: Any = object()


def where(run: VolumeRunRecord, st: RunState) -> str:
    """Where the run trains or trained: this machine's name, or its Slurm job and node."""
    slurm = st.get("slurm") or {}
    if not slurm:
        return st.get("host", "this machine") if run.kind == "local" else run.kind
    attempts = slurm.get("attempts") or []
    node = attempts[-1]["node"] if attempts else "-"
    return f"job {slurm.get('job_id', '-')} on {node}" + (f" ({len(attempts)} starts)" if len(attempts) > 1 else "")


def slurm_job(run: VolumeRunRecord, st: RunState) -> dict[str, str] | None | bool:
    """``scontrol show job`` of a Slurm run still going by run.json (None: Slurm forgot it);
    False when there is nothing to ask (not a Slurm run, ended, no job, or Slurm not answering)."""
    job_id = (st.get("slurm") or {}).get("job_id")  # from the state in hand: run.json is not read again
    if (st.get("status") or RunStatus.CREATED) in ENDED or not job_id:  # most runs of a long listing: asked nothing
        return False
    from det_lab.slurm import submit
    from det_lab.slurm.record import SlurmRunRecord

    if not isinstance(run, SlurmRunRecord):
        return False
    try:
        return submit.job_state(job_id)
    except submit.SlurmError:
        return False


def live_status(run: VolumeRunRecord, st: RunState | None = None, job: dict[str, str] | None | bool = _ASK) -> str:
    """run.json's status, corrected by Slurm for a job that ended without the driver saying so,
    and by the trainer lock for a local run whose trainer died (``st`` and ``job``: the run's state
    and :func:`slurm_job`, when the caller has them)."""
    st = run.state() if st is None else st
    status = str(st.get("status") or RunStatus.CREATED)
    job = slurm_job(run, st) if job is _ASK else job
    if isinstance(job, bool):
        if run.kind == "local" and status in (RunStatus.RUNNING, RunStatus.CREATED):  # "running" only while its trainer lives
            from det_lab.runs.run_guard import training_status

            return training_status(st, run.dir)
        return status
    from det_lab.slurm import submit

    if job is None or job.get("JobState") in submit.FINAL_STATES:
        return (job or {}).get("JobState", "gone").lower()
    return job["JobState"].lower()


def waiting(run: VolumeRunRecord, st: RunState | None = None, job: dict[str, str] | None | bool = _ASK) -> str | None:
    """Why a run waits, in words: a Slurm run's pending job (e.g. a per-user GPU limit), a local run in
    this machine's line for GPUs; None when it does not wait."""
    st = run.state() if st is None else st
    if run.kind == "local" and st.get("status") == RunStatus.WAITING:
        from det_lab.gpus import waiting_words

        return waiting_words(st.get("name", run.dir.name)) or "not in line any more: its det-lab run is gone"
    job = slurm_job(run, st) if job is _ASK else job
    if not isinstance(job, dict) or job.get("JobState") != "PENDING":
        return None
    from det_lab.accounting.limits import pending_words

    return pending_words(job)


def listing(settings: LabSettings, project: str | None, user: str | None,
            warn: Callable[[str], None]) -> list[dict[str, Any]]:
    """``det-lab runs list``'s rows, oldest run.json first: each run's name, kind, template, live
    status, progress, the watchdog's notice, where it ran, its last validation metric, its owner and
    why it waits; only ``project``'s and ``user``'s when given. A damaged or unreadable run.json is
    ``warn``-ed and listed as such; run.json and metrics are re-read only where they changed
    (:class:`~det_lab.runs.listing.ListingCache`)."""
    from det_lab.runs.listing import Listed, ListingCache, Unlisted, all_runs, user_name
    from det_lab.watchdog import notice_line

    cache = ListingCache(settings.data_root)
    owners: dict[int, str] = {}
    rows: list[tuple[int, dict[str, Any]]] = []
    runs = all_runs(settings, project, ordered=False, probe=False)  # ordered below, by what was stat'ed
    for run, listed in zip(runs, cache.read_all(runs)):  # re-read only where the files changed
        if isinstance(listed, Unlisted):  # one damaged or unreadable run.json: said, and listed as such
            warn(str(listed))
            try:
                kept = run.run_file.stat()
                uid, changed = kept.st_uid, kept.st_mtime_ns
            except OSError:  # a run directory this user may not enter
                uid, changed = -1, 0
            listed = Listed({"name": run.dir.name, "status": listed.status}, 0, {}, uid, changed)
        if listed is None:  # deleted since it was found
            continue
        st = cast(RunState, listed.state)
        owner = st.get("user") or user_name(listed.uid, owners)
        if user and owner != user:
            continue
        job = slurm_job(run, st)  # asked once, for the status and the reason it waits
        status = live_status(run, st, job)
        rows.append((listed.changed, {"name": st["name"], "kind": run.kind, "template": st.get("template"),
                     "status": status, "step": listed.step, "of": st.get("max_length"),
                     "watchdog": notice_line(run.dir) if status in WATCHED else None,
                     "where": where(run, st), "dir": str(run.dir),
                     "metric": next(iter(listed.validation.items()), None), "user": owner,
                     "waiting": waiting(run, st, job)}))
    cache.save(complete=project is None)
    return [row for _, row in sorted(rows, key=lambda pair: pair[0])]  # oldest run.json first


def describe(run: VolumeRunRecord) -> dict[str, Any]:
    """Everything ``det-lab runs show`` tells of a run, as one JSON-able dict: its record (config,
    hyperparameters, progress, checkpoints and what retention did with them), where it ran, why it
    waits, its GPU efficiency, the watchdog's notice and what each tracker received. A damaged
    run.json is its :class:`~det_lab.runs.record.RunRecordError`."""
    from det_lab.trials.gpu_sampler import summary_lines
    from det_lab.runs.listing import run_owner
    from det_lab.runs.retention import explain
    from det_lab.watchdog import notice_line

    st = run.state()
    step, validation = run.progress()
    job = slurm_job(run, st)
    efficiency = st.get("gpu_efficiency")
    return {
        "name": st.get("name", run.dir.name), "kind": run.kind, "status": live_status(run, st, job),
        "directory": str(run.dir), "user": run_owner(run, st), "waiting": waiting(run, st, job),
        "where": where(run, st), "template": st.get("template"), "config": st.get("config"),
        "hparams": st.get("hparams"), "step": step, "max_length": st.get("max_length"),
        "max_length_unit": st.get("max_length_unit", ""), "validation": validation,
        "checkpoints": st.get("checkpoints") or [], "latest_checkpoint": st.get("latest_checkpoint"),
        "latest_checkpoint_step": st.get("latest_checkpoint_step"), "retention": explain(run),
        "slurm": st.get("slurm") or None,
        "gpu_efficiency": summary_lines(efficiency) if isinstance(efficiency, dict) else [],
        "watchdog": notice_line(run.dir), "tracking": (run.tracking_summary() or {}).get("backends", []),
    }


def cancel_run(run: VolumeRunRecord) -> str:
    """Stop ``run`` as a preemption does (its trial checkpoints and stops): a Slurm run's job is
    cancelled; a local run's trial gets SIGTERM on its trainer's machine, or leaves this machine's
    line for GPUs. What was done, in words; :class:`NotCancelled` when nothing can be."""
    from det_lab.slurm import submit
    from det_lab.slurm.record import SlurmRunRecord

    st = run.state()
    name = run.dir.name
    if st.get("status") in ENDED:
        raise NotCancelled(f"run {name} already ended ({st.get('status')}); nothing to cancel")
    job_id = run.job_id() if isinstance(run, SlurmRunRecord) else None
    if not isinstance(run, SlurmRunRecord) or not job_id:
        return _cancel_local(run, name, st)
    submit.cancel(job_id)
    return (f"cancelled Slurm job {job_id} of run {name}; its trial checkpoints and stops "
            f"(resume it with: sbatch {run.job_script})")


def _cancel_local(run: VolumeRunRecord, name: str, st: RunState) -> str:
    """SIGTERM to the trial that holds the run's trainer lock: det_lab's preemption (checkpoint,
    stop); its ``det-lab run`` records the outcome. Only on the trainer's own machine."""
    import os
    import signal

    from det_lab.gpus import cancel_waiting
    from det_lab.runs import run_guard

    if st.get("status") == RunStatus.WAITING:  # in line for GPUs: its det-lab run leaves the line, recording it cancelled
        pid = cancel_waiting(name)
        if pid is None:
            raise NotCancelled(f"run {name} is not in this machine's line for GPUs (waiting on another machine, "
                               "or its det-lab run is gone)")
        return f"took run {name} out of the line for GPUs (its det-lab run, pid {pid}, records it cancelled)"
    holder = run_guard.trainer(run.dir)
    if holder is None or holder.stale:
        raise NotCancelled(f"run {name} has no live trainer ({holder.stale if holder else 'nobody holds it'}); "
                           "nothing to cancel")
    if not holder.here:
        raise NotCancelled(f"run {name} trains as pid {holder.pid} on host {holder.host}: "
                           f"run 'det-lab runs cancel {name}' there")
    try:
        os.kill(holder.pid, signal.SIGTERM)
    except ProcessLookupError:
        raise NotCancelled(f"run {name}: its trainer (pid {holder.pid}) is gone; nothing to cancel") from None
    except PermissionError:
        raise NotCancelled(f"run {name} trains as pid {holder.pid} of another user: stop it as that user") from None
    return (f"asked run {name}'s trial (pid {holder.pid}) to checkpoint and stop "
            f"(resume it with: det-lab run {st.get('template', '<template>')} --local --resume --run {name})")
