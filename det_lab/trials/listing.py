"""Listing many runs: what ``det-lab runs list`` shows of each, re-read only where its files changed.

A listing reads every run's ``run.json`` and ``metrics.jsonl``: two file reads per run, over a
second for 10,000 runs on a local disk, more on NFS or for long runs' metrics. The figures of the
last listing are kept per user on local disk (``$XDG_CACHE_HOME/det-lab/runs-<volume>.json``),
each under its two files' inode, size and modification time: a run whose files did not change
costs two ``stat`` calls. ``run.json`` is replaced whole (a new inode at each write) and
``metrics.jsonl`` only grows, so an unchanged key means unchanged content; the files are stat'ed
before they are read, so a change while reading is picked up by the next listing. A cache that
cannot be read or written is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.trials.record import METRICS_FILE, RUN_FILE, LocalRunRecord
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


def _signature(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_uid]


def _shown(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: state[k] for k in _SHOWN if k in state}
    slurm = state.get("slurm") or {}
    if slurm:
        out["slurm"] = {"job_id": slurm.get("job_id"),
                        "attempts": [{"node": a.get("node")} for a in slurm.get("attempts") or []]}
    return out


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

    def read(self, run: LocalRunRecord) -> Listed:
        """``run`` as a listing shows it, from the cache when neither of its files changed."""
        directory = str(run.dir)
        key = [_signature(os.path.join(directory, RUN_FILE)), _signature(os.path.join(directory, METRICS_FILE))]
        hit = self.entries.get(directory)
        if isinstance(hit, dict) and hit.get("key") == key and key[0] is not None:
            entry = hit
        else:
            step, validation = run.progress()
            entry = {"key": key, "state": _shown(run.state()), "step": step, "validation": validation}
        self.seen[directory] = entry
        uid, changed = (key[0][3], key[0][2]) if key[0] else (-1, 0)
        return Listed(entry["state"], entry["step"], entry["validation"], uid, changed)

    def save(self, complete: bool) -> None:
        """Keep what this listing read (``complete``: it listed every run, so drop the others)."""
        entries = self.seen if complete else {**self.entries, **self.seen}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(entries), mode=0o600)
        except OSError:
            pass
