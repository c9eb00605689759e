"""The cluster's own checks for ``det-lab doctor`` and the start's preflight: the master database's
backups, the host paths task containers bind-mount, the lab config tasks read from the volume."""

from __future__ import annotations

from collections.abc import Iterator

from det_lab.checks import Check
from det_lab.host_checks import collect
from det_lab.settings import LabSettings

def backup_checks(settings: LabSettings) -> Iterator[Check]:
    """The master database's newest backup, where this lab runs a cluster or keeps backups."""
    from det_lab.cluster.backup import backup_check

    found = backup_check(settings)
    if found is not None:
        yield Check("backups", *found)


def bind_source_checks(settings: LabSettings) -> Iterator[Check]:
    """Every host path a task bind-mounts exists here (Docker refuses a missing one), where this
    lab has a cluster config; a fail on the cluster's own machines, a warn elsewhere."""
    import socket

    from det_lab.cluster.bind_sources import missing_bind_sources
    from det_lab.cluster.settings import ClusterConfigError, load_cluster_settings

    try:
        cluster = load_cluster_settings(settings)
    except ClusterConfigError:
        return  # the backup check reports the damaged file
    if cluster.source is None:
        return
    host = socket.gethostname()
    ours = host == cluster.master_host or any(host in p.agents for p in cluster.pools)
    missing = missing_bind_sources(settings, cluster)
    for detail, fix in missing:
        yield Check("bind mounts", "fail" if ours else "warn", detail, fix)
    if not missing:
        yield Check("bind mounts", "pass", "every host path task containers bind-mount exists here")


def task_config_checks(settings: LabSettings) -> Iterator[Check]:
    """Cluster tasks read the lab config from its copy on the volume: there, and the same as this one."""
    from det_lab.cluster.render import task_config_path, task_config_problem
    from det_lab.cluster.settings import ClusterConfigError, load_cluster_settings

    try:
        cluster = load_cluster_settings(settings)
    except ClusterConfigError:
        return
    if cluster.source is None:
        return
    problem = task_config_problem(settings)
    if problem:
        yield Check("task lab config", "warn", problem,
                    "run 'det-lab cluster up' (or 'det-lab cluster agent-up') on a cluster machine")
    else:
        yield Check("task lab config", "pass", f"{task_config_path(settings)} is this lab config")



def cluster_checks(settings: LabSettings) -> list[Check]:
    """Backups, bind sources and the task lab config, each producer crash-isolated."""
    return collect((lambda: backup_checks(settings), lambda: bind_source_checks(settings),
                    lambda: task_config_checks(settings)))
