"""The audit trail of GPU leases on the shared volume: every lease's start and end, one line each.

``<data root>/.det-lab/gpus/journal/<host>.<user>.jsonl``: each member appends only to their own
file of each machine (no two writers on one file across NFS clients; the host's lease lock orders
the lines of one machine). A lease's start names its host, GPUs, user, run, project, template and
holder pid; its end says when and how (``released`` by its holder, or ``holder gone``: found dead,
ended at its last heartbeat). A lease with a start and no end is still held, or on another machine
whose holder died and that nobody there has looked at since.

Beside it, ``<data root>/.det-lab/gpus/live/<lease>``: an empty file per lease held, created with the
lease and touched by its holder every third of ``$DET_LAB_LOCK_LIFETIME`` (60 s by default, the
volume locks' lifetime), removed when the lease ends. Other machines cannot check a holder's pid;
they read this heartbeat instead: a lease whose file was not touched for a whole lifetime is
**silent** (its holder was killed, or its host is down or cut off) and counts as ended at its last
heartbeat (:func:`read_records` says so with ``how`` :data:`SILENT`; nothing is written: should the
holder beat again, the lease is held again). A lease without the file (journaled by an older
det_lab) is shown as its journal says. Clocks are compared across machines: keep them in step
(NTP; munge, which Slurm needs, requires it too).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.ondisk import FORMAT_KEY, GPU_LEASE_JOURNAL, check, stamp
from det_lab.runs.run_guard import lock_lifetime_s
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout

#: ``how`` of a lease that was not ended but whose holder stopped beating on the volume
SILENT = "silent"


def journal_dir(settings: LabSettings) -> Path:
    """Where every machine's lease journal lies on the volume."""
    return VolumeLayout.from_settings(settings).state / "gpus" / "journal"


@dataclass
class LeaseRecord:
    """One lease as the journal tells it (``end`` None: not ended as far as it knows)."""

    lease: str
    host: str
    user: str
    run: str
    project: str
    template: str
    gpus: list[tuple[int, str]]  # (NVML index, UUID) on ``host``
    pid: int
    since: float  # epoch seconds
    end: float | None = None
    how: str | None = None
    heartbeat: float | None = None  # its holder's last beat on the volume (None: it has no heartbeat file)
    extra: dict[str, Any] = field(default_factory=dict)

    def seconds(self, now: float) -> float:
        """How long it was (or has so far been) held."""
        return max(0.0, (self.end if self.end is not None else now) - self.since)

    def gpu_hours(self, now: float) -> float:
        return len(self.gpus) * self.seconds(now) / 3600


def append(settings: LabSettings, host: str, user: str, event: dict[str, Any]) -> None:
    """Append one event to this machine's and user's journal (OSError when the volume cannot take it)."""
    folder = journal_dir(settings)
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        try:  # members add their own files: the group writes here (the volume's setgid keeps the group)
            folder.chmod(0o2775)
            folder.parent.chmod(0o2775)
        except PermissionError:
            pass
    line = (json.dumps({**event, FORMAT_KEY: stamp(GPU_LEASE_JOURNAL)}, sort_keys=True) + "\n").encode()
    fd = os.open(folder / f"{host}.{user}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
    try:
        os.write(fd, line)  # one write of a short line: whole or not at all in the file
        os.fsync(fd)
    finally:
        os.close(fd)


def start_event(record: LeaseRecord) -> dict[str, Any]:
    return {"event": "start", "lease": record.lease, "host": record.host, "user": record.user, "run": record.run,
            "project": record.project, "template": record.template,
            "gpus": [{"index": i, "uuid": u} for i, u in record.gpus], "pid": record.pid, "since": record.since}


def end_event(lease: str, at: float, how: str) -> dict[str, Any]:
    return {"event": "end", "lease": lease, "at": at, "how": how}


def read_records(settings: LabSettings) -> list[LeaseRecord]:
    """Every lease in every machine's journal, by start time; the first end of a lease counts (a
    damaged line, as a disk that filled mid-write leaves, is passed over; a line a newer det_lab
    wrote is a :class:`~det_lab.ondisk.NewerFormat`)."""
    folder = journal_dir(settings)
    starts: dict[str, LeaseRecord] = {}
    ends: dict[str, tuple[float, str]] = {}
    try:
        files = sorted(folder.glob("*.jsonl"))
    except OSError:
        return []
    for path in files:
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for n, raw in enumerate(lines, 1):
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            check(e, GPU_LEASE_JOURNAL, f"{path} line {n}")
            try:
                if e["event"] == "start":
                    starts.setdefault(e["lease"], LeaseRecord(
                        lease=e["lease"], host=e["host"], user=e["user"], run=e.get("run") or "",
                        project=e.get("project") or "", template=e.get("template") or "",
                        gpus=[(int(g["index"]), str(g["uuid"])) for g in e["gpus"]], pid=int(e["pid"]),
                        since=float(e["since"])))
                elif e["event"] == "end":
                    ends.setdefault(e["lease"], (float(e["at"]), str(e.get("how") or "")))
            except (ValueError, KeyError, TypeError):
                continue
    for lease, (at, how) in ends.items():
        if lease in starts:
            starts[lease].end, starts[lease].how = at, how
    open_ = [r for r in starts.values() if r.end is None]
    if open_:
        beats = read_beats(settings, [r.lease for r in open_])
        now, lifetime = time.time(), lock_lifetime_s()
        for r in open_:
            r.heartbeat = beats.get(r.lease)
            if r.heartbeat is not None and now - r.heartbeat > lifetime:
                r.end, r.how = max(r.heartbeat, r.since), SILENT
    return sorted(starts.values(), key=lambda r: (r.since, r.lease))


def beat_dir(settings: LabSettings) -> Path:
    """Where the holders of leases beat (see the module's docstring)."""
    return journal_dir(settings).parent / "live"


def beat(settings: LabSettings, lease: str) -> None:
    """Lease ``lease``'s holder is alive now (its heartbeat file made or touched; OSError when the volume
    cannot take it)."""
    path = beat_dir(settings) / lease
    try:
        os.utime(path)  # on NFS: the server's time
        return
    except FileNotFoundError:
        pass
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.parent.chmod(0o2775)
        except PermissionError:
            pass
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o664))


def end_beat(settings: LabSettings, lease: str) -> None:
    """Lease ``lease`` ended (journaled): its heartbeat file removed, where this user may."""
    try:
        (beat_dir(settings) / lease).unlink(missing_ok=True)
    except OSError:
        pass


def read_beats(settings: LabSettings, leases: list[str]) -> dict[str, float]:
    """The last heartbeat of each of ``leases`` that has a heartbeat file. The file is opened before its
    time is read: an NFS client then asks the server (close-to-open), not its attribute cache."""
    folder = beat_dir(settings)
    out: dict[str, float] = {}
    for lease in leases:
        try:
            fd = os.open(folder / lease, os.O_RDONLY)
        except OSError:
            continue
        try:
            out[lease] = os.fstat(fd).st_mtime
        finally:
            os.close(fd)
    return out


def recent_gpu_hours(records: list[LeaseRecord], now: float, half_life_s: float) -> dict[str, float]:
    """Each user's GPU-hours, the older the less (halved every ``half_life_s``), as Slurm's fair-share
    decays past use (PriorityDecayHalfLife); a lease still held counts up to now."""
    out: dict[str, float] = {}
    for r in records:
        age = max(0.0, now - (r.end if r.end is not None else now))
        out[r.user] = out.get(r.user, 0.0) + r.gpu_hours(now) * 0.5 ** (age / half_life_s)
    return out
