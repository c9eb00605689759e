"""Listing many runs: what ``det-lab runs list`` shows of each, re-read only where its files changed.

A listing reads every run's ``run.json`` (stat'ed through its open descriptor before it is read,
so the figures and the key they are kept under belong together) and only what it shows of it: the
top-level keys of a file as det_lab writes it are found without parsing its lineage and config. An
ended run's run.json holds the progress it reached and the size of ``metrics.jsonl`` then
(:meth:`~det_lab.trials.record.RunRecord.record_end`): while the metrics keep that size, one
``stat`` replaces reading them; any other run's metrics are read (det_lab's own lines counted, not
parsed). The figures of the last listing are kept per user on local disk
(``$XDG_CACHE_HOME/det-lab/runs-<volume>.json``), each under its two files' inode, size and
modification time: a run whose files did not change costs two ``stat`` calls. ``run.json`` is
replaced whole (a new inode at each write) and ``metrics.jsonl`` only grows, so an unchanged key
means unchanged content; a file that grows while it is read keeps the smaller size as its key, so
the next listing reads it again. A cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.trials.record import (METRICS_FILE, PROGRESS_KEY, RUN_FILE, LocalRunRecord, parse_progress,
                                   parse_run_file)
from det_lab.volume import atomic_write_text

#: the run.json keys a listing shows (the rest, lineage included, stays in the file)
_SHOWN = ("name", "template", "status", "max_length", "host", "user")


@dataclass(frozen=True)
class Listed:
    """One run as a listing shows it: part of its run.json, its progress, and who owns it."""

    state: dict[str, Any]
    step: int
    validation: dict[str, float]
    uid: int
    #: when run.json was last written (ns)
    changed: int


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_uid]


def stat_signature(path: str) -> list[int] | None:
    """The file's inode, size, modification time (ns) and owner's uid; None when there is none."""
    try:
        return _signature(os.stat(path))
    except FileNotFoundError:
        return None


def read_signed(path: str) -> tuple[bytes, list[int]] | None:
    """The file's bytes and the signature of what was read (stat'ed first); None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        data = os.read(fd, st.st_size + 1)
        if len(data) != st.st_size:  # grew since the stat, or a short read: read to the end
            chunks = [data]
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            data = b"".join(chunks)
        return data, _signature(st)
    finally:
        os.close(fd)


def _shown(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: state[k] for k in _SHOWN if k in state}
    slurm = state.get("slurm") or {}
    if slurm:
        out["slurm"] = {"job_id": slurm.get("job_id"),
                        "attempts": [{"node": a.get("node")} for a in slurm.get("attempts") or []]}
    progress = state.get(PROGRESS_KEY)
    if isinstance(progress, dict) and isinstance(progress.get("step"), int) and \
            isinstance(progress.get("validation"), dict) and isinstance(progress.get("metrics_bytes"), int):
        out[PROGRESS_KEY] = progress
    return out


#: a top-level key shown by a listing, in a run.json as det_lab writes it (json.dumps, indent=2:
#: only top-level keys start a line with two spaces and a quote; JSON strings hold no newline)
_TOP_SCALAR = re.compile(rb'\n  ("(?:' + b"|".join(k.encode() for k in _SHOWN) + rb')": [^\n]*?),?(?=\n)')
#: the top-level objects it shows: each ends at the first line that closes at the top level's depth
_TOP_OBJECTS = (b'\n  "slurm": {', b'\n  "' + PROGRESS_KEY.encode() + b'": {')


def shown_state(data: bytes, path: str) -> dict[str, Any]:
    """What a listing shows of the run.json ``data`` (at ``path``, for errors): its top-level keys
    found without parsing the rest (lineage and config are most of a run.json), for a whole file
    as det_lab writes it; any other file is parsed whole (a damaged one: ``ValueError``)."""
    if data.startswith(b'{\n  "') and data.endswith((b"\n}", b"\n}\n")):  # whole: not cut short
        parts = _TOP_SCALAR.findall(data)
        for head in _TOP_OBJECTS:
            at = data.find(head)
            end = data.find(b"\n  }", at)
            if at >= 0 and end > at:
                parts.append(data[at + 3:end + 4])
        try:
            found = json.loads(b"{" + b",".join(parts) + b"}")  # the shown keys alone, parsed at once
            if "name" in found:
                return _shown(found)
        except (ValueError, AttributeError, TypeError):
            pass  # not as det_lab writes it after all: read it whole
    return _shown(parse_run_file(data, path))


class ListingCache:
    """The last listing of the volume at ``data_root``, as this user saw it (see the module doc)."""

    def __init__(self, data_root: Path) -> None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "det-lab"
        volume = hashlib.sha256(str(Path(data_root).resolve()).encode()).hexdigest()[:16]
        self.path = base / f"runs-{volume}.json"
        try:
            entries = json.loads(self.path.read_text())
            self.entries: dict[str, Any] = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            self.entries = {}
        self.seen: dict[str, Any] = {}
        #: runs read from their files in this listing (not from the cache)
        self.read_again = 0

    def read(self, run: LocalRunRecord) -> Listed | None:
        """``run`` as a listing shows it, from the cache when neither of its files changed; None
        when its run.json is gone (a run deleted since it was found). A damaged run.json is a
        one-line ``ValueError`` naming it."""
        directory = str(run.dir)
        run_path, metrics_path = os.path.join(directory, RUN_FILE), os.path.join(directory, METRICS_FILE)
        hit = self.entries.get(directory)
        if isinstance(hit, dict):  # a listing before this one read it: two stats tell whether it changed
            key = [stat_signature(run_path), stat_signature(metrics_path)]
            if hit.get("key") == key and key[0] is not None and isinstance(hit.get("state"), dict):
                return self._listed(directory, hit)
        read = read_signed(run_path)
        if read is None:
            return None
        state = shown_state(read[0], run_path)
        recorded = state.pop(PROGRESS_KEY, None)
        metrics_key = stat_signature(metrics_path) if recorded else None
        if recorded and recorded["metrics_bytes"] == (metrics_key[1] if metrics_key else 0):
            step, validation = recorded["step"], recorded["validation"]  # an ended run: its metrics as it left them
        else:
            metrics = read_signed(metrics_path)
            step, validation = parse_progress(metrics[0]) if metrics else (0, {})
            metrics_key = metrics[1] if metrics else None
        entry = {"key": [read[1], metrics_key], "state": state, "step": step, "validation": validation}
        self.read_again += 1
        return self._listed(directory, entry)

    def _listed(self, directory: str, entry: dict[str, Any]) -> Listed:
        self.seen[directory] = entry
        _ino, _size, changed, uid = entry["key"][0]
        return Listed(entry["state"], entry["step"], entry["validation"], uid, changed)

    def save(self, complete: bool) -> None:
        """Keep what this listing read (``complete``: it listed every run, so drop the others)."""
        if not self.read_again and (not complete or len(self.seen) == len(self.entries)):
            return  # nothing new: the file on disk says it already
        entries = self.seen if complete else {**self.entries, **self.seen}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(entries), mode=0o600)
        except OSError:
            pass
