"""``det-lab tracking ...``: the MLflow server, and journals waiting for a tracker."""

from __future__ import annotations

from pathlib import Path

import typer

from det_lab.cli.common import console, err_console, fail, print_json, state

app = typer.Typer(help="Experiment tracking: MLflow server, undelivered journals.", no_args_is_help=True)


@app.command("status")
def status_(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="The journals, their waiting events and damage as JSON."),
) -> None:
    """List tracking journals on the volume that still hold undelivered events, and damaged ones
    (exit code 1 when there is one: its events cannot be delivered until it is repaired)."""
    from det_lab.tracking.sync import backlogs
    from det_lab.runs.record import volume_journals as find_journals

    settings = state(ctx).settings
    found = backlogs(find_journals(settings))
    waiting = [b for b in found if not b.damaged]
    damaged = [b for b in found if b.damaged]
    if as_json:
        print_json({"journals": [b.as_dict() for b in found]})
        raise typer.Exit(1 if damaged else 0)
    for b in waiting:
        console.print(f"{b.events:>8} events waiting  {b.journal}", highlight=False)
    for b in damaged:
        console.print(f"{b.events:>8} events waiting  {b.journal}\n          damaged: {b.damaged}", highlight=False,
                      soft_wrap=True)
    console.print(f"{len(waiting)} journal(s) with undelivered events"
                  + (f", {len(damaged)} damaged" if damaged else ""), highlight=False)
    if damaged:
        raise typer.Exit(1)


@app.command("sync")
def sync_(ctx: typer.Context, journal: Path | None = typer.Argument(None, help="One journal (default: all waiting).")) -> None:
    """Deliver events that runs journaled while their tracker was down."""
    from det_lab.tracking.sync import sync, sync_waiting
    from det_lab.runs.record import volume_journals as find_journals

    settings = state(ctx).settings
    if journal and not (journal / "run.json").is_file():
        fail(f"{journal} is not a det_lab tracking journal (no run.json)")
    summaries, skipped = ([sync(journal)], []) if journal else sync_waiting(find_journals(settings))
    for summary in summaries:
        console.print(str(summary), highlight=False)
    for line in skipped:
        err_console.print(f"warning: {line}; left as it is", highlight=False, markup=False, soft_wrap=True)
    left = sum(b.pending for s in summaries for b in s.backends)
    if left or skipped:
        fail(f"{left} events still undelivered (is the tracking server up?)" if left
             else f"{len(skipped)} journal(s) left undelivered (above)", code=1)


@app.command()
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 for the lab network."),
    port: int = typer.Option(5000, help="TCP port to listen on (1-65535)."),
    store: Path | None = typer.Option(None, help="Local-disk directory for a SQLite store (never on NFS); "
                                      "default: the store local runs write to."),
    allowed_host: list[str] = typer.Option([], "--allowed-host", help="Another name clients reach this server "
                                           "by (besides this machine's names and tracking.mlflow_uri's host)."),
) -> None:
    """Run an MLflow tracking server over the store local runs write to; artifacts on the volume."""
    import signal
    import socket
    from urllib.parse import urlsplit

    from det_lab.tracking.mlflow_server import MlflowServer, MlflowServerError, StopRequest, port_in_use
    from det_lab.tracking.targets import default_local_uri, default_mlflow_store

    settings = state(ctx).settings
    if not 1 <= port <= 65535:
        fail(f"--port {port} is not a TCP port: use 1-65535")
    if port_in_use(host, port):
        fail(f"port {port} on {host} is in use (another server?): choose another with --port")
    configured = settings.tracking.mlflow_uri
    if store is not None:
        root, store_uri = store.expanduser(), None
    elif configured and not configured.startswith(("http://", "https://")):
        root, store_uri = default_mlflow_store() / "mlflow-server", configured  # the configured local store
    else:
        root, store_uri = default_mlflow_store(), default_local_uri()
    artifacts = settings.data_root / "outputs" / "mlflow-artifacts"
    # the names tasks and members use for it: MLflow 3 refuses other Host headers than localhost and IPs
    named = urlsplit(configured).hostname if configured and "://" in configured else None
    names = [n for n in (named, socket.gethostname(), socket.getfqdn(), *allowed_host) if n]
    server = MlflowServer(root, port, host=host, artifacts=artifacts, store_uri=store_uri, allowed_hosts=names)
    shown = store_uri or f"sqlite:///{root / 'mlflow.db'}"
    console.print(f"MLflow at {server.uri}, store {shown}, artifacts {artifacts}; Ctrl-C stops it", highlight=False)

    stopping = StopRequest()  # a signal only asks; the server stops in serve's own time
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stopping.set())
    try:
        server.serve(stopping)
    except MlflowServerError as exc:
        fail(f"mlflow server did not start: {str(exc).splitlines()[0]} (log: {root / 'server.log'})")
