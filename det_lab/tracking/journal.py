"""A durable, append-only journal of one run's tracking events, with a cursor per backend.

Events are JSON lines in segment files (``seg-<first seq>.jsonl``), appended and fsynced in
batches by one writer (the trial's chief). Each backend's cursor (the last sequence number it
has acknowledged, and its run id) is a small file replaced atomically. A restarted process opens
the same directory and replays every event past each cursor, in order. A line torn by a crash
(no trailing newline) is cut off on open. Segments every backend has passed are deleted.

It is plain files rather than SQLite so that it can live on the shared NFS volume, where a
restarted trial on another machine finds it; SQLite must not be used on NFS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from det_lab.tracking.events import Event, RunInfo, from_record, to_record
from det_lab.volume import atomic_write_text

SEGMENT_EVENTS = 5000


@dataclass(frozen=True)
class Cursor:
    seq: int = 0  # last delivered sequence number (0: nothing yet)
    run_id: str | None = None


class Journal:
    """The journal in ``directory`` (created if missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._segments = sorted(directory.glob("seg-*.jsonl"))
        self.last_seq = self._recover_tail()
        self._current_count = self._count_lines(self._segments[-1]) if self._segments else 0

    # --- writing -------------------------------------------------------------------------------

    def append(self, events: Iterable[Event]) -> int:
        """Append events durably; returns the sequence number of the last one."""
        lines = []
        for event in events:
            self.last_seq += 1
            lines.append(json.dumps(to_record(self.last_seq, event), separators=(",", ":")) + "\n")
        first = self.last_seq - len(lines) + 1
        while lines:
            if not self._segments or self._current_count >= SEGMENT_EVENTS:
                self._segments.append(self.directory / f"seg-{first:012d}.jsonl")
                self._current_count = 0
            room = SEGMENT_EVENTS - self._current_count
            chunk, lines = lines[:room], lines[room:]
            with open(self._segments[-1], "a") as f:
                f.writelines(chunk)
                f.flush()
                os.fsync(f.fileno())
            self._current_count += len(chunk)
            first += len(chunk)
        return self.last_seq

    # --- reading -------------------------------------------------------------------------------

    def read_after(self, seq: int, limit: int) -> list[tuple[int, Event]]:
        """Up to ``limit`` events with sequence numbers above ``seq``, in order."""
        out: list[tuple[int, Event]] = []
        for i, segment in enumerate(self._segments):
            nxt = self._segments[i + 1] if i + 1 < len(self._segments) else None
            if nxt is not None and _first_seq(nxt) <= seq + 1:
                continue  # every event of this segment is at or below seq
            try:
                with open(segment) as f:
                    for line in f:
                        record = json.loads(line)
                        if record["seq"] > seq:
                            out.append(from_record(record))
                            if len(out) >= limit:
                                return out
            except FileNotFoundError:
                continue
        return out

    # --- cursors -------------------------------------------------------------------------------

    def cursor(self, backend: str) -> Cursor:
        try:
            data = json.loads((self.directory / f"cursor-{backend}.json").read_text())
            return Cursor(int(data["seq"]), data.get("run_id"))
        except (OSError, ValueError, KeyError):
            return Cursor()

    def advance(self, backend: str, cursor: Cursor) -> None:
        atomic_write_text(self.directory / f"cursor-{backend}.json",
                          json.dumps({"seq": cursor.seq, "run_id": cursor.run_id}) + "\n")

    def compact(self, backends: Iterable[str]) -> None:
        """Delete segments whose events every backend has delivered (never the current one)."""
        floor = min((self.cursor(b).seq for b in backends), default=0)
        while len(self._segments) > 1 and _first_seq(self._segments[1]) <= floor + 1:
            self._segments.pop(0).unlink(missing_ok=True)

    def pending(self, backend: str) -> int:
        return self.last_seq - self.cursor(backend).seq

    def describe_run(self, run: RunInfo, backends: list[str]) -> None:
        """Record whose events these are, so ``det-lab tracking sync`` can deliver them later."""
        atomic_write_text(self.directory / "run.json",
                          json.dumps({"run": asdict(run), "backends": backends}, indent=2) + "\n")

    def run(self) -> tuple[RunInfo, list[str]]:
        data = json.loads((self.directory / "run.json").read_text())
        return RunInfo(**data["run"]), list(data["backends"])

    # --- recovery ------------------------------------------------------------------------------

    def _recover_tail(self) -> int:
        """The last complete event's seq; a torn final line is cut off."""
        if not self._segments:
            return 0
        last = self._segments[-1]
        data = last.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with open(last, "r+b") as f:
                f.truncate(end)
        lines = data[:end].splitlines()
        if lines:
            return int(json.loads(lines[-1])["seq"])
        # an empty last segment: its name says where it would have started
        return _first_seq(last) - 1

    @staticmethod
    def _count_lines(path: Path) -> int:
        with open(path, "rb") as f:
            return sum(1 for _ in f)


def _first_seq(segment: Path) -> int:
    return int(segment.stem.removeprefix("seg-"))
