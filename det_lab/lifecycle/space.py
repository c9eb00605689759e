"""Who uses the volume's space: bytes by project, user, kind or run, and what cleaning would free.

One walk of each project's directories, in the order ``cache, snapshots, datasets, checkpoints,
outputs``, counts each inode once within the project (as its quota does), where it is first met (a snapshot file hard-linked from the
cache counts in the cache), by its blocks on disk, directories included: the figure of each
directory is what ``du -s -B1`` prints for it when given the same directories in the same order
(``du`` counts a hard-linked file once; ``du -l`` would count it at each link). A file belongs to
the user who owns it, and to a run when it lies in the run's directory or in a checkpoint its
``run.json`` lists. What cleaning would free comes from the plans, which change nothing:
``det-lab data gc --days N`` and ``det-lab runs prune --older-than Nd``.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from det_lab.ondisk import SPACE_CACHE
from det_lab.settings import LabSettings
from det_lab.runs.listing import user_name
from det_lab.errors import UserError
from det_lab.lifecycle.storage import FactsCache, RunFacts, run_facts, trains
from det_lab.runs import cachefile
from det_lab.volume import VolumeLayout

Kind = Literal["cache", "snapshots", "datasets", "checkpoints", "outputs"]
KINDS: tuple[Kind, ...] = ("cache", "snapshots", "datasets", "checkpoints", "outputs")
By = Literal["project", "user", "kind", "run"]
NO_RUN = ""
#: a complete checkpoint unchanged this long is taken as written for good (its figures kept)
SETTLED_S = 60.0
_NOTHING: dict[str, Any] = {}
_SPACE_VERSION = SPACE_CACHE.version  # of the cache file's shape: {parent directory: {checkpoint: its figures}}


class SpaceError(UserError):
    """``det-lab volume usage`` cannot look: no volume at the data root."""


def kind_dir(layout: VolumeLayout, project: str, kind: Kind) -> Path:
    return {"cache": layout.dvc_cache, "snapshots": layout.snapshots, "datasets": layout.datasets,
            "checkpoints": layout.project_checkpoints, "outputs": layout.outputs}[kind](project)


@dataclass
class ProjectSpace:
    """One project's bytes by kind, its quota, and what each cleaning would free."""

    project: str
    quota: int
    kinds: dict[str, int] = field(default_factory=dict)
    reclaimable: dict[str, int] = field(default_factory=dict)  # "data gc", "runs prune" -> bytes

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


@dataclass
class SpaceReport:
    """The volume's space: ``cells`` maps (project, kind, run, uid) to bytes."""

    projects: dict[str, ProjectSpace]
    cells: dict[tuple[str, str, str, int], int]
    days: float
    notes: list[str] = field(default_factory=list)

    def by(self, dimension: By) -> list[tuple[str, int]]:
        """``(name, bytes)`` along ``dimension``, largest first (a run is ``project/run``; bytes in
        no run are ``project/(no run)``)."""
        totals: dict[str, int] = defaultdict(int)
        users: dict[int, str] = {}
        for (project, kind, run, uid), n in self.cells.items():
            key = {"project": project, "kind": kind, "user": user_name(uid, users) if dimension == "user" else "",
                   "run": f"{project}/{run or '(no run)'}"}[dimension]
            totals[key] += n
        return sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))

    @property
    def total(self) -> int:
        return sum(self.cells.values())


