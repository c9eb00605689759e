"""``det-lab usage``: GPU-hours, jobs and outcomes from Slurm's accounting, joined with the run records."""

from __future__ import annotations

import json

import typer

from det_lab.cli.common import console, err_console, fail, state


def usage(
    ctx: typer.Context,
    since: str = typer.Option("30d", "--since", help="Period: 30d, 12h, 2w, 90m, or a date (2026-11-01)."),
    by: str = typer.Option("user", "--by", help="Group by user, project or template."),
    as_json: bool = typer.Option(False, "--json", help="The summary and every job as one JSON object."),
    as_csv: bool = typer.Option(False, "--csv", help="Every job start as CSV (one row each)."),
) -> None:
    """Who used the GPUs, on what: sacct's jobs (user, project, GPUs, time, outcome) with their det_lab runs
    (run, template, dataset, code commit)."""
    from det_lab.services.usage import usage_report

    if as_json and as_csv:
        fail("pass --json or --csv, not both")
    report = usage_report(state(ctx).settings, since, by, lambda msg: err_console.print(
        f"warning: {msg}", style="yellow", highlight=False, markup=False))
    start, summary, jobs = report.since, report.summary, report.jobs
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
        return
    if as_csv:
        import csv
        import sys

        fields = list(jobs[0].as_dict()) if jobs else ["job_id"]
        writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for j in jobs:
            writer.writerow(j.as_dict())
        return
    from rich.table import Table

    table = Table(by, "jobs", "GPU-hours", *(("idle GPU-hours",) if by == "user" else ()), "hours", "det-lab runs",
                  "outcomes", title=f"GPU use since {start:%Y-%m-%d %H:%M} by {by}", title_justify="left")
    for r in summary:
        outcomes = ", ".join(f"{n} {s}" for s, n in sorted(r["outcomes"].items()))
        table.add_row(str(r[by]), str(r["jobs"]), f"{r['gpu_hours']:.2f}",
                      *((f"{r['idle_gpu_hours']:.2f}",) if by == "user" else ()), f"{r['elapsed_hours']:.2f}",
                      str(r["runs"]), outcomes)
    console.print(table)
    runs = [j for j in jobs if j.run]
    if runs:
        detail = Table("job", "user", "project", "GPUs", "minutes", "state", "run", "template", "dataset", "commit",
                       "GPU busy", title="det-lab runs", title_justify="left")
        for j in runs:
            detail.add_row(j.job_id, j.user, j.account, str(j.gpus), f"{j.elapsed_s / 60:.1f}", j.state.lower(),
                           j.run or "", j.template or "", j.dataset or "", (j.code_commit or "")[:12],
                           "-" if j.gpu_utilization is None else f"{j.gpu_utilization:.0f} %")
        console.print(detail)
