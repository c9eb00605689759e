"""slurm.conf, gres.conf and cgroup.conf for the lab's machines, rendered from the Slurm settings.

What the files encode, and why:

- one partition per GPU kind (``cpu`` for machines without GPUs), so ``--partition a100`` is how a
  user asks for a kind of GPU, and a job never spans two kinds;
- GPUs as generic resources (``gres/gpu``, typed by kind) with their device files in gres.conf;
- ``task/cgroup`` + ``ConstrainDevices=yes``: a job can open only the GPU devices it was given,
  so two jobs on one machine cannot collide on a GPU (the first failure mode of sharing GPUs);
- ``JobRequeue=1`` and no ``RequeueExit`` tricks: det_lab's job script requeues itself after the
  trial has checkpointed (see :mod:`det_lab.slurm.job`);
- a requeued job waits ``cred_expire`` seconds (default 120) before it can start again;
- ``nodes_share_disk``: several slurmd on one machine (a test bed of namespaces, or one big machine
  split into nodes) each need their own spool directory, pid file and log, so those paths carry
  Slurm's ``%n`` (the node's name, expanded by slurmd: slurm.conf(5), SlurmdSpoolDir). slurmd does
  not create its spool directory: make ``<spool_dir>/<node>`` for every node.
"""

from __future__ import annotations

from det_lab.settings import LabSettings
from det_lab.slurm.render_accounting import accounting_keys, billing_weights, render_job_submit_lua
from det_lab.slurm.settings import SlurmSettings


def slurm_conf_keys(slurm: SlurmSettings, nodes_share_disk: bool = False) -> dict[str, str]:
    """The global keys of slurm.conf, ``extra`` applied last (it may replace any of them).

    ``nodes_share_disk``: slurmd's spool directory, pid file and log are per node (``%n``)."""
    logs = slurm.log_dir
    node = "/%n" if nodes_share_disk else ""  # a directory per node under spool_dir
    dash = "-%n" if nodes_share_disk else ""  # slurmd-<node>.pid, slurmd-<node>.log
    controller = slurm.controller + (f"({slurm.controller_addr})" if slurm.controller_addr else "")
    keys = {
        "ClusterName": slurm.cluster_name,
        "SlurmctldHost": controller,
        "SlurmctldPort": str(slurm.slurmctld_port),
        "SlurmdPort": str(slurm.slurmd_port),
        "SlurmUser": slurm.slurm_user,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "StateSaveLocation": str(slurm.state_dir),
        "SlurmdSpoolDir": f"{slurm.spool_dir}{node}",
        "SlurmctldPidFile": "/run/slurmctld.pid",
        "SlurmdPidFile": f"/run/slurmd{dash}.pid",
        "SlurmctldLogFile": str(logs / "slurmctld.log"),
        "SlurmdLogFile": str(logs / f"slurmd{dash}.log"),
        "ProctrackType": "proctrack/cgroup",
        "TaskPlugin": "task/cgroup,task/affinity",
        "SelectType": "select/cons_tres",
        # memory is scheduled only when every node says how much it has
        "SelectTypeParameters": "CR_Core_Memory" if all(n.memory for n in slurm.nodes) else "CR_Core",
        "GresTypes": "gpu",
        "SchedulerType": "sched/backfill",
        "JobRequeue": "1",
        "EnforcePartLimits": "ALL",  # refuse at submission what a partition can never run
        "ReturnToService": "2",
        "MpiDefault": "none",
        "KillWait": "60",  # SIGTERM -> SIGKILL at the time limit: room for a last checkpoint
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "JobAcctGatherType": "jobacct_gather/cgroup",
    }
    keys.update(accounting_keys(slurm))  # slurmdbd, limits, fair-share: only with an accounting section
    keys.update(slurm.extra)
    return keys


def _memory_mib(node) -> int | None:
    return int(node.memory) // 2**20 if node.memory else None