def _labels(layout: VolumeLayout, project: str, facts_cache: FactsCache, old_before: float,
            listed: list[tuple[Path, RunFacts | None]]) -> tuple[dict[str, str], set[str]]:
    """Directory -> run name (each local-style run's directory, each checkpoint its ``run.json``
    lists, each cluster trial's output directory), and the runs ``runs prune --older-than`` would
    take: unchanged since ``old_before`` and not training. Each run's facts are added to ``listed``
    (data gc's plan reads them from there)."""
    labels: dict[str, str] = {}
    old: set[str] = set()
    roots: dict[str, str] = {}
    by_id: dict[int, tuple[Any, str]] = {}  # id(storage) -> (storage, root): the cache shares equal ones
    for directory, facts in run_facts(layout, project, facts_cache):
        listed.append((directory, facts))
        path = str(directory)
        name = path.rpartition(os.sep)[2]
        labels[path] = name
        if facts is None:
            continue
        if facts.changed < old_before and not trains(facts, directory):
            old.add(name)
        storage = facts.storage
        known = by_id.get(id(storage))
        if known is not None and known[0] is storage:
            root = known[1]
        else:
            where = repr(storage)
            if where not in roots:
                roots[where] = str(layout.experiment_checkpoints(project, {"checkpoint_storage": storage}
                                                                 if storage else None)) + os.sep
            root = roots[where]
            by_id[id(storage)] = (storage, root)
        for uuid in facts.checkpoints:
            labels.setdefault(root + uuid, name)
    trials = layout.outputs(project) / "trials"
    try:
        with os.scandir(trials) as it:
            for e in it:
                labels[e.path] = e.name
    except OSError:
        pass
    return labels, old


