"""``det-lab models ...``: base models on the volume (imported once, read offline by every run)."""

from __future__ import annotations

from pathlib import Path

import typer

from det_lab.cli.common import console, print_dry_run, print_json, state

app = typer.Typer(help="Base models on the shared volume: Hugging Face snapshots and torch hub weights, read "
                  "offline by every run.", no_args_is_help=True)


@app.command("import")
def import_(
    ctx: typer.Context,
    source: Path = typer.Argument(..., help="A downloaded hub snapshot (huggingface-cli download --local-dir DIR), "
                                  "a hub cache's models--org--name folder, or a torch hub weight file (*.pth)."),
    name: str | None = typer.Argument(None, help="The hub id it is loaded by (org/name); none for a weight file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Hash the files and say what it would copy and how big; "
                                 "write nothing."),
    as_json: bool = typer.Option(False, "--json", help="What was imported (with --dry-run: the plan) as JSON."),
) -> None:
    """Import a base model onto the volume once, as a new revision unless the same files are there."""
    from det_lab import models
    from det_lab.volume import human_bytes

    report = models.import_model(state(ctx).settings, source, name, dry_run=dry_run)
    if as_json:
        print_json(report.to_json())
        return
    if dry_run:
        print_dry_run(report.lines, f"dry run: nothing written; would copy {human_bytes(report.copy_bytes)}")
        return
    what = f"{report.name} revision {report.revision}" if report.kind == "hub" else report.name
    how = (f"imported ({human_bytes(report.copy_bytes)} copied)" if report.new
           else "already on the volume (made main)" if report.kind == "hub" else "already on the volume")
    console.print(f"{what}: {how}, {human_bytes(report.size)} at {report.path}", highlight=False, soft_wrap=True)
    for note in report.lines:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


@app.command("list")
def list_(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Every model with its revisions, and the torch weight "
                                 "files, as JSON."),
) -> None:
    """List the base models on the volume: revisions, sizes, which one runs load."""
    from rich.table import Table

    from det_lab import models
    from det_lab.volume import human_bytes

    listing = models.list_models(state(ctx).settings)
    if as_json:
        print_json(listing.to_json())
        return
    table = Table(title=f"base models in {listing.root}", title_justify="left")
    for col in ("model", "revisions", "main", "size", "last import"):
        table.add_column(col)
    for m in listing.models:
        last = m.revisions[-1]
        table.add_row(m.name, str(len(m.revisions)), (m.main or "-")[:12], human_bytes(m.size),
                      f"{last.imported_at or '?'} by {last.imported_by or '?'}")
    for w in listing.torch:
        table.add_row(f"torch: {w.name}", "-", "-", human_bytes(w.size), "-")
    console.print(table)


@app.command()
def show(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The model's hub id (org/name)."),
    as_json: bool = typer.Option(False, "--json", help="Its revisions, files, sizes and importers as JSON."),
) -> None:
    """Show a base model's revisions: sizes, who imported each, when and from where."""
    from det_lab import models
    from det_lab.volume import human_bytes

    info = models.show_model(state(ctx).settings, name)
    if as_json:
        print_json(info.to_json())
        return
    console.print(f"{info.name}: {len(info.revisions)} revisions, {human_bytes(info.size)}", highlight=False)
    for r in info.revisions:
        mark = " (main)" if r.revision == info.main else ""
        hub = f", hub commit {r.hub_commit}" if r.hub_commit else ""
        console.print(f"  {r.revision}{mark}: {len(r.files)} files, {human_bytes(r.size)}{hub}", highlight=False)
        console.print(f"    imported {r.imported_at or '?'} by {r.imported_by or '?'} on {r.host or '?'} "
                      f"from {r.source or '?'}", highlight=False, soft_wrap=True)
