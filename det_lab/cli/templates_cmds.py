"""``det-lab templates``: the experiment templates and notebooks that ship with det_lab."""

from __future__ import annotations

from pathlib import Path

import typer

from det_lab import templates
from det_lab.cli.common import console, print_json

app = typer.Typer(help="List the experiment templates and copy one (or the notebooks) to edit.",
                  no_args_is_help=True)


@app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="The templates and the notebooks as JSON."),
) -> None:
    """List the templates by name, with where their files are."""
    from rich.table import Table

    found = templates.available()
    notebooks = templates.notebooks_dir()
    if as_json:
        print_json({"templates": [{"name": t.name, "summary": t.summary, "path": str(t.path)} for t in found],
                    "notebooks": {"name": templates.NOTEBOOKS, "path": str(notebooks)}})
        return
    table = Table(box=None, show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("what")
    table.add_column("directory", overflow="fold")  # a cut path cannot be copied
    for t in found:
        table.add_row(t.name, t.summary, str(t.path))
    table.add_row(templates.NOTEBOOKS, "Jupyter notebooks: submit and watch, datasets, compare runs", str(notebooks))
    console.print(table, highlight=False)


@app.command("copy")
def copy_(
    name: str = typer.Argument(..., metavar="NAME",
                               help=f"A template ({', '.join(templates.NAMES)}) or '{templates.NOTEBOOKS}'."),
    dest: Path = typer.Argument(..., metavar="DIR", help="New directory to create (an existing one must be empty)."),
) -> None:
    """Copy a template (or the notebooks) to a new directory, to edit and submit with
    'det experiment create DIR/const.yaml DIR' or run with 'det-lab run DIR --local'."""
    out = templates.copy(name, dest)
    console.print(f"copied {name} to {out}", highlight=False, soft_wrap=True)
