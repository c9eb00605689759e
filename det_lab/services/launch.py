"""``det-lab run --slurm`` and a Slurm rerun of ``det-lab reproduce``: check, submit, follow.

Above the schedulers and the accounting wing: the Slurm account a run charges is checked against
Slurm accounting's limits (:func:`charged_account`) before anything is created. The run itself is
recorded and submitted by :mod:`det_lab.slurm.run`; a search by :mod:`det_lab.slurm.search`.
"""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.settings import LabSettings
from det_lab.slurm import run as slurm_run
from det_lab.slurm import submit
from det_lab.slurm.record import SlurmRunRecord
from det_lab.slurm.search import Search, is_search
from det_lab.slurm.settings import SlurmSettings, load_slurm_settings
from det_lab.runs import local
from det_lab.runs.run_state import RunStatus

#: how a follower prints a line (rich markup off) or a rich renderable
Say = Callable[[Any], None]


class AccountRefused(submit.SlurmError):
    """Slurm accounting's limits can never admit the run (or accounting cannot be asked)."""


@dataclass(frozen=True)
class Submitted:
    """What ``det-lab run --slurm`` submitted: a run or a search, its job and where it goes."""

    job_id: str
    where: slurm_run.Placement
    run: SlurmRunRecord | None = None
    search: Search | None = None


def charged_account(slurm: SlurmSettings, conf: dict[str, Any], source: str) -> str | None:
    """With accounting, the run's project: the Slurm account it charges, after checking that Slurm's
    limits can ever admit its GPUs (:class:`AccountRefused` naming the limit when they cannot)."""
    if slurm.accounting is None:
        return None
    from det_lab.accounting.limits import limits_for, refusal
    from det_lab.accounting.slurm_accounts import AccountingError
    from det_lab.runs.expconf import lab_section

    project = lab_section(conf, source).project
    raw = (conf.get("resources") or {}).get("slots_per_trial")
    gpus = 1 if raw is None else int(raw)
    user = pwd.getpwuid(os.geteuid()).pw_name
    try:
        why = refusal(limits_for(slurm.cluster_name, user, project), gpus, str(slurm.source or "slurm.yaml"))
    except AccountingError as exc:
        raise AccountRefused(str(exc)) from None
    if why:
        raise AccountRefused(why)
    return project


