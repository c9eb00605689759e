"""A run's GPU limits before it is submitted, and why a submitted job waits, in words.

Both read what Slurm enforces (the association and its QOS in slurmdbd, the running jobs in
squeue), not the lab config, which may not have been applied yet.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from det_lab.accounting.slurm_accounts import AccountingError, sacctmgr

_GPUS = re.compile(r"gres/gpu=(\d+)")


def gpus_in(tres: str) -> int | None:
    """The untyped GPU count of a TRES string (``cpu=1,gres/gpu=2,...``), None when it has none."""
    m = _GPUS.search(tres or "")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Limits:
    """What Slurm holds for one user in one account."""

    user: str
    account: str
    associated: bool
    qos: str = ""
    per_user: int | None = None  # the QOS's MaxTRESPerUser GPUs
    per_job: int | None = None  # the QOS's MaxTRESPerJob GPUs
    project: int | None = None  # the account's GrpTRES GPUs
    deny: bool = False  # QOS Flags=DenyOnLimit


def limits_for(cluster: str, user: str, account: str) -> Limits:
    """The association of ``user`` in ``account`` and the limits of its default QOS."""
    rows = [line.split("|") for line in sacctmgr(
        "show", "assoc", f"cluster={cluster}", f"account={account}", "format=User,GrpTRES,DefaultQOS,QOS").splitlines()
        if line.strip()]
    project = next((gpus_in(r[1]) for r in rows if not r[0]), None)
    mine = next((r for r in rows if r[0] == user), None)
    if mine is None:
        return Limits(user, account, False, project=project)
    qos = mine[2] or (mine[3].split(",")[0] if mine[3] else "normal")
    q = [line.split("|") for line in sacctmgr("show", "qos", f"name={qos}", "format=MaxTRESPU,MaxTRES,Flags").splitlines()
         if line.strip()]
    per_user, per_job, flags = (gpus_in(q[0][0]), gpus_in(q[0][1]), q[0][2]) if q else (None, None, "")
    return Limits(user, account, True, qos, per_user, per_job, project, "DenyOnLimit" in flags)


def refusal(limits: Limits, gpus: int, source: str = "slurm.yaml") -> str | None:
    """Why a request for ``gpus`` GPUs can never run under ``limits`` (one line), or None when it can."""
    who, acc = limits.user, limits.account
    if not limits.associated:
        return (f"user {who} may not charge account {acc} in Slurm: add them to {source} accounting.members "
                f"with project {acc} and run 'det-lab slurm accounts'")
    if limits.per_user is not None and gpus > limits.per_user:
        return (f"the run asks for {gpus} GPUs, but {who} may hold at most {limits.per_user} at a time "
                f"(QOS {limits.qos}: MaxTRESPerUser=gres/gpu={limits.per_user}; {source} accounting gpu_limit): "
                f"ask for fewer (--set resources.slots_per_trial={limits.per_user})")
    if limits.per_job is not None and gpus > limits.per_job:
        return (f"the run asks for {gpus} GPUs, but one job may hold at most {limits.per_job} "
                f"(QOS {limits.qos}: MaxTRES=gres/gpu={limits.per_job})")
    if limits.project is not None and gpus > limits.project:
        return (f"the run asks for {gpus} GPUs, but project {acc} may hold at most {limits.project} at a time "
                f"(account {acc}: GrpTRES=gres/gpu={limits.project}; {source} accounting.projects.{acc}.gpu_limit)")
    return None


def _running_gpus(*selector: str) -> int:
    """GPUs held by the running jobs ``squeue`` selects (``-u USER`` or ``-A ACCOUNT``)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-t", "RUNNING", *selector, "-O", "tres-alloc:300"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(gpus_in(line) or 0 for line in proc.stdout.splitlines())


_PLAIN = {
    "Priority": "other jobs come first (fair-share: whoever used the GPUs least lately)",
    "Resources": "no free GPUs or CPUs yet",
    "Dependency": "waiting for the jobs it depends on",
    "BeginTime": "its start time has not come",
    "JobHeldUser": "held by its owner (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "ReqNodeNotAvail": "the node it needs is unavailable",
    "PartitionTimeLimit": "its time limit is beyond the partition's",
    "AssocMaxJobsLimit": "the account's limit of running jobs is reached",
    "QOSMaxGRESPerJob": "it asks more GPUs than one job may hold",
    "InvalidAccount": "its account does not exist (any more) in Slurm",
    "InvalidQOS": "its QOS does not exist (any more) in Slurm",
}


def _user_name(job: dict[str, str]) -> str:
    return job.get("UserId", "").split("(")[0]


def pending_words(job: dict[str, str], cluster: str | None = None) -> str | None:
    """Why a pending job (``scontrol show job`` as a dict) waits, in words; None for a job that does not wait."""
    if job.get("JobState") != "PENDING":
        return None
    reason = job.get("Reason") or "None"
    if reason == "None":
        return "waiting: Slurm has not looked at it yet"
    user, account, qos = _user_name(job), job.get("Account", ""), job.get("QOS", "")
    try:
        if reason == "QOSMaxGRESPerUser":
            limit = _qos_gpus(qos, "MaxTRESPU")
            unit = "GPU" if limit == "1" else "GPUs"
            return f"waiting: {user} already uses {_running_gpus('-u', user)} of their {limit} {unit} ({reason})"
        if reason == "AssocGrpGRES":
            limit = _account_gpus(account, cluster)
            unit = "GPU" if limit == "1" else "GPUs"
            return (f"waiting: project {account} already uses {_running_gpus('-A', account)} of its {limit} {unit} "
                    f"({reason})")
        if reason == "QOSGrpGRES":
            limit = _qos_gpus(qos, "GrpTRES")
            return f"waiting: QOS {qos} already uses all of its {limit} GPUs ({reason})"
    except AccountingError:
        pass
    return f"waiting: {_PLAIN.get(reason, 'see Slurm')} ({reason})"


def _qos_gpus(qos: str, column: str) -> str:
    out = sacctmgr("show", "qos", f"name={qos}", f"format={column}").strip()
    n = gpus_in(out)
    return str(n) if n is not None else "?"


def _account_gpus(account: str, cluster: str | None) -> str:
    where = [f"cluster={cluster}"] if cluster else []
    for line in sacctmgr("show", "assoc", f"account={account}", *where, "format=User,GrpTRES").splitlines():
        user, _, grp = line.partition("|")
        if not user and gpus_in(grp) is not None:
            return str(gpus_in(grp))
    return "?"
