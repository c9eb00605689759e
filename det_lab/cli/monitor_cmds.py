"""``det-lab exporter`` and ``det-lab monitor config|token|report``: Prometheus monitoring of the lab."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import typer

from det_lab.cli.common import console, fail, out_dir, state

#: how long ``det-lab exporter`` waits for its sources' first reads before it listens
PRIME_TIMEOUT_S = 30.0

app = typer.Typer(help="Monitoring: Prometheus config, rules, dashboards; the master token; a report.",
                  no_args_is_help=True)


def exporter(
    ctx: typer.Context,
    port: int = typer.Option(9540, help="TCP port of /metrics (1-65535)."),
    address: str = typer.Option("0.0.0.0", help="Address to listen on."),
    source: list[str] | None = typer.Option(None, "--source", "-s",
                                            help="A source to export (gpus, slurm, volume, runs, trackers); "
                                                 "repeat. Default: all (slurm where squeue or a Slurm config is)."),
    textfile: Path | None = typer.Option(None, "--textfile", help="Write DIR/det_lab.prom once for node_exporter's "
                                         "textfile collector and exit, instead of serving."),
) -> None:
    """Serve the lab's metrics for Prometheus: GPUs, Slurm queue, volume, runs, trackers."""
    from det_lab.monitoring.exporter import build_sources, default_sources, registry_for, serve, write_textfile

    if not 1 <= port <= 65535:
        fail(f"--port {port} is not a TCP port (1-65535)")
    settings = state(ctx).settings
    sources = build_sources(settings, source or default_sources(settings))
    registry, collector = registry_for(sources)
    if textfile is not None:
        try:
            path = write_textfile(registry, textfile)
        except OSError as exc:
            fail(f"cannot write {textfile / 'det_lab.prom'}: {exc.strerror or exc}")
        for name, why in collector.errors().items():
            console.print(f"source {name}: {why}", highlight=False)
        console.print(f"wrote {path}", highlight=False)
        return
    import time

    start = time.monotonic()  # every source read once before the first scrape: no scrape walks the volume
    slow = collector.prime(timeout=PRIME_TIMEOUT_S)
    console.print(f"read {', '.join(s.name for s in sources)} in {time.monotonic() - start:.1f} s", highlight=False)
    for name in slow:
        console.print(f"source {name}: still reading after {PRIME_TIMEOUT_S:.0f} s; it is a scrape error until it "
                      "answers", highlight=False)
    for name, why in collector.errors().items():
        console.print(f"source {name}: {why}", highlight=False)
    try:
        server, _thread = serve(registry, port, address)
    except OSError as exc:
        fail(f"cannot listen on {address}:{port}: {exc.strerror or exc}")
    console.print(f"det-lab exporter on http://{address}:{port}/metrics: {', '.join(s.name for s in sources)}",
                  highlight=False)
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # systemd stops it with SIGTERM; Ctrl-C by hand
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


@app.command("config")
def config_(
    ctx: typer.Context,
    out: Path = typer.Option(Path("det-lab-monitoring"), "--out", help="Directory to write prometheus/, grafana/ "
                             "and systemd/ into."),
    lab_exporter: str = typer.Option("localhost:9540", help="host:port of the lab exporter."),
    machine: list[str] | None = typer.Option(None, "--machine", help="A GPU machine to scrape (repeat); "
                                             "default: the Slurm nodes and Determined agents of the lab's configs."),
    tsdb: Path = typer.Option(Path("/var/lib/det-lab/prometheus"), help="Prometheus' TSDB directory (a local disk)."),
    pending_hours: float = typer.Option(24.0, min=0.01, help="Alert on a Slurm job pending longer than this."),
    silent_minutes: int = typer.Option(30, min=1, help="Alert on a running run silent longer than this."),
    idle_minutes: int = typer.Option(30, min=1, help="Alert on a GPU held idle longer than this."),
    scrape_interval: str = typer.Option("30s", help="How often Prometheus scrapes and evaluates rules."),
) -> None:
    """Write prometheus.yml, recording and alert rules, Grafana provisioning and systemd units."""
    from det_lab.monitoring.render import Machine, MonitorPlan, machines_from_configs, write
    from det_lab.monitoring.rules import Thresholds

    from det_lab.monitoring.report import ReportError, parse_duration

    settings = state(ctx).settings
    out_dir(out)
    try:
        parse_duration(scrape_interval)
    except ReportError as exc:
        fail(f"--scrape-interval: {exc}")
    machines, master, scheme = machines_from_configs(settings)
    if machine:
        machines = [Machine(m, True) for m in machine]
    plan = MonitorPlan(out=out, machines=machines, lab_exporter=lab_exporter, master=master, master_scheme=scheme,
                       tsdb=tsdb.absolute(), det_lab=shutil.which("det-lab") or "det-lab",
                       lab_config=settings.source.absolute() if settings.source else None,
                       thresholds=Thresholds(idle_minutes=idle_minutes, pending_hours=pending_hours,
                                             silent_minutes=silent_minutes),
                       scrape_interval=scrape_interval)
    try:
        written = write(plan)
    except OSError as exc:
        fail(f"cannot write under {out}: {exc.strerror or exc}")
    for path in written:
        console.print(str(path), highlight=False)
    console.print(f"check: promtool check config {out / 'prometheus' / 'prometheus.yml'}", highlight=False)


@app.command()
def token(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory to write det-master.token into, the file Prometheus "
                             "reads (credentials_file; monitor config's prometheus/ directory)."),
    master: str | None = typer.Option(None, help="Master URL (default: the lab's master_url or cluster config)."),
) -> None:
    """Log in to the Determined master (DET_USER / DET_PASS) and write a fresh token for Prometheus."""
    from det_lab.monitoring.render import TOKEN_FILE
    from det_lab.monitoring.token import renew

    out_dir(out, TOKEN_FILE)
    settings = state(ctx).settings
    url = master or settings.master_url
    if not url:
        from det_lab.cluster.settings import ClusterConfigError, load_cluster_settings
        try:
            cluster = load_cluster_settings(settings)
        except ClusterConfigError as exc:
            fail(f"{exc} (or pass --master http://host:8080)")
        if cluster.source is not None:
            url = cluster.master_url
    if not url:
        fail("no master: pass --master http://host:8080 or set master_url in the lab config")
    user, password = os.environ.get("DET_USER"), os.environ.get("DET_PASS")
    if not user or password is None:
        fail("set DET_USER and DET_PASS (in /etc/det-lab/monitor-token.env for the systemd timer)")
    try:
        path = renew(url if "://" in url else f"http://{url}", user, password, out / TOKEN_FILE)
    except OSError as exc:  # the token file
        fail(str(exc))
    console.print(f"wrote a token for {user} to {path}", highlight=False)


@app.command()
def report(
    prometheus: str = typer.Option("http://localhost:9090", help="Prometheus' URL."),
    since: str = typer.Option("7d", help="The period to plot: 7d, 12h, 30m."),
    out: Path = typer.Option(Path("det-lab-report"), "--out", help="Directory for index.html and the PNGs."),
) -> None:
    """Plot the dashboards' panels from Prometheus into PNGs and one HTML page."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("the report needs matplotlib: pip install matplotlib")
    from det_lab.monitoring.report import ReportError, build_report, parse_duration

    try:
        seconds = parse_duration(since)
    except ReportError as exc:
        fail(f"--since: {exc}")
    out_dir(out, "index.html")
    index = build_report(prometheus, seconds, out)
    console.print(f"wrote {index}", highlight=False)
