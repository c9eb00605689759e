"""Letting go of an Aim client without hanging: Aim 3.29 releases a remote repository's server
resources in finalizers and sends writes from a queue that retries forever, and its exit cleanup
waits for both; these helpers probe, drain or drop them now, with errors ignored."""

from __future__ import annotations

import logging
import socket
from typing import Any

logger = logging.getLogger("det_lab.tracking.aim_backend")  # the backend's: one logger to configure


def probe_tcp(host: str, port: int, timeout_s: float) -> None:
    """Fail fast when nothing listens: Aim's own client waits up to 10 s per attempt."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(f"Aim server {host}:{port} is unreachable: {e}") from e


def release_remote_resources(client: Any) -> None:
    """Run, now, the finalizers of every Aim object that holds a server resource of ``client``."""
    from aim.ext.cleanup import AutoClean

    for _, finalizer in list(AutoClean._finalizers.values()):
        state = finalizer.peek()
        owner = getattr(state[1], "__self__", None) if state else None
        if getattr(owner, "rpc_client", None) is client:
            try:
                finalizer()
            except Exception as e:
                logger.debug("Aim: ignoring error while releasing a remote resource: %s", e)


def discard_queued_writes(request_queue: Any) -> None:
    """Stop an Aim client's write queue and forget its backlog (``aim.ext.transport.request_queue``)."""
    pending = getattr(request_queue, "_queue", None)
    if pending is None:
        return
    request_queue._shutdown = True  # register_task becomes a no-op, the worker stops
    worker = getattr(request_queue, "_thread", None)
    if worker is not None and pending.unfinished_tasks:
        worker.join(timeout=1.0)  # it puts a failed task back before it sees the shutdown
    with pending.mutex:
        pending.queue.clear()
        pending.unfinished_tasks = 0
        pending.all_tasks_done.notify_all()
        request_queue.current_memory_usage = 0
