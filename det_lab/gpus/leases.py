"""This machine's GPU leases and queue, on local disk, and :func:`active_leases` for every machine.

``$DET_LAB_GPU_STATE_DIR`` (default ``/tmp/det-lab-gpus``, local to each machine) holds ``host.lock``
(``flock``: whoever chooses GPUs or changes the queue holds it, so two runs never pick one GPU),
``leases/<id>.json`` (one per run holding GPUs: its GPUs, user, run and holder) and ``queue/<id>.json``
(one per run waiting). A lease or an entry counts only while its holder lives
(:class:`~det_lab.gpus.holders.ProcessId`: pid, start time and boot id, checked at every read), so a
holder that exits, is killed with -9, is a zombie or lost a reboot holds nothing from that moment.
Its file, left behind, is journaled as ended at its last heartbeat and removed by the next reader
that holds the lock. The directories are writable by every user (not sticky): any member's run
clears a dead holder's files. This is cooperation between members, not a security boundary.
Other machines see a lease through the journal and its holder's heartbeat on the volume
(:mod:`det_lab.gpus.journal`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.gpus import journal
from det_lab.gpus.holders import ProcessId, boot_id
from det_lab.ondisk import GPU_LEASE, check, stamped
from det_lab.settings import LabSettings, env_value

DEFAULT_STATE_DIR = Path("/tmp/det-lab-gpus")
HEARTBEAT_S = 5.0  # how often a holder touches its lease file: a dead one's end is known this closely


def host_name() -> str:
    return socket.gethostname().split(".")[0]


@dataclass(frozen=True)
class Lease:
    """One GPU held by one run (a run on two GPUs holds two)."""

    host: str
    gpu_index: int
    gpu_uuid: str
    user: str
    run: str
    pid: int
    since: float  # epoch seconds
    lease_id: str = ""
    project: str = ""
    template: str = ""
    checked: bool = True  # False: another machine's, known from the journal only


@dataclass
class Held:
    """A lease file of this machine: what it holds and who holds it."""

    path: Path
    data: dict[str, Any]
    holder: ProcessId

    @property
    def id(self) -> str:
        return str(self.data["lease"])

    @property
    def uuids(self) -> list[str]:
        return [g["uuid"] for g in self.data["gpus"]]

    def leases(self) -> list[Lease]:
        d = self.data
        return [Lease(host=d["host"], gpu_index=int(g["index"]), gpu_uuid=g["uuid"], user=d["user"], run=d["run"],
                      pid=self.holder.pid, since=float(d["since"]), lease_id=d["lease"], project=d.get("project", ""),
                      template=d.get("template", "")) for g in d["gpus"]]

    def record(self) -> journal.LeaseRecord:
        d = self.data
        return journal.LeaseRecord(lease=d["lease"], host=d["host"], user=d["user"], run=d["run"],
                                   project=d.get("project", ""), template=d.get("template", ""),
                                   gpus=[(int(g["index"]), g["uuid"]) for g in d["gpus"]], pid=self.holder.pid,
                                   since=float(d["since"]))


def state_dir() -> Path:
    """This machine's lease directory (``$DET_LAB_GPU_STATE_DIR``)."""
    return Path(env_value("DET_LAB_GPU_STATE_DIR", DEFAULT_STATE_DIR))


