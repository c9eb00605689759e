"""Checkpoint retention for local-style runs (``--local``, ``--slurm``), by Determined's own keys.

The experiment config's ``checkpoint_storage.save_experiment_best``, ``save_trial_best`` and
``save_trial_latest`` (Determined 0.38.1's defaults: 0, 1, 1) select what stays, as the master's
query does (``master/internal/experiment/postgres_experiments.go``, ``ExperimentCheckpointsToGCRaw``):

- each checkpoint's metric is the ``searcher.metric`` validated at its step (``validations.total_batches
  = steps_completed``); ``smaller_is_better`` sets the order; a tie goes to the earlier validation
  (``ORDER BY sign * metric ASC NULLS LAST, v.id ASC``: here its line in ``metrics.jsonl``);
- a checkpoint goes when it is neither among the trial's ``save_trial_best`` nor the experiment's
  ``save_experiment_best`` (or was never validated), and not among the trial's ``save_trial_latest``
  by step (``rank() ... ORDER BY steps_completed DESC``: checkpoints at one step share a rank);
- a checkpoint another run starts from is kept (the query's ``warm_start_checkpoint_id`` exclusion:
  here, one that another run's ``run.json`` lists, as a ``det-lab reproduce --continue`` run does).

det_lab adds: the run's resume point (``latest_checkpoint``) always stays, whatever the keys say;
only checkpoints ``run.json`` lists (complete ones) are considered, never one being written. The
master collects at the experiment's end; a local-style run is collected after each checkpoint is
complete (:func:`enforce`), so the volume holds what the master would leave if the run ended now.

Deletion is recorded before and after, so a kill -9 at any point leaves ``run.json`` and the
volume consistent: the entry is first marked ``deleting`` (never a resume point, shown as such),
then its files go (``metadata.json`` first, so nothing takes a half-deleted one as a checkpoint),
then the entry moves to ``checkpoints_deleted`` with why. The next pass finishes marked entries;
files already gone are no error (Determined's ``shared_fs`` delete returns on a missing directory).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.ondisk import NewerFormat, strings_in
from det_lab.runs.expconf import searcher_metric

log = logging.getLogger("det_lab.trials")

#: Determined 0.38.1's defaults (``schemas/expconf/v0/checkpoint-storage.json``)
DEFAULTS = {"save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 1}
#: run.json key of the checkpoints deleted, each with why and when
DELETED_KEY = "checkpoints_deleted"
#: mark of a checkpoint entry whose deletion has started
DELETING = "deleting"
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


class RetentionConfigError(UserError):
    """A ``checkpoint_storage.save_*`` key that is not a whole number >= 0."""


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints stay: the experiment's and the trial's best, the trial's latest."""

    experiment_best: int = DEFAULTS["save_experiment_best"]
    trial_best: int = DEFAULTS["save_trial_best"]
    trial_latest: int = DEFAULTS["save_trial_latest"]
    metric: str | None = None
    smaller_is_better: bool = True

    @classmethod
    def of(cls, exp_conf: Mapping[str, Any]) -> RetentionPolicy:
        """The policy of an experiment config (a missing or null key: Determined's default)."""
        storage = exp_conf.get("checkpoint_storage") or {}
        counts = {}
        for key, default in DEFAULTS.items():
            value = storage.get(key) if isinstance(storage, Mapping) else None
            if value is None:
                value = default
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RetentionConfigError(f"checkpoint_storage.{key}: {value!r} is not a whole number >= 0 "
                                           f"(Determined's default is {default})")
            counts[key] = value
        metric, smaller = searcher_metric(dict(exp_conf))
        return cls(counts["save_experiment_best"], counts["save_trial_best"], counts["save_trial_latest"],
                   metric, smaller)

    def describe(self) -> str:
        """Why a checkpoint went, in words: the keys it fell outside of."""
        keys = f"save_trial_best {self.trial_best}, save_trial_latest {self.trial_latest}"
        return keys + (f", save_experiment_best {self.experiment_best}" if self.experiment_best else "")


@dataclass(frozen=True)
class Candidate:
    """One complete checkpoint of a trial, with the searcher metric validated at its step."""

    uuid: str
    step: int
    trial: str  # the run it belongs to
    metric: float | None = None
    order: int = 0  # the validation's position (Determined's v.id): earlier wins a tie


