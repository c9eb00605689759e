"""``det-lab reproduce RUN | CHECKPOINT_UUID | MLFLOW_RUN_ID | AIM_RUN_HASH``: re-run a recorded
run from its lineage and say whether it came out the same."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, print_json, state

if TYPE_CHECKING:
    from det_lab.reproduce.compare import Comparison


def reproduce(
    ctx: typer.Context,
    ref: str = typer.Argument(..., metavar="RUN|CHECKPOINT_UUID|MLFLOW_RUN_ID|AIM_RUN_HASH",
                              help="The run's name, a checkpoint's UUID, its MLflow run id or its Aim run hash."),
    local_mode: bool = typer.Option(False, "--local", help="Re-run it here (the default)."),
    slurm: bool = typer.Option(False, "--slurm", help="Re-run it as a Slurm job (and wait for it)."),
    continue_: bool = typer.Option(False, "--continue",
                                   help="Start from the checkpoint named (or the run's latest), not from the start."),
    run_name: str | None = typer.Option(None, "--run", help="The new run's name (default: <run>-repro-<time>)."),
    rtol: float = typer.Option(1e-5, "--rtol", help="Relative tolerance of the metric comparison."),
    atol: float = typer.Option(1e-8, "--atol", help="Absolute tolerance of the metric comparison."),
    as_json: bool = typer.Option(False, "--json", help="What was re-run (code, dataset, seed, environment "
                                 "differences) and the comparison as one JSON object."),
) -> None:
    """Re-run a run with its code commit (and saved local changes), dataset revision, config and
    seed, then compare its metrics with the original's step by step."""
    from det_lab.reproduce import compare, envdiff, rerun
    from det_lab.reproduce.find import locate
    from det_lab.runs import local
    from det_lab.runs.record import LocalRunRecord, VolumeRunRecord

    if local_mode and slurm:
        fail("pass --local or --slurm, not both")
    settings = state(ctx).settings
    record_cls: type[VolumeRunRecord] = LocalRunRecord
    if slurm:
        from det_lab.slurm.record import SlurmRunRecord

        record_cls = SlurmRunRecord
    origin = locate(settings, ref)
    rows, note = envdiff.against_here(origin.lineage)
    plan = rerun.prepare(settings, origin, name=run_name, continue_=continue_, record_cls=record_cls)
    ds = origin.lineage.get("dataset") or {}
    latest = plan.record.state()["latest_checkpoint"]
    summary = {"original": origin.name, "found_by": origin.found_by, "run": plan.record.dir.name,
               "from_step": plan.from_step, "from_checkpoint": latest if plan.from_step else None,
               "code": plan.code_source, "dataset": ds, "seed": origin.seed, "hparams": origin.hparams,
               "log": plan.record.log_file, "environment_note": note,
               "environment": [{"distribution": n, "recorded": before, "here": after} for n, before, after in rows]}
    if not as_json:
        _environment(rows, note)
    start = f" from checkpoint {latest} (step {plan.from_step})" if plan.from_step else ""
    if not as_json:
        console.print(f"reproducing {origin.name} (found by {origin.found_by}) as run {plan.record.dir.name}{start}\n"
                      f"  code: {plan.code_source}\n"
                      f"  dataset: {ds.get('path', '-')} at {str(ds.get('commit', '-'))[:12]} (md5 {ds.get('md5', '-')})\n"
                      f"  seed: {origin.seed}  hyperparameters: {json.dumps(origin.hparams)}\n"
                      f"  log: {plan.record.log_file}", highlight=False, soft_wrap=True)
    if slurm:
        exit_code = _run_slurm(ctx, plan)
    else:
        proc = local.launch(plan.record, plan.cwd, plan.command, settings)
        exit_code = local.wait_with_progress(proc, plan.record, show=sys.stderr.isatty() or sys.stdout.isatty())
        local.record_exit(plan.record, exit_code)
    summary["exit_code"] = exit_code
    if as_json and (exit_code != 0 or origin.record is None):
        print_json({**summary, "comparison": None})
    if exit_code != 0:
        fail(f"the reproduction {plan.record.dir.name} failed (exit code {exit_code}); last lines of "
             f"{plan.record.log_file}:\n{local.tail(plan.record.log_file)}", 1)
    if origin.record is None:
        if as_json:
            return
        console.print(f"the original's metrics are not on this volume (a cluster run): compare "
                      f"{plan.record.dir.name} with it in the tracker", highlight=False)
        return
    result = compare.compare(origin.metrics(), plan.record.metrics(), plan.from_step, rtol, atol)
    plan.record.update(reproduction=result.as_dict())
    if as_json:
        print_json({**summary, "comparison": result.as_dict()})
    else:
        _comparison(result)
    if result.diverged_at is not None:
        raise typer.Exit(1)


def _environment(rows: list[tuple[str, str, str]], note: str | None) -> None:
    from rich.table import Table

    if note:
        err_console.print(f"[yellow]warning:[/] {note}", highlight=False, soft_wrap=True)
    if not rows:
        if not note:
            console.print("environment: the same distributions and versions as recorded", highlight=False)
        return
    console.print(f"environment: {len(rows)} difference(s) from the run's (it runs anyway)", highlight=False)
    table = Table("distribution", "recorded", "here")
    for name, before, after in rows:
        table.add_row(name, before, after)
    console.print(table)


def _comparison(result: Comparison) -> None:
    from rich.table import Table

    after = f" after step {result.from_step}" if result.from_step else ""
    table = Table("metric", "steps", "max abs diff", "max rel diff", "first step beyond tolerance",
                  title=f"metrics, step by step{after}", title_justify="left")
    for m in result.metrics:
        table.add_row(m.key, str(m.steps), f"{m.max_abs:.3g}", f"{m.max_rel:.3g}",
                      "-" if m.first_beyond is None else str(m.first_beyond))
    console.print(table)
    console.print(f"verdict: {result.verdict}", highlight=False)


def _run_slurm(ctx: typer.Context, plan) -> int:
    """Submit the prepared run as a Slurm job and follow it to its end."""
    from det_lab.services.launch import submit_prepared, wait_for

    job_id = submit_prepared(state(ctx).settings, plan.record)
    console.print(f"  Slurm job {job_id}", highlight=False)
    return wait_for(plan.record, job_id, lambda what: console.print(what, highlight=False))
