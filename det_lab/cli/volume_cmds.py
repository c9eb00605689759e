"""``det-lab init`` and ``det-lab config``: the lab configuration and the shared volume."""

from __future__ import annotations

import typer

from det_lab.cli.common import console, fail, state


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
    except (OSError, ValueError) as exc:
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
        from det_lab.data import DataError
        from det_lab.data.publish import publish_demos

        try:
            with console.status("generating and publishing the demo datasets"):
                published = publish_demos(settings)
        except DataError as exc:
            fail(str(exc))
        for name in published:
            console.print(f"[green]published[/] {name} (pull it with: det-lab data pull {name})", highlight=False)
        if not published:
            console.print("demo datasets already published", highlight=False)


def config(ctx: typer.Context) -> None:
    """Print the effective lab configuration and where it came from."""
    import yaml

    from det_lab.settings import ENV_OVERRIDES

    settings = state(ctx).settings
    console.print(f"# source: {settings.source or 'built-in defaults'}", highlight=False)
    console.print(f"# environment overrides: {', '.join(ENV_OVERRIDES)}", highlight=False)
    data = settings.model_dump(mode="json")
    for p in data["projects"].values():
        p["quota"] = f"{p['quota'] / 2**30:g}GiB"
    console.print(yaml.safe_dump(data, sort_keys=False), highlight=False, end="")
