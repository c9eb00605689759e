"""``det-lab doctor``: what is wrong with this machine, one line per check, each with its fix.

Every check returns :class:`Check` results and never raises: a broken Docker, a hung
``nvidia-smi`` or an unreachable master becomes a warn/fail line, not a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from det_lab.checks import Check, Status  # noqa: F401  (Status: re-exported)
from det_lab.cluster.health import backup_checks, bind_source_checks, task_config_checks
from det_lab.host_checks import collect, config_check, docker_checks, gpu_checks, service_checks, tool_checks, volume_checks
from det_lab.host_checks import gpu_report  # noqa: F401  (re-exported: det_lab.doctor.gpu_report)
from det_lab.mounts import NETWORK_FS, Mount, mount_of, parse_mounts  # noqa: F401  (re-exported)
from det_lab.settings import LabSettings

#: the five ways a team sharing GPUs without a scheduler gets hurt:
#: (the check that watches for it on this machine, what covers it once work goes through det_lab)
RISKS: dict[str, tuple[str, str]] = {
    "GPU OOM from concurrent jobs": ("gpus", "prevented: Determined and Slurm give each task its own GPUs, and "
                                     "det-lab run --local leases its GPUs (never one held, nor one a process "
                                     "outside det-lab uses)"),
    "no identity on who holds a GPU": ("gpus", "prevented for det-lab's runs: a task's owner in the Web UI, a "
                                       "local run's lease; det-lab gpus names every holder, outside det-lab too"),
    "no disk quota": ("quota", "per-project quotas from the lab config, checked before every dataset pull"),
    "CUDA version conflicts": ("cuda", "handled by the cluster: each task brings its CUDA in its own image"),
    "no audit trail": ("audit trail", "Determined records every experiment; det_lab mirrors it to MLflow/Aim; "
                       "local runs' GPU leases are journaled on the volume (det-lab usage)"),
}


def run_checks(settings: LabSettings, mounts_file: Path = Path("/proc/mounts")) -> list[Check]:
    """Run every check against this machine and ``settings``: the machine's
    (:mod:`det_lab.host_checks`), the cluster's (:mod:`det_lab.cluster.health`), Prometheus' and
    Slurm accounting's."""
    return [config_check(settings)] + collect((
        lambda: volume_checks(settings, mounts_file), tool_checks, docker_checks, gpu_checks,
        lambda: service_checks(settings),
        lambda: backup_checks(settings),
        lambda: bind_source_checks(settings),
        lambda: task_config_checks(settings),
        lambda: _tsdb_checks(mounts_file),
        lambda: _accounting_checks(settings),
    ))


def risk_lines(checks: list[Check]) -> list[Check]:
    """Map each of the five shared-GPU failure modes to the worst status of the checks watching it."""
    out = []
    for risk, (name, covered) in RISKS.items():
        watching = [c for c in checks if c.name == name or c.name.startswith(name + " ")]
        worst = max(watching, key=lambda c: ("pass", "warn", "fail").index(c.status), default=None)
        if worst is None:
            out.append(Check(risk, "warn", f"{covered}; not checked here (no '{name}' check ran)"))
        else:
            out.append(Check(risk, worst.status, f"{covered}; see '{worst.name}'", worst.fix))
    return out


def as_json(checks: list[Check]) -> dict:
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [asdict(c) for c in checks],
        "risks": [asdict(c) for c in risk_lines(checks)],
    }


def _accounting_checks(settings: LabSettings) -> Iterator[Check]:
    """With Slurm accounting in slurm.yaml: slurmdbd and its database answer, and the cluster is registered."""
    from det_lab.slurm.settings import SlurmConfigError, load_slurm_settings

    try:
        slurm = load_slurm_settings(settings)
    except SlurmConfigError:
        return  # det-lab slurm commands say what is wrong with it
    if slurm.accounting is None:
        return
    from det_lab.accounting.slurm_accounts import AccountingError, sacctmgr

    try:
        clusters = sacctmgr("show", "cluster", "format=Cluster", timeout=15).split()
    except AccountingError as exc:
        yield Check("slurm accounting", "warn", str(exc),
                    "start MariaDB, then slurmdbd, then slurmctld ('det-lab slurm config' prints the set-up)")
        return
    if slurm.cluster_name not in clusters:
        yield Check("slurm accounting", "warn", f"slurmdbd answers, but cluster {slurm.cluster_name} is not registered",
                    "start slurmctld (it registers its cluster), then run 'det-lab slurm accounts'")
        return
    yield Check("slurm accounting", "pass", f"slurmdbd answers; cluster {slurm.cluster_name} registered")


def _tsdb_checks(mounts_file: Path, tsdb_dirs: list[Path] | None = None) -> Iterator[Check]:
    """Prometheus' TSDB must be on a local disk: on NFS it corrupts (Prometheus' storage docs)."""
    from det_lab.monitoring.render import installed_tsdb_dirs

    for d in installed_tsdb_dirs() if tsdb_dirs is None else tsdb_dirs:
        mount = mount_of(d, parse_mounts(mounts_file.read_text()))
        if mount is not None and mount.fstype in NETWORK_FS:
            yield Check("prometheus tsdb", "warn", f"{d} is on {mount.fstype} ({mount.device})",
                        "put Prometheus' --storage.tsdb.path on a local disk: det-lab monitor config --tsdb DIR")
        else:
            yield Check("prometheus tsdb", "pass", f"{d} on a local file system")
