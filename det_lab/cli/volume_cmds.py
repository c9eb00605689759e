"""``det-lab init`` and ``det-lab config``: the lab configuration and the shared volume."""

from __future__ import annotations

import typer

from det_lab.cli.common import console, fail, print_json, state


def init(
    ctx: typer.Context,
    demo: bool = typer.Option(False, "--demo", help="Also publish the demo datasets (vla-demo, 3dgs-demo)."),
) -> None:
    """Create the shared volume's layout under the data root (idempotent, never overwrites)."""
    from det_lab.settings import LabConfigError, check_writable
    from det_lab.volume import VolumeLayout, init_volume

    settings = state(ctx).settings
    layout = VolumeLayout.from_settings(settings)
    try:
        check_writable(layout.root, layout.state, layout.locks)  # an existing volume mounted read-only
    except LabConfigError as exc:
        fail(f"cannot initialise {settings.data_root}: {exc}")
    try:
        report = init_volume(settings)
    except (OSError, LabConfigError) as exc:  # a read-only volume, the config's group missing here
        fail(f"cannot initialise {settings.data_root}: {exc}")
    for d in report.created:
        console.print(f"[green]created[/]  {d}", highlight=False)
    for d in report.fixed_permissions:
        console.print(f"[yellow]shared[/]   {d} (setgid, group-writable)", highlight=False)
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    console.print(
        f"{settings.data_root}: {len(report.created)} directories created, "
        f"{len(report.existing)} already there, nothing overwritten",
        highlight=False,
    )
    if demo:
        from det_lab.data.publish import publish_demos

        with console.status("generating and publishing the demo datasets"):
            published = publish_demos(settings)
        for name in published:
            console.print(f"[green]published[/] {name} (pull it with: det-lab data pull {name})", highlight=False)
        if not published:
            console.print("demo datasets already published", highlight=False)


def config(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="The configuration (quotas in bytes), its source and the "
                                 "environment overrides as JSON."),
) -> None:
    """Print the effective lab configuration and where it came from."""
    import yaml

    from det_lab.settings import ENV_OVERRIDES

    settings = state(ctx).settings
    if as_json:
        print_json({"source": str(settings.source) if settings.source else None,
                    "environment_overrides": dict(ENV_OVERRIDES), "config": settings.model_dump(mode="json")})
        return
    console.print(f"# source: {settings.source or 'built-in defaults'}", highlight=False)
    console.print(f"# environment overrides: {', '.join(ENV_OVERRIDES)}", highlight=False)
    data = settings.model_dump(mode="json")
    for p in data["projects"].values():
        p["quota"] = f"{p['quota'] / 2**30:g}GiB"
    console.print(yaml.safe_dump(data, sort_keys=False), highlight=False, end="")


app = typer.Typer(help="The shared volume: who uses its space.", no_args_is_help=True)


@app.command()
def usage(
    ctx: typer.Context,
    by: str = typer.Option("project", "--by", help="Group the bytes by project, user, kind or run."),
    days: float = typer.Option(30.0, "--days", help="What 'data gc --days' and 'runs prune --older-than' would free uses this."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Bytes on the volume by project, user, kind (checkpoints, snapshots, cache, outputs) or run,
    hard links counted once (as du), and what data gc and runs prune would free."""

    from det_lab.lifecycle.space import volume_space
    from det_lab.volume import human_bytes

    if by not in ("project", "user", "kind", "run"):
        fail(f"--by must be project, user, kind or run (got {by!r})")
    if not days >= 0:
        fail(f"--days must be 0 or more (got {days:g})")
    settings = state(ctx).settings
    report = volume_space(settings, days=days)
    rows = report.by(by)  # type: ignore[arg-type]
    if as_json:
        print_json({
            "by": by, "total_bytes": report.total, "rows": [{"name": n, "bytes": b} for n, b in rows],
            "projects": {p.project: {"bytes": p.total, "quota_bytes": p.quota, "kinds": p.kinds,
                                     "reclaimable": p.reclaimable} for p in report.projects.values()},
            "notes": report.notes})
        return
    from rich.table import Table

    table = Table(title=f"space on {settings.data_root} by {by}", title_justify="left")
    for col in (by, "bytes", "share"):
        table.add_column(col, justify="left" if col == by else "right")
    for name, n in rows:
        table.add_row(name, human_bytes(n), f"{n / report.total:.0%}" if report.total else "-")
    console.print(table)
    for p in report.projects.values():
        free = ", ".join(f"{what} would free {human_bytes(b)}" for what, b in sorted(p.reclaimable.items())) or "nothing to free"
        console.print(f"{p.project}: {human_bytes(p.total)} of {human_bytes(p.quota)} ({p.total / p.quota:.0%}); {free}",
                      highlight=False)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