@dataclass(frozen=True)
class Verdict:
    """What happens to one checkpoint, and why: ``keep`` empty means it is deleted."""

    uuid: str
    step: int
    metric: float | None
    keep: tuple[str, ...]

    @property
    def deleted(self) -> bool:
        return not self.keep


def _rank(items: list[Candidate], key) -> dict[str, int]:
    """SQL's ``rank()``: 1 + how many rows sort strictly before (equal keys share a rank)."""
    keys = {c.uuid: key(c) for c in items}
    return {u: 1 + sum(1 for other in keys.values() if other < k) for u, k in keys.items()}


def _metric_key(policy: RetentionPolicy):
    sign = 1.0 if policy.smaller_is_better else -1.0

    def key(c: Candidate) -> tuple:
        return (1, 0.0, 0) if c.metric is None else (0, sign * c.metric, c.order)  # NULLS LAST

    return key


def _words(rank: int, what: str) -> str:
    return what if rank == 1 else f"{what} #{rank}"


def decide(trial: list[Candidate], policy: RetentionPolicy, *, experiment: Iterable[Candidate] = (),
           resume_point: str | None = None, used_by: Mapping[str, str] | None = None) -> list[Verdict]:
    """The verdict on each of ``trial``'s checkpoints, by step (see the module docstring).

    ``experiment``: the other trials' checkpoints of the same experiment (a Slurm search's), ranked
    with these for ``save_experiment_best``; ``used_by``: uuid -> the other run that lists it."""
    key = _metric_key(policy)
    everyone = [*trial, *experiment]
    trial_rank, exp_rank = _rank(trial, key), _rank(everyone, key)
    order_rank = _rank(trial, lambda c: -c.step)
    used_by = used_by or {}
    out = []
    for c in sorted(trial, key=lambda c: (c.step, c.uuid)):
        valued = f"{policy.metric} {c.metric:.4g}" if c.metric is not None else ""
        keep: list[str] = []
        if c.uuid == resume_point:
            keep.append("resume point")
        if order_rank[c.uuid] <= policy.trial_latest:
            keep.append(_words(order_rank[c.uuid], "latest"))
        if c.metric is not None and trial_rank[c.uuid] <= policy.trial_best:
            keep.append(f"{_words(trial_rank[c.uuid], 'best')} ({valued})")
        if c.metric is not None and exp_rank[c.uuid] <= policy.experiment_best:
            keep.append(f"{_words(exp_rank[c.uuid], 'experiment best')} ({valued})")
        if c.uuid in used_by:
            keep.append(f"used by run {used_by[c.uuid]}")
        out.append(Verdict(c.uuid, c.step, c.metric, tuple(keep)))
    return out


def candidates(state: Mapping[str, Any], metrics: Iterable[Mapping[str, Any]], metric: str | None,
               trial: str) -> list[Candidate]:
    """The checkpoints ``run.json`` lists as complete (not being deleted), each with ``metric`` as
    validated at its step (the first validation of that step, as the query's join takes it)."""
    validated: dict[int, tuple[float, int]] = {}
    for i, m in enumerate(metrics):
        if m.get("group") != "validation" or not metric:
            continue
        value = (m.get("metrics") or {}).get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and int(m["step"]) not in validated:
            validated[int(m["step"])] = (float(value), i)
    out = []
    for entry in state.get("checkpoints") or []:
        if entry.get(DELETING):
            continue
        step = int(entry.get("step") or 0)
        value, order = validated.get(step, (None, 0))
        out.append(Candidate(str(entry["uuid"]), step, trial, value, order))
    return out