class _Walk:
    """One walk of the volume, each inode once. A complete checkpoint (its ``metadata.json``
    there, nothing in it changed for a minute) is written once and never changed in place, so its
    figures are kept on local disk (``$XDG_CACHE_HOME/det-lab/space-<volume>.pickle``) under the
    inode and times of each of its directories, and a later walk stats its directories only."""

    def __init__(self, data_root: Path) -> None:
        self.path = cachefile.cache_path(data_root, "space")
        known = cachefile.load(self.path, _SPACE_VERSION)
        self.known: dict[str, Any] = known if isinstance(known, dict) else {}
        self.kept: dict[str, Any] = {}
        self.changed = False
        self.seen: set[tuple[int, int]] = set()
        self.now = time.time()

    def tree(self, top: Path, run: str, labels: dict[str, str], cells: dict[tuple[str, int], int],
             units: bool = False) -> int:
        """Add the blocks under ``top`` (itself included) to ``cells[(run, uid)]``; returns the
        total. With ``units``, each labelled directory is a checkpoint that may come from the cache."""
        try:
            st = os.lstat(top)
        except OSError:
            return 0
        total = st.st_blocks * 512
        cells[(run, st.st_uid)] += total
        stack = [(str(top), run)]
        seen, known, kept = self.seen, self.known, self.kept
        while stack:  # one pass per directory; a hard-linked inode once (st_nlink > 1 only)
            current, label = stack.pop()
            try:
                it = os.scandir(current)
            except OSError:
                continue
            known_here = known.get(current) if units else None
            if type(known_here) is not dict:
                known_here = _NOTHING
            kept_here: dict[str, Any] = {}
            files: dict[int, int] = {}  # uid -> blocks of this directory's files (all of ``label``)
            with it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        path = entry.path
                        owner_run = labels.get(path)
                        if units and owner_run is not None:
                            hit = known_here.get(entry.name)
                            if hit is not None and len(hit) == 5:  # the common checkpoint: one directory, one owner
                                try:
                                    st = entry.stat(follow_symlinks=False)
                                except OSError:
                                    continue
                                if st.st_ino == hit[0] and st.st_mtime_ns == hit[1] and st.st_ctime_ns == hit[2]:
                                    cells[(owner_run, hit[4])] += hit[3]
                                    total += hit[3]
                                    kept_here[entry.name] = hit
                                    continue
                            total += self._checkpoint(entry, owner_run, cells, current)
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        mine = label if owner_run is None else owner_run
                        stack.append((path, mine))
                        n = st.st_blocks * 512
                        cells[(mine, st.st_uid)] += n
                        total += n
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if st.st_nlink > 1:
                        key = (st.st_dev, st.st_ino)
                        if key in seen:
                            continue
                        seen.add(key)
                    uid = st.st_uid
                    files[uid] = files.get(uid, 0) + st.st_blocks * 512
            for uid, n in files.items():
                cells[(label, uid)] += n
                total += n
            if kept_here:
                kept.setdefault(current, {}).update(kept_here)
        return total

    def _checkpoint(self, dir_entry: os.DirEntry, run: str, cells: dict[tuple[str, int], int], parent: str) -> int:
        path = dir_entry.path
        try:
            st = dir_entry.stat(follow_symlinks=False)
        except OSError:
            return 0
        here = self.known.get(parent)
        hit = here.get(dir_entry.name) if isinstance(here, dict) else None
        if isinstance(hit, list) and len(hit) == 3 and self._unchanged(hit[0], st):
            try:
                return self._add(hit, run, cells, parent, dir_entry.name)
            except (TypeError, ValueError):
                pass
        entry = self._measure(path, st)
        if entry is None:  # not complete yet: measured, not kept
            mine: dict[tuple[str, int], int] = defaultdict(int)
            n = self.tree(Path(path), run, {}, mine)
            for k, v in mine.items():
                cells[k] += v
            return n
        self.changed = True
        return self._add(entry, run, cells, parent, dir_entry.name)

    def _unchanged(self, dirs: list, top: os.stat_result) -> bool:
        for i, (d, ino, mtime, ctime) in enumerate(dirs):
            try:
                st = top if i == 0 else os.lstat(d)
            except OSError:
                return False
            if (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != (ino, mtime, ctime):
                return False
        return True

    def _add(self, entry: list, run: str, cells: dict[tuple[str, int], int], parent: str, name: str) -> int:
        if len(entry) == 5:
            cells[(run, int(entry[4]))] += int(entry[3])
            self.kept.setdefault(parent, {})[name] = entry
            return int(entry[3])
        dirs, by_uid, linked = entry
        total = 0
        for uid, n in by_uid:
            cells[(run, int(uid))] += int(n)
            total += int(n)
        for dev, ino, uid, n in linked:
            key = (dev, ino)
            if key in self.seen:
                continue
            self.seen.add(key)
            cells[(run, int(uid))] += int(n)
            total += int(n)
        self.kept.setdefault(parent, {})[name] = entry
        return total

    def _measure(self, path: str, st: os.stat_result) -> list | None:
        """``[dirs with their signatures, [uid, bytes] of singly linked entries, linked files]``
        of a complete checkpoint; None for one still being written."""
        dirs, by_uid, linked = [], defaultdict(int), []
        newest = 0.0
        complete = False
        stack = [(path, st)]
        by_uid[st.st_uid] += st.st_blocks * 512
        while stack:
            current, dst = stack.pop()
            dirs.append([current, dst.st_ino, dst.st_mtime_ns, dst.st_ctime_ns])
            newest = max(newest, dst.st_mtime, dst.st_ctime)
            try:
                with os.scandir(current) as it:
                    for e in it:
                        est = e.stat(follow_symlinks=False)
                        newest = max(newest, est.st_mtime, est.st_ctime)
                        complete = complete or (current == path and e.name == "metadata.json")
                        if e.is_dir(follow_symlinks=False):
                            by_uid[est.st_uid] += est.st_blocks * 512
                            stack.append((e.path, est))
                        elif est.st_nlink > 1:
                            linked.append([est.st_dev, est.st_ino, est.st_uid, est.st_blocks * 512])
                        else:
                            by_uid[est.st_uid] += est.st_blocks * 512
            except OSError:
                return None
        if not complete or newest > self.now - SETTLED_S:
            return None
        if len(dirs) == 1 and len(by_uid) == 1 and not linked:  # compact: [ino, mtime, ctime, bytes, uid]
            (uid, n), = by_uid.items()
            return [dirs[0][1], dirs[0][2], dirs[0][3], n, uid]
        return [dirs, [[u, n] for u, n in by_uid.items()], linked]

    def save(self) -> None:
        if not self.changed and sum(map(len, self.kept.values())) == sum(
                len(v) for v in self.known.values() if isinstance(v, dict)):
            return
        cachefile.dump(self.path, self.kept, _SPACE_VERSION)


def volume_space(settings: LabSettings, *, days: float = 30.0, reclaimable: bool = True,
                 projects: list[str] | None = None) -> SpaceReport:
    """The space of ``projects`` (default: all) by project, kind, user and run; with
    ``reclaimable``, what ``data gc --days days`` and ``runs prune --older-than <days>d`` would free."""
    layout = VolumeLayout.from_settings(settings)
    if not layout.state.is_dir():
        raise SpaceError(f"{layout.state} does not exist: no volume at {layout.root} (run 'det-lab init' there first)")
    names = sorted(projects or settings.projects)
    report = SpaceReport({}, {}, days)
    walk, facts = _Walk(settings.data_root), FactsCache(settings.data_root)
    old_runs: dict[str, set[str]] = {}
    listed: dict[str, list[tuple[Path, RunFacts | None]]] = {}
    jobs = []
    for project in names:
        labels, old_runs[project] = _labels(layout, project, facts, time.time() - days * 86400,
                                            listed.setdefault(project, []))
        jobs.append((walk, layout, project, labels))
    facts.save()
    kept: dict[str, Any] = {}
    changed = False
    for project, (kinds, cells, project_kept, project_changed) in zip(names, (_walk_project(*job) for job in jobs)):
        ps = ProjectSpace(project, int(settings.project(project).quota), kinds)
        for (kind, run, uid), n in cells.items():
            report.cells[(project, kind, run, uid)] = n
        report.projects[project] = ps
        kept.update(project_kept)
        changed = changed or project_changed
    walk.kept, walk.changed = kept, changed
    walk.save()
    if reclaimable:
        for (project, _kind, run, _uid), n in report.cells.items():
            if run in old_runs.get(project, ()):
                ps = report.projects[project]
                ps.reclaimable["runs prune"] = ps.reclaimable.get("runs prune", 0) + n
        _reclaimable(settings, report, listed)
    return report


def _walk_project(walk: _Walk, layout: VolumeLayout, project: str, labels: dict[str, str]
                  ) -> tuple[dict[str, int], dict[tuple[str, str, int], int], dict[str, Any], bool]:
    """Walk one project: its kinds' totals, cells ``(kind, run, uid) -> bytes``, and the
    checkpoint figures to keep. Each inode once within the project, as its quota counts."""
    walk.seen, walk.kept, walk.changed = set(), {}, False
    kinds: dict[str, int] = {}
    out: dict[tuple[str, str, int], int] = {}
    for kind in KINDS:
        cells: dict[tuple[str, int], int] = defaultdict(int)
        kinds[kind] = walk.tree(kind_dir(layout, project, kind), NO_RUN, labels, cells, units=kind == "checkpoints")
        for (run, uid), n in cells.items():
            out[(kind, run, uid)] = n
    return kinds, out, walk.kept, walk.changed


def _reclaimable(settings: LabSettings, report: SpaceReport, listed: dict[str, list[tuple[Path, RunFacts | None]]]) -> None:
    from det_lab.lifecycle.storage import data_gc

    try:
        plan, _ = data_gc(settings, report.days, listed=listed)  # the runs as this walk read them
        for p in plan.projects:
            if p.project in report.projects:
                report.projects[p.project].reclaimable["data gc"] = p.freed_bytes
                if p.skipped:
                    report.notes.append(f"{p.project}: data gc leaves its cache alone: {p.skipped}")
    except (UserError, RuntimeError) as exc:  # a damaged registry or pins file: the figures stay without it
        report.notes.append(f"data gc: {exc}")


def largest_consumers(settings: LabSettings, project: str, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` runs and kinds of ``project`` that use the most space (for doctor's quota warning)."""
    report = volume_space(settings, reclaimable=False, projects=[project])
    runs = [(name, b) for name, b in report.by("run") if not name.endswith("/(no run)")]
    kinds = report.by("kind")
    return (runs[:n] if runs else []) + kinds[:n]
