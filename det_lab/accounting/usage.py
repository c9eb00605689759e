"""``det-lab usage``: who used the GPUs, on what: Slurm's job records joined with det_lab's run records.

Every job slurmdbd recorded in the period (``sacct -a -X -D``: each start of a requeued job is its
own record, so its GPU time is counted once per start) gives user, account (the project), GPUs,
elapsed time and state. A job that a det_lab run submitted is matched to its run record by job id
and gains the run's name, template, dataset identity and code commit (from the run's latest
checkpoint's lineage). GPU-hours are GPUs x elapsed time.

Local runs' GPU leases (``det-lab run --local`` on a workstation, journaled on the volume by
:mod:`det_lab.gpus`) are records too, one per lease (``local-<lease>``, partition ``local:<host>``),
joined to their run by its name; a lease still held counts up to now.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_lab.errors import UserError
from det_lab.accounting.limits import gpus_in

if TYPE_CHECKING:
    from det_lab.settings import LabSettings

SACCT_FORMAT = "JobIDRaw,JobName,User,Account,QOS,Partition,State,AllocTRES,ElapsedRaw,Start,End,ExitCode"
_SINCE = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
GROUPS = ("user", "project", "template")


class UsageError(UserError, ValueError):
    """sacct failed or an option is wrong: one line."""


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``30d``, ``12h``, ``2w``, ``90m`` before now, or a date ``YYYY-MM-DD[THH:MM]``."""
    now = now or dt.datetime.now()
    m = _SINCE.match(text.strip())
    if m:
        return now - dt.timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        return dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"--since {text!r}: give a period (30d, 12h, 2w, 90m) or a date (2026-11-01)") from None


@dataclass
class JobRecord:
    """One start of one Slurm job, as sacct recorded it, with its det_lab run when there is one."""

    job_id: str
    job_name: str
    user: str
    account: str
    qos: str
    partition: str
    state: str
    gpus: int
    elapsed_s: float
    start: str
    end: str
    exit_code: str
    run: str | None = None
    template: str | None = None
    project: str | None = None
    dataset: str | None = None
    code_commit: str | None = None
    gpu_utilization: float | None = None  # the run's mean GPU utilization (percent, its gpu_efficiency)

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.elapsed_s / 3600

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpu_hours": round(self.gpu_hours, 6)}


