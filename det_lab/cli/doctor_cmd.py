"""``det-lab doctor``: one table, a line per check, each with its fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, print_json, state

if TYPE_CHECKING:
    from rich.table import Table

    from det_lab.checks import Check

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def doctor(
    ctx: typer.Context,
    as_json_: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
) -> None:
    """Check this machine for det_lab: volume, quotas, tools, Docker, GPUs, master, tracking.

    Exits 1 when any check fails.
    """
    from det_lab.doctor import Check, as_json, risk_lines, run_checks
    from det_lab.settings import LabConfigError, load_settings

    try:
        settings = load_settings(state(ctx).config)
    except LabConfigError as exc:
        checks = [Check("config", "fail", str(exc), "fix the lab config file as the message says")]
    else:
        checks = run_checks(settings)
    if as_json_:
        print_json(as_json(checks))
    else:
        console.print(_table("det-lab doctor", checks))
        console.print(_table("Sharing GPUs without a scheduler: what covers each risk", risk_lines(checks), fix=False))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def _table(title: str, checks: list[Check], fix: bool = True) -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail")
    if fix:
        table.add_column("fix")
    for c in checks:
        row = [c.name, f"[{STYLE[c.status]}]{c.status}[/]", c.detail] + ([c.fix] if fix else [])
        table.add_row(*row)
    return table
