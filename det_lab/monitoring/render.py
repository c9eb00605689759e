"""``det-lab monitor config``: prometheus.yml, the rules, Grafana provisioning and systemd units.

Targets come from the lab's configs: every Slurm node (``<data root>/.det-lab/slurm.yaml``) and
every Determined agent (``cluster.yaml`` pools) gets node_exporter; those with GPUs also a det-lab
exporter of their GPUs, dcgm-exporter and the idle-GPU watchdog (``det-lab watchdog``); the lab
exporter (queue, volume, runs, trackers) runs on one machine. A Determined master is scraped at ``/prom/det-state-metrics`` and
``/debug/prom/metrics`` with a bearer token read from a file (``authorization.credentials_file``)
that ``det-lab monitor token`` renews from a systemd timer; master.yaml carries
``observability.enable_prometheus: true``. The TSDB belongs on a local disk (``det-lab doctor``
warns when it is on NFS).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from det_lab.monitoring.dashboards import DASHBOARDS, DATASOURCE_UID, grafana_json
from det_lab.monitoring.exporter import DEFAULT_PORT
from det_lab.monitoring.rules import Thresholds, alert_rules, recording_rules
from det_lab.volume import atomic_write_text

NODE_EXPORTER_PORT = 9100
DCGM_PORT = 9400
PROMETHEUS_PORT = 9090
TOKEN_FILE = "det-master.token"
RECORDING_FILE = "rules/det-lab-recording.yml"
ALERTS_FILE = "rules/det-lab-alerts.yml"
PROMETHEUS_UNIT = "det-lab-prometheus.service"
WATCHDOG_UNIT = "det-lab-watchdog.service"
DEFAULT_TSDB = Path("/var/lib/det-lab/prometheus")
SYSTEMD_DIR = Path("/etc/systemd/system")


@dataclass(frozen=True)
class Machine:
    host: str
    gpus: bool


@dataclass
class MonitorPlan:
    """What to render: machines, the lab exporter, an optional master, where things live."""

    out: Path
    machines: list[Machine] = field(default_factory=list)
    lab_exporter: str = f"localhost:{DEFAULT_PORT}"
    master: str | None = None  # host:port
    master_scheme: str = "http"
    tsdb: Path = DEFAULT_TSDB
    det_lab: str = "det-lab"
    lab_config: Path | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    scrape_interval: str = "30s"

    @property
    def token_file(self) -> Path:
        return self.out / "prometheus" / TOKEN_FILE


def machines_from_configs(lab) -> tuple[list[Machine], str | None, str]:
    """Machines of the Slurm and Determined configs that exist on the volume, and the master (host:port, scheme)."""
    from det_lab.cluster.settings import load_cluster_settings
    from det_lab.slurm.settings import default_slurm_file, load_slurm_settings

    machines: dict[str, Machine] = {}
    master, scheme = None, "http"
    if default_slurm_file(lab).is_file():
        for node in load_slurm_settings(lab).nodes:
            host = node.addr or node.name
            machines[host] = Machine(host, node.gpus > 0)
    cluster = load_cluster_settings(lab)
    if cluster.source is not None:
        for pool in cluster.pools:
            for agent in pool.agents:
                machines.setdefault(agent, Machine(agent, cluster.agent.slot_type not in ("cpu", "none")))
        master = f"{cluster.master_host}:{cluster.master_port}"
    elif lab.master_url:
        scheme, _, master = lab.master_url.partition("://")
    return list(machines.values()), master, scheme


def prometheus_yml(plan: MonitorPlan) -> dict[str, Any]:
    hosts = sorted(m.host for m in plan.machines)
    gpu_hosts = sorted(m.host for m in plan.machines if m.gpus)
    scrape: list[dict[str, Any]] = [
        {"job_name": "det-lab", "static_configs": [{"targets": [plan.lab_exporter], "labels": {"role": "lab"}}]},
    ]
    if gpu_hosts:
        scrape.append({"job_name": "det-lab-node", "static_configs": [{
            "targets": [f"{h}:{DEFAULT_PORT}" for h in gpu_hosts], "labels": {"role": "node"}}]})
    if hosts:
        scrape.append({"job_name": "node", "static_configs": [{"targets": [f"{h}:{NODE_EXPORTER_PORT}" for h in hosts]}]})
    if gpu_hosts:
        scrape.append({"job_name": "dcgm", "static_configs": [{"targets": [f"{h}:{DCGM_PORT}" for h in gpu_hosts]}]})
    if plan.master:
        for job, path in (("determined-state", "/prom/det-state-metrics"), ("determined-master", "/debug/prom/metrics")):
            scrape.append({"job_name": job, "metrics_path": path, "scheme": plan.master_scheme,
                           # relative to prometheus.yml's directory
                           "authorization": {"type": "Bearer", "credentials_file": TOKEN_FILE}, "static_configs": [{"targets": [plan.master]}]})
    return {
        "global": {"scrape_interval": plan.scrape_interval, "evaluation_interval": plan.scrape_interval},
        "rule_files": [RECORDING_FILE, ALERTS_FILE],
        "scrape_configs": scrape,
    }


def grafana_files() -> dict[str, str]:
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "det-lab Prometheus", "type": "prometheus", "uid": DATASOURCE_UID, "access": "proxy",
        "url": f"http://localhost:{PROMETHEUS_PORT}", "isDefault": True, "editable": False}]}
    provider = {"apiVersion": 1, "providers": [{
        "name": "det-lab", "type": "file", "folder": "det-lab", "disableDeletion": False,
        "options": {"path": "/var/lib/grafana/dashboards/det-lab"}}]}
    files = {"grafana/provisioning/datasources/det-lab.yml": _yaml(datasource),
             "grafana/provisioning/dashboards/det-lab.yml": _yaml(provider)}
    for d in DASHBOARDS:
        files[f"grafana/dashboards/{d.uid}.json"] = json.dumps(grafana_json(d), indent=2) + "\n"
    return files


def systemd_units(plan: MonitorPlan) -> dict[str, str]:
    env = f"Environment=DET_LAB_CONFIG={plan.lab_config}\n" if plan.lab_config else ""
    prom_dir = plan.out.resolve() / "prometheus"

    def service(description: str, exec_start: str, extra: str = "", kind: str = "simple") -> str:
        restart = "Restart=on-failure\nRestartSec=10\n" if kind == "simple" else ""
        wanted = "\n[Install]\nWantedBy=multi-user.target\n" if kind == "simple" else ""
        return (f"[Unit]\nDescription={description}\nAfter=network-online.target\nWants=network-online.target\n\n"
                f"[Service]\nType={kind}\n{env}{extra}ExecStart={exec_start}\n{restart}{wanted}")

    units = {
        "det-lab-exporter.service": service(
            "det-lab exporter for the lab: Slurm queue, volume, runs, trackers",
            f"{plan.det_lab} exporter --port {DEFAULT_PORT}"),
        "det-lab-exporter-gpus.service": service(
            "det-lab exporter of this machine's GPUs (NVML)",
            f"{plan.det_lab} exporter --port {DEFAULT_PORT} --source gpus"),
        # as root: it reads other users' process environments, cancels their jobs, signals their trainers
        WATCHDOG_UNIT: service(
            "det-lab watchdog: warn, then stop, holders of this machine's idle GPUs (lab config: watchdog)",
            f"{plan.det_lab} watchdog", "User=root\n"),
        PROMETHEUS_UNIT: service(
            "Prometheus for the det-lab lab (TSDB on a local disk, never NFS)",
            f"/usr/bin/prometheus --config.file={prom_dir / 'prometheus.yml'} --storage.tsdb.path={plan.tsdb} "
            f"--storage.tsdb.retention.time=90d --web.listen-address=:{PROMETHEUS_PORT}",
            f"ExecStartPre=/usr/bin/mkdir -p {plan.tsdb}\n"),
    }
    if plan.master:
        units["det-lab-monitor-token.service"] = service(
            "Renew the Determined master token Prometheus scrapes with",
            f"{plan.det_lab} monitor token --out {plan.token_file.parent.resolve()}",
            "EnvironmentFile=-/etc/det-lab/monitor-token.env\n", kind="oneshot")
        units["det-lab-monitor-token.timer"] = (
            "[Unit]\nDescription=Renew the Determined master token for Prometheus\n\n"
            "[Timer]\nOnBootSec=1min\nOnUnitActiveSec=6h\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n")
    return units


def render(plan: MonitorPlan) -> dict[str, str]:
    """Every file, by its path under ``plan.out``."""
    files = {
        "prometheus/prometheus.yml": _yaml(prometheus_yml(plan)),
        f"prometheus/{RECORDING_FILE}": _yaml(recording_rules()),
        f"prometheus/{ALERTS_FILE}": _yaml(alert_rules(plan.thresholds)),
        **grafana_files(),
        **{f"systemd/{name}": text for name, text in systemd_units(plan).items()},
    }
    return files


def write(plan: MonitorPlan) -> list[Path]:
    """Write every file (whole, each replaced atomically); an existing token file is kept."""
    written = []
    for rel, text in render(plan).items():
        path = plan.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text, 0o644)
        written.append(path)
    if plan.master and not plan.token_file.exists():
        # promtool and Prometheus want the credentials file to exist; 'det-lab monitor token' fills it
        atomic_write_text(plan.token_file, "", 0o600)
        written.append(plan.token_file)
    return written


def installed_tsdb_dirs(systemd_dir: Path = SYSTEMD_DIR) -> list[Path]:
    """The TSDB directories of the det-lab Prometheus units installed on this machine."""
    unit = systemd_dir / PROMETHEUS_UNIT
    try:
        text = unit.read_text()
    except OSError:
        return []
    return [Path(p) for p in re.findall(r"--storage\.tsdb\.path=(\S+)", text)]


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=200)