def sacct_jobs(since: dt.datetime, until: dt.datetime | None = None) -> list[JobRecord]:
    """Every job start slurmdbd holds between ``since`` and ``until`` (default now), all users."""
    argv = ["sacct", "-a", "-X", "-D", "-P", "-n", f"--format={SACCT_FORMAT}",
            f"--starttime={since:%Y-%m-%dT%H:%M:%S}", f"--endtime={(until or dt.datetime.now()):%Y-%m-%dT%H:%M:%S}"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UsageError("sacct not found on PATH: install Slurm's client (apt-get install slurm-client)") from None
    except subprocess.TimeoutExpired:
        raise UsageError("sacct did not answer in 120 s: is slurmdbd running?") from None
    if proc.returncode != 0:
        msg = " ".join(line.removeprefix("sacct: error: ") for line in proc.stderr.strip().splitlines())
        raise UsageError(f"sacct failed: {msg or proc.returncode} (is slurmdbd running, and accounting on in slurm.conf?)")
    out = []
    for line in proc.stdout.splitlines():
        f = (line.split("|") + [""] * 12)[:12]
        if not f[0]:
            continue
        out.append(JobRecord(job_id=f[0], job_name=f[1], user=f[2], account=f[3], qos=f[4], partition=f[5],
                             state=f[6].split()[0] if f[6] else "", gpus=gpus_in(f[7]) or 0,
                             elapsed_s=int(f[8] or 0), start=f[9], end=f[10], exit_code=f[11]))
    return out


def local_jobs(settings: LabSettings, since: dt.datetime, until: dt.datetime | None = None) -> list[JobRecord]:
    """Every local run's GPU lease between ``since`` and ``until`` (default now), from the volume's
    journal; the part of a lease outside the period is not counted."""
    from det_lab.gpus.journal import read_records

    lo = since.timestamp()
    hi = (until or dt.datetime.now()).timestamp()
    out = []
    for r in read_records(settings):
        end = r.end if r.end is not None else hi
        start, stop = max(r.since, lo), min(end, hi)
        if stop <= start:
            continue
        state = "RUNNING" if r.end is None else "COMPLETED" if r.how == "released" else "ENDED_WITH_HOLDER"
        out.append(JobRecord(job_id=f"local-{r.lease}", job_name=r.run, user=r.user, account=r.project, qos="",
                             partition=f"local:{r.host}", state=state, gpus=len(r.gpus), elapsed_s=stop - start,
                             start=dt.datetime.fromtimestamp(r.since).isoformat(timespec="seconds"),
                             end=dt.datetime.fromtimestamp(r.end).isoformat(timespec="seconds") if r.end else "",
                             exit_code="", run=r.run or None, template=r.template or None, project=r.project or None))
    return out


def all_jobs(settings: LabSettings, since: dt.datetime, warn: Callable[[str], None]) -> list[JobRecord]:
    """Slurm's jobs and the local runs' GPU leases; without a working sacct, the leases alone (said
    through ``warn``) when there are any, else sacct's one-line error."""
    local = local_jobs(settings, since)
    try:
        slurm = sacct_jobs(since)
    except UsageError as exc:
        if not local:
            raise
        warn(f"{exc}; showing local runs' GPU leases only")
        slurm = []
    return slurm + local


def run_lineage(st: dict[str, Any], checkpoints_dir: Path | None) -> dict[str, Any]:
    """A run record's (``st``: its run.json) name, template, project, dataset and code commit (the last
    two from its latest checkpoint's lineage, when it has one)."""
    conf = ((st.get("exp_conf") or {}).get("data") or {}).get("det_lab") or {}
    info: dict[str, str | None] = {"run": st.get("name"), "template": st.get("template"),
                                   "project": conf.get("project"), "dataset": conf.get("dataset"),
                                   "code_commit": None, "gpu_utilization": None}
    gpus = [g.get("utilization_mean") for g in (st.get("gpu_efficiency") or {}).get("gpus") or []]
    gpus = [u for u in gpus if isinstance(u, (int, float))]
    if gpus:
        info["gpu_utilization"] = sum(gpus) / len(gpus)
    latest = st.get("latest_checkpoint")
    if latest and checkpoints_dir is not None:
        try:
            meta = json.loads((checkpoints_dir / latest / "metadata.json").read_text()).get("det_lab") or {}
        except (OSError, ValueError):
            meta = {}
        ds = meta.get("dataset") or {}
        if ds:
            info["dataset"] = f"{ds.get('repo')}:{ds.get('path')}@{ds.get('rev')} ({str(ds.get('md5', ''))[:12]})"
        info["code_commit"] = meta.get("code_commit")
    return info


def run_job_ids(st: dict[str, Any]) -> set[str]:
    """Every Slurm job id a run's record (``st``: its run.json) names: its job and the job of each start."""
    slurm = st.get("slurm") or {}
    ids = {str(slurm["job_id"])} if slurm.get("job_id") else set()
    ids |= {str(a["job_id"]) for a in slurm.get("attempts") or [] if a.get("job_id")}
    return ids


def join(jobs: list[JobRecord], runs: Iterable[tuple[dict[str, Any], Path | None]]) -> list[JobRecord]:
    """``jobs`` with the run record of each det_lab job filled in (``runs``: each record's run.json and
    its checkpoints dir); only a run with a job in ``jobs`` has its checkpoint's lineage read."""
    wanted = {j.job_id for j in jobs}
    local = {j.run: j.job_id for j in jobs if j.job_id.startswith("local-") and j.run}
    by_id: dict[str, dict[str, str | None]] = {}
    for st, ckpts in runs:
        ids = run_job_ids(st) & wanted
        if st.get("name") in local:  # a local run's leases: joined by its name
            ids |= {j.job_id for j in jobs if j.job_id.startswith("local-") and j.run == st.get("name")}
        if ids:
            info = run_lineage(st, ckpts)
            by_id.update({i: info for i in ids})
    for job in jobs:
        info = by_id.get(job.job_id)
        if info:
            job.run, job.template, job.project = info["run"], info["template"], info["project"]
            job.dataset, job.code_commit = info["dataset"], info["code_commit"]
            job.gpu_utilization = info["gpu_utilization"]
    return jobs


def summarize(jobs: list[JobRecord], by: str) -> list[dict[str, Any]]:
    """One row per user, project (the Slurm account) or template: jobs, GPU-hours, elapsed hours, outcomes."""
    if by not in GROUPS:
        raise UsageError(f"--by {by!r}: one of {', '.join(GROUPS)}")
    rows: dict[str, dict[str, Any]] = {}
    for j in jobs:
        key = {"user": j.user, "project": j.account or j.project or "-", "template": j.template or "(not det-lab)"}[by]
        r = rows.setdefault(key, {by: key, "jobs": 0, "gpu_hours": 0.0, "elapsed_hours": 0.0, "runs": set(),
                                  "outcomes": {}})
        r["jobs"] += 1
        r["gpu_hours"] += j.gpu_hours
        r["elapsed_hours"] += j.elapsed_s / 3600
        if j.run:
            r["runs"].add(j.run)
        r["outcomes"][j.state.lower()] = r["outcomes"].get(j.state.lower(), 0) + 1
    out = []
    for r in sorted(rows.values(), key=lambda r: (-r["gpu_hours"], r[by])):
        out.append({**r, "runs": len(r["runs"]), "gpu_hours": round(r["gpu_hours"], 6),
                    "elapsed_hours": round(r["elapsed_hours"], 6)})
    return out
