"""The shipped Grafana dashboards: each panel one PromQL expression and the labels its legend shows.

Dashboards are defined here once; ``det-lab monitor config`` writes them as Grafana JSON and
``det-lab monitor report`` plots the same panels. ``needs`` says what a panel's series need beyond
det_lab's exporter on a Slurm lab: ``gpu`` (an NVIDIA driver where the exporter runs),
``determined`` (a Determined master and dcgm-exporter), ``accounting`` (slurmdbd).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DATASOURCE_UID = "det-lab-prometheus"


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    legend: str = ""
    unit: str = "short"
    needs: str = ""

    @property
    def labels(self) -> list[str]:
        """The labels the legend shows (each returned series must carry them)."""
        return re.findall(r"{{\s*(\w+)\s*}}", self.legend)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...]


DASHBOARDS = (
    Dashboard("det-lab-overview", "det-lab: lab overview", (
        Panel("GPUs by state (Slurm)", "sum by (state) (det_lab_slurm_gpus)", "{{state}}"),
        Panel("GPUs allocated per user (Slurm)", "lab:user_gpus_allocated:sum", "{{user}}"),
        Panel("Jobs by state", "sum by (state) (det_lab_slurm_jobs)", "{{state}}"),
        Panel("Quota used per project", "lab:project_quota_used:ratio", "{{project}}", "percentunit"),
        Panel("Runs by status", "sum by (status) (det_lab_runs)", "{{status}}"),
        Panel("Exporter sources failing", "det_lab_scrape_error", "{{instance}} {{source}}"),
    )),
    Dashboard("det-lab-gpus", "det-lab: GPUs by user", (
        Panel("GPUs allocated per user and partition (Slurm)", "sum by (user, partition) (det_lab_slurm_user_gpus_allocated)",
              "{{user}} {{partition}}"),
        Panel("GPU utilisation by holder", "lab:gpu_holder_utilization:ratio", "{{user}} {{host}}/{{gpu}} job {{slurm_job}}",
              "percentunit", "gpu"),
        Panel("GPU memory per user", "sum by (user) (det_lab_gpu_process_memory_bytes)", "{{user}}", "bytes", "gpu"),
        Panel("GPUs held per user", "lab:user_gpus_held:count", "{{user}}", "short", "gpu"),
        Panel("Determined tasks' GPU utilisation", "lab:det_gpu_task_utilization:percent",
              "{{task_id}} {{gpu_uuid}}", "percent", "determined"),
        Panel("Fair-share per user", "det_lab_slurm_fairshare", "{{account}} {{user}}", "short", "accounting"),
    )),
    Dashboard("det-lab-queue", "det-lab: the queue", (
        Panel("Jobs by user and state", "sum by (user, state) (det_lab_slurm_jobs)", "{{user}} {{state}}"),
        Panel("Pending jobs' wait so far", "det_lab_slurm_job_pending_seconds", "{{user}} job {{job_id}}: {{reason}}", "s"),
        Panel("Nodes by partition and state", "det_lab_slurm_nodes", "{{partition}} {{state}}"),
        Panel("GPUs by partition and state", "det_lab_slurm_gpus", "{{partition}} {{state}}"),
    )),
    Dashboard("det-lab-volume", "det-lab: volume and data", (
        Panel("Bytes per project", "det_lab_volume_project_bytes", "{{project}}", "bytes"),
        Panel("Bytes per project and area", "det_lab_volume_area_bytes", "{{project}} {{area}}", "bytes"),
        Panel("Free space", "det_lab_volume_free_bytes / det_lab_volume_size_bytes", "free", "percentunit"),
        Panel("Dataset snapshots per project", "det_lab_volume_snapshots", "{{project}}"),
    )),
    Dashboard("det-lab-runs", "det-lab: runs and trackers", (
        Panel("Runs by project, scheduler, template and status", "det_lab_runs",
              "{{project}} {{kind}} {{template}} {{status}}"),
        Panel("Running runs: seconds since their last metric", "det_lab_run_last_metric_age_seconds",
              "{{run}} ({{user}})", "s"),
        Panel("Undelivered tracker events", "det_lab_tracker_undelivered_events", "{{run}} -> {{backend}}"),
        Panel("Age of the oldest undelivered event", "det_lab_tracker_oldest_undelivered_seconds",
              "{{run}} -> {{backend}}", "s"),
        Panel("Tracker servers answering", "det_lab_tracker_up", "{{backend}} {{target}}"),
    )),
)


def grafana_json(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (timeseries panels, two per row)."""
    panels = []
    for i, p in enumerate(dashboard.panels):
        panel: dict[str, Any] = {
            "id": i + 1, "type": "timeseries", "title": p.title,
            "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": "A", "expr": p.expr, "legendFormat": p.legend or "__auto",
                         "datasource": {"type": "prometheus", "uid": DATASOURCE_UID}}],
        }
        if p.needs:
            panel["description"] = f"needs: {p.needs}"
        panels.append(panel)
    return {"uid": dashboard.uid, "title": dashboard.title, "tags": ["det-lab"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "1m", "time": {"from": "now-24h", "to": "now"},
            "panels": panels}


def panels_of(data: dict[str, Any]) -> list[tuple[str, str, list[str], str]]:
    """``(title, expr, legend labels, needs)`` of each panel of a dashboard JSON (as written or edited)."""
    out = []
    for panel in data.get("panels", []):
        needs = str(panel.get("description", "")).removeprefix("needs: ") if "needs:" in str(panel.get("description", "")) else ""
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            out.append((panel["title"], target["expr"], re.findall(r"{{\s*(\w+)\s*}}", legend), needs))
    return out
