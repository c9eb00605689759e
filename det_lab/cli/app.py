"""The ``det-lab`` application: global options and the command groups."""

from __future__ import annotations

from pathlib import Path

import click
import typer
import typer.core

from det_lab import __version__
from det_lab.cli import data_cmds, doctor_cmd, run_cmd, tracking_cmds, volume_cmds
from det_lab.cli import cluster_backup_cmds, cluster_cmds
from det_lab.cli import templates_cmds
from det_lab.cli import runs_cmds, slurm_cmds
from det_lab.cli import usage_cmd
from det_lab.cli import monitor_cmds
from det_lab.cli import reproduce_cmd
from det_lab.cli import watchdog_cmd
from det_lab.cli import gpus_cmd
from det_lab.cli import models_cmds
from det_lab.cli.common import State, fail, report_user_error
from det_lab.errors import UserError
from det_lab.volume import share_with_group


class _Commands(typer.core.TyperGroup):
    """det-lab's root group: a :class:`UserError` from any command is its one ``error:`` line, exit 2
    (here, not only in :func:`main`, so that typer's test runner sees what a user sees)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            fail(str(exc))


app = typer.Typer(
    name="det-lab",
    cls=_Commands,
    help="A robotics ML team's training platform: Determined, one NFS volume, DVC, MLflow/Aim.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # plain help, like git's: rich panels print a '<bool>' type for every flag
    rich_markup_mode=None,
)


#: the packages whose versions a bug report needs beside det_lab's (read from their metadata: no import)
VERSIONED = ("determined", "mlflow", "aim", "dvc", "torch")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        typer.echo(f"det-lab {__version__}")
        for name in VERSIONED:
            try:
                typer.echo(f"{name} {version(name)}")
            except PackageNotFoundError:
                typer.echo(f"{name} not installed")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    config: Path | None = typer.Option(
        None, "--config", "-c", envvar="DET_LAB_CONFIG",
        help="Lab config file (default: ./det-lab.yaml, ~/.config/det-lab/lab.yaml, /etc/det-lab/lab.yaml).",
    ),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    ctx.obj = State(config)


app.command()(volume_cmds.init)
app.command()(volume_cmds.config)
app.command()(doctor_cmd.doctor)
app.add_typer(data_cmds.app, name="data")
app.add_typer(models_cmds.app, name="models")
app.add_typer(volume_cmds.app, name="volume")
app.command()(run_cmd.run)
app.add_typer(tracking_cmds.app, name="tracking")
cluster_cmds.app.command()(cluster_backup_cmds.backup)
cluster_cmds.app.command()(cluster_backup_cmds.restore)
cluster_cmds.app.command("backup-timer")(cluster_backup_cmds.backup_timer)
app.add_typer(cluster_cmds.app, name="cluster")
app.add_typer(templates_cmds.app, name="templates")
app.add_typer(slurm_cmds.app, name="slurm")
app.add_typer(runs_cmds.app, name="runs")
app.command()(usage_cmd.usage)
app.command()(monitor_cmds.exporter)
app.add_typer(monitor_cmds.app, name="monitor")
app.command()(reproduce_cmd.reproduce)
app.add_typer(watchdog_cmd.app, name="watchdog")
app.command()(gpus_cmd.gpus)


def main() -> None:
    share_with_group()  # what det-lab and its trials write on the volume stays the group's
    try:
        app()
    except UserError as exc:  # raised by a package below cli/: one line, no traceback
        report_user_error(exc)
