"""``det-lab runs delete`` and ``det-lab runs prune``: whole local-style runs off the volume.

:func:`plan_delete` (named runs) and :func:`plan_prune` (runs chosen by age, status, owner,
project) read and change nothing; :func:`execute` deletes what a plan holds. Never deleted:

- a run whose trainer lives (its lock, :mod:`~det_lab.runs.run_guard`) or whose Slurm job is
  queued or running (:meth:`~det_lab.runs.record.RunRecord.scheduled`);
- a run this user could not ``rm -r``: every directory of it, and the directory holding it, must
  be writable and searchable by this user as Unix decides (owner, group, others; a sticky parent
  needs the owner). Another member's run goes with the group's write rights, not otherwise;
- a checkpoint another run still lists (a ``det-lab reproduce --continue`` run's start, or the
  origin such a run started from), unless that run is deleted too;
- the tracker runs: they are tagged ``det_lab.deleted`` through the run's journal, which is moved
  beside the cluster trials' journals first (``outputs/<project>/tracking-journal/<run key>/``):
  when the tracker does not answer the tag waits there and ``det-lab tracking sync`` delivers it.

:func:`execute` marks the run ``deleting`` in run.json first, then tags, deletes its checkpoints,
renames the directory to a hidden ``.<name>.deleting`` (gone from every listing at once) and removes
it. A run killed on the way is still marked (or hidden): the next ``runs prune`` finishes it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.ondisk import NewerFormat
from det_lab.settings import LabSettings
from det_lab.runs import retention, run_guard
from det_lab.runs.expconf import project_of
from det_lab.runs.listing import user_name
from det_lab.runs.record import JOURNAL_DIR, RUN_FILE, LocalRunRecord, run_dirs
from det_lab.lifecycle.trees import TreeCache, cannot_remove, walked_bytes
from det_lab.volume import VolumeLayout

#: run.json statuses a run can be pruned by (``running`` is refused: a live run is never deleted)
STATUSES = ("finished", "failed", "stopped", "cancelled", "pruned", "died", "created", "queued", "deleting")
#: run.json key of a deletion under way
DELETING_KEY = "deleting"
#: file in a deleted run's journal (moved beside the cluster trials'), holding the run's old place
DELETED_RUN_MARK = "deleted-run"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([mhdw])")
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class PruneError(UserError):
    """Bad input to ``runs delete``/``runs prune``, said in one line; nothing was changed."""


@dataclass
class PlannedRun:
    """One run a plan deletes, or refuses to, and why."""

    name: str
    project: str
    kind: str
    owner: str
    status: str
    dir: Path
    changed: float  # run.json's mtime
    bytes: int = 0
    checkpoint_paths: list[str] = field(default_factory=list)  # deleted with the run
    kept_checkpoints: dict[str, str] = field(default_factory=dict)  # uuid -> the run that still lists it
    trackers: list[str] = field(default_factory=list)  # what the tracker side will do, in words
    refused: str | None = None  # why this run is not deleted
    record: Any = field(default=None, repr=False)  # its run record (of its kind)
    state: dict[str, Any] = field(default_factory=dict, repr=False)  # its run.json as read

    @property
    def checkpoints(self) -> list[Path]:
        """The checkpoints deleted with the run (made when asked: a plan holds tens of thousands)."""
        return [Path(c) for c in self.checkpoint_paths]

    @checkpoints.setter
    def checkpoints(self, paths: Iterable[Path | str]) -> None:
        self.checkpoint_paths = [os.fspath(c) for c in paths]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "project": self.project, "kind": self.kind, "owner": self.owner,
                "status": self.status, "dir": str(self.dir), "bytes": self.bytes,
                "checkpoints": [os.path.basename(c) for c in self.checkpoint_paths],
                "kept_checkpoints": self.kept_checkpoints,
                "trackers": self.trackers, "refused": self.refused}


@dataclass
class Plan:
    """What ``runs delete``/``runs prune`` would do: ``runs`` go, ``refused`` stay."""

    runs: list[PlannedRun] = field(default_factory=list)
    refused: list[PlannedRun] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)  # hidden .<name>.deleting directories of killed deletions

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.runs)


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``2w``, ``90m`` in seconds; :class:`PruneError` for anything else."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise PruneError(f"--older-than {text}: expected a duration such as 30d, 12h, 2w or 90m")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_statuses(text: str) -> set[str]:
    """A comma-separated list of run statuses (``failed,stopped``); :class:`PruneError` for others."""
    wanted = {s.strip().lower() for s in text.split(",") if s.strip()}
    if "running" in wanted:
        raise PruneError("--status running: a running run is never deleted; stop it first (det-lab runs cancel)")
    unknown = sorted(wanted - set(STATUSES))
    if unknown or not wanted:
        raise PruneError(f"--status {text}: {', '.join(unknown) or 'empty'} is not a run status "
                         f"(one or more of {', '.join(STATUSES)})")
    return wanted


# --- reading one run -----------------------------------------------------------------------------


def live(run: LocalRunRecord, state: dict[str, Any]) -> str | None:
    """Why ``run`` trains or will, in words (its trainer lives, its job is queued), else None."""
    holder = run_guard.trainer(run.dir)
    if holder is not None and holder.stale is None:
        return f"it is training as pid {holder.pid} on host {holder.host}"
    return run.scheduled(state)


def status_of(run: LocalRunRecord, state: dict[str, Any]) -> str:
    if state.get(DELETING_KEY):
        return "deleting"
    return run_guard.training_status(state, run.dir) if run.kind == "local" else str(state.get("status") or "created")


def _describe_trackers(run: LocalRunRecord) -> list[str]:
    from det_lab.tracking.late_tags import recorded_targets, unreachable

    targets = recorded_targets(run.journal_dir)
    if not targets:
        return ["no tracker run recorded"]
    summary = run.tracking_summary() or {}
    ids = {b.get("backend"): b.get("run_id") for b in summary.get("backends", [])}
    out = []
    for backend, target in targets.items():
        why = unreachable(target)
        what = f"{backend} run {ids.get(backend) or '?'}"
        out.append(f"{what}: tagged det_lab.deleted" if why is None else
                   f"{what}: {backend} is down ({why}): the tag waits in the journal for det-lab tracking sync")
    return out


def _planned(settings: LabSettings, run: LocalRunRecord, owners: dict[int, str]) -> PlannedRun | None:
    try:
        state = run.state()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        st = run.dir.stat()
        return PlannedRun(run.dir.name, run.dir.parent.parent.name, run.kind, user_name(st.st_uid, owners),
                          "newer" if isinstance(exc, NewerFormat) else "damaged", run.dir, st.st_mtime, refused=str(exc))
    conf = state.get("exp_conf") or {}
    owner = state.get("user") or user_name(run.run_file.stat().st_uid, owners)
    planned = PlannedRun(str(state.get("name") or run.dir.name), project_of(conf), run.kind, owner,
                         status_of(run, state), run.dir, run.run_file.stat().st_mtime, record=run)
    planned.state = state
    root = VolumeLayout.from_settings(settings).experiment_checkpoints(planned.project, conf)
    for entry in state.get("checkpoints") or []:
        path = retention.checkpoint_path(root, str(entry.get("uuid")))
        if path is not None and os.path.lexists(path):
            planned.checkpoint_paths.append(str(path))
    return planned


def _listings(runs: list[PlannedRun]) -> contextlib.ExitStack:
    """One scheduler listing for each kind of run among ``runs`` (not one question per run)."""
    stack = contextlib.ExitStack()
    for kind in {type(p.record) for p in runs if p.record is not None}:
        stack.enter_context(kind.scheduler_listing())
    return stack


def _all_runs(settings: LabSettings, projects: Iterable[str] | None = None) -> list[LocalRunRecord]:
    layout = VolumeLayout.from_settings(settings)
    return [cls(d) for p in sorted(projects or settings.projects) for d, cls in run_dirs(layout, p)]


def _finish(settings: LabSettings, plan: Plan, every: list[LocalRunRecord]) -> Plan:
    """Sizes, permissions, shared checkpoints and tracker words for the runs a plan would delete."""
    for p in list(plan.runs):
        if p.refused is None:
            p.refused = cannot_remove(p.dir) or next((why for why in map(cannot_remove, p.checkpoints) if why), None)
        if p.refused is not None:
            plan.runs.remove(p)
            plan.refused.append(p)
    going = {r.dir for r in plan.runs}  # a run refused stays, and so does every checkpoint it lists
    others = retention.checkpoint_users(r for r in every if r.dir not in going) if plan.runs else {}
    for p in plan.runs:
        used = retention.used_elsewhere(others, p.dir, {c.name for c in p.checkpoints})
        p.kept_checkpoints = used
        p.checkpoints = [c for c in p.checkpoints if c.name not in used]
        p.bytes = walked_bytes(p.dir) + sum(walked_bytes(c) for c in p.checkpoints)
        p.trackers = _describe_trackers(LocalRunRecord(p.dir))
    layout = VolumeLayout.from_settings(settings)
    roots = {r.dir.parent for r in every} | {LocalRunRecord.runs_root(layout, p) for p in settings.projects}
    plan.leftovers = sorted(d for root in roots if root.is_dir() for d in root.glob(".*.deleting"))
    return plan


def plan_delete(settings: LabSettings, names: list[str]) -> Plan:
    """The plan of ``runs delete NAMES``: every name must be a run this user may delete and that
    does not train; otherwise :class:`PruneError` naming the first that is not (nothing changes)."""
    if not names:
        raise PruneError("name the runs to delete (det-lab runs list shows them)")
    every = _all_runs(settings)
    by_name: dict[str, LocalRunRecord] = {}
    for r in every:
        by_name.setdefault(r.dir.name, r)
    plan, owners = Plan(), {}
    for name in dict.fromkeys(names):
        if name not in by_name:
            raise PruneError(f"no run named {name!r} on {settings.data_root} (list them with: det-lab runs list)")
        planned = _planned(settings, by_name[name], owners)
        if planned is None:
            raise PruneError(f"run {name} was deleted meanwhile")
        plan.runs.append(planned)
    with _listings(plan.runs):
        for p in plan.runs:
            p.refused = p.refused or live(p.record, p.state)
    _finish(settings, plan, every)
    if plan.refused:
        first = plan.refused[0]
        raise PruneError(f"run {first.name} cannot be deleted: {first.refused}; nothing was deleted")
    return plan


def plan_prune(settings: LabSettings, *, older_than: str | None = None, statuses: str | None = None,
               user: str | None = None, project: str | None = None, now: float | None = None,
               fresh: bool = False) -> Plan:
    """The plan of ``runs prune``: runs whose run.json has not changed for ``older_than`` (``30d``),
    whose status is one of ``statuses`` (``failed,stopped``), of Unix ``user``, in ``project``; runs
    that train, or that this user may not delete, are listed as refused. At least one filter.

    Each run.json's facts and each tree's listing come from this user's caches
    (:class:`~det_lab.lifecycle.storage.FactsCache`, :class:`~det_lab.lifecycle.trees.TreeCache`) where
    unchanged; ``fresh`` reads every run.json and walks every tree instead (the same plan)."""
    if not any((older_than, statuses, user, project)):
        raise PruneError("say which runs to prune: --older-than, --status, --user and/or --project")
    age = parse_age(older_than) if older_than else None
    wanted = parse_statuses(statuses) if statuses else None
    if project:
        try:
            settings.project(project)
        except ValueError as exc:
            raise PruneError(str(exc)) from None
    now = time.time() if now is None else now
    if not fresh:
        return _fast_prune(settings, age, wanted, user, project, now)
    every = _all_runs(settings)
    plan, owners, chosen = Plan(), {}, []
    for run in every:
        if project and run.dir.parent.parent.name != project:
            continue
        p = _planned(settings, run, owners)
        if p is None or (user and p.owner != user):
            continue
        if age is not None and now - p.changed < age:
            continue
        if wanted is not None and p.status not in wanted and p.status != "deleting" and not p.refused:
            continue  # one that cannot be read (damaged, newer) is shown as refused: its status is unknown
        chosen.append(p)
    with _listings(chosen):  # a run's liveness only for the runs the filters chose
        for p in chosen:
            p.refused = p.refused or live(p.record, p.state)
            (plan.refused if p.refused else plan.runs).append(p)
    plan.runs.sort(key=lambda r: (r.project, r.changed))
    return _finish(settings, plan, every)


def _fast_prune(settings: LabSettings, age: float | None, wanted: set[str] | None, user: str | None,
                project: str | None, now: float) -> Plan:
    """:func:`plan_prune` from the caches: one ``stat`` per run.json; for a chosen run one
    ``lstat`` per directory of its trees and per file (a complete checkpoint's sizes kept)."""
    from det_lab.lifecycle.storage import FactsCache

    layout = VolumeLayout.from_settings(settings)
    facts_cache, trees = FactsCache(settings.data_root), TreeCache(settings.data_root)
    plan, owners, chosen = Plan(), {}, []
    listed: list[tuple[str, Any]] = []  # (run directory, facts) of every run that can be read
    roots: dict[tuple[str, str], tuple[Path, str]] = {}
    kinds: set[tuple[str, type[LocalRunRecord]]] = set()
    ckpts: dict[int, tuple[Path, str, list[str]]] = {}  # id(run) -> its checkpoints' root and uuids
    for name in sorted(settings.projects):
        for d, cls in run_dirs(layout, name, probe=False):
            kinds.add((name, cls))
            directory = str(d)
            try:
                facts = facts_cache.facts(directory + os.sep + RUN_FILE)  # os.path.join's string, without its cost
            except (OSError, ValueError):  # damaged: read as the plan from scratch would
                p = _planned(settings, cls(d), owners) if not project or name == project else None
                if p is not None and not (user and p.owner != user) and not (age is not None and now - p.changed < age) \
                        and (wanted is None or p.status in wanted or p.refused):
                    chosen.append((p, None))
                continue
            if facts is None:
                continue
            listed.append((directory, facts))
            owner = facts.user or user_name(facts_cache.stat.st_uid, owners)
            if (project and name != project) or (user and owner != user) or (age is not None and now - facts.changed < age):
                continue
            status = "deleting" if facts.deleting else (
                run_guard.training_status({"status": facts.status}, d) if cls.kind == "local" else facts.status)
            if wanted is not None and status not in wanted and status != "deleting":
                continue
            p = PlannedRun(facts.name or d.name, facts.project, cls.kind, owner, status, d, facts.changed, record=cls(d))
            p.state = dict(facts.scheduling or {})
            key = (p.project, repr(facts.storage))
            if key not in roots:
                root = layout.experiment_checkpoints(p.project, {"checkpoint_storage": facts.storage}
                                                     if facts.storage else None)
                roots[key] = (root, str(root) + os.sep)
            # as retention.checkpoint_path: a uuid that is no plain directory name names nothing
            ckpts[id(p)] = (*roots[key], [u for u in facts.checkpoints
                                          if retention._SAFE_NAME.fullmatch(u) and u not in (".", "..")])
            chosen.append((p, facts))
    facts_cache.save()
    tops = {}
    with _listings([p for p, _ in chosen]):  # as plan_prune: liveness first, in the volume's order
        for p, facts in chosen:
            if facts is not None:
                top = tops[id(p)] = trees.tree(str(p.dir))
                held = run_guard.LOCK_NAME in top.names  # no lock file: nobody trains it
                p.refused = p.refused or (live(p.record, p.state) if held else p.record.scheduled(p.state))
            if p.refused and facts is not None:
                base, uuids = ckpts[id(p)][1:]
                p.checkpoint_paths = [base + u for u in uuids if os.path.lexists(base + u)]
            (plan.refused if p.refused else plan.runs).append(p)
    plan.runs.sort(key=lambda r: (r.project, r.changed))
    found: dict[int, list[tuple[str, Any]]] = {}  # id(run) -> (uuid, tree) of its checkpoints there
    for p in plan.runs:  # then whether this user may remove each tree
        base, uuids = ckpts[id(p)][1:]
        there = found[id(p)] = [(u, t) for u, t in ((u, trees.tree(base + u, checkpoint=True)) for u in uuids)
                                if t.exists]
        p.refused = tops[id(p)].refused or next((t.refused for _, t in there if t.refused), None)
        if p.refused:
            p.checkpoint_paths = [base + u for u, _ in there]
    plan.refused.extend(p for p in plan.runs if p.refused)
    plan.runs = [p for p in plan.runs if not p.refused]
    going = {str(p.dir) for p in plan.runs}
    others: dict[str, str] = {}  # uuid -> the first run that stays and lists it
    for directory, facts in listed:
        if directory not in going:
            who = facts.name or os.path.basename(directory)
            for u in (*facts.checkpoints, str(facts.latest)):
                others.setdefault(u, who)
    for p in plan.runs:
        base = ckpts[id(p)][1]
        there = found[id(p)]
        p.kept_checkpoints = {u: others[u] for u, _ in there if u in others}
        p.checkpoint_paths = [base + u for u, _ in there if u not in p.kept_checkpoints]
        p.bytes = tops[id(p)].bytes + sum(t.bytes for u, t in there if u not in p.kept_checkpoints)
        p.trackers = (_describe_trackers(LocalRunRecord(p.dir)) if JOURNAL_DIR in tops[id(p)].names
                      else ["no tracker run recorded"])
    trees.save()
    dirs = {cls.runs_root(layout, name) for name, cls in kinds} | {LocalRunRecord.runs_root(layout, p)
                                                                  for p in settings.projects}
    plan.leftovers = sorted(d for root in dirs if root.is_dir() for d in root.glob(".*.deleting"))
    return plan


# --- doing it ------------------------------------------------------------------------------------


@dataclass
class Deleted:
    """What :func:`execute` did to one run."""

    name: str
    bytes: int
    checkpoints: int
    trackers: list[str]


def _tag(run: LocalRunRecord, planned: PlannedRun, settings: LabSettings) -> list[str]:
    """Move the run's journal out of its directory and tag its tracker runs deleted."""
    from det_lab.tracking.late_tags import recorded_targets, tag_ended_run

    journal = run.journal_dir
    key = str(run.state().get("run_key") or f"{run.kind}-{planned.name}")
    kept = VolumeLayout.from_settings(settings).outputs(planned.project) / JOURNAL_DIR / key
    if recorded_targets(journal) and not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.rename(journal, kept)
        (kept / DELETED_RUN_MARK).write_text(str(run.dir) + "\n")  # a later pass removes it once delivered
    if not recorded_targets(kept):  # no tracker, or a deletion killed after the move: tag (again) below
        return ["no tracker run recorded"]
    tags = {"det_lab.deleted": "true", "det_lab.deleted_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "det_lab.deleted_by": getpass.getuser(), "det_lab.deleted_run_dir": str(run.dir)}
    summary = tag_ended_run(kept, tags, timeout=10.0)
    out = []
    for b in summary.backends:
        if b.pending == 0:
            out.append(f"{b.backend} run {b.run_id}: tagged det_lab.deleted")
        else:
            out.append(f"{b.backend} run {b.run_id}: tag pending in {kept} ({b.error or 'not delivered yet'}); "
                       "det-lab tracking sync delivers it")
    if summary.complete:
        shutil.rmtree(kept, ignore_errors=True)  # everything delivered: the journal has done its work
    return out


def execute(settings: LabSettings, plan: Plan, progress: Callable[[str], None] | None = None) -> list[Deleted]:
    """Delete every run of ``plan`` (see the module docstring for the order), and finish killed deletions."""
    from det_lab.tracking.sync import pending

    done = []
    for leftover in plan.leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    layout = VolumeLayout.from_settings(settings)
    for project in settings.projects:  # journals of deleted runs whose tags a later sync delivered
        for mark in (layout.outputs(project) / JOURNAL_DIR).glob(f"*/{DELETED_RUN_MARK}"):
            if pending(mark.parent) == 0:
                shutil.rmtree(mark.parent, ignore_errors=True)
    for p in plan.runs:
        run = p.record or LocalRunRecord(p.dir)
        if progress:
            progress(f"deleting run {p.name}")
        state = run.state()
        if live(run, state):  # started since the plan was made
            continue
        if not state.get(DELETING_KEY):
            run.update(**{DELETING_KEY: {"since": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                                         "by": getpass.getuser()}})
        try:
            trackers = _tag(run, p, settings)
            for ckpt in p.checkpoints:
                retention.remove_checkpoint(ckpt)
            hidden = p.dir.parent / f".{p.dir.name}.deleting"
            if hidden.exists():  # the same name deleted before, killed mid-way
                shutil.rmtree(hidden)
            os.rename(p.dir, hidden)
            shutil.rmtree(hidden)
        except OSError as exc:  # e.g. a file made read-only since the plan: the run stays marked
            raise PruneError(f"run {p.name}: {exc.strerror or exc} ({exc.filename}); it is marked deleting: "
                             "fix that, then run det-lab runs prune --status deleting --yes") from None
        done.append(Deleted(p.name, p.bytes, len(p.checkpoints), trackers))
    return done