def shared_dir(path: Path) -> Path:
    """``path``, made writable by every user when this process creates it."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        try:
            path.chmod(0o777)
        except PermissionError:
            pass
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``path`` replaced whole (a reader sees the old file or the new one), readable by all; stamped
    with :data:`~det_lab.ondisk.GPU_LEASE`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(stamped(data, GPU_LEASE), sort_keys=True).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


class HostBook:
    """This machine's leases and queue (see the module's docstring)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or state_dir()

    @property
    def lease_dir(self) -> Path:
        return self.root / "leases"

    @property
    def queue_dir(self) -> Path:
        return self.root / "queue"

    @contextmanager
    def lock(self) -> Iterator[None]:
        """The machine's lease lock, held by this process until the block ends (or it dies)."""
        shared_dir(self.root)
        path = self.root / "host.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)  # flock needs no write access
        try:
            try:
                os.fchmod(fd, 0o666)
            except PermissionError:
                pass
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _read(self, folder: Path) -> tuple[list[Held], list[Held]]:
        """(live, dead) entries of ``folder``; a file half-written or damaged is passed over. A file
        a newer det_lab wrote is a :class:`~det_lab.ondisk.NewerFormat` before any is acted on:
        its GPUs are not known here, and it is never reaped by this det_lab."""
        live: list[Held] = []
        dead: list[Held] = []
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return live, dead
        boot = boot_id()
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = folder / name
            try:
                data = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            check(data, GPU_LEASE, path)
            try:
                holder = ProcessId.from_dict(data["holder"])
            except (KeyError, TypeError, ValueError):
                continue
            (live if holder.alive(boot) else dead).append(Held(path, data, holder))
        return live, dead

    def leases(self) -> tuple[list[Held], list[Held]]:
        return self._read(self.lease_dir)

    def queue(self) -> list[Held]:
        """The live queue entries (the dead are removed as they are found, when this user may)."""
        live, dead = self._read(self.queue_dir)
        for d in dead:
            d.path.unlink(missing_ok=True)
        return live

    def reap(self, settings: LabSettings) -> list[Held]:
        """The live leases; each dead one journaled as ended at its last heartbeat, and removed. Hold the lock."""
        live, dead = self.leases()
        for d in dead:
            try:
                at = d.path.stat().st_mtime
            except FileNotFoundError:
                continue
            try:
                journal.append(settings, host_name(), _me(), journal.end_event(d.id, max(at, float(d.data["since"])),
                                                                              "holder gone"))
            except OSError:
                continue  # the volume is away: journaled by a later reader
            journal.end_beat(settings, d.id)
            d.path.unlink(missing_ok=True)
        return live

    def take(self, settings: LabSettings, gpus: list[tuple[int, str]], run: str, project: str, template: str,
             holder: ProcessId) -> Held:
        """A new lease on ``gpus`` for ``run``, journaled. Hold the lock, having checked they are free."""
        lease_id = uuid.uuid4().hex[:12]
        data: dict[str, Any] = {"lease": lease_id, "host": host_name(), "user": _me(), "run": run, "project": project,
                "template": template, "gpus": [{"index": i, "uuid": u} for i, u in gpus],
                "holder": holder.as_dict(), "since": time.time()}
        held = Held(shared_dir(self.lease_dir) / f"{lease_id}.json", data, holder)
        journal.append(settings, data["host"], data["user"], journal.start_event(held.record()))
        try:
            journal.beat(settings, lease_id)
        except OSError:
            pass  # other machines show it as its journal says until the holder's next beat
        write_json(held.path, data)
        return held

    def release(self, settings: LabSettings, held: Held, how: str = "released") -> None:
        """End ``held``: journaled, then its file removed (where the volume cannot take the end, the file
        stays until this process ends; the next reader then journals it at its last heartbeat)."""
        with self.lock():
            try:
                journal.append(settings, held.data["host"], _me(), journal.end_event(held.id, time.time(), how))
            except OSError:
                return  # kept: once this process ends, the next reader journals its end at the last heartbeat
            journal.end_beat(settings, held.id)
            held.path.unlink(missing_ok=True)


def _me() -> str:
    from det_lab.gpus.holders import user_name

    return user_name()


def active_leases(settings: LabSettings) -> list[Lease]:
    """Every GPU held now: this machine's leases whose holders live (checked), and the leases other
    machines journaled on the volume without an end whose holders still beat there, or have no
    heartbeat file (``checked`` False: their pids are not verifiable from here)."""
    live, _ = HostBook().leases()
    out = [lease for h in live for lease in h.leases()]
    here = host_name()
    for r in journal.read_records(settings):
        if r.end is None and r.host != here:
            out.extend(Lease(host=r.host, gpu_index=i, gpu_uuid=u, user=r.user, run=r.run, pid=r.pid, since=r.since,
                             lease_id=r.lease, project=r.project, template=r.template, checked=False)
                       for i, u in r.gpus)
    return out
