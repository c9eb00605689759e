"""``det-lab tracking ...``: the MLflow server, and journals waiting for a tracker."""

from __future__ import annotations

from pathlib import Path

import typer

from det_lab.cli.common import console, fail, state
from det_lab.tracking.sync import find_journals, pending, sync

app = typer.Typer(help="Experiment tracking: MLflow server, undelivered journals.", no_args_is_help=True)


@app.command("status")
def status_(ctx: typer.Context) -> None:
    """List tracking journals on the volume that still hold undelivered events."""
    settings = state(ctx).settings
    waiting = [(j, pending(j)) for j in find_journals(settings)]
    waiting = [(j, n) for j, n in waiting if n]
    for j, n in waiting:
        console.print(f"{n:>8} events waiting  {j}", highlight=False)
    console.print(f"{len(waiting)} journal(s) with undelivered events", highlight=False)


@app.command("sync")
def sync_(ctx: typer.Context, journal: Path | None = typer.Argument(None, help="One journal (default: all waiting).")) -> None:
    """Deliver events that runs journaled while their tracker was down."""
    settings = state(ctx).settings
    journals = [journal] if journal else [j for j in find_journals(settings) if pending(j)]
    if journal and not (journal / "run.json").is_file():
        fail(f"{journal} is not a det_lab tracking journal (no run.json)")
    left = 0
    for j in journals:
        summary = sync(settings, j)
        console.print(str(summary), highlight=False)
        left += sum(b.pending for b in summary.backends)
    if left:
        fail(f"{left} events still undelivered (is the tracking server up?)", code=1)


@app.command()
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 for the lab network."),
    port: int = typer.Option(5000),
    store: Path = typer.Option(Path("~/.local/share/det-lab/mlflow-server").expanduser(),
                               help="Local-disk directory for the SQLite store (never on NFS)."),
) -> None:
    """Run an MLflow tracking server: SQLite on local disk, artifacts on the volume."""
    from det_lab.tracking.mlflow_server import MlflowServer

    settings = state(ctx).settings
    artifacts = settings.data_root / "outputs" / "mlflow-artifacts"
    server = MlflowServer(store, port, host=host, artifacts=artifacts)
    console.print(f"MLflow at {server.uri}, store {store}, artifacts {artifacts}; Ctrl-C stops it", highlight=False)
    server.start()
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()
