"""Input series and expected alerts for ``promtool test rules`` (tests/test_monitoring.py).

Each case: series that make one alert fire for one subject (with a bystander that must not), the
time it fires with the labels and summary naming whom it concerns, and a later time when it has
resolved. Times are minutes from the start of the series, one sample a minute.
"""

from __future__ import annotations

LAB = {"instance": "lab:9540", "job": "det-lab"}
NODE = {"instance": "n1:9540", "job": "det-lab-node", "host": "n1"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


CASES = [
    # alert, input series, fire at (min), expected labels (besides alertname), expected summary, resolved at
    ("GPUHeldIdle", [
        series("det_lab_gpu_process_memory_bytes", {**NODE, "gpu": "0", "uuid": "GPU-a", "pid": "100", "user": "alice",
                                                     "slurm_job": "17", "run": "vla-1", "container": ""}, "1e9x120"),
        series("det_lab_gpu_process_memory_bytes", {**NODE, "gpu": "1", "uuid": "GPU-b", "pid": "200", "user": "bob",
                                                     "slurm_job": "18", "run": "vla-2", "container": ""}, "1e9x120"),
        series("det_lab_gpu_utilization_ratio", {**NODE, "gpu": "0", "uuid": "GPU-a"}, "0.02x60 0.9x60"),
        series("det_lab_gpu_utilization_ratio", {**NODE, "gpu": "1", "uuid": "GPU-b"}, "0.95x120"),
     ], 45, {"instance": "n1:9540", "host": "n1", "gpu": "0", "uuid": "GPU-a", "user": "alice", "slurm_job": "17",
             "run": "vla-1", "severity": "warning"},
     "GPU 0 on n1 held idle for 30 min by user alice (Slurm job 17, run vla-1)", 100),
    ("DeterminedGPUIdle", [
        series("det_gpu_uuid_container_id", {"gpu_uuid": "GPU-x", "container_id": "c1", "instance": "m:8080",
                                             "job": "determined-state"}, "1x120"),
        series("det_gpu_uuid_container_id", {"gpu_uuid": "GPU-y", "container_id": "c0", "instance": "m:8080",
                                             "job": "determined-state"}, "0x120"),  # an ended allocation: 0 until restart
        series("det_container_id_allocation_id", {"container_id": "c1", "allocation_id": "a1", "instance": "m:8080",
                                                  "job": "determined-state"}, "1x120"),
        series("det_container_id_allocation_id", {"container_id": "c0", "allocation_id": "a0", "instance": "m:8080",
                                                  "job": "determined-state"}, "0x120"),
        series("det_allocation_id_task_id_task_actor", {"allocation_id": "a1", "task_id": "t1", "task_actor": "x",
                                                        "job_id": "j1", "instance": "m:8080", "job": "determined-state"},
               "1x120"),
        series("det_allocation_id_task_id_task_actor", {"allocation_id": "a0", "task_id": "t0", "task_actor": "x",
                                                        "job_id": "j0", "instance": "m:8080", "job": "determined-state"},
               "0x120"),
        series("DCGM_FI_DEV_GPU_UTIL", {"UUID": "GPU-x", "gpu": "0", "Hostname": "n1", "instance": "n1:9400",
                                        "job": "dcgm"}, "3x60 80x60"),
        series("DCGM_FI_DEV_GPU_UTIL", {"UUID": "GPU-y", "gpu": "1", "Hostname": "n1", "instance": "n1:9400",
                                        "job": "dcgm"}, "0x120"),
     ], 45, {"UUID": "GPU-x", "gpu": "0", "Hostname": "n1", "instance": "n1:9400", "job": "dcgm", "gpu_uuid": "GPU-x",
             "container_id": "c1", "allocation_id": "a1", "task_id": "t1", "task_actor": "x", "job_id": "j1",
             "severity": "warning"},
     "GPU GPU-x of Determined task t1 (job j1) idle for 30 min", 100),
    ("GPUXidErrors", [
        series("DCGM_EXP_XID_ERRORS_COUNT", {"gpu": "1", "Hostname": "n2", "xid": "79", "instance": "n2:9400",
                                             "job": "dcgm"}, "0x10 1x10 0x20"),
        series("DCGM_EXP_XID_ERRORS_COUNT", {"gpu": "0", "Hostname": "n2", "xid": "79", "instance": "n2:9400",
                                             "job": "dcgm"}, "0x40"),
     ], 15, {"gpu": "1", "Hostname": "n2", "xid": "79", "instance": "n2:9400", "job": "dcgm", "severity": "critical"},
     "XID 79 on GPU 1 of n2", 30),
    ("GPUMissing", [
        series("det_lab_gpu_info", {**NODE, "gpu": "0", "uuid": "GPU-a", "model": "H200"}, "1x120"),
        series("det_lab_gpu_info", {**NODE, "gpu": "1", "uuid": "GPU-b", "model": "H200"}, "1x30 _x40 1x50"),
     ], 50, {"instance": "n1:9540", "host": "n1", "severity": "critical"},
     "n1 sees 1 GPUs, fewer than it had in the last day", 100),
    ("DCGMGPUMissing", [
        series("DCGM_FI_DEV_GPU_UTIL", {"UUID": "GPU-a", "gpu": "0", "Hostname": "n3", "instance": "n3:9400",
                                        "job": "dcgm"}, "5x120"),
        series("DCGM_FI_DEV_GPU_UTIL", {"UUID": "GPU-b", "gpu": "1", "Hostname": "n3", "instance": "n3:9400",
                                        "job": "dcgm"}, "5x30 _x40 5x50"),
     ], 50, {"Hostname": "n3", "severity": "critical"},
     "n3 reports 1 GPUs to DCGM, fewer than it had in the last day", 100),
    ("SlurmGPUsUnavailable", [
        series("det_lab_slurm_gpus", {**LAB, "partition": "a100", "state": "unavailable"}, "0x5 2x30 0x10"),
        series("det_lab_slurm_gpus", {**LAB, "partition": "rtx", "state": "unavailable"}, "0x45"),
     ], 25, {**LAB, "partition": "a100", "state": "unavailable", "severity": "warning"},
     "2 GPUs of partition a100 are on nodes that are down or drained", 40),
    ("ExporterDown", [
        series("up", {"instance": "lab:9540", "job": "det-lab"}, "1x10 0x20 1x20"),
        series("up", {"instance": "n1:9100", "job": "node"}, "1x50"),
     ], 20, {"instance": "lab:9540", "job": "det-lab", "severity": "warning"},
     "det-lab exporter at lab:9540 is down", 45),
    ("MonitoringSourceFailing", [
        series("det_lab_scrape_error", {**LAB, "source": "slurm"}, "0x5 1x30 0x20"),
        series("det_lab_scrape_error", {**LAB, "source": "volume"}, "0x55"),
     ], 25, {**LAB, "source": "slurm", "severity": "warning"},
     "det-lab exporter at lab:9540 cannot read its slurm source", 50),
    ("MonitoringSourceStale", [
        series("det_lab_scrape_age_seconds", {**LAB, "source": "volume"}, "0+60x25 0x20"),
        series("det_lab_scrape_age_seconds", {**LAB, "source": "slurm"}, "3x45"),
     ], 22, {**LAB, "source": "volume", "severity": "warning"},
     "det-lab exporter at lab:9540 answers with volume figures 22m 0s old (its refresh hangs)", 35),
    ("ProjectNearQuota", [
        series("det_lab_volume_project_bytes", {**LAB, "project": "vla"}, "50x10 95x30 10x20"),
        series("det_lab_volume_project_quota_bytes", {**LAB, "project": "vla"}, "100x60"),
        series("det_lab_volume_project_bytes", {**LAB, "project": "isaac"}, "50x60"),
        series("det_lab_volume_project_quota_bytes", {**LAB, "project": "isaac"}, "100x60"),
     ], 30, {**LAB, "project": "vla", "severity": "warning"}, "project vla uses 95% of its quota", 55),
    ("VolumeFreeSpaceLow", [
        series("det_lab_volume_free_bytes", LAB, "50x10 5x30 50x20"),
        series("det_lab_volume_size_bytes", LAB, "100x60"),
     ], 30, {**LAB, "severity": "warning"}, "the shared volume has 5% free", 55),
    ("TrackerBacklogOld", [
        series("det_lab_tracker_oldest_undelivered_seconds", {**LAB, "project": "vla", "run": "r1", "backend": "mlflow"},
               "0+60x20 0x10"),
        series("det_lab_tracker_oldest_undelivered_seconds", {**LAB, "project": "vla", "run": "r2", "backend": "aim"},
               "0x30"),
     ], 15, {**LAB, "project": "vla", "run": "r1", "backend": "mlflow", "severity": "warning"},
     "run r1 (vla) has events undelivered to mlflow for 15m 0s", 25),
    ("TrackerDown", [
        series("det_lab_tracker_up", {**LAB, "backend": "mlflow", "target": "http://mlflow:5000"}, "1x5 0x20 1x10"),
        series("det_lab_tracker_up", {**LAB, "backend": "aim", "target": "aim://aim:53800"}, "1x35"),
     ], 15, {**LAB, "backend": "mlflow", "target": "http://mlflow:5000", "severity": "warning"},
     "the mlflow server at http://mlflow:5000 does not answer", 30),
    ("SlurmJobPendingLong", [
        series("det_lab_slurm_job_pending_seconds", {**LAB, "job_id": "42", "user": "bob", "account": "vla",
                                                     "partition": "a100", "reason": "QOSMaxGRESPerUser"},
               "0+3600x30 _x10"),
        series("det_lab_slurm_job_pending_seconds", {**LAB, "job_id": "43", "user": "alice", "account": "vla",
                                                     "partition": "a100", "reason": "Priority"}, "0+60x40"),
     ], 28, {**LAB, "job_id": "42", "user": "bob", "account": "vla", "partition": "a100", "reason": "QOSMaxGRESPerUser",
             "severity": "warning"},
     "Slurm job 42 of user bob has waited 1d 4h 0m 0s (QOSMaxGRESPerUser)", 40),
    ("RunSilent", [
        series("det_lab_run_last_metric_age_seconds", {**LAB, "project": "vla", "run": "run-a", "kind": "slurm",
                                                       "template": "vla", "user": "alice"}, "0+120x20 0x10"),
        series("det_lab_run_last_metric_age_seconds", {**LAB, "project": "vla", "run": "run-b", "kind": "local",
                                                       "template": "vla", "user": "bob"}, "0+10x30"),
     ], 18, {**LAB, "project": "vla", "run": "run-a", "kind": "slurm", "template": "vla", "user": "alice",
             "severity": "warning"},
     "running run run-a of user alice (slurm) has reported no metric for 36m 0s", 25),
    ("RunDied", [  # run-c died at minute 5 (last metric 2 min before) and was resumed at 20; run-d trains on
        series("det_lab_run_died_seconds", {**LAB, "project": "isaac", "run": "run-c", "kind": "local",
                                            "template": "isaac", "user": "carol"}, "_x5 120+60x15"),
        series("det_lab_run_last_metric_age_seconds", {**LAB, "project": "isaac", "run": "run-d", "kind": "local",
                                                       "template": "isaac", "user": "dave"}, "5x40"),
     ], 10, {**LAB, "project": "isaac", "run": "run-c", "kind": "local", "template": "isaac", "user": "carol",
             "severity": "warning"},
     "run run-c of user carol died without recording an end (its trainer and det-lab run are gone; last metric "
     "7m 0s ago): resume it with det-lab run --local --resume --run run-c", 30),
]


def promtool_tests(rule_files: list[str]) -> dict:
    """The ``promtool test rules`` file: per case, the alert firing then resolved."""
    tests = []
    for alert, inputs, fire_at, labels, summary, resolved_at in CASES:
        tests.append({
            "interval": "1m", "input_series": inputs,
            "alert_rule_test": [
                {"eval_time": f"{fire_at}m", "alertname": alert,
                 "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}]},
                {"eval_time": f"{resolved_at}m", "alertname": alert, "exp_alerts": []},
            ],
        })
    # the Determined join keeps live allocations only (ended ones stay 0-valued in 0.38.1)
    det_inputs = CASES[1][1]
    tests.append({"interval": "1m", "input_series": det_inputs, "promql_expr_test": [{
        "expr": "lab:det_gpu_task:info", "eval_time": "10m",
        "exp_samples": [{"labels": 'lab:det_gpu_task:info{gpu_uuid="GPU-x",container_id="c1",allocation_id="a1",'
                                   'task_id="t1",task_actor="x",job_id="j1",instance="m:8080",job="determined-state"}',
                         "value": 1}]}]})
    # a Determined container's user: from the GPU process det_lab's exporter sees in it (live mappings only)
    tests.append({"interval": "1m", "input_series": [
        series("det_lab_gpu_process_memory_bytes", {**NODE, "gpu": "0", "uuid": "GPU-x", "pid": "300", "user": "carol",
                                                     "slurm_job": "", "run": "", "container": "rt1"}, "1e9x20"),
        series("det_lab_gpu_process_memory_bytes", {**NODE, "gpu": "1", "uuid": "GPU-y", "pid": "301", "user": "dan",
                                                     "slurm_job": "", "run": "", "container": "rt0"}, "1e9x20"),
        series("det_container_id_runtime_container_id", {"container_runtime_id": "rt1", "container_id": "c1",
                                                         "instance": "m:8080", "job": "determined-state"}, "1x20"),
        series("det_container_id_runtime_container_id", {"container_runtime_id": "rt0", "container_id": "c0",
                                                         "instance": "m:8080", "job": "determined-state"}, "0x20"),
     ], "promql_expr_test": [{"expr": "lab:det_container_user:info", "eval_time": "10m",
                              "exp_samples": [{"labels": 'lab:det_container_user:info{container_id="c1",user="carol"}',
                                               "value": 1}]}]})
    return {"rule_files": rule_files, "evaluation_interval": "1m", "tests": tests}
