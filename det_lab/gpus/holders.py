"""Who a process is, in a form that outlives pid reuse and reboots, and what a process on a GPU is.

A lease or a queue entry names its holder by ``(pid, start, boot)``: the pid, its start time in clock
ticks since boot (``/proc/<pid>/stat`` field 22) and the kernel's boot id. It is alive only while a
process with that pid *and* that start time runs on this boot, and is not a zombie: a holder killed
with -9, a zombie not yet reaped, a pid reused by another program and a machine rebooted since all
read as gone, at once, with nothing to clean up first.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_BOOT_ID = PROC / "sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id (a new one after every reboot); '' where the kernel has none."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` split after the command (which may hold spaces and parentheses)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    return text[text.rfind(")") + 2:].split()


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from any later one with its pid."""

    pid: int
    start: int  # clock ticks after boot
    boot: str

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The live process ``pid``; None when there is none (or only its zombie)."""
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return None
        return cls(pid, int(fields[19]), boot_id())  # field 22 of stat; fields[0] is field 3

    @classmethod
    def me(cls) -> ProcessId:
        found = cls.of(os.getpid())
        assert found is not None  # this process reads its own /proc entry
        return found

    def alive(self, boot: str | None = None) -> bool:
        """Whether this very process still runs (not a zombie), on this boot."""
        if self.boot != (boot if boot is not None else boot_id()):
            return False
        fields = _stat_fields(self.pid)
        return fields is not None and fields[0] not in ("Z", "X") and int(fields[19]) == self.start

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "start": self.start, "boot": self.boot}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessId:
        return cls(int(d["pid"]), int(d["start"]), str(d["boot"]))


@dataclass(frozen=True)
class ForeignProcess:
    """A process NVML lists on a GPU that no det_lab lease accounts for."""

    pid: int
    user: str
    command: str
    memory: int  # bytes on that GPU

    def words(self) -> str:
        mib = self.memory / 2**20
        return f"{self.user or '?'}'s pid {self.pid} ({self.command or '?'}, {mib:,.0f} MiB)"


def describe(pid: int, memory: int) -> ForeignProcess:
    """User and command line of host pid ``pid`` ('' where /proc does not tell: gone, or hidden)."""
    base = PROC / str(pid)
    user = command = ""
    try:
        uid = base.stat().st_uid
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        command = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        pass
    return ForeignProcess(pid, user, command, memory)


def user_name(uid: int | None = None) -> str:
    """The login name of ``uid`` (default: this process's user), its number where it has none."""
    uid = os.geteuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