@dataclass
class Outcome:
    """What one retention pass did."""

    deleted: list[dict[str, Any]] = field(default_factory=list)
    kept: list[Verdict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def checkpoint_path(root: Path, uuid: str) -> Path | None:
    """``root/uuid``, or None for a name that is not a plain directory name (a damaged run.json)."""
    return root / uuid if _SAFE_NAME.fullmatch(uuid) and uuid not in (".", "..") else None


def remove_checkpoint(path: Path) -> None:
    """Delete one checkpoint directory: ``metadata.json`` first (nothing then takes the rest for a
    complete checkpoint), then the tree; a directory already gone is no error."""
    if path.is_symlink():  # the link goes, never what it points to
        path.unlink()
        return
    try:
        (path / "metadata.json").unlink()
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        path.unlink(missing_ok=True)
        return
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def delete_marked(record: Any, root: Path, reason: str, only: set[str] | None = None) -> Outcome:
    """Delete the checkpoints of ``record`` that run.json marks ``deleting`` (``only``: mark those
    uuids first), recording each as deleted once its files are gone. Safe to repeat after a kill."""
    outcome = Outcome()
    state = record.state()
    entries = state.get("checkpoints") or []
    if only:
        protected = state.get("latest_checkpoint")
        for entry in entries:
            if entry["uuid"] in only and entry["uuid"] != protected and not entry.get(DELETING):
                entry[DELETING] = {"since": _now(), "reason": reason}
        record.save(state)  # the intent is on disk before any file goes
    for entry in entries:  # the resume point is never deleted, whoever marked it
        if entry.get(DELETING) and entry["uuid"] == state.get("latest_checkpoint"):
            del entry[DELETING]
            record.save(state)
    marked = [e for e in entries if e.get(DELETING)]
    if not marked:
        return outcome
    gone: list[dict[str, Any]] = []
    for entry in marked:
        path = checkpoint_path(root, str(entry["uuid"]))
        if path is None:
            outcome.problems.append(f"checkpoint {entry['uuid']!r}: not a checkpoint name; left alone")
            continue
        try:
            remove_checkpoint(path)
        except OSError as exc:
            outcome.problems.append(f"checkpoint {entry['uuid']}: {exc.strerror or exc} ({path}); "
                                    "marked deleting, retried on the next pass")
            continue
        why = entry[DELETING].get("reason", reason) if isinstance(entry[DELETING], dict) else reason
        gone.append({"uuid": entry["uuid"], "step": entry.get("step"), "reason": why, "deleted": _now()})
    if gone:
        state = record.state()  # reread: only this pass's entries change
        ids = {g["uuid"] for g in gone}
        state["checkpoints"] = [e for e in state.get("checkpoints") or [] if e["uuid"] not in ids]
        state[DELETED_KEY] = [*(state.get(DELETED_KEY) or []), *gone]
        record.save(state)
        outcome.deleted = gone
    return outcome


def checkpoint_users(records: Iterable[Any]) -> dict[str, list[tuple[Path, str]]]:
    """Every checkpoint uuid the runs of ``records`` list (their checkpoints or resume point) ->
    (run directory, run name) of each, reading each run.json once."""
    users: dict[str, list[tuple[Path, str]]] = {}
    for other in records:
        try:
            st = other.state()
        except NewerFormat as exc:  # a newer det_lab's run: whatever it names may be a checkpoint it lists
            st = {"checkpoints": [{"uuid": word} for word in strings_in(Path(exc.path))]}
        except (OSError, ValueError):
            continue
        listed = {str(e.get("uuid")) for e in st.get("checkpoints") or []} | {str(st.get("latest_checkpoint"))}
        who = (Path(other.dir), str(st.get("name") or Path(other.dir).name))
        for u in listed:
            users.setdefault(u, []).append(who)
    return users


def used_elsewhere(records: Iterable[Any] | dict[str, list[tuple[Path, str]]], own_dir: Path,
                   uuids: set[str]) -> dict[str, str]:
    """Which of ``uuids`` another run lists (its checkpoints or resume point): uuid -> that run.
    ``records`` may be :func:`checkpoint_users` of them, made once for many questions."""
    if not uuids:
        return {}
    users = records if isinstance(records, dict) else checkpoint_users(records)
    out: dict[str, str] = {}
    for u in uuids:
        for run_dir, name in users.get(u, ()):
            if run_dir != Path(own_dir):
                out.setdefault(u, name)
                break
    return out


def validations(record: Any) -> list[dict[str, Any]]:
    """The validation records of ``record``'s metrics, in the order written (training lines, most
    of a long run's file, are not parsed); a line still being written is left out."""
    try:
        data = record.metrics_file.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        if b'"validation"' not in line[:40]:
            continue
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and m.get("group") == "validation" and isinstance(m.get("step"), int):
            out.append(m)
    return out


def plan(record: Any, policy: RetentionPolicy | None = None, *, siblings: Iterable[Any] = (),
         others: Iterable[Any] = ()) -> list[Verdict]:
    """The verdict on each complete checkpoint of ``record`` (nothing is deleted).

    ``siblings``: the other trials of its experiment (a Slurm search); ``others``: every other run
    of the project, whose listed checkpoints are kept."""
    state = record.state()
    policy = policy or RetentionPolicy.of(state.get("exp_conf") or {})
    mine = candidates(state, validations(record), policy.metric, state.get("name", ""))
    experiment = []
    for sib in siblings:
        try:
            experiment += candidates(sib.state(), validations(sib), policy.metric, sib.dir.name)
        except (OSError, ValueError):
            continue
    resume = state.get("latest_checkpoint")
    first = decide(mine, policy, experiment=experiment, resume_point=resume)
    doomed = {v.uuid for v in first if v.deleted}
    if not doomed:
        return first
    return decide(mine, policy, experiment=experiment, resume_point=resume,
                  used_by=used_elsewhere(others, record.dir, doomed))


def enforce(record: Any, root: Path, *, siblings: Iterable[Any] = (), others: Iterable[Any] = ()) -> Outcome:
    """One retention pass over ``record``'s checkpoints under ``root``: finish deletions a killed
    pass left marked, then delete what the policy no longer keeps. Call it with the run's trainer
    lock held (the trainer itself, or a command that checked none is alive)."""
    state = record.state()
    policy = RetentionPolicy.of(state.get("exp_conf") or {})
    outcome = delete_marked(record, root, "")  # a killed pass's leftovers first
    verdicts = plan(record, policy, siblings=siblings, others=others)
    doomed = set()
    for v in verdicts:
        path = checkpoint_path(root, v.uuid)
        if v.deleted and path is not None and os.path.isdir(path):
            doomed.add(v.uuid)
        elif v.deleted:  # its files are not where the run writes checkpoints: not ours to judge
            outcome.problems.append(f"checkpoint {v.uuid} is not under {root}; left in the record")
    if doomed:
        why = f"retention: outside {policy.describe()}"
        done = delete_marked(record, root, why, only=doomed)
        outcome.deleted += done.deleted
        outcome.problems += done.problems
    outcome.kept = [v for v in verdicts if v.uuid not in doomed]
    return outcome


def retain(record: Any, layout: Any, project: str, root: Path) -> Outcome:
    """:func:`enforce` for a run of ``project`` on the volume ``layout``: the project's other runs
    are read only when something would be deleted, a Slurm search's trials only for
    ``save_experiment_best``."""
    from det_lab.runs.record import run_dirs

    def runs() -> Iterable[Any]:
        for d, cls in run_dirs(layout, project):
            if d != record.dir:
                yield cls(d)

    state = record.state()
    search = (state.get("search") or {}).get("dir")
    siblings: list[Any] = []
    if search and RetentionPolicy.of(state.get("exp_conf") or {}).experiment_best:
        for other in runs():
            try:
                if (other.state().get("search") or {}).get("dir") == search:
                    siblings.append(other)
            except (OSError, ValueError):
                continue
    return enforce(record, root, siblings=siblings, others=runs())


def explain(record: Any, others: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """Every checkpoint ``record`` made, by step: ``state`` kept (with ``why``), deleting or
    deleted (with the reason and when), for ``det-lab runs show``."""
    state = record.state()
    rows: list[dict[str, Any]] = []
    try:
        verdicts = {v.uuid: v for v in plan(record, others=others)}
    except RetentionConfigError as exc:
        verdicts, problem = {}, str(exc)
    else:
        problem = None
    for entry in state.get("checkpoints") or []:
        uuid, step = str(entry.get("uuid")), entry.get("step")
        if entry.get(DELETING):
            mark = entry[DELETING] if isinstance(entry[DELETING], dict) else {}
            rows.append({"uuid": uuid, "step": step, "state": "deleting", "why": mark.get("reason", "")})
            continue
        v = verdicts.get(uuid)
        why = ", ".join(v.keep) if v and v.keep else problem or "deleted at the next checkpoint"
        rows.append({"uuid": uuid, "step": step, "state": "kept", "why": why})
    for gone in state.get(DELETED_KEY) or []:
        rows.append({"uuid": gone.get("uuid"), "step": gone.get("step"), "state": "deleted",
                     "why": f"{gone.get('reason', '')} ({gone.get('deleted', '?')})"})
    return sorted(rows, key=lambda r: (int(r["step"] or 0), r["state"]))
