"""What ``det-lab gpus`` and ``det-lab runs list|cancel`` show of the GPUs: holders (this machine's and,
from the volume, every other machine's), the line, a waiting run."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from det_lab import nvml
from det_lab.gpus import journal
from det_lab.gpus.holders import describe
from det_lab.gpus.leases import Held, HostBook, host_name
from det_lab.gpus.queue import GpusError, lab_rules, plan
from det_lab.settings import LabSettings

#: a silent lease is listed this long after its last heartbeat (a machine that never came back
#: leaves its leases unended in the journal: they are not listed for ever)
SHOW_SILENT_S = 24 * 3600.0


def _lease_holder(held: Held) -> dict[str, Any]:
    d = held.data
    return {"kind": "lease", "user": d["user"], "run": d["run"], "project": d.get("project", ""),
            "template": d.get("template", ""), "since": float(d["since"]), "pid": held.holder.pid, "lease": d["lease"]}


def _journaled(r: journal.LeaseRecord) -> dict[str, Any]:
    """Another machine's lease as the volume tells it (``heartbeat``: its holder's last beat, where it beats)."""
    out: dict[str, Any] = {"host": r.host, "gpus": [i for i, _ in r.gpus], "user": r.user, "run": r.run,
                           "since": r.since, "lease": r.lease}
    if r.heartbeat is not None:
        out["heartbeat"] = r.heartbeat
    return out


def gpus_status(settings: LabSettings) -> dict[str, Any]:
    """Each GPU of this machine (holder: a lease's user, run and since when, or the processes outside
    det_lab on it; memory, utilisation); the leases other machines hold (``other_hosts``: journaled
    without an end, their holders beating on the volume or without a heartbeat file) and those whose
    holders went silent in the last day (``silent``: killed, or their host down or cut off; not held);
    and the line of waiting runs."""
    book = HostBook()
    try:
        readings = nvml.read_gpus()
    except Exception as exc:  # pynvml.NVMLError
        raise GpusError(f"NVML cannot read this machine's GPUs: {exc}") from None
    live, _ = book.leases()
    by_uuid = {u: h for h in live for u in h.uuids}
    here = host_name()
    gpus = []
    for r in readings:
        held = by_uuid.get(r.uuid)
        holder: dict[str, Any] | None = _lease_holder(held) if held else None
        others = [describe(pid, used) for pid, used in r.processes]
        if holder is None and others:
            holder = {"kind": "outside det-lab", "processes": [vars(p) for p in others]}
        gpus.append({"host": here, "index": r.index, "uuid": r.uuid, "name": r.name, "memory_used": r.memory_used,
                     "memory_total": r.memory_total, "utilization": r.utilization, "holder": holder})
    records = journal.read_records(settings)
    now = time.time()
    elsewhere = [_journaled(r) for r in records if r.end is None and r.host != here]
    silent = [{**_journaled(r), "silent_since": r.end} for r in records
              if r.how == journal.SILENT and r.host != here and now - float(r.end or 0) < SHOW_SILENT_S]
    entries = [h.data for h in book.queue()]
    line: list[dict[str, Any]] = []
    if entries:
        rules = lab_rules(settings)
        step = plan(readings, live, entries, journal.recent_gpu_hours(records, time.time(), rules.half_life_s), rules)
        by_id = {e["entry"]: e for e in entries}
        for pos, eid in enumerate(step.order, 1):
            e = by_id[eid]
            line.append({"position": pos, "run": e["run"], "user": e["user"], "gpus": e["slots"], "picks": e.get("picks"),
                         "since": e["enqueued"], "pid": int(e["holder"]["pid"]),
                         "waiting": e.get("words") or step.reasons.get(eid, "starting")})
    return {"host": here, "gpus": gpus, "other_hosts": elsewhere, "silent": silent, "queue": line,
            "oldest_wait_s": max((now - q["since"] for q in line), default=0.0)}


def _entry(run: str) -> Held | None:
    return next((h for h in HostBook().queue() if h.data.get("run") == run), None)


def waiting_words(run: str) -> str | None:
    """Why run ``run`` waits for GPUs on this machine ("both GPUs held (alice vla-… since 10:02, ...);
    1 run ahead": ``runs list`` shows it after the run's status, waiting), None when it is not in this
    machine's line."""
    held = _entry(run)
    if held is None:
        return None
    return held.data.get("words") or "in line for GPUs"


def cancel_waiting(run: str) -> int | None:
    """Take run ``run`` out of this machine's line (SIGTERM to its ``det-lab run``, which records it
    cancelled); its pid, or None when it is not in line here."""
    held = _entry(run)
    if held is None:
        return None
    try:
        os.kill(held.holder.pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    except PermissionError:
        raise GpusError(f"run {run} waits as pid {held.holder.pid} of {held.data['user']}: cancel it as that user") from None
    return held.holder.pid
