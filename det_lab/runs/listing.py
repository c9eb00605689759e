"""Listing many runs: what ``det-lab runs list`` shows of each, re-read only where its files changed.

A listing reads every run's ``run.json`` (stat'ed through its open descriptor before it is read,
so the figures and the key they are kept under belong together; parsed by orjson). An ended run's run.json holds the progress it reached and the size of ``metrics.jsonl`` then
(:meth:`~det_lab.runs.record.RunRecord.record_end`): while the metrics keep that size, one
``stat`` replaces reading them; any other run's metrics are read (det_lab's own lines counted, not
parsed). The figures of the last listing are kept per user on local disk
(``$XDG_CACHE_HOME/det-lab/runs-<volume>.json``), each under its two files' inode, size and
modification time: a run whose files did not change costs two ``stat`` calls. ``run.json`` is
replaced whole (a new inode at each write) and ``metrics.jsonl`` only grows, so an unchanged key
means unchanged content; a file that grows while it is read keeps the smaller size as its key, so
the next listing reads it again. A cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import json
import math
import os
import pwd
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from det_lab.errors import UserError
from det_lab.jsonload import loads
from det_lab.ondisk import FORMAT_KEY, RUNS_LISTING_CACHE, NewerFormat, stamp, version_of
from det_lab.runs.cachefile import cache_path
from det_lab.runs.record import (METRICS_FILE, PROGRESS_KEY, RUN_FILE, VolumeRunRecord, parse_progress,
                                   parse_run_file, run_dirs)
from det_lab.runs.run_state import RunState
from det_lab.settings import LabSettings
from det_lab.volume import VolumeLayout, atomic_write_text

#: the run.json keys a listing shows (the rest, lineage included, stays in the file)
_SHOWN = ("name", "template", "status", "max_length", "host", "user")


class Listed(NamedTuple):  # one per run of a listing of thousands: a tuple, not a dataclass
    """One run as a listing shows it: part of its run.json, its progress, and who owns it."""

    state: dict[str, Any]
    step: int
    validation: dict[str, float]
    uid: int
    #: when run.json was last written (ns)
    changed: int


def user_name(uid: int, known: dict[int, str]) -> str:
    """The login name of ``uid`` (its number where it has none), remembered in ``known``."""
    if uid not in known:
        try:
            known[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            known[uid] = str(uid)
    return known[uid]


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


def shown_state(data: bytes, path: str) -> dict[str, Any]:
    """What a listing shows of the run.json ``data`` (at ``path``, for errors); a damaged one is a
    one-line ``ValueError`` naming it."""
    return _shown(parse_run_file(data, path))


def read_entry(directory: str) -> dict[str, Any] | None:
    """What a listing keeps of the run in ``directory``, read from its files: ``{"key", "state",
    "step", "validation"}``; None when its run.json is not there; a damaged run.json is a one-line
    ``ValueError`` naming it."""
    run_path, metrics_path = os.path.join(directory, RUN_FILE), os.path.join(directory, METRICS_FILE)
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
    return {"key": [read[1], metrics_key], "state": state, "step": step, "validation": validation}


class Unlisted(UserError, ValueError):
    """A run a listing cannot show: its run.json ``damaged``, ``unreadable`` or written by a
    ``newer`` det_lab (``status``)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def _entry_or_error(directory: str) -> dict[str, Any] | tuple[str, str] | None:
    """:func:`read_entry` for a worker process: a run it cannot read as ``(status, message)``."""
    try:
        return read_entry(directory)
    except NewerFormat as exc:  # listed, never read as this det_lab would misread it
        return "newer", str(exc)
    except ValueError as exc:
        return "damaged", str(exc)
    except OSError as exc:  # another member's run.json this user may not read
        return "unreadable", f"{os.path.join(directory, RUN_FILE)}: cannot be read ({exc.strerror or exc})"


#: below this many runs to read, a listing reads them itself (starting workers costs more)
PARALLEL_MIN = 2000


def listing_workers() -> int:
    """How many processes read runs side by side: ``DET_LAB_LIST_WORKERS``, else one per CPU this
    process may use, at most 8."""
    from det_lab.settings import env_value

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(int(env_value("DET_LAB_LIST_WORKERS", min(cpus, 8))), 1)


