"""Every series the exporter exports: its name, what it measures and its labels, declared once.

The collector's ``describe()`` declares these families (prometheus_client checks names against
them when the collector is registered), ``Families`` takes each family's help text from here, and
the metrics reference page is generated from this table (``docs/gen_reference.py``). A source that
exports a series not declared here fails ``tests/test_docs_reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "det_lab_"


@dataclass(frozen=True)
class Series:
    """One exported gauge family (``name`` without the ``det_lab_`` prefix)."""

    source: str  # the exporter source that exports it ("exporter": every scrape, per source)
    name: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # what a value counts: bytes, seconds, a ratio in [0, 1], a count ...


_GPU = ("host", "gpu", "uuid")
_RUN = ("project", "run", "kind", "template", "user")

SERIES: tuple[Series, ...] = (
    Series("exporter", "scrape_error", "1 when the source could not be read at the last refresh (its series are "
           "then absent)", ("source",), "0 or 1"),
    Series("exporter", "scrape_duration_seconds", "how long the source's last refresh took", ("source",), "seconds"),
    Series("exporter", "scrape_age_seconds", "how old the source's answer is (its ttl, plus a refresh under way)",
           ("source",), "seconds"),
    Series("gpus", "gpu_info", "1 per GPU NVML sees", (*_GPU, "model"), "1"),
    Series("gpus", "gpu_utilization_ratio", "fraction of the last sample period a kernel ran", _GPU, "ratio"),
    Series("gpus", "gpu_memory_used_bytes", "GPU memory in use", _GPU, "bytes"),
    Series("gpus", "gpu_memory_total_bytes", "GPU memory in all", _GPU, "bytes"),
    Series("gpus", "gpu_process_memory_bytes", "GPU memory of each process, with its user, Slurm job, det_lab run "
           "and container", (*_GPU, "pid", "user", "slurm_job", "run", "container"), "bytes"),
    Series("gpus", "gpu_lease_info", "1 per GPU a local run's lease holds: its user, run, project, lease and "
           "holder pid (det-lab run --local)", (*_GPU, "user", "run", "project", "lease", "pid"), "1"),
    Series("gpus", "gpu_queue_length", "local runs waiting in this machine's line for GPUs (--queue)", ("host",),
           "runs"),
    Series("gpus", "gpu_queue_oldest_wait_seconds", "how long the longest-waiting local run has waited for GPUs "
           "(0: none waits)", ("host",), "seconds"),
    Series("slurm", "slurm_jobs", "Slurm jobs by user, account, partition and state",
           ("user", "account", "partition", "state"), "jobs"),
    Series("slurm", "slurm_job_gpus", "GPUs of each live job (allocated when running, asked for when pending)",
           ("job_id", "user", "account", "partition", "state", "name"), "GPUs"),
    Series("slurm", "slurm_user_gpus_allocated", "GPUs allocated to each user's jobs",
           ("user", "account", "partition"), "GPUs"),
    Series("slurm", "slurm_job_pending_seconds", "how long each pending job has waited so far, with Slurm's reason",
           ("job_id", "user", "account", "partition", "reason"), "seconds"),
    Series("slurm", "slurm_nodes", "nodes by partition and state", ("partition", "state"), "nodes"),
    Series("slurm", "slurm_gpus", "GPUs by partition and state (allocated, idle, unavailable)",
           ("partition", "state"), "GPUs"),
    Series("slurm", "slurm_fairshare", "each user's fair-share factor (1: under-served, 0: over-served)",
           ("account", "user"), "ratio"),
    Series("volume", "volume_size_bytes", "size of the file system holding the data root", (), "bytes"),
    Series("volume", "volume_free_bytes", "space left for unprivileged users on it", (), "bytes"),
    Series("volume", "volume_area_bytes", "bytes of each project's area (dvc-cache is the shared cache; "
           "checkpoints its checkpoints)", ("project", "area"), "bytes"),
    Series("volume", "volume_project_bytes", "bytes counted against each project's quota", ("project",), "bytes"),
    Series("volume", "volume_project_quota_bytes", "each project's quota", ("project",), "bytes"),
    Series("volume", "volume_snapshots", "published dataset snapshots of each project", ("project",), "snapshots"),
    Series("volume", "volume_user_bytes", "bytes on the volume each user owns (hard links once)", ("user",), "bytes"),
    Series("volume", "volume_reclaimable_bytes", "bytes each clean-up would free per project",
           ("project", "by"), "bytes"),
    Series("volume", "volume_sample_time_seconds", "when these figures were taken (Unix time)", (), "Unix time"),
    Series("runs", "runs", "det_lab runs by project, scheduler (kind), template and status",
           ("project", "kind", "template", "status"), "runs"),
    Series("runs", "run_last_metric_age_seconds", "seconds since each running run last reported a metric", _RUN,
           "seconds"),
    Series("runs", "run_died_seconds", "each local run whose trainer and det-lab run vanished without recording an "
           "end: seconds since its last metric", _RUN, "seconds"),
    Series("runs", "run_gpu_utilization_ratio", "each run's mean GPU utilization, per GPU, from its efficiency "
           "summary (run.json gpu_efficiency, written when the trial ends)", (*_RUN, "gpu"), "ratio"),
    Series("runs", "run_gpu_memory_peak_bytes", "each run's peak GPU memory, per GPU, from its efficiency summary",
           (*_RUN, "gpu"), "bytes"),
    Series("trackers", "tracker_undelivered_events", "events journaled and not yet delivered, per run and backend",
           ("project", "run", "backend"), "events"),
    Series("trackers", "tracker_oldest_undelivered_seconds", "age of each run's oldest undelivered event, per "
           "backend", ("project", "run", "backend"), "seconds"),
    Series("trackers", "tracker_backlog_events", "undelivered events of all runs, per backend", ("backend",),
           "events"),
    Series("trackers", "tracker_damaged_journals", "journals whose run.json cannot be read", (), "journals"),
    Series("trackers", "tracker_up", "1 when the lab's tracker server answers", ("backend", "target"), "0 or 1"),
)

BY_NAME: dict[str, Series] = {s.name: s for s in SERIES}


def series_of(sources: list[str] | tuple[str, ...]) -> list[Series]:
    """The series the exporter exports with these sources (and its own per-source ones)."""
    return [s for s in SERIES if s.source == "exporter" or s.source in sources]
