"""``det-lab runs list|show|tail|cancel|diff``: runs on the volume, whatever ran them (local, Slurm)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, state

if TYPE_CHECKING:
    from det_lab.settings import LabSettings
    from det_lab.runs.record import VolumeRunRecord

app = typer.Typer(help="Runs recorded on the volume (det-lab run --local / --slurm): list, show, tail, cancel.",
                  no_args_is_help=True)

def read_state(run: VolumeRunRecord) -> dict:
    """``run``'s run.json; a damaged one is one error line naming it (exit 1)."""
    from det_lab.runs.record import RunRecordError

    try:
        return run.state()
    except RunRecordError as exc:
        fail(str(exc), 1)


@app.command("list")
def list_runs(
    ctx: typer.Context,
    project: str | None = typer.Option(None, "--project", "-p", help="Only this project's runs."),
    user: str | None = typer.Option(None, "--user", "-u", help="Only the runs of this Unix user."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per run."),
) -> None:
    """Every run on the volume, oldest first: kind, status, progress, where it ran, who owns it."""
    settings = state(ctx).settings
    if project:
        settings.project(project)  # an unknown one: LabConfigError
    from det_lab.services.runs import listing

    rows = listing(settings, project, user, lambda msg: err_console.print(f"warning: {msg}", style="yellow",
                                                                          highlight=False, markup=False))
    if as_json:
        typer.echo("".join(json.dumps(row) + "\n" for row in rows), nl=False)
        return
    # plain columns: rich's Table measures every cell, seconds for thousands of runs
    table = [("run", "kind", "status", "progress", "last validation", "where")]
    for r in rows:
        metric = f"{r['metric'][0]}={r['metric'][1]:.4g}" if r["metric"] else ""
        status = f"{r['status']}: {r['waiting']}" if r["waiting"] else r["status"]
        status = f"{status} ({r['watchdog']})" if r["watchdog"] else status
        table.append((r["name"], r["kind"], status, f"{r['step']}/{r['of'] if r['of'] is not None else '?'}", metric,
                      r["where"]))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    typer.echo("".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() + "\n" for row in table),
               nl=False)


@app.command()
def show(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The run's name (det-lab runs list)."),
    as_json: bool = typer.Option(False, "--json", help="The run's record as one JSON object."),
) -> None:
    """A run's record: config, hyperparameters, checkpoints, where it ran, tracking."""
    from rich.table import Table

    from det_lab.services.runs import describe

    from det_lab.runs.listing import find_run

    run = find_run(state(ctx).settings, name)
    read_state(run)  # a damaged run.json: its one error line, exit 1
    d = describe(run)
    if as_json:
        typer.echo(json.dumps(d, default=str))
        return
    table = Table(title=f"{d['name']} ({d['kind']}): {d['status']}", show_header=False, title_justify="left")
    table.add_row("directory", d["directory"])
    table.add_row("user", d["user"])
    if d["waiting"]:
        table.add_row("waiting", d["waiting"].removeprefix("waiting: "))
    table.add_row("config", str(d["config"]))
    table.add_row("hyperparameters", json.dumps(d["hparams"]))
    table.add_row("progress", f"{d['step']} of {d['max_length']} {d['max_length_unit']}")
    if d["validation"]:
        table.add_row("last validation", ", ".join(f"{k}={v:.5g}" for k, v in d["validation"].items()))
    table.add_row("checkpoints", f"{len(d['checkpoints'])}; latest {d['latest_checkpoint']} "
                                 f"(step {d['latest_checkpoint_step']})")
    for row in d["retention"]:  # what retention kept and why, what it deleted
        table.add_row(f"  step {row['step']}", f"{row['state']}: {row['why']}; {row['uuid']}")
    slurm = d["slurm"] or {}
    if slurm:
        table.add_row("slurm job", f"{slurm.get('job_id')} in partition {slurm.get('partition')}, "
                                   f"{slurm.get('nodes')} node(s) x {slurm.get('gpus_per_node')} GPU(s)")
        for a in slurm.get("attempts") or []:
            moved = f"; moved from {a['moved_from']}: {a['why']}" if a.get("moved_from") else ""
            where = f"{', '.join(a['nodes'])} (rank 0 on {a['node']}; " if a.get("nodes") else f"{a['node']} ("
            table.add_row("  started", f"{a['started']} on {where}restart {a['restart']}){moved}")
        table.add_row("job script", str(slurm.get("script")))
    for i, line in enumerate(d["gpu_efficiency"]):
        table.add_row("GPU efficiency" if i == 0 else "", line)
    if d["watchdog"]:
        table.add_row("watchdog", d["watchdog"])
    for b in d["tracking"]:
        table.add_row(b["backend"], f"run {b['run_id']}: {b['delivered']} events delivered, {b['pending']} pending")
    console.print(table)