def _read_entries(directories: list[str]) -> list[dict[str, Any] | tuple[str, str] | None]:
    """:func:`_entry_or_error` of each directory, in order; many are read by worker processes side
    by side (parsing thousands of records is CPU work, and on NFS each file waits on the network),
    and by this process alone when workers cannot start."""
    workers = listing_workers()
    if workers > 1 and len(directories) >= PARALLEL_MIN:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        chunk = max(len(directories) // (workers * 4), 64)
        try:  # fork: the workers start with what this process imported, and nothing is pickled in
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                return list(pool.map(_entry_or_error, directories, chunksize=chunk))
        except (OSError, BrokenProcessPool):
            pass  # no processes to be had (a limit on them, a worker killed): read them here
    return [_entry_or_error(d) for d in directories]


def user_cache(data_root: Path, stem: str) -> tuple[Path, dict[str, Any]]:
    """This user's cache file ``<stem>-<volume>.json`` of the volume at ``data_root`` on local disk
    (``$XDG_CACHE_HOME/det-lab``), and what it holds (empty when missing or unreadable)."""
    path = cache_path(data_root, stem).with_suffix(".json")
    try:
        entries = loads(path.read_bytes())
    except (OSError, ValueError):
        return path, {}
    return path, entries if isinstance(entries, dict) else {}


class ListingCache:
    """The last listing of the volume at ``data_root``, as this user saw it (see the module doc)."""

    def __init__(self, data_root: Path) -> None:
        self.path, entries = user_cache(data_root, "runs")
        try:
            version_of(entries, RUNS_LISTING_CACHE, self.path)
            self.newer = False
        except NewerFormat:  # a newer det_lab's cache: not read, and left to it (never saved over)
            entries, self.newer = {}, True
        entries.pop(FORMAT_KEY, None)
        self.entries: dict[str, Any] = entries
        self.seen: dict[str, Any] = {}
        #: runs read from their files in this listing (not from the cache)
        self.read_again = 0

    def _unchanged(self, directory: str) -> dict[str, Any] | None:
        """The cache's entry of ``directory`` when neither of its files changed (two ``stat``)."""
        hit = self.entries.get(directory)
        if not isinstance(hit, dict):
            return None
        key = [stat_signature(os.path.join(directory, RUN_FILE)), stat_signature(os.path.join(directory, METRICS_FILE))]
        if hit.get("key") == key and key[0] is not None and isinstance(hit.get("state"), dict):
            return hit
        return None

    def read_all(self, runs: list[VolumeRunRecord]) -> list[Listed | Unlisted | None]:
        """Each run as a listing shows it, in order: from the cache when neither of its files
        changed, else read (side by side when there are many: :func:`_read_entries`); None for a
        run deleted since it was found, an :class:`Unlisted` (not raised) for one it cannot read."""
        out: list[Listed | Unlisted | None] = [None] * len(runs)
        missed: list[int] = []
        for i, run in enumerate(runs):
            entry = self._unchanged(str(run.dir))
            if entry is None:
                missed.append(i)
            else:
                out[i] = self._listed(str(run.dir), entry)
        for i, entry in zip(missed, _read_entries([str(runs[i].dir) for i in missed])):
            if isinstance(entry, tuple):
                out[i] = Unlisted(*entry)
            elif entry is not None:
                self.read_again += 1
                out[i] = self._listed(str(runs[i].dir), entry)
        return out

    def _listed(self, directory: str, entry: dict[str, Any]) -> Listed:
        self.seen[directory] = entry
        _ino, _size, changed, uid = entry["key"][0]
        return Listed(entry["state"], entry["step"], entry["validation"], uid, changed)

    def save(self, complete: bool) -> None:
        """Keep what this listing read (``complete``: it listed every run, so drop the others)."""
        if self.newer or not self.read_again and (not complete or len(self.seen) == len(self.entries)):
            return  # nothing new: the file on disk says it already
        entries = self.seen if complete else {**self.entries, **self.seen}
        # orjson writes thousands of entries in a tenth of json's time, but NaN (a diverged
        # validation loss) as null: json.dumps keeps it
        try:
            finite = all(type(v) is not float or math.isfinite(v)
                         for e in entries.values() for v in e["validation"].values())
        except (AttributeError, KeyError, TypeError):  # an entry of a damaged cache kept for other runs
            finite = False
        entries = {FORMAT_KEY: stamp(RUNS_LISTING_CACHE), **entries}
        text = orjson.dumps(entries).decode() if finite else json.dumps(entries, separators=(",", ":"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, text, mode=0o600)
        except OSError:
            pass


class RunNotFound(UserError, LookupError):
    """No run of that name on the volume."""


def all_runs(settings: LabSettings, project: str | None = None, ordered: bool = True,
             probe: bool = True) -> list[VolumeRunRecord]:
    """Every run of ``project`` (default: all projects), by the time of its run.json unless not
    ``ordered``; ``probe``: see :func:`det_lab.runs.record.run_dirs`."""
    layout = VolumeLayout.from_settings(settings)
    projects = [project] if project else sorted(settings.projects)
    runs = [cls(d) for p in projects for d, cls in run_dirs(layout, p, probe or ordered)]
    return sorted(runs, key=lambda r: r.run_file.stat().st_mtime) if ordered else runs


def find_run(settings: LabSettings, name: str) -> VolumeRunRecord:
    """The run called ``name`` in any project; :class:`RunNotFound` (one line) if there is none."""
    for run in all_runs(settings):
        if run.dir.name == name:
            return run
    raise RunNotFound(f"no run named {name!r} on {settings.data_root} (list them with: det-lab runs list)")


def run_owner(run: VolumeRunRecord, st: RunState) -> str:
    """Who made the run: run.json's user (a Slurm run's submitter), else the owner of its run.json."""
    return st.get("user") or user_name(run.run_file.stat().st_uid, {})
