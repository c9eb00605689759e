"""Who uses the volume's space: bytes by project, user, kind or run, and what cleaning would free.

One walk of every project's directories, in the order ``cache, snapshots, datasets, checkpoints,
outputs``, counts each inode once, where it is first met (a snapshot file hard-linked from the
cache counts in the cache), by its blocks on disk, directories included: the figure of each
directory is what ``du -s -B1`` prints for it when given the same directories in the same order
(``du`` counts a hard-linked file once; ``du -l`` would count it at each link). A file belongs to
the user who owns it, and to a run when it lies in the run's directory or in a checkpoint its
``run.json`` lists. What cleaning would free comes from the plans, which change nothing:
``det-lab data gc --days N`` and ``det-lab runs prune --older-than Nd``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from det_lab.settings import LabSettings
from det_lab.trials.listing import user_name
from det_lab.trials.storage import run_states
from det_lab.volume import VolumeLayout

Kind = Literal["cache", "snapshots", "datasets", "checkpoints", "outputs"]
KINDS: tuple[Kind, ...] = ("cache", "snapshots", "datasets", "checkpoints", "outputs")
By = Literal["project", "user", "kind", "run"]
NO_RUN = ""


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


def _labels(layout: VolumeLayout, project: str) -> dict[str, str]:
    """Directory -> run name: each local-style run's directory, each cluster trial's output
    directory, and each checkpoint a run's ``run.json`` lists."""
    labels: dict[str, str] = {}
    for directory, state, _st in run_states(layout, project):
        name = directory.name
        labels[str(directory)] = name
        if not state:
            continue
        root = layout.experiment_checkpoints(project, state.get("exp_conf") if isinstance(state.get("exp_conf"), dict) else None)
        for entry in state.get("checkpoints") or []:
            if isinstance(entry, dict) and entry.get("uuid"):
                labels.setdefault(os.path.join(root, str(entry["uuid"])), name)
    trials = layout.outputs(project) / "trials"
    try:
        with os.scandir(trials) as it:
            for e in it:
                labels[e.path] = e.name
    except OSError:
        pass
    return labels


def _walk(top: Path, run: str, labels: dict[str, str], seen: set[tuple[int, int]],
          cells: dict[tuple[str, int], int]) -> int:
    """Add the blocks under ``top`` (itself included) to ``cells[(run, uid)]``, each inode once;
    returns the total."""
    try:
        st = os.lstat(top)
    except OSError:
        return 0
    total = st.st_blocks * 512
    cells[(run, st.st_uid)] += total
    stack = [(str(top), run)]
    while stack:
        current, label = stack.pop()
        try:
            it = os.scandir(current)
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, labels.get(entry.path, label)))
                    mine = labels.get(entry.path, label)
                elif st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                    mine = label
                else:
                    mine = label
                n = st.st_blocks * 512
                cells[(mine, st.st_uid)] += n
                total += n
    return total


def volume_space(settings: LabSettings, *, days: float = 30.0, reclaimable: bool = True,
                 projects: list[str] | None = None) -> SpaceReport:
    """The space of ``projects`` (default: all) by project, kind, user and run; with
    ``reclaimable``, what ``data gc --days days`` and ``runs prune --older-than <days>d`` would free."""
    layout = VolumeLayout.from_settings(settings)
    names = sorted(projects or settings.projects)
    report = SpaceReport({}, {}, days)
    seen: set[tuple[int, int]] = set()
    for project in names:
        ps = ProjectSpace(project, int(settings.project(project).quota))
        labels = _labels(layout, project)
        for kind in KINDS:
            cells: dict[tuple[str, int], int] = defaultdict(int)
            ps.kinds[kind] = _walk(kind_dir(layout, project, kind), NO_RUN, labels, seen, cells)
            for (run, uid), n in cells.items():
                report.cells[(project, kind, run, uid)] = n
        report.projects[project] = ps
    if reclaimable:
        _reclaimable(settings, report)
    return report


def _reclaimable(settings: LabSettings, report: SpaceReport) -> None:
    from det_lab.errors import UserError
    from det_lab.trials.storage import data_gc

    try:
        plan, _ = data_gc(settings, report.days)
        for p in plan.projects:
            if p.project in report.projects:
                report.projects[p.project].reclaimable["data gc"] = p.freed_bytes
                if p.skipped:
                    report.notes.append(f"{p.project}: data gc leaves its cache alone: {p.skipped}")
    except (UserError, RuntimeError) as exc:  # a damaged registry or pins file: the figures stay without it
        report.notes.append(f"data gc: {exc}")
    try:
        from det_lab.trials.prune import plan_prune
    except ImportError:
        return
    try:
        pruned = plan_prune(settings, older_than=f"{report.days:g}d")
    except (UserError, RuntimeError, ValueError) as exc:
        report.notes.append(f"runs prune: {exc}")
        return
    for run in pruned.runs:
        if run.project in report.projects:
            ps = report.projects[run.project]
            ps.reclaimable["runs prune"] = ps.reclaimable.get("runs prune", 0) + run.bytes


def largest_consumers(settings: LabSettings, project: str, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` runs and kinds of ``project`` that use the most space (for doctor's quota warning)."""
    report = volume_space(settings, reclaimable=False, projects=[project])
    runs = [(name, b) for name, b in report.by("run") if not name.endswith("/(no run)")]
    kinds = report.by("kind")
    return (runs[:n] if runs else []) + kinds[:n]
