"""Prometheus recording and alert rules, as the dicts ``det-lab monitor config`` writes as YAML.

Recording rules join what each source cannot say alone: a GPU's utilisation with the processes
holding it (det_lab's NVML source: user, Slurm job, det_lab run, container), and Determined's
state mappings (``/prom/det-state-metrics``: GPU -> container -> allocation -> task, no user) to
DCGM's utilisation. Determined 0.38.1 keeps ended allocations as 0-valued series until the master
restarts, so every mapping is taken ``> 0``. Every alert names whom it concerns in its labels
(``user``, ``slurm_job``, ``run``, ``project``, ``task_id``), so a route or a person reading it
knows whom to ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    """What the alerts wait for; ``det-lab monitor config`` options."""

    idle_minutes: int = 30
    idle_ratio: float = 0.10
    pending_hours: float = 24.0
    silent_minutes: int = 30
    quota_fraction: float = 0.90
    free_fraction: float = 0.10
    backlog_seconds: int = 600


HOLDER = "instance, host, gpu, uuid, user, slurm_job, run, container"
DET_TASK = "container_id, allocation_id, task_id, task_actor, job_id"


def recording_rules() -> dict[str, Any]:
    rules = [
        {"record": "lab:gpu_holder_utilization:ratio",
         # one series per (GPU, holding process's owner/job/run) carrying the GPU's utilisation
         "expr": f"(max by ({HOLDER}) (det_lab_gpu_process_memory_bytes) * 0)"
                 " + on (instance, uuid) group_left det_lab_gpu_utilization_ratio"},
        {"record": "lab:user_gpus_held:count",
         "expr": "count by (user) (count by (user, instance, uuid) (det_lab_gpu_process_memory_bytes))"},
        {"record": "lab:user_gpus_allocated:sum",
         "expr": "sum by (user) (det_lab_slurm_user_gpus_allocated)"},
        {"record": "lab:project_quota_used:ratio",
         "expr": "det_lab_volume_project_bytes / det_lab_volume_project_quota_bytes"},
        {"record": "lab:det_gpu_task:info",
         "expr": "(det_gpu_uuid_container_id > 0)"
                 " * on (container_id) group_left (allocation_id) (det_container_id_allocation_id > 0)"
                 " * on (allocation_id) group_left (task_id, task_actor, job_id) (det_allocation_id_task_id_task_actor > 0)"},
        {"record": "lab:det_gpu_task_utilization:percent",
         "expr": 'label_replace(DCGM_FI_DEV_GPU_UTIL, "gpu_uuid", "$1", "UUID", "(.+)")'
                 f" * on (gpu_uuid) group_left ({DET_TASK}) lab:det_gpu_task:info"},
        {"record": "lab:det_container_user:info",
         # det_lab's NVML source sees the container's runtime id in each GPU process's cgroup
         "expr": "max by (container_id, user) ("
                 '(max by (container_runtime_id, user) (label_replace(det_lab_gpu_process_memory_bytes{container!=""},'
                 ' "container_runtime_id", "$1", "container", "(.+)")) * 0 + 1)'
                 " * on (container_runtime_id) group_left (container_id) (det_container_id_runtime_container_id > 0))"},
    ]
    return {"groups": [{"name": "det-lab-recording", "rules": rules}]}


#: what each alert means, for the person it reaches (the alerts reference page, docs/reference/alerts.md)
MEANINGS: dict[str, str] = {
    "GPUHeldIdle": "a GPU with a process on it has been under the idle ratio (10 %) busy for the idle time "
                   "(30 min): someone holds a GPU they do not use",
    "DeterminedGPUIdle": "a GPU of a live Determined allocation has been under 10 % busy (DCGM) for the idle time",
    "GPUXidErrors": "DCGM counts XID errors on a GPU (DCGM_EXP_XID_ERRORS_COUNT, which resolves, unlike "
                    "DCGM_FI_DEV_XID_ERRORS): a driver or hardware fault",
    "GPUMissing": "a machine's GPU exporter sees fewer GPUs than it had in the last day (a GPU fell off the bus)",
    "DCGMGPUMissing": "a machine reports fewer GPUs to DCGM than it had in the last day",
    "SlurmGPUsUnavailable": "GPUs have been on down or drained Slurm nodes for 15 min",
    "ExporterDown": "a scrape target has been down for 5 min",
    "MonitoringSourceFailing": "a det-lab exporter source has failed for 10 min: its series are absent",
    "MonitoringSourceStale": "an exporter answers with a source's figures over 15 min old (its refresh hangs, "
                             "e.g. on the volume)",
    "ProjectNearQuota": "a project has used over 90 % of its quota for 15 min: its next pull may be refused",
    "VolumeFreeSpaceLow": "the shared volume has had under 10 % free space for 15 min",
    "TrackerBacklogOld": "a run's oldest undelivered tracker event is over 10 min old (its tracker is down or "
                         "its sender died; det-lab tracking sync delivers it)",
    "TrackerDown": "the MLflow or Aim server has not answered for 5 min",
    "SlurmJobPendingLong": "a Slurm job has been pending longer than the pending time (24 h)",
    "RunSilent": "a running run has reported no metric for the silent time (30 min): hung, or its job died unseen",
    "RunDied": "a local run's trainer and det-lab run vanished without recording an end (a machine lost power); "
               "the summary says how to resume it",
}


def _alert(name: str, expr: str, duration: str, summary: str, severity: str = "warning") -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity},
            "annotations": {"summary": summary}}


def alert_rules(t: Thresholds = Thresholds()) -> dict[str, Any]:
    rules = [
        _alert("GPUHeldIdle", f"lab:gpu_holder_utilization:ratio < {t.idle_ratio}", f"{t.idle_minutes}m",
               "GPU {{ $labels.gpu }} on {{ $labels.host }} held idle for " f"{t.idle_minutes} min by user "
               "{{ $labels.user }} (Slurm job {{ $labels.slurm_job }}, run {{ $labels.run }})"),
        _alert("DeterminedGPUIdle", f"lab:det_gpu_task_utilization:percent < {t.idle_ratio * 100:g}",
               f"{t.idle_minutes}m",
               "GPU {{ $labels.gpu_uuid }} of Determined task {{ $labels.task_id }} (job {{ $labels.job_id }}) idle "
               f"for {t.idle_minutes} min"),
        _alert("GPUXidErrors", "DCGM_EXP_XID_ERRORS_COUNT > 0", "0m",
               "XID {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.Hostname }}", "critical"),
        _alert("GPUMissing",
               "count by (instance, host) (det_lab_gpu_info)"
               " < max_over_time((count by (instance, host) (det_lab_gpu_info))[1d:5m])", "5m",
               "{{ $labels.host }} sees {{ $value }} GPUs, fewer than it had in the last day", "critical"),
        _alert("DCGMGPUMissing",
               "count by (Hostname) (DCGM_FI_DEV_GPU_UTIL)"
               " < max_over_time((count by (Hostname) (DCGM_FI_DEV_GPU_UTIL))[1d:5m])", "5m",
               "{{ $labels.Hostname }} reports {{ $value }} GPUs to DCGM, fewer than it had in the last day",
               "critical"),
        _alert("SlurmGPUsUnavailable", 'det_lab_slurm_gpus{state="unavailable"} > 0', "15m",
               "{{ $value }} GPUs of partition {{ $labels.partition }} are on nodes that are down or drained"),
        _alert("ExporterDown", "up == 0", "5m", "{{ $labels.job }} exporter at {{ $labels.instance }} is down"),
        _alert("MonitoringSourceFailing", "det_lab_scrape_error == 1", "10m",
               "det-lab exporter at {{ $labels.instance }} cannot read its {{ $labels.source }} source"),
        _alert("MonitoringSourceStale", "det_lab_scrape_age_seconds > 900", "5m",
               "det-lab exporter at {{ $labels.instance }} answers with {{ $labels.source }} figures "
               "{{ $value | humanizeDuration }} old (its refresh hangs)"),
        _alert("ProjectNearQuota", f"lab:project_quota_used:ratio > {t.quota_fraction}", "15m",
               "project {{ $labels.project }} uses {{ $value | humanizePercentage }} of its quota"),
        _alert("VolumeFreeSpaceLow",
               f"det_lab_volume_free_bytes / det_lab_volume_size_bytes < {t.free_fraction}", "15m",
               "the shared volume has {{ $value | humanizePercentage }} free"),
        _alert("TrackerBacklogOld", f"det_lab_tracker_oldest_undelivered_seconds > {t.backlog_seconds}", "0m",
               "run {{ $labels.run }} ({{ $labels.project }}) has events undelivered to {{ $labels.backend }} "
               "for {{ $value | humanizeDuration }}"),
        _alert("TrackerDown", "det_lab_tracker_up == 0", "5m",
               "the {{ $labels.backend }} server at {{ $labels.target }} does not answer"),
        _alert("SlurmJobPendingLong", f"det_lab_slurm_job_pending_seconds > {t.pending_hours * 3600:g}", "0m",
               "Slurm job {{ $labels.job_id }} of user {{ $labels.user }} has waited {{ $value | humanizeDuration }} "
               "({{ $labels.reason }})"),
        _alert("RunSilent", f"det_lab_run_last_metric_age_seconds > {t.silent_minutes * 60}", "0m",
               "running run {{ $labels.run }} of user {{ $labels.user }} ({{ $labels.kind }}) has reported no metric "
               "for {{ $value | humanizeDuration }}"),
        _alert("RunDied", "det_lab_run_died_seconds", "0m",
               "run {{ $labels.run }} of user {{ $labels.user }} died without recording an end (its trainer and "
               "det-lab run are gone; last metric {{ $value | humanizeDuration }} ago): resume it with det-lab run "
               "--local --resume --run {{ $labels.run }}"),
    ]
    return {"groups": [{"name": "det-lab-alerts", "rules": rules}]}
