"""``det-lab run <template> --local``: train an experiment config on this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, renamed_option, state, viewer_command

if TYPE_CHECKING:
    from det_lab.settings import LabSettings
    from det_lab.runs.record import VolumeRunRecord


def run(
    ctx: typer.Context,
    template: str = typer.Argument(..., help="Template name (vla, 3dgs, isaac) or a directory with an experiment config."),
    local_mode: bool = typer.Option(False, "--local", help="Run here through Determined's local training mode."),
    config: Path | None = typer.Option(None, "--exp-config", help="Experiment config (default: const.yaml in the template)."),
    old_config: Path | None = typer.Option(None, "--config", hidden=True, help="Old spelling of --exp-config."),
    resume: bool = typer.Option(False, "--resume", help="Continue the latest local run of this template."),
    run_name: str | None = typer.Option(None, "--run", help="With --resume: the run to continue; without: the new run's name."),
    seed: int | None = typer.Option(None, help="Seed for sampling hyperparameters of a search config."),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE",
        help="Set a key of the experiment config, dotted (data.det_lab.max_length.batches=50); repeatable."),
    slurm: bool = typer.Option(False, "--slurm", help="Submit it as a Slurm job (a search: an Optuna job array)."),
    partition: str | None = typer.Option(None, "--partition", help="With --slurm: the partition (one per GPU kind)."),
    time_limit: str | None = typer.Option(None, "--time", help="With --slurm: the job's time limit, e.g. 04:00:00."),
    wait: bool = typer.Option(False, "--wait", help="With --slurm: follow the job; exit with the trial's outcome."),
    gpus: str | None = typer.Option(None, "--gpus", metavar="0,1",
                                    help="With --local: train on these GPUs of this machine (det-lab gpus lists them)."),
    queue: bool = typer.Option(False, "--queue", help="With --local: wait in line when the GPUs are taken."),
) -> None:
    """Train a template: here with --local, as a Slurm job with --slurm (on Determined: det experiment create)."""
    config = renamed_option(config, old_config, "--config", "--exp-config")
    if slurm and local_mode:
        fail("pass --local (train here) or --slurm (a Slurm job), not both")
    if slurm:
        if resume:
            fail("a Slurm run resumes by resubmitting its job script: sbatch <run directory>/job.sbatch "
                 "(det-lab runs show NAME prints it)")
        if gpus is not None or queue:
            fail("--gpus and --queue are for --local runs; Slurm chooses a job's GPUs and queues it itself")
        return _run_slurm(ctx, template, config, overrides, partition, time_limit, wait, seed, run_name)
    if not local_mode:
        fail("pass --local (here) or --slurm (a Slurm job); on Determined use: det experiment create <config> <dir>")
    from det_lab.gpus import GpusError, LocalClaim
    from det_lab.runs import local

    settings = state(ctx).settings
    claim = LocalClaim(settings, gpus, queue)
    run_, cwd, command = local.prepare(settings, template, config, (run_name or True) if resume else False, seed,
                                       overrides=overrides, name=None if resume else run_name, warn=_warn,
                                       gpu_check=claim.check)
    with claim:  # the GPUs are given back however this ends (and by the kernel if it is killed)
        st = run_.state()
        how = f"resuming {st['name']} from checkpoint {st['latest_checkpoint']}" if resume else f"run {st['name']}"
        console.print(f"{how}\n  hyperparameters: {json.dumps(st['hparams'])}\n  log: {run_.log_file}", highlight=False)
        try:
            env = claim.wait(run_, on_wait=lambda why: console.print(f"  waiting for GPUs: {why}", highlight=False))
        except KeyboardInterrupt:
            run_.record_end(status="cancelled", waiting_for_gpus=None)
            fail(f"run {st['name']} cancelled while it waited for GPUs", 1)
        except GpusError as exc:
            run_.record_end(status="cancelled", waiting_for_gpus=None)
            fail(str(exc))
        if claim.gpus_words():
            console.print(f"  GPUs: {claim.gpus_words()}", highlight=False)
        proc = local.launch(run_, cwd, command, settings, extra_env=env)
        code = local.wait_with_progress(proc, run_, show=sys.stderr.isatty() or sys.stdout.isatty())
    if local.record_exit(run_, code) == "busy":
        fail(local.busy_error(run_))
    _summary(run_, code, settings)
    if code != 0:
        raise typer.Exit(code if code > 0 else 1)


def _run_slurm(ctx: typer.Context, template: str, config: Path | None, sets: list[str], partition: str | None,
               time_limit: str | None, wait: bool, seed: int | None, name: str | None) -> None:
    """``det-lab run T --slurm``: the run recorded on the volume, its trial submitted as a Slurm job."""
    from det_lab.services.launch import show_search, submit_template, wait_for
    from det_lab.slurm import submit

    def say(what: object) -> None:
        console.print(what, highlight=False)

    done = submit_template(state(ctx).settings, template, config, sets, partition=partition, time_limit=time_limit,
                           seed=seed, name=name)
    where = done.where
    if done.search is not None:
        st = done.search.state()
        n, _, c = st["array"].removeprefix("0-").partition("%")
        say(f"search {st['name']}: Slurm job array {done.job_id} ({int(n) + 1} trials, at most {c} at a time)\n"
            f"  job script: {done.search.job_script}\n  study: {done.search.dir / 'optuna.journal'}\n"
            f"  table: det-lab slurm search {st['name']}\n"
            f"  dashboard: optuna-dashboard {done.search.dir / 'optuna.journal'}")
        if wait:
            submit.wait_array(done.job_id)
            raise typer.Exit(show_search(done.search, say))
        return
    assert done.run is not None
    rst = done.run.state()
    gpus = f", {where.nodes} node(s) x {where.gpus_per_node} GPU(s)" if where.gpus_per_node else ""
    say(f"run {rst['name']}: Slurm job {done.job_id} (partition {where.partition}{gpus})\n"
        f"  hyperparameters: {json.dumps(rst['hparams'])}\n  job script: {done.run.job_script}\n"
        f"  log: {done.run.log_file}\n  follow: det-lab runs tail -f {rst['name']}")
    if wait:
        raise typer.Exit(wait_for(done.run, done.job_id, say))


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def _summary(run_: VolumeRunRecord, code: int, settings: LabSettings) -> None:
    from rich.table import Table

    from det_lab import templates
    from det_lab.trials.session import local_checkpoint_dir
    from det_lab.runs import local

    st = run_.state()
    step, val = run_.progress()
    title = st["status"] if code == 0 else f"{st['status']} (exit code {code})"
    table = Table(title=f"{st['name']}: {title}", show_header=False,
                  title_justify="left")
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # paths and commands are for copying: folded, never cut
    table.add_row("run directory", str(run_.dir))
    table.add_row("metrics", str(run_.metrics_file))
    table.add_row("steps", f"{step} of {st['max_length']} {st['max_length_unit']}")
    if val:
        table.add_row("last validation", ", ".join(f"{k}={v:.5g}" for k, v in val.items() if k not in ("batches", "epochs")))
    ckpts = st.get("checkpoints", [])
    if st.get("latest_checkpoint"):
        where = local_checkpoint_dir(settings, st["exp_conf"]["data"]["det_lab"]["project"], st["exp_conf"])
        table.add_row("checkpoints", f"{len(ckpts)} in {where}; latest {where / st['latest_checkpoint']} "
                                     f"(step {st.get('latest_checkpoint_step')})")
    else:
        table.add_row("checkpoints", "none")
    summary = run_.tracking_summary()
    if summary is not None:
        for b in summary["backends"]:
            line = f"run {b['run_id']}: {b['delivered']} events delivered"
            if b["pending"]:
                line += f", {b['pending']} waiting in {summary['journal']}"
            target = _targets(summary["journal"]).get(b["backend"])
            if target:
                line += f"\nstore: {target}\nopen it: {viewer_command(b['backend'], target)}"
            table.add_row(b["backend"], line)
    if code != 0:
        table.add_row("last log lines", local.tail(run_.log_file))
    if st["status"] != "finished" and st.get("latest_checkpoint"):
        again = templates.run_argument(Path(st["cwd"]))
        table.add_row("resume with", f"det-lab run {again} --local --resume --run {st['name']}")
    console.print(table)


def _targets(journal: str) -> dict[str, str]:
    """Where each backend delivered the run's metrics, as its journal recorded it."""
    from det_lab.tracking.journal import Journal, JournalError

    try:
        return Journal(Path(journal)).run()[1]
    except (JournalError, OSError):
        return {}