@app.command()
def tail(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The run's name."),
    lines: int = typer.Option(20, "--lines", "-n", help="How many lines to show first."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the run ends."),
) -> None:
    """The run's log (train.log): its last lines, and with -f what follows."""
    from det_lab.services.runs import FINAL, live_status

    from det_lab.runs.listing import find_run

    run = find_run(state(ctx).settings, name)
    try:
        text = run.log_file.read_text(errors="replace")
    except FileNotFoundError:
        text = ""
    for line in text.splitlines()[-lines:]:
        typer.echo(line)
    if not follow:
        return
    pos = len(text.encode())
    while True:
        try:
            with open(run.log_file, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            pos += len(chunk)
            typer.echo(chunk.decode(errors="replace"), nl=False)
        elif live_status(run) in FINAL:
            return
        time.sleep(0.5)


@app.command()
def cancel(ctx: typer.Context, name: str = typer.Argument(..., help="The run's name.")) -> None:
    """Stop a run: its trial checkpoints and stops, as on a preemption. A Slurm job is cancelled; a
    local run's trial is signalled on the machine it trains on."""
    from det_lab.services.runs import cancel_run

    from det_lab.runs.listing import find_run

    run = find_run(state(ctx).settings, name)
    read_state(run)  # a damaged run.json: its one error line, exit 1
    console.print(cancel_run(run), highlight=False)


@app.command("diff")
def diff_runs(
    ctx: typer.Context,
    a: str = typer.Argument(..., metavar="A", help="A run: its name, a checkpoint UUID, an MLflow run id or Aim run hash."),
    b: str = typer.Argument(..., metavar="B", help="The other run, named the same ways."),
    as_json: bool = typer.Option(False, "--json", help="The differences as one JSON object."),
) -> None:
    """What differs between two runs: config and hyperparameters, dataset, code (git diff --stat and
    saved patches), environment, scheduler and host; and their final metrics, side by side."""
    from rich.table import Table

    from det_lab.reproduce.diff import runs_diff
    from det_lab.reproduce.find import locate

    settings = state(ctx).settings
    result = runs_diff(locate(settings, a), locate(settings, b))
    if as_json:
        typer.echo(json.dumps(result, default=str))
        return
    diffs = result["differences"]
    table = Table("what", result["a"], result["b"], title=f"{len(diffs)} difference(s)", title_justify="left")
    for d in diffs:
        table.add_row(f"{d['section']}: {d['field']}", str(d["a"]), str(d["b"]))
    console.print(table)
    if result["code_diff_stat"]:
        console.print(f"code: git diff --stat {result['a']} -> {result['b']}\n{result['code_diff_stat']}", highlight=False)
    for side in ("a", "b"):
        if result["patches"][side]:
            console.print(f"{result[side]} ran with local changes: {result['patches'][side]}", highlight=False)
    metrics = Table("final metric", result["a"], result["b"], title_justify="left")
    for key, vals in result["final_metrics"].items():
        metrics.add_row(key, *("-" if vals[s] is None else f"{vals[s]:.6g}" for s in ("a", "b")))
    console.print(metrics)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _plan_out(plan, yes: bool, as_json: bool, settings: LabSettings) -> None:
    """Print a deletion plan (``det_lab.lifecycle.prune``); with ``yes``, carry it out."""
    from det_lab.lifecycle import prune

    if as_json:
        typer.echo(json.dumps({"runs": [r.as_dict() for r in plan.runs], "refused": [r.as_dict() for r in plan.refused],
                               "bytes": plan.bytes, "leftovers": [str(p) for p in plan.leftovers]}))
    else:
        rows = [("run", "project", "owner", "status", "size")]
        rows += [(r.name, r.project, r.owner, r.status, _size(r.bytes)) for r in plan.runs]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        typer.echo(f"{len(plan.runs)} run(s) to delete, {_size(plan.bytes)} in all:")
        for row in rows if plan.runs else []:
            typer.echo("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for r in plan.runs:
            for uuid, other in r.kept_checkpoints.items():
                typer.echo(f"  {r.name}: checkpoint {uuid} stays: run {other} lists it")
            for line in r.trackers:
                typer.echo(f"  {r.name}: tracker: {line}")
        for r in plan.refused:
            typer.echo(f"  not deleted: {r.name} ({r.owner}, {r.status}): {r.refused}")
        for p in plan.leftovers:
            typer.echo(f"  left by a deletion that was killed: {p} (removed too)")
    if not yes:
        if not as_json and (plan.runs or plan.leftovers):
            typer.echo("nothing deleted yet: run again with --yes to delete")
        return
    for d in prune.execute(settings, plan):
        if not as_json:
            console.print(f"deleted run {d.name}: {_size(d.bytes)}, {d.checkpoints} checkpoint(s); "
                          + "; ".join(d.trackers), highlight=False, markup=False)


@app.command("delete")
def delete_runs(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., metavar="RUN...", help="The runs' names (det-lab runs list)."),
    yes: bool = typer.Option(False, "--yes", help="Delete them (without it: only print the plan)."),
    as_json: bool = typer.Option(False, "--json", help="The plan as one JSON object."),
) -> None:
    """Delete runs: their directories and checkpoints (a checkpoint another run lists stays), their
    tracker runs tagged det_lab.deleted, not erased. Prints the plan; --yes does it. Never a run
    that trains or is queued, nor one this user's Unix rights do not let it remove."""
    from det_lab.lifecycle import prune

    settings = state(ctx).settings
    plan = prune.plan_delete(settings, names)
    _plan_out(plan, yes, as_json, settings)


@app.command("prune")
def prune_runs(
    ctx: typer.Context,
    older_than: str | None = typer.Option(None, "--older-than", help="Runs whose record has not changed for this long: 30d, 12h, 2w."),
    status: str | None = typer.Option(None, "--status", help="Runs with one of these statuses: failed,stopped,..."),
    user: str | None = typer.Option(None, "--user", "-u", help="Only this Unix user's runs."),
    project: str | None = typer.Option(None, "--project", "-p", help="Only this project's runs."),
    yes: bool = typer.Option(False, "--yes", help="Delete them (without it: only print the plan)."),
    as_json: bool = typer.Option(False, "--json", help="The plan as one JSON object."),
) -> None:
    """Delete the runs matching every filter given, as 'runs delete' does; runs that train, or
    that this user may not remove, are listed and left alone. Prints the plan; --yes does it."""
    from det_lab.lifecycle import prune

    settings = state(ctx).settings
    plan = prune.plan_prune(settings, older_than=older_than, statuses=status, user=user, project=project)
    _plan_out(plan, yes, as_json, settings)