def render_slurm_conf(slurm: SlurmSettings, lab: LabSettings | None = None, nodes_share_disk: bool = False) -> str:
    """slurm.conf: the global keys, a NodeName line per machine, a PartitionName line per GPU kind
    (``nodes_share_disk``: see :func:`slurm_conf_keys`)."""
    src = f" from {slurm.source}" if slurm.source else ""
    lines = [f"# slurm.conf rendered by 'det-lab slurm config'{src}; the same file on every node."]
    if lab is not None:
        lines.append(f"# Jobs read and write the lab volume at {lab.data_root}: mount it at that path on every node.")
    lines += [f"{k}={v}" for k, v in slurm_conf_keys(slurm, nodes_share_disk).items()]
    lines.append("")
    for node in slurm.nodes:
        parts = [f"NodeName={node.name}"]
        if node.addr:
            parts.append(f"NodeAddr={node.addr}")
        parts.append(f"CPUs={node.cpus}")
        mem = _memory_mib(node)
        if mem:
            parts.append(f"RealMemory={mem}")
        if node.gpus:
            parts.append(f"Gres=gpu:{node.gpu_kind}:{node.gpus}")
        parts.append("State=UNKNOWN")
        lines.append(" ".join(parts))
    for name, nodes in slurm.partitions().items():
        default = "YES" if name == slurm.default else "NO"
        line = (f"PartitionName={name} Nodes={','.join(n.name for n in nodes)} Default={default} "
                f"MaxTime={slurm.max_time} DefaultTime={slurm.default_time}")
        if all(n.memory for n in slurm.nodes):
            # without it a job that names no --mem is given a whole node's memory
            line += f" DefMemPerCPU={min(_memory_mib(n) // n.cpus for n in nodes)}"
        if slurm.accounting is not None:  # fair-share counts a GPU-hour as gpu_billing CPU-hours
            line += f" TRESBillingWeights={billing_weights(slurm.accounting)}"
        lines.append(line + " State=UP")
    return "\n".join(lines) + "\n"


def render_gres_conf(slurm: SlurmSettings) -> str:
    """gres.conf: each node's GPUs, typed by kind, with their device files."""
    lines = ["# gres.conf rendered by 'det-lab slurm config'; the same file on every node."]
    for node in slurm.nodes:
        if node.gpus:
            lines.append(f"NodeName={node.name} Name=gpu Type={node.gpu_kind} File={node.device_files}")
    return "\n".join(lines) + "\n"


def render_cgroup_conf() -> str:
    """cgroup.conf: a job's processes see only its cores, memory and GPU devices."""
    return "\n".join([
        "# cgroup.conf rendered by 'det-lab slurm config'.",
        "CgroupPlugin=autodetect",
        "ConstrainCores=yes",
        "ConstrainDevices=yes",  # a job can open only the /dev/nvidia* it was allocated
        "ConstrainRAMSpace=yes",
    ]) + "\n"


def render_all(slurm: SlurmSettings, lab: LabSettings | None = None, nodes_share_disk: bool = False) -> dict[str, str]:
    """The files by name: slurm.conf, gres.conf, cgroup.conf, and with accounting job_submit.lua
    (slurmdbd.conf holds a secret: :mod:`det_lab.slurm.render_accounting` writes it).
    ``nodes_share_disk``: several slurmd on one machine (:func:`slurm_conf_keys`)."""
    files = {"slurm.conf": render_slurm_conf(slurm, lab, nodes_share_disk), "gres.conf": render_gres_conf(slurm),
             "cgroup.conf": render_cgroup_conf()}
    if slurm.accounting is not None:
        files["job_submit.lua"] = render_job_submit_lua(slurm)
    return files


def setup_notes(slurm: SlurmSettings, lab: LabSettings) -> list[str]:
    """What a person must do on the machines besides copying the files."""
    nodes = ", ".join(n.name for n in slurm.nodes)
    return [
        f"copy slurm.conf, gres.conf and cgroup.conf to /etc/slurm/ on {slurm.controller} and on every node ({nodes})",
        "munge: the same /etc/munge/munge.key (mode 0400, owner munge) on every machine; "
        "check with: munge -n | ssh <node> unmunge",
        f"the volume: mount {lab.data_root} at the same path on every node (hard NFS mount in fstab); "
        "jobs write checkpoints and run records there",
        "install det_lab on every node (jobs start it as the submitting user: the same uid everywhere); "
        "trials run in an Apptainer image where images: maps their config's image ('det-lab slurm image')",
        f"start: slurmctld on {slurm.controller}, slurmd on every node; then 'sinfo' shows "
        f"{', '.join(slurm.partitions())}",
        "a requeued job waits cred_expire (120 s by default) before it starts again",
    ]
