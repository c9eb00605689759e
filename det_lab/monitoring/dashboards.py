"""The shipped Grafana dashboards: each panel one PromQL expression and the labels its legend shows.

Dashboards are defined here once; ``det-lab monitor config`` writes them as Grafana JSON and
``det-lab monitor report`` plots the same panels. ``needs`` says what a panel's series need beyond
det_lab's exporter on a Slurm lab: ``gpu`` (an NVIDIA driver where the exporter runs),
``determined`` (a Determined master and dcgm-exporter), ``accounting`` (slurmdbd). ``unit`` is a
Grafana unit, never its unitless ``short``: counts are ``count:<what they count>`` (Grafana's custom
count unit; the report draws them on a whole-number axis from 0).
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
    unit: str = "none"  # a Grafana unit: count:<what> for counts, bytes, s, percentunit, bool_yes_no ...
    needs: str = ""

    @property
    def stacked(self) -> bool:
        """A count of disjoint things (GPUs per user, jobs per state) is drawn stacked: the bands sum to
        the whole. A 0/1 state is not."""
        return self.unit.startswith("count:")

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
        Panel("GPUs by state (Slurm)", "sum by (state) (det_lab_slurm_gpus)", "{{state}}", "count:GPUs"),
        Panel("GPUs allocated per user (Slurm)", "lab:user_gpus_allocated:sum", "{{user}}", "count:GPUs"),
        Panel("Slurm jobs by state", "sum by (state) (det_lab_slurm_jobs)", "{{state}}", "count:jobs"),
        Panel("Quota used per project", "lab:project_quota_used:ratio", "{{project}}", "percentunit"),
        Panel("det-lab runs by status", "sum by (status) (det_lab_runs)", "{{status}}", "count:runs"),
        Panel("Exporter sources failing", "det_lab_scrape_error", "{{instance}} {{source}}", "bool_yes_no"),
    )),
    Dashboard("det-lab-gpus", "det-lab: GPUs by user", (
        Panel("GPUs allocated per user and partition (Slurm)", "sum by (user, partition) (det_lab_slurm_user_gpus_allocated)",
              "{{user}} {{partition}}", "count:GPUs"),
        Panel("GPU utilisation by holder", "lab:gpu_holder_utilization:ratio", "{{user}} {{host}}/{{gpu}} job {{slurm_job}}",
              "percentunit", "gpu"),
        Panel("GPU memory per user", "sum by (user) (det_lab_gpu_process_memory_bytes)", "{{user}}", "bytes", "gpu"),
        Panel("GPUs held per user (NVML)", "lab:user_gpus_held:count", "{{user}}", "count:GPUs", "gpu"),
        Panel("Determined tasks' GPU utilisation", "lab:det_gpu_task_utilization:percent",
              "{{task_id}} {{gpu_uuid}}", "percent", "determined"),
        Panel("Fair-share per user", "det_lab_slurm_fairshare", "{{account}} {{user}}", "none", "accounting"),
    )),
    Dashboard("det-lab-queue", "det-lab: the queue", (
        Panel("Slurm jobs by user and state", "sum by (user, state) (det_lab_slurm_jobs)", "{{user}} {{state}}", "count:jobs"),
        Panel("Pending jobs' wait so far", "det_lab_slurm_job_pending_seconds", "{{user}} job {{job_id}}: {{reason}}", "s"),
        Panel("Slurm nodes by partition and state", "det_lab_slurm_nodes", "{{partition}} {{state}}", "count:nodes"),
        Panel("GPUs by partition and state (Slurm)", "det_lab_slurm_gpus", "{{partition}} {{state}}", "count:GPUs"),
    )),
    Dashboard("det-lab-volume", "det-lab: volume and data", (
        Panel("Bytes per project", "det_lab_volume_project_bytes", "{{project}}", "bytes"),
        Panel("Bytes per project and area", "det_lab_volume_area_bytes", "{{project}} {{area}}", "bytes"),
        Panel("Free space on the volume", "det_lab_volume_free_bytes / det_lab_volume_size_bytes", "free", "percentunit"),
        Panel("Dataset snapshots per project", "det_lab_volume_snapshots", "{{project}}", "count:snapshots"),
    )),
    Dashboard("det-lab-runs", "det-lab: runs and trackers", (
        Panel("Runs by project, scheduler, template and status", "det_lab_runs",
              "{{project}} {{kind}} {{template}} {{status}}", "count:runs"),
        Panel("Running runs: seconds since their last metric", "det_lab_run_last_metric_age_seconds",
              "{{run}} ({{user}})", "s"),
        Panel("Undelivered tracker events", "det_lab_tracker_undelivered_events", "{{run}} -> {{backend}}", "count:events"),
        Panel("Age of the oldest undelivered event", "det_lab_tracker_oldest_undelivered_seconds",
              "{{run}} -> {{backend}}", "s"),
        Panel("Tracker servers answering", "det_lab_tracker_up", "{{backend}} {{target}}", "bool_yes_no"),
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
            "fieldConfig": {"defaults": {"unit": p.unit, **({"decimals": 0, "min": 0, "custom": {
                "stacking": {"mode": "normal"}, "lineInterpolation": "stepAfter", "fillOpacity": 60}}
                if p.stacked else {})}, "overrides": []},
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
