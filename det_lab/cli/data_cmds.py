"""``det-lab data ...``: register, pull, inspect and list datasets on the shared volume."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, print_dry_run, print_json, state

if TYPE_CHECKING:
    from det_lab import data

app = typer.Typer(help="Datasets on the shared volume (DVC): pulled once, used by every trial.", no_args_is_help=True)


def _spec_or_name(name: str | None, project: str | None, repo: str | None, path: str | None, rev: str) -> str | data.DatasetSpec:
    from det_lab import data

    if name and not (repo or path):
        return name
    if not (project and repo and path):
        fail("give a registered dataset NAME, or --project, --repo and --path")
    return data.DatasetSpec(project=project, repo=repo, path=path, rev=rev)


@app.command()
def register(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Name trials and configs use for it."),
    project: str = typer.Option(..., help="Project it belongs to (quota, cache)."),
    repo: str = typer.Option(..., help="Git URL or path of the DVC project repository."),
    path: str = typer.Option(..., help="DVC-tracked path inside the repository (has a .dvc file)."),
    rev: str = typer.Option("HEAD", help="Branch, tag or commit."),
    replace: bool = typer.Option(False, help="Replace an existing registration of NAME."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check everything and say what it would record (and "
                                 "which registration it replaces); write nothing."),
) -> None:
    """Register a dataset by name after checking that repo, revision and path exist."""
    from det_lab import data
    from det_lab.volume import human_bytes

    settings = state(ctx).settings
    if dry_run:
        identity, replaced = data.register_plan(name, data.DatasetSpec(project, repo, path, rev), settings,
                                                replace=replace)
        was = f", replacing {replaced.repo} {replaced.path}@{replaced.rev}" if replaced else ""
        console.print(f"would register {name}: {repo} {path}@{rev} (now {identity.commit[:10]}, {identity.nfiles} "
                      f"files, {human_bytes(identity.size)}){was}; dry run: nothing written", highlight=False)
        return
    identity = data.register(name, data.DatasetSpec(project, repo, path, rev), settings, replace=replace)
    console.print(f"registered {name}: {repo} {path}@{rev} (now {identity.commit[:10]}, "
                  f"{identity.nfiles} files, {human_bytes(identity.size)})", highlight=False)


@app.command()
def pull(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, help="Registered dataset name."),
    project: str | None = typer.Option(None, help="Without NAME: the project the dataset belongs to."),
    repo: str | None = typer.Option(None, help="Without NAME: the dataset's git repository (path or URL)."),
    path: str | None = typer.Option(None, help="Without NAME: the DVC-tracked path inside the repository."),
    rev: str = typer.Option("HEAD", help="Without NAME: the git revision (branch, tag or commit)."),
    as_json: bool = typer.Option(False, "--json", help="Print path and identity as JSON."),
) -> None:
    """Fetch a dataset revision into the shared cache once and print where to read it."""
    from det_lab import data
    from det_lab.volume import human_bytes

    settings = state(ctx).settings
    try:
        ds = data.pull(_spec_or_name(name, project, repo, path, rev), settings)
    except KeyboardInterrupt:
        fail("interrupted: nothing partial was published; pull again to finish", code=130)
    if ds.repaired:
        err_console.print(f"[yellow]warning:[/] {len(ds.repaired)} snapshot files were changed or deleted since "
                          f"they were verified and have been restored: {', '.join(ds.repaired[:5])}"
                          f"{' ...' if len(ds.repaired) > 5 else ''}", highlight=False, soft_wrap=True)
    if as_json:
        print_json({"path": str(ds.path), "fetched": ds.fetched, "repaired": list(ds.repaired),
                    "identity": asdict(ds.identity)})
        return
    how = "fetched" if ds.fetched else "already on the volume"
    console.print(f"{ds.path}  ({how}; {ds.identity.commit[:10]} {ds.identity.md5}, "
                  f"{ds.identity.nfiles} files, {human_bytes(ds.identity.size)})", highlight=False)


@app.command()
def status(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Registered dataset name."),
    as_json: bool = typer.Option(False, "--json", help="The identity, cache and snapshot as one JSON object."),
) -> None:
    """Show what a dataset name resolves to now and whether it is ready on the volume."""
    from det_lab import data
    from det_lab.volume import human_bytes

    settings = state(ctx).settings
    st = data.status(name, settings)
    if as_json:
        print_json({"name": name, **st.as_dict()})
        return
    i = st.identity
    console.print(f"{name}: {i.repo} {i.path}@{i.rev} -> commit {i.commit}", highlight=False)
    console.print(f"  DVC hash {i.md5}, {i.nfiles} files, {human_bytes(i.size)}", highlight=False)
    console.print(f"  shared cache: {st.cached_files}/{st.total_files} files", highlight=False)
    console.print(f"  snapshot: {st.snapshot or 'not yet (det-lab data pull ' + name + ')'}", highlight=False)


@app.command("list")
def list_(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Per project: sizes, datasets and snapshots as JSON."),
) -> None:
    """List datasets and snapshots on the volume with sizes per project."""
    from rich.table import Table

    from det_lab import data
    from det_lab.volume import human_bytes

    settings = state(ctx).settings
    listings = data.list_volume(settings)
    if as_json:
        print_json({"data_root": str(settings.data_root), "projects": [lst.as_dict() for lst in listings]})
        return
    table = Table(title=f"datasets on {settings.data_root}", title_justify="left")
    for col in ("project", "remote", "cache", "quota", "registered", "snapshots (revision: files)"):
        table.add_column(col)
    for lst in listings:
        snaps = "\n".join(f"{s.path}@{s.commit[:10]}: {s.nfiles}" for s in lst.snapshots) or "-"
        table.add_row(lst.project, human_bytes(lst.remote_bytes), human_bytes(lst.cache_bytes),
                      human_bytes(lst.quota_bytes),
                      "\n".join(sorted(lst.registered)) or "-", snaps)
    console.print(table)


@app.command()
def verify(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, help="Registered dataset name (default: every snapshot and cache object)."),
    repair: bool = typer.Option(False, "--repair", help="Restore damaged files from the DVC remote."),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --repair: say which files it would restore "
                                 "and which cache objects it would delete; change nothing."),
    as_json: bool = typer.Option(False, "--json", help="The counts and every damaged, repaired and planned path as JSON."),
) -> None:
    """Hash (md5, as DVC) every snapshot file and shared-cache object; --repair restores damage."""
    from det_lab.data.verify import verify as verify_volume

    settings = state(ctx).settings
    with console.status("hashing snapshots and cache objects") if not as_json else nullcontext():
        report = verify_volume(settings, name, repair=repair and not dry_run)
    if as_json:
        print_json(report.as_dict())
        raise typer.Exit(0 if report.ok or dry_run else 1)
    if repair and dry_run:
        for path in report.to_restore:
            console.print(f"would restore {path}", highlight=False)
        for path in report.to_delete:
            console.print(f"would delete  {path}", highlight=False)
        console.print(f"dry run: nothing changed; 'det-lab data verify --repair{' ' + name if name else ''}' restores "
                      f"{len(report.to_restore)} from the DVC remote and deletes {len(report.to_delete)} cache "
                      "objects (a later pull fetches them again)", highlight=False)
        return
    for path in report.damaged:
        how = "[green]repaired[/]" if path in report.repaired else "[red]damaged[/] "
        console.print(f"{how} {path}", highlight=False)
    for line in report.errors:
        err_console.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True)
    console.print(f"{report.snapshots} snapshots ({report.files} files) and {report.objects} cache objects "
                  f"checked: {len(report.damaged)} damaged, {len(report.repaired)} repaired", highlight=False)
    if not report.ok:
        if not repair and not report.errors:
            err_console.print(f"[bold red]error:[/] damaged data on the volume: run 'det-lab data verify --repair"
                              f"{' ' + name if name else ''}'", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command("import")
def import_(
    ctx: typer.Context,
    directory: str = typer.Argument(..., help="Directory to version: a LeRobot dataset, a COLMAP scene, ..."),
    name: str = typer.Argument(..., help="Name trials and configs use for it."),
    project: str = typer.Option(..., help="Project it belongs to (quota, cache)."),
    replace: bool = typer.Option(False, "--replace", help="Import as a new revision of an already registered NAME."),
    message: str | None = typer.Option(None, help="Commit message of the new revision."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what it would create, push and register "
                                 "(and which registration it replaces); write nothing."),
    as_json: bool = typer.Option(False, "--json", help="What was imported (with --dry-run: the plan) as JSON."),
) -> None:
    """Version a directory with DVC on the volume and register it as NAME, in one command."""
    from pathlib import Path

    from det_lab.data.importer import import_directory, import_plan
    from det_lab.volume import human_bytes

    settings = state(ctx).settings
    if dry_run:
        plan = import_plan(settings, Path(directory), name, project, replace=replace)
        if as_json:
            print_json(plan.as_dict())
            return
        print_dry_run(plan.lines(), "dry run: nothing written")
        return
    with console.status(f"versioning {directory} with DVC") if not as_json else nullcontext():
        spec, identity = import_directory(settings, Path(directory), name, project, replace=replace, message=message)
    if as_json:
        print_json({"name": name, "registered": asdict(spec), "identity": asdict(identity)})
        return
    console.print(f"imported {directory} as {name}: {spec.repo} {spec.path}@{spec.rev} (commit {identity.commit[:10]}, "
                  f"{identity.md5}, {identity.nfiles} files, {human_bytes(identity.size)})", highlight=False)
    console.print(f"trials use it with data.det_lab.dataset: {name}; 'det-lab data pull {name}' fetches it", highlight=False)


@app.command()
def gc(
    ctx: typer.Context,
    days: float = typer.Option(30.0, "--days", help="Evict snapshots not used for this many days."),
    yes: bool = typer.Option(False, "--yes", help="Delete (without it: a dry run that only shows what would go)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would be deleted (the default)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan (and what was done) as JSON."),
) -> None:
    """Evict unused snapshots and remove shared-cache objects no revision, run or pin needs."""
    from det_lab.lifecycle.storage import data_gc
    from det_lab.volume import human_bytes

    if yes and dry_run:
        fail("give --dry-run or --yes, not both")
    settings = state(ctx).settings
    with console.status("collecting what the datasets, runs and pins reference") if not as_json else nullcontext():
        made, report = data_gc(settings, days, yes=yes)
    if as_json:
        print_json({
            "days": made.days, "deleted": report is not None, "freed_bytes": made.freed_bytes,
            "projects": [{"project": p.project, "evict": [str(e.path) for e in p.evict], "remove_objects": len(p.remove),
                          "kept_objects": p.kept_objects, "freed_bytes": p.freed_bytes, "skipped": p.skipped,
                          "repositories": p.repositories} for p in made.projects],
            "evicted": [str(p) for p in report.evicted] if report else [],
            "removed_objects": report.removed if report else 0,
            "kept_back": report.kept_back if report else []})
        return
    verb = "freed" if report else "would free"
    for p in made.projects:
        if p.skipped:
            err_console.print(f"[yellow]warning:[/] {p.project}: {p.skipped}", highlight=False, soft_wrap=True)
        console.print(f"{p.project}: {len(p.evict)} snapshots unused for {days:g} days, {len(p.remove)} cache objects "
                      f"unreferenced ({p.kept_objects} kept): {verb} {human_bytes(p.freed_bytes)}", highlight=False)
    if report is None:
        console.print(f"dry run: nothing deleted; 'det-lab data gc --days {days:g} --yes' deletes this "
                      f"({human_bytes(made.freed_bytes)})", highlight=False)
        return
    for line in report.kept_back:
        err_console.print(f"[yellow]kept:[/] {line}", highlight=False, soft_wrap=True)
    console.print(f"evicted {len(report.evicted)} snapshots, removed {report.removed} cache objects; "
                  "a later pull links or fetches them again", highlight=False)


@app.command()
def pin(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Registered dataset name; its revision now is pinned under this label."),
    remove: bool = typer.Option(False, "--remove", help="Drop the pin instead."),
) -> None:
    """Keep a dataset revision in the shared cache whatever 'det-lab data gc' finds."""
    from det_lab.data.pins import pin_dataset

    settings = state(ctx).settings
    identity = pin_dataset(settings, name, remove=remove)
    if identity is None:
        console.print(f"unpinned {name}", highlight=False)
    else:
        console.print(f"pinned {name}: {identity.path}@{identity.commit[:10]} ({identity.md5})", highlight=False)
