"""``det-lab cluster backup / restore / backup-timer``: the master database's backups."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import typer

from det_lab.cli.cluster_common import load as _load
from det_lab.cli.common import console, fail, out_dir, print_dry_run, print_json


def backup(
    ctx: typer.Context,
    to: Path | None = typer.Option(None, "--to", help="Directory (default: backup.dir, else "
                                   "<data_root>/.det-lab/backups on the shared volume)."),
    keep_daily: int | None = typer.Option(None, "--keep-daily", min=1,
                                          help="Keep the newest backup of each of the last N days (default: backup.keep_daily)."),
    keep_weekly: int | None = typer.Option(None, "--keep-weekly", min=0,
                                           help="Keep the newest backup of each of the last M weeks (default: backup.keep_weekly)."),
    keep_last: int | None = typer.Option(None, "--keep-last", min=1,
                                         help="Keep the newest N backups whatever their day (default: backup.keep_last)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Name the files it would write and the old backups "
                                 "pruning would delete; dump and delete nothing."),
    as_json: bool = typer.Option(False, "--json", help="The files written and pruned (with --dry-run: that would "
                                 "be) as JSON."),
) -> None:
    """Dump the master's database (pg_dump -Fc + pg_dumpall --globals-only), then prune old backups."""
    from det_lab.cluster import backup as b

    lab, cluster = _load(ctx)
    directory = (to or b.default_backup_dir(lab, cluster)).absolute()
    keep = (keep_daily or cluster.backup.keep_daily, cluster.backup.keep_weekly if keep_weekly is None else keep_weekly,
            keep_last or cluster.backup.keep_last)
    conn = b.connection(cluster)
    if dry_run:
        made = b.planned_backup(conn, directory)
        removed = b.prune_plan(directory, conn.db, *keep, adding=made)
    else:
        made = b.backup(conn, directory)
        removed = b.prune(directory, conn.db, *keep)
    if as_json:
        print_json({"database": conn.describe(), "dry_run": dry_run, "writes": [str(made.dump), str(made.globals_file)],
                    "prunes": [str(p) for r in removed for p in (r.dump, r.globals_file)]})
        return
    if dry_run:
        console.print(f"would write {made.dump} and {made.globals_file.name} (of {conn.describe()})",
                      highlight=False, soft_wrap=True)
        for r in removed:
            console.print(f"would prune {r.dump.name} and {r.globals_file.name}", highlight=False)
        console.print("dry run: nothing dumped or deleted", highlight=False)
        return
    size = made.dump.stat().st_size
    console.print(f"backup {made.dump} ({size} bytes) and {made.globals_file.name} of {conn.describe()}",
                  highlight=False, soft_wrap=True)
    for r in removed:
        console.print(f"pruned {r.dump.name}", highlight=False)


def restore(
    ctx: typer.Context,
    file: Path = typer.Argument(..., help="A .dump file written by 'det-lab cluster backup'."),
    force: bool = typer.Option(False, "--force", help="Replace a database that is not empty (stop the master first)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what it would create or replace (with --force: "
                                 "every table now in the database); change nothing."),
    as_json: bool = typer.Option(False, "--json", help="What was restored (with --dry-run: would be) as JSON."),
) -> None:
    """Restore a backup into the master's database (empty or missing; --force replaces one)."""
    from det_lab.cluster import backup as b
    from det_lab.cluster.restore import restore as restore_backup
    from det_lab.cluster.restore import restore_plan

    _lab, cluster = _load(ctx)
    conn = b.connection(cluster)
    plan = restore_plan(conn, file, force=force) if dry_run else restore_backup(conn, file, force=force)
    if as_json:
        print_json({**plan.as_dict(), "dry_run": dry_run})
        return
    if dry_run:
        print_dry_run(plan.lines(), "dry run: nothing changed")
        return
    console.print(f"restored {file} into {conn.describe()}; roles are in "
                  f"{b.globals_of(file).name} (apply with psql if they were lost)",
                  highlight=False, soft_wrap=True)


def backup_timer(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", help="Write det-lab-backup.service/.timer into this directory "
                                    "(e.g. /etc/systemd/system; default: print them)."),
    user: str | None = typer.Option(None, "--user", help="Unix user the backup runs as (owns the DB password "
                                    "file; default: you)."),
) -> None:
    """Render a systemd service and timer that run 'det-lab cluster backup' nightly."""
    import getpass

    from det_lab.cluster.backup import UNIT_NAME, render_units
    from det_lab.volume import atomic_write_text

    _lab, cluster = _load(ctx)
    units = render_units(cluster, user=user or getpass.getuser())
    files = {f"{UNIT_NAME}.service": units.service, f"{UNIT_NAME}.timer": units.timer}
    if out is None:
        for name, text in files.items():
            typer.echo(f"# --- {name} ---")
            typer.echo(text, nl=False)
        return
    out_dir(out, f"{UNIT_NAME}.service")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = out / name
            path = path.resolve() if path.is_symlink() else path  # a linked unit stays linked: its target is rewritten
            atomic_write_text(path, text, mode=_unit_mode(path))
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")
    console.print(f"wrote {', '.join(files)} to {out}; enable with: systemctl daemon-reload && "
                  f"systemctl enable --now {UNIT_NAME}.timer", highlight=False, soft_wrap=True)


def _unit_mode(path: Path) -> int:
    """The mode a unit file keeps when rewritten (its own), else the one a new file gets (umask)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask
