"""A durable, append-only journal of one run's tracking events, shared by two processes.

The trial's chief is the only writer: it appends events as JSON lines to segment files
(``seg-<first seq>.jsonl``), in batches, each batch written and fsynced. One sender process per
backend tails the segments with a :class:`JournalReader` and records how far it has delivered
in a cursor file (``cursor-<backend>.json``, replaced atomically, with the backend's run id and
its last error). A reader only ever takes whole lines: a line that is still being written, or
that a crash tore, is left where it is; the next writer cuts a torn line off before appending.
A sender deletes segments that every backend has delivered (never the last one, the only one a
writer appends to).

Beside the events: ``run.json`` (whose events, and the target each backend delivers to),
``writer.json`` (the current writer, so an old sender hands over to a new trial's),
``marks.json`` (the highest step journaled per metric, so a resumed trial's replayed steps are
dropped even after their segments are gone) and ``end.json`` (how the run ended, once it has).
``run.json`` carries the journal's format version (:data:`det_lab.ondisk.TRACKING_JOURNAL`): a
journal a newer det_lab made is neither read nor written here (:attr:`Journal.newer`).

It is plain files rather than SQLite so that it can live on the shared NFS volume, where a
restarted trial on another machine finds it; SQLite must not be used on NFS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from det_lab.errors import UserError
from det_lab.ondisk import TRACKING_JOURNAL, NewerFormat, check, newer_file, stamped
from det_lab.tracking.events import Event, Metrics, RunInfo, from_record, to_record
from det_lab.volume import atomic_write_text, write_synced

SEGMENT_EVENTS = 5000
READ_BYTES = 1 << 20

Marks = dict[str, dict[str, int]]  # group -> metric key -> highest step journaled


class JournalError(UserError):
    """A journal that cannot be used as it is (no run.json, no recorded targets)."""


@dataclass(frozen=True)
class Cursor:
    seq: int = 0  # last delivered sequence number (0: nothing yet)
    run_id: str | None = None
    error: str | None = None  # why the last delivery failed; None while the backend answers


@dataclass(frozen=True)
class End:
    status: str  # FINISHED, FAILED, KILLED
    seq: int  # the last event of the run when it ended


class _RunFile(BaseModel):
    """``run.json`` as :meth:`Journal.describe_run` writes it (``targets`` absent in older journals)."""

    run: RunInfo
    backends: list[str]
    targets: dict[str, str] | None = None


class Journal:
    """The journal in ``directory`` (created if missing).

    Any process may read it and move cursors; only the trial's writer may :meth:`append`.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        #: why this det_lab may not use the journal (a newer det_lab made it); None when it may
        self.newer: NewerFormat | None = newer_file(directory / "run.json", TRACKING_JOURNAL)
        self.last_seq = 0 if self.newer else self._scan_tail()
        self._fd: int | None = None  # the segment being appended to (writer only)
        self._current_count = 0
        #: how the writer replaces its marks and end files (a trial's fence publishes them: Mirror)
        self.replace: Callable[[Path, str], None] = atomic_write_text

    # --- writing (the trial's chief only) ------------------------------------------------------

    def append(self, events: Iterable[Event]) -> int:
        """Append events durably; returns the sequence number of the last one."""
        first = self.last_seq + 1
        lines = [encode(seq, e) for seq, e in enumerate(events, start=first)]
        self.write_lines(lines)
        return self.last_seq

    def write_lines(self, lines: list[str]) -> None:
        """Append encoded lines that carry the next sequence numbers, in order; fsync them."""
        self._refuse_newer()
        if self._fd is None:
            self._open_for_append()
        first = self.last_seq + 1
        while lines:
            if self._fd is None or self._current_count >= SEGMENT_EVENTS:
                self._roll(first)
            room = SEGMENT_EVENTS - self._current_count
            chunk, lines = lines[:room], lines[room:]
            _write_all(self._fd, "".join(chunk).encode())
            os.fsync(self._fd)
            self._current_count += len(chunk)
            first += len(chunk)
            self.last_seq = first - 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open_for_append(self) -> None:
        """Cut a line torn by a crashed writer off the last segment, then append to it."""
        segments = self.segments()
        if not segments:
            return
        last = segments[-1]
        data = last.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with open(last, "r+b") as f:
                f.truncate(end)
        self._fd = os.open(last, os.O_WRONLY | os.O_APPEND)
        self._current_count = data.count(b"\n", 0, end)

    def _roll(self, first: int) -> None:
        self.close()
        path = self.directory / f"seg-{first:012d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
        self._current_count = 0

    # --- reading -------------------------------------------------------------------------------

    def segments(self) -> list[Path]:
        """The segment files now on disk, oldest first (another process may add or delete some)."""
        return sorted(self.directory.glob("seg-*.jsonl"))

    def read_after(self, seq: int, limit: int) -> list[tuple[int, Event]]:
        """Up to ``limit`` events with sequence numbers above ``seq``, in order."""
        return JournalReader(self.directory).read(seq, max_events=limit)

    # --- cursors -------------------------------------------------------------------------------

    def cursor(self, backend: str) -> Cursor:
        data = _read_json(self.directory / f"cursor-{backend}.json")
        if not isinstance(data, dict) or "seq" not in data:
            return Cursor()
        return Cursor(int(data["seq"]), data.get("run_id"), data.get("error"))

    def advance(self, backend: str, cursor: Cursor, stage: Path | None = None) -> None:
        """Record ``backend``'s cursor; with ``stage`` (the trial's attempt directory) written there and
        renamed from it: FileNotFoundError once a newer attempt removed it, so a write a cut-off
        volume held up is refused by the file server when it lands (det_lab.runs.fence)."""
        self._refuse_newer()
        path, text = self.directory / f"cursor-{backend}.json", json.dumps(asdict(cursor)) + "\n"
        if stage is None:
            atomic_write_text(path, text)
            return
        tmp = stage / f".{path.name}.{os.getpid()}.tmp"
        write_synced(tmp, text)
        os.replace(tmp, path)

    def compact(self, backends: Iterable[str]) -> None:
        """Delete segments whose events every backend has delivered (never the last one).

        Events after the saved marks are kept too: a writer that restarts reads them to rebuild
        its marks.
        """
        segments = self.segments()
        if len(segments) < 2 or self.newer:  # a newer det_lab's segments are its own to delete
            return
        floor = min((self.cursor(b).seq for b in backends), default=0)
        marks = _read_json(self.directory / "marks.json")
        if isinstance(marks, dict) and "seq" in marks:
            floor = min(floor, int(marks["seq"]))
        while len(segments) > 1 and _first_seq(segments[1]) <= floor + 1:
            segments.pop(0).unlink(missing_ok=True)

    def pending(self, backend: str) -> int:
        return self.last_seq - self.cursor(backend).seq

    # --- what the run is, who writes it, how it ended --------------------------------------------

    def describe_run(self, run: RunInfo, targets: dict[str, str]) -> None:
        """Record whose events these are and where each backend delivers them (stamped)."""
        self._refuse_newer()
        atomic_write_text(self.directory / "run.json", json.dumps(stamped(
            {"run": asdict(run), "backends": list(targets), "targets": targets}, TRACKING_JOURNAL), indent=2) + "\n")

    def run(self) -> tuple[RunInfo, dict[str, str]]:
        """The run and its ``{backend: target}``; :class:`JournalError` if they are not recorded,
        :class:`~det_lab.ondisk.NewerFormat` if a newer det_lab made the journal."""
        path = self.directory / "run.json"
        try:
            recorded = _RunFile.model_validate(check(_read_json(path), TRACKING_JOURNAL, path))
        except ValidationError:
            raise JournalError(f"{path} is missing or damaged: {self.directory} is not a det_lab tracking journal") from None
        if recorded.targets is None or set(recorded.targets) != set(recorded.backends):
            raise JournalError(f"{path} does not record where its events go (written by det_lab before targets "
                               "were recorded); it cannot be delivered safely")
        return recorded.run, recorded.targets

    def claim(self, token: str) -> None:
        """Make this writer the journal's current one; an older writer's sender hands over."""
        self._refuse_newer()
        atomic_write_text(self.directory / "writer.json", json.dumps({"token": token, "pid": os.getpid()}) + "\n")
        (self.directory / "end.json").unlink(missing_ok=True)

    def writer(self) -> str | None:
        data = _read_json(self.directory / "writer.json")
        return data.get("token") if isinstance(data, dict) else None

    def mark_end(self, status: str) -> None:
        """Record that the run ended with ``status`` after the last event written so far."""
        self._refuse_newer()
        self.replace(self.directory / "end.json", json.dumps(asdict(End(status, self.last_seq))) + "\n")

    def end(self) -> End | None:
        data = _read_json(self.directory / "end.json")
        return End(str(data["status"]), int(data["seq"])) if isinstance(data, dict) and "seq" in data else None

    # --- one value per metric and step -----------------------------------------------------------

    def save_marks(self, seq: int, marks: Marks) -> None:
        """Record the highest step journaled per metric, as of event ``seq``."""
        self._refuse_newer()
        self.replace(self.directory / "marks.json", json.dumps({"seq": seq, "marks": marks}) + "\n")

    def load_marks(self) -> Marks:
        """The highest step journaled per metric: the saved marks plus the events after them."""
        data = _read_json(self.directory / "marks.json")
        ok = isinstance(data, dict) and isinstance(data.get("marks"), dict)
        marks: Marks = {g: dict(m) for g, m in data["marks"].items()} if ok else {}
        after = int(data["seq"]) if ok else 0
        reader = JournalReader(self.directory)
        while batch := reader.read(after, max_events=SEGMENT_EVENTS):
            for seq, event in batch:
                if isinstance(event, Metrics):
                    group = marks.setdefault(event.group, {})
                    for key in event.values:
                        group[key] = max(group.get(key, event.step), event.step)
                after = seq
        return marks

    # --- recovery ------------------------------------------------------------------------------

    def _refuse_newer(self) -> None:
        """Nothing of a journal a newer det_lab made is written over or added to here."""
        if self.newer is not None:
            raise self.newer

    def _scan_tail(self) -> int:
        """The last complete event's seq (a torn final line does not count)."""
        segments = self.segments()
        if not segments:
            return 0
        data = segments[-1].read_bytes()
        complete = data[:data.rfind(b"\n") + 1]
        if complete:
            return int(json.loads(complete.splitlines()[-1])["seq"])
        # an empty last segment: its name says where it would have started
        return _first_seq(segments[-1]) - 1


class JournalReader:
    """Reads a journal forward while its writer appends, keeping its place between calls."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._segment: Path | None = None
        self._offset = 0
        self._after: int | None = None  # the seq the next read is expected to continue from

    def read(self, after: int, max_events: int = 1000, max_values: int | None = None) -> list[tuple[int, Event]]:
        """Events with sequence numbers above ``after``, in order: at most ``max_events``, and
        (metrics counted by value) ``max_values``, but always at least one when there is one."""
        if after != self._after or self._segment is None:
            self._locate(after)
        out: list[tuple[int, Event]] = []
        values, size = 0, READ_BYTES
        while self._segment is not None and len(out) < max_events and (max_values is None or values < max_values):
            try:
                with open(self._segment, "rb") as f:
                    f.seek(self._offset)
                    data = f.read(size)
            except FileNotFoundError:  # compacted away: this reader was past it, or is re-placed
                self._locate(after)
                if self._segment is None or not self._segment.exists():
                    break
                continue
            complete = data[:data.rfind(b"\n") + 1]
            if not complete:
                if len(data) == size:  # one line longer than a read: read more at once
                    size *= 2
                    continue
                nxt = self._next_segment()
                if nxt is None or data:  # at the writer's end (data: a line being written)
                    break
                self._segment, self._offset = nxt, 0
                continue
            for line in complete.splitlines(keepends=True):
                self._offset += len(line)
                seq, event = from_record(json.loads(line))
                if seq <= after:
                    continue
                out.append((seq, event))
                after = seq
                values += len(event.values) if isinstance(event, Metrics) else 1
                if len(out) >= max_events or (max_values is not None and values >= max_values):
                    break
        self._after = after
        return out

    def _locate(self, after: int) -> None:
        """Place the reader at the start of the segment that holds event ``after + 1``."""
        segments = sorted(self.directory.glob("seg-*.jsonl"))
        before = [s for s in segments if _first_seq(s) <= after + 1]
        self._segment = before[-1] if before else (segments[0] if segments else None)
        self._offset = 0

    def _next_segment(self) -> Path | None:
        current = _first_seq(self._segment)
        later = [s for s in self.directory.glob("seg-*.jsonl") if _first_seq(s) > current]
        return min(later, key=_first_seq) if later else None


def encode(seq: int, event: Event) -> str:
    return json.dumps(to_record(seq, event), separators=(",", ":")) + "\n"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _first_seq(segment: Path) -> int:
    return int(segment.stem.removeprefix("seg-"))
