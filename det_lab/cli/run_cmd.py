"""``det-lab run <template> --local``: train an experiment config on this machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from det_lab.cli.common import console, fail, state
from det_lab.trials import local
from det_lab.trials.record import LocalRunRecord


def run(
    ctx: typer.Context,
    template: str = typer.Argument(..., help="Template name (vla, 3dgs, isaac) or a directory with an experiment config."),
    local_mode: bool = typer.Option(False, "--local", help="Run here through Determined's local training mode."),
    config: Path | None = typer.Option(None, "--config", help="Experiment config (default: const.yaml in the template)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the latest local run of this template."),
    run_name: str | None = typer.Option(None, "--run", help="With --resume: the run to continue; without: the new run's name."),
    seed: int | None = typer.Option(None, help="Seed for sampling hyperparameters of a search config."),
) -> None:
    """Train a template: locally with --local (the cluster path is 'det experiment create')."""
    if not local_mode:
        fail("only --local runs start from det-lab; on a cluster use: det experiment create <config> <dir>")
    settings = state(ctx).settings
    try:
        run_, cwd, command = local.prepare(settings, template, config, (run_name or True) if resume else False, seed,
                                           name=None if resume else run_name)
    except (local.RunError, ValueError) as exc:
        fail(str(exc))
    st = run_.state()
    how = f"resuming {st['name']} from checkpoint {st['latest_checkpoint']}" if resume else f"run {st['name']}"
    console.print(f"{how}\n  hyperparameters: {json.dumps(st['hparams'])}\n  log: {run_.log_file}", highlight=False)
    proc = local.launch(run_, cwd, command, settings)
    code = local.wait_with_progress(proc, run_, show=sys.stderr.isatty() or sys.stdout.isatty())
    local.record_exit(run_, code)
    _summary(run_, code)
    if code != 0:
        raise typer.Exit(code if code > 0 else 1)


def _summary(run_: LocalRunRecord, code: int) -> None:
    st = run_.state()
    step, val = run_.progress()
    title = st["status"] if code == 0 else f"{st['status']} (exit code {code})"
    table = Table(title=f"{st['name']}: {title}", show_header=False,
                  title_justify="left")
    table.add_row("run directory", str(run_.dir))
    table.add_row("steps", f"{step} of {st['max_length']} {st['max_length_unit']}")
    if val:
        table.add_row("last validation", ", ".join(f"{k}={v:.5g}" for k, v in val.items() if k not in ("batches", "epochs")))
    ckpts = st.get("checkpoints", [])
    table.add_row("checkpoints", f"{len(ckpts)}; latest {st.get('latest_checkpoint')} (step {st.get('latest_checkpoint_step')})")
    summary = run_.tracking_summary()
    if summary is not None:
        for b in summary["backends"]:
            line = f"run {b['run_id']}: {b['delivered']} events delivered"
            if b["pending"]:
                line += f", {b['pending']} waiting in {summary['journal']}"
            table.add_row(b["backend"], line)
    if code != 0:
        table.add_row("last log lines", local.tail(run_.log_file))
    if st["status"] != "finished":
        table.add_row("resume with", f"det-lab run {st['template']} --local --resume --run {st['name']}")
    console.print(table)
