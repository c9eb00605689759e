"""What runs keep on the volume: the dataset revisions their lineage records and the snapshots
running trials read; and ``det-lab data gc``, which must keep both.

A local-style run (``det-lab run --local``, Slurm) records its dataset in ``run.json``'s
``lineage.dataset``; that revision's objects stay in the shared cache as long as the run is on
the volume. A run that trains now (a live trainer holds its lock,
:func:`det_lab.runs.run_guard.training_status`) keeps its snapshot whatever its last use says.
A run whose ``run.json`` cannot be read keeps its whole project's cache: what it needs is unknown.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from det_lab.data.directory import DIRECTORY_REV
from det_lab.data.gc import GcPlan, GcReport, Keep, collect
from det_lab.jsonload import loads
from det_lab.ondisk import RUN_FACTS_CACHE, RUN_RECORD, check, newer_file
from det_lab.settings import LabSettings
from det_lab.runs.expconf import project_of
from det_lab.runs import cachefile
from det_lab.runs.record import RUN_FILE, WAIT_KEY, run_dirs
from det_lab.runs.run_guard import training_status
from det_lab.runs.run_state import RunStatus
from det_lab.volume import VolumeLayout

__all__ = ["FactsCache", "RunDataUse", "RunFacts", "data_gc", "dataset_keep", "run_facts", "trains"]


class RunFacts(NamedTuple):
    """What the volume's clean-up needs of one run.json (kept per user between calls; a tuple:
    ten thousand of them are made from the cache per listing)."""

    status: str
    changed: float  # run.json's modification time
    dataset: dict[str, Any] | None  # lineage.dataset
    checkpoints: tuple[str, ...]  # the uuids run.json lists
    storage: dict[str, Any] | None  # exp_conf.checkpoint_storage: where its checkpoints are
    # what runs prune's plan reads (det_lab.lifecycle.prune)
    name: str | None = None  # run.json's name
    user: str | None = None  # run.json's user
    project: str = "default"  # the project its exp_conf names
    deleting: bool = False  # a deletion under way
    latest: str | None = None  # latest_checkpoint: a resume starts there
    scheduling: dict[str, Any] | None = None  # the keys a record's ``scheduled`` reads


_N_FACTS = len(RunFacts._fields)  # an entry of fewer (an older det_lab's) is read again
_FACTS_VERSION = RUN_FACTS_CACHE.version  # of the cache file's shape: path -> (ino, size, mtime_ns, facts)
#: run.json's keys a run record's ``scheduled`` reads (its status, its GPU wait, its Slurm job)
SCHEDULING_KEYS = ("status", WAIT_KEY)


def _facts(state: dict[str, Any], changed: float) -> RunFacts:
    lineage = state.get("lineage")
    ds = lineage.get("dataset") if isinstance(lineage, dict) else None
    conf = state.get("exp_conf")
    storage = conf.get("checkpoint_storage") if isinstance(conf, dict) else None
    uuids = tuple(str(e["uuid"]) for e in state.get("checkpoints") or [] if isinstance(e, dict) and e.get("uuid"))
    scheduling = {k: state[k] for k in SCHEDULING_KEYS if k in state}
    slurm = state.get("slurm")
    if isinstance(slurm, dict) and slurm.get("job_id"):
        scheduling["slurm"] = {"job_id": slurm["job_id"]}
    return RunFacts(str(state.get("status") or "created"), changed, ds if isinstance(ds, dict) else None, uuids,
                    storage if isinstance(storage, dict) else None,
                    str(state["name"]) if state.get("name") else None,
                    str(state["user"]) if state.get("user") else None,
                    project_of(conf) if isinstance(conf, dict) else "default", bool(state.get("deleting")),
                    None if state.get("latest_checkpoint") is None else str(state.get("latest_checkpoint")),
                    scheduling)


class FactsCache:
    """The facts of the last reading of each run.json, under the file's inode, size and time, on
    this user's local disk (``$XDG_CACHE_HOME/det-lab/run-facts-<volume>.pickle``,
    :mod:`~det_lab.runs.cachefile`): a run.json
    replaced since (every write is a new inode) is read again; the others cost one ``stat``. A
    cache that cannot be read or written is ignored."""

    def __init__(self, data_root: Path) -> None:
        self.path = cachefile.cache_path(data_root, "run-facts")
        known = cachefile.load(self.path, _FACTS_VERSION)
        self.entries: dict[str, Any] = known if isinstance(known, dict) else {}
        self.seen: dict[str, Any] = {}
        self.read_again = 0
        self.stat: os.stat_result | None = None  # of the run.json the last call looked at

    def facts(self, path: str) -> RunFacts | None:
        """The facts of the run.json at ``path``; None when it is gone; ``ValueError`` or
        ``OSError`` when it cannot be parsed or read."""
        try:
            st = self.stat = os.stat(path)
        except FileNotFoundError:
            return None
        hit = self.entries.get(path)
        if (type(hit) is tuple and len(hit) == 4 and hit[0] == st.st_ino and hit[1] == st.st_size
                and hit[2] == st.st_mtime_ns and type(hit[3]) is tuple and len(hit[3]) == _N_FACTS):
            self.seen[path] = hit
            return RunFacts._make(hit[3])
        with open(path, "rb") as f:
            st = self.stat = os.fstat(f.fileno())
            state = loads(f.read())
        if not isinstance(state, dict):
            raise ValueError(f"{path}: not a JSON object")
        check(state, RUN_RECORD, path)  # a newer det_lab's run: NewerFormat (a ValueError), never misread
        facts = _facts(state, st.st_mtime)
        self.seen[path] = (st.st_ino, st.st_size, st.st_mtime_ns, tuple(facts))
        self.read_again += 1
        return facts

    def save(self) -> None:
        if not self.read_again and len(self.seen) == len(self.entries):
            return
        same: dict[Any, Any] = {}  # a lineage, a storage config: one object for every run naming it
        entries = {path: (*key, tuple(cachefile.shared(v, same) for v in facts)) for path, (*key, facts) in self.seen.items()}
        cachefile.dump(self.path, entries, _FACTS_VERSION)


def run_facts(layout: VolumeLayout, project: str, cache: FactsCache) -> Iterator[tuple[Path, RunFacts | None]]:
    """``(run directory, its facts)`` of every local-style run of ``project``; ``None`` facts for
    a run.json that cannot be read or parsed (a run deleted meanwhile is left out)."""
    for directory, _cls in run_dirs(layout, project, probe=False):
        try:
            facts = cache.facts(os.path.join(directory, RUN_FILE))
        except (OSError, ValueError):
            yield directory, None
            continue
        if facts is not None:
            yield directory, facts


def trains(facts: RunFacts, directory: Path) -> bool:
    """Whether the run trains now (a live trainer holds its lock)."""
    return facts.status in (RunStatus.RUNNING, RunStatus.CREATED) and \
        training_status({"status": facts.status}, directory) == RunStatus.RUNNING


@dataclass
class RunDataUse:
    """What the runs of the volume keep, and the runs that could not be read."""

    keep: Keep = field(default_factory=Keep)
    unreadable: dict[str, list[Path]] = field(default_factory=dict)  # project -> run.json files


Listed = dict[str, list[tuple[Path, RunFacts | None]]]


def dataset_keep(settings: LabSettings, listed: Listed | None = None) -> RunDataUse:
    """The dataset revisions runs' lineage records, and the snapshots running trials read.
    ``listed``: the runs of some projects as :func:`run_facts` gave them just now (not read again)."""
    layout = VolumeLayout.from_settings(settings)
    use = RunDataUse()
    listed = listed or {}
    cache = FactsCache(settings.data_root) if set(settings.projects) - set(listed) else None
    for project in sorted(settings.projects):
        runs = listed[project] if project in listed else run_facts(layout, project, cache)  # type: ignore[arg-type]
        for directory, facts in runs:
            if facts is None:
                use.unreadable.setdefault(project, []).append(directory / RUN_FILE)
                continue
            ds = facts.dataset
            if ds is None or ds.get("rev") == DIRECTORY_REV or not ds.get("md5"):
                continue
            owner = str(ds.get("project") or project)
            use.keep.lineage.setdefault(owner, set()).add(str(ds["md5"]))
            if ds.get("repo"):
                use.keep.repositories.setdefault(owner, set()).add(str(ds["repo"]))
            if trains(facts, directory):
                use.keep.in_use.setdefault(owner, set()).add(str(ds["md5"]).removesuffix(".dir"))
    if cache is not None:
        cache.save()
    return use


def data_gc(settings: LabSettings, days: float, *, yes: bool = False,
            listed: Listed | None = None) -> tuple[GcPlan, GcReport | None]:
    """``det-lab data gc``: the plan (``yes``: carried out) of evicting snapshots unused for
    ``days`` and removing the cache objects nothing keeps (:mod:`det_lab.data.gc`). A project
    with a run whose record cannot be read is left alone, with the reason. ``listed``: as
    :func:`dataset_keep`'s (``volume usage`` gives the runs its walk read)."""
    use = dataset_keep(settings, listed)
    made, report = _collect(settings, use, days, yes)
    return made, report


def _collect(settings: LabSettings, use: RunDataUse, days: float, yes: bool) -> tuple[GcPlan, GcReport | None]:
    if not use.unreadable:
        return collect(settings, use.keep, days, yes=yes)
    # a project with an unreadable run keeps everything: collect the others only
    blocked = set(use.unreadable)
    kept = settings.model_copy(update={"projects": {k: v for k, v in settings.projects.items() if k not in blocked}})
    made, report = collect(kept, use.keep, days, yes=yes)
    from det_lab.data.gc import ProjectGc

    for project in sorted(blocked):
        files = use.unreadable[project]
        newer = newer_file(files[0], RUN_RECORD)
        more = f" (and {len(files) - 1} more run records cannot be read)" if len(files) > 1 else ""
        made.projects.append(ProjectGc(project, skipped=f"{newer}{more}: nothing of this project is collected" if newer else
                                       f"{files[0]}{f' and {len(files) - 1} more' if len(files) > 1 else ''}"
                                       " cannot be read: the dataset it needs is unknown, so nothing of this "
                                       "project is collected; fix or remove that run record"))
    made.projects.sort(key=lambda p: p.project)
    return made, report
