"""Whether every host path a task container bind-mounts exists on this machine.

Determined hands each bind mount to Docker as a mount of type ``bind``
(``master/pkg/tasks/mounts.go`` ``ToDockerMounts`` l.12-30), and the shared_fs checkpoint storage's
``host_path`` likewise (``master/pkg/tasks/task_trial.go`` l.152-157). Unlike ``docker run -v``,
Docker refuses such a mount when its source does not exist ("bind source path does not exist"):
every task scheduled on the agent fails at container creation, long after ``agent-up`` said
the agent joined. ``agent-up``, ``up`` and ``doctor`` check first and name the missing path.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from det_lab.cluster.render import render_master
from det_lab.cluster.settings import ClusterSettings
from det_lab.settings import LabSettings


def _sources(conf: dict[str, Any], pool: str) -> list[tuple[str, str]]:
    """(host path, where in master.yaml) of what a task of ``pool`` mounts."""
    found: list[tuple[str, str]] = []
    storage = conf.get("checkpoint_storage") or {}
    if storage.get("type") == "shared_fs" and storage.get("host_path"):
        found.append((storage["host_path"], "checkpoint_storage.host_path"))
    blocks = [("task_container_defaults", conf.get("task_container_defaults") or {})]
    for i, block in enumerate(conf.get("resource_pools") or []):
        if block.get("pool_name") == pool and block.get("task_container_defaults"):
            blocks.append((f"resource_pools[{i}].task_container_defaults", block["task_container_defaults"]))
    for where, tcd in blocks:
        for j, mount in enumerate(tcd.get("bind_mounts") or []):
            found.append((mount["host_path"], f"{where}.bind_mounts[{j}]"))
    return found


def missing_bind_sources(lab: LabSettings, cluster: ClusterSettings, pool: str | None = None,
                         *, made_later: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(problem, fix) for each host path that a task of ``pool`` (default: this machine's pool)
    would bind-mount and that does not exist on this machine; empty when all do. ``made_later``:
    sources the caller makes itself once it may (agent-up's task cache, after Docker answers)."""
    pool = pool or cluster.pool_of_agent(socket.gethostname()).name
    root = str(lab.data_root)
    listed = {str(m.host_path) for m in cluster.bind_mounts}
    problems, seen = [], set(made_later)
    for host, where in _sources(render_master(lab, cluster), pool):
        if host in seen or os.path.exists(host):
            continue
        seen.add(host)
        if host == root or host.startswith(root.rstrip("/") + "/"):
            fix = f"mount the shared volume at {root} here ('det-lab init' creates its directories)"
        elif host in listed:
            fix = f"create it here, or remove it from bind_mounts in {cluster.source or 'cluster.yaml'}"
        else:
            fix = "create it here (det_lab mounts it into every task)"
        problems.append((f"bind mount source {host} does not exist on this machine ({where} in master.yaml): "
                         "Docker refuses to start a task whose mount source is missing", fix))
    return problems


def check_bind_sources(lab: LabSettings, cluster: ClusterSettings, pool: str | None = None,
                       *, made_later: frozenset[str] = frozenset()) -> str | None:
    """The first missing source as one line with its fix (and how many more), or None."""
    missing = missing_bind_sources(lab, cluster, pool, made_later=made_later)
    if not missing:
        return None
    more = f" ({len(missing) - 1} more: det-lab doctor lists them)" if len(missing) > 1 else ""
    return f"{missing[0][0]}; {missing[0][1]}{more}"
