"""The watchdog's journal on the volume: every warning, action and snooze, each once.

``<data root>/.det-lab/watchdog/journal.jsonl``, one JSON object a line, appended under a volume
lock (one file for every machine's watchdog and every user's snooze). Each event of a holder's
episode (warned, acted, cleared) is written once: the watchdog reads the journal back before it
writes, so a watchdog restarted mid-grace neither warns again nor acts twice, and its deadline is
the one the first warning gave. A snooze ends the episode: after it, an idle holder is warned anew.

Beside it, per machine: ``samples-<node>.json`` (the windows, so a restart keeps them, and the
watchdog of a multi-node job's first node judges it on every node's; ``<node>``: the machine's
Slurm node name, its host name by default) and ``idle-<host>.json`` (idle GPU-seconds per user and
day, for ``det-lab usage``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.data.lock import VolumeLock
from det_lab.volume import atomic_write_text

JOURNAL_FILE = "journal.jsonl"
EVENTS = ("warned", "acted", "cleared", "snoozed")


def watchdog_dir(data_root: Path) -> Path:
    return data_root / ".det-lab" / "watchdog"


@dataclass
class HolderState:
    """What the journal says of one holder."""

    episode: int = 1
    warned_at: float | None = None
    deadline: float | None = None
    acted: bool = False
    snoozed_until: float | None = None


class WatchdogJournal:
    """The journal of the volume at ``data_root``."""

    def __init__(self, data_root: Path) -> None:
        self.dir = watchdog_dir(data_root)
        self.file = self.dir / JOURNAL_FILE

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every entry, oldest first (a line being written, or damaged, is passed over)."""
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return
        for line in data[:data.rfind(b"\n") + 1].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") in EVENTS:
                yield entry

    def states(self, entries: list[dict[str, Any]] | None = None) -> dict[str, HolderState]:
        """Each holder's state, folded from the journal (or ``entries`` read from it; snoozes are by their
        target names, see :meth:`snoozes`)."""
        out: dict[str, HolderState] = {}
        for e in self.entries() if entries is None else entries:
            if e["event"] == "snoozed":
                continue
            st = out.setdefault(e["holder"], HolderState())
            if int(e.get("episode", 1)) < st.episode:
                continue
            st.episode = int(e.get("episode", 1))
            if e["event"] == "warned":
                st.warned_at, st.deadline = float(e["at"]), e.get("deadline")
            elif e["event"] == "acted":
                st.acted = True
            elif e["event"] == "cleared":
                st.episode, st.warned_at, st.deadline, st.acted = st.episode + 1, None, None, False
        return out

    def snoozes(self, entries: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Every snooze asked: ``target`` (what the user named), ``until``, ``by`` (their user)."""
        return [e for e in (self.entries() if entries is None else entries) if e["event"] == "snoozed"]

    def append(self, entry: dict[str, Any], once: bool = True) -> bool:
        """Append ``entry`` (``holder``, ``event``, ``episode`` ...); with ``once``, not when that holder's
        episode already has that event. Returns whether it was written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now().astimezone()
        entry = {"time": now.isoformat(timespec="seconds"), "at": now.timestamp(), **entry}
        with VolumeLock(self.dir / "journal.lock", timeout=30):
            if once and any(e.get("holder") == entry.get("holder") and e["event"] == entry["event"]
                            and e.get("episode") == entry.get("episode") for e in self.entries()):
                return False
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
            try:
                os.write(fd, (json.dumps(entry, default=str) + "\n").encode())
            finally:
                os.close(fd)
        return True


class MachineState:
    """One machine's samples and idle GPU-seconds, kept on the volume between passes and restarts."""

    def __init__(self, data_root: Path, host: str, node: str | None = None) -> None:
        base = watchdog_dir(data_root)
        self.samples_file = samples_file(data_root, node or host)
        self.idle_file = base / f"idle-{host}.json"

    def load_samples(self) -> dict[str, dict[int, list[tuple[float, float, float]]]]:
        """``{holder key: {gpu: [(time, util %, mem %)]}}`` as last saved ({} when none)."""
        return _load_samples(self.samples_file)

    def save_samples(self, samples: dict[str, dict[int, list]]) -> None:
        self.samples_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.samples_file, json.dumps(samples) + "\n", 0o664)

    def add_idle(self, seconds_by_user: dict[str, float], day: str) -> None:
        """Add idle GPU-seconds to each user's ``day``."""
        if not seconds_by_user:
            return
        table = read_idle(self.idle_file)
        for user, seconds in seconds_by_user.items():
            per_day = table.setdefault(user, {})
            per_day[day] = per_day.get(day, 0.0) + seconds
        self.idle_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.idle_file, json.dumps(table, sort_keys=True) + "\n", 0o664)


def samples_file(data_root: Path, node: str) -> Path:
    return watchdog_dir(data_root) / f"samples-{node}.json"


def read_samples(data_root: Path, node: str) -> dict[str, dict[int, list[tuple[float, float, float]]]]:
    """The samples the watchdog of ``node`` last saved ({} when none)."""
    return _load_samples(samples_file(data_root, node))


def _load_samples(path: Path) -> dict[str, dict[int, list[tuple[float, float, float]]]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    try:
        return {k: {int(g): [tuple(s) for s in v] for g, v in gpus.items()} for k, gpus in raw.items()}
    except (AttributeError, TypeError, ValueError):
        return {}


def read_idle(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def idle_gpu_hours(data_root: Path, since: dt.date) -> dict[str, float]:
    """Idle GPU-hours per user on every machine since ``since`` (the days the watchdog sampled)."""
    out: dict[str, float] = {}
    for path in sorted(watchdog_dir(data_root).glob("idle-*.json")):
        for user, days in read_idle(path).items():
            for day, seconds in (days.items() if isinstance(days, dict) else ()):
                if str(day) >= since.isoformat():
                    out[user] = out.get(user, 0.0) + float(seconds) / 3600
    return out