def apply_sets(conf: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` overrides applied to an experiment config (TemplateError: one line)."""
    if not sets:
        return conf
    from det_lab.templates import apply_overrides

    return apply_overrides(conf, list(sets))


def submit_template(settings: LabSettings, template: str, config: Path | None, sets: list[str], *,
                    partition: str | None = None, time_limit: str | None = None, seed: int | None = None,
                    name: str | None = None, slurm_config: Path | None = None) -> Submitted:
    """Record a new run of ``template`` (named ``name``, else the next free name) and submit its trial
    as a Slurm job; a search config becomes an Optuna job array instead. Nothing is created when
    the request is refused (a bad ``--set``, a partition without such GPUs, an account's limit)."""
    slurm = load_slurm_settings(settings, slurm_config)
    if name is not None:
        _refuse_taken(settings, name)
    tdir = local.resolve_template(template)
    _, conf = local.load_config(tdir, config)
    conf = apply_sets(conf, sets)
    where = slurm_run.place(slurm, conf, partition, time_limit, charged_account(slurm, conf, str(config or tdir)))
    if is_search(conf):
        if name is not None:
            raise local.RunError("--run names one run; a search names its trials' runs itself")
        search, job_id = slurm_run.submit_search(settings, slurm, tdir, conf, str(config or tdir), where, seed)
        return Submitted(job_id, where, search=search)
    run_, _, _ = local.prepare(settings, template, config, False, seed, record_cls=SlurmRunRecord,
                               overrides=list(sets), name=name)
    assert isinstance(run_, SlurmRunRecord)
    return Submitted(slurm_run.submit_run(run_, settings, slurm, where), where, run=run_)


def _refuse_taken(settings: LabSettings, name: str) -> None:
    """A new run's name must name no run yet, of any kind (``det-lab runs`` finds runs by name)."""
    from det_lab.runs.listing import RunNotFound, find_run

    try:
        taken = find_run(settings, name)
    except RunNotFound:
        return
    again = f"; a Slurm run resumes by resubmitting its job script: sbatch {taken.dir / 'job.sbatch'}" \
        if isinstance(taken, SlurmRunRecord) else ""
    raise local.RunError(f"run {name} exists ({taken.kind}, {taken.dir}): choose another name with --run{again}")


def submit_prepared(settings: LabSettings, record: SlurmRunRecord) -> str:
    """Submit a run already recorded (``det-lab reproduce --slurm``) as a Slurm job: its job id."""
    slurm = load_slurm_settings(settings)
    where = slurm_run.place(slurm, record.state()["exp_conf"], None, None)
    return slurm_run.submit_run(record, settings, slurm, where)


def wait_for(run_: SlurmRunRecord, job_id: str, say: Say) -> int:
    """Follow the job until it has ended for good (a progress bar on a terminal, each change of the
    job's state as a line); the trial's outcome as an exit code."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    st = run_.state()
    total = st["max_length"] if st.get("max_length_unit") == "batches" else None
    show = sys.stderr.isatty() or sys.stdout.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task(f"job {job_id}", total=total)

        def changed(job: dict[str, str]) -> None:
            where = f" on {job['NodeList']}" if job.get("NodeList") not in (None, "", "(null)") else ""
            restarts = f" (restart {job['Restarts']})" if job.get("Restarts", "0") != "0" else ""
            bar.console.print(f"job {job_id}: {job.get('JobState')}{where}{restarts}", highlight=False)

        def tick() -> None:
            step, _ = run_.progress()
            bar.update(task, completed=step)

        try:
            job = submit.wait(job_id, on_change=changed, tick=tick)
        except KeyboardInterrupt:
            say(f"stopped waiting; job {job_id} goes on (cancel it with: det-lab runs cancel {st['name']})")
            return 130
        tick()
    st = run_.state()
    step, val = run_.progress()
    status = str(st.get("status"))
    if status not in (RunStatus.FINISHED, RunStatus.STOPPED, RunStatus.FAILED):
        status = (job or {}).get("JobState", "gone").lower()  # the job ended before the trial could say
    metrics = ", ".join(f"{k}={v:.5g}" for k, v in val.items() if k not in ("batches", "epochs"))
    say(f"{st['name']}: {status} at step {step} of {st['max_length']}; latest checkpoint "
        f"{st.get('latest_checkpoint')}" + (f"; last validation {metrics}" if metrics else ""))
    if status == RunStatus.FINISHED:
        return 0
    say(local.tail(run_.log_file))
    return int(st.get("exit_code") or 0) or 1


def show_search(s: Search, say: Say) -> int:
    """Print the search's table (``say`` gets a rich Table, then lines); 0 when there is a best trial."""
    import json

    from rich.table import Table

    st = s.state()
    metric = st["searcher"]["metric"]
    table = Table("trial", "task", "state", f"{metric}", "step", "hyperparameters", "run",
                  title=f"search {st['name']} ({st['searcher']['name']}, {st['array']})", title_justify="left")
    for r in s.rows():
        value = f"{r['value']:.5g}" if r["value"] is not None else ""
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        table.add_row(str(r["number"]), str(r["array_task"]), r["state"], value, str(r["step"] or ""), params,
                      str(r["run"]))
    say(table)
    best = s.best()
    if best is None:
        say("best: none yet (no trial has finished)")
        return 1
    say(f"best: trial {best['number']} {metric}={best['value']:.5g} run {best['run']} "
        f"params {json.dumps(best['params'])}")
    say(f"dashboard: optuna-dashboard {s.dir / 'optuna.journal'}")
    return 0
