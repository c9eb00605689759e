"""The master stand-in's hyperparameter searchers: a port of Determined 0.38.1's master/pkg/searcher.

``make_searcher(config, seed)`` gives a ``Searcher`` (searcher.go) around one search method:
``single``/``random`` (random.go), ``grid`` (grid.go), ``async_halving`` (asha_stopping.go, the
*stopping* ASHA) and ``adaptive_asha`` (adaptive_asha.go: ASHA brackets run side by side by
tournament.go). The master feeds it trial events and carries out the ``Create``/``Stop``/``Shutdown``
actions it returns, as master/internal/experiment.go:548-700 does. Sampling, grids, the seeded RNG,
the searcher config's defaults and checks and the adaptive brackets' sizes are in searcher_hparams.py.
Every path:line below is at the tag v0.38.1.
"""

from __future__ import annotations

import bisect
import copy
import math
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Union

from tests.standin.searcher_hparams import (NPRand, check_hparams, hyperparameter_grid, make_brackets, sample_all,
                                            searcher_config)


@dataclass
class Create:
    """actions.go:16-43 Create / NewCreate: a trial to create."""
    request_id: str
    hparams: dict[str, Any]
    trial_seed: int


@dataclass
class Stop:
    """actions.go:45-60 Stop: the master stops this trial (TrialSearcherState.EarlyStoppedBySearcher)."""
    request_id: str


@dataclass
class Shutdown:
    """actions.go:62-73 Shutdown; experiment.go:678-697 maps failure to STOPPING_ERROR, cancel to
    STOPPING_CANCELED, else STOPPING_COMPLETED. ``reason``: set when the search method errored
    (experiment.go:624-631 "encountered error ...", also STOPPING_ERROR)."""
    failure: bool = False
    cancel: bool = False
    reason: str = ""


Action = Union[Create, Stop, Shutdown]

# master/pkg/model/experiment.go:921-936 ExitedReason; trial.go:780-789 sends only the first two.
ERRORED, USER_CANCELED, INVALID_HP, INIT_INVALID_HP = "ERRORED", "USER_CANCELED", "INVALID_HP", "INIT_INVALID_HP"
_INVALID = (INVALID_HP, INIT_INVALID_HP)
ASHA_EXITED_METRIC = sys.float_info.max  # asha_stopping.go:52 ashaExitedMetricValue


class SearchError(Exception):
    """An error a Go search method returns (asha_stopping.go:174-192 getMetric)."""


def new_create(rng: NPRand, hparams: dict[str, Any]) -> Create:
    """actions.go:34-43 NewCreate and model/searcher.go:24-37 NewRequestID: a UUIDv4 from 16 RNG
    bytes, then a trial seed in [0, 2**31). Callers sample the hparams first, as Go's argument order does."""
    raw = bytearray(rng.read(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return Create(str(uuid.UUID(bytes=bytes(raw))), hparams, rng.intn(1 << 31))


def _create(rng: NPRand, hps: dict[str, Any]) -> Create:
    """NewCreate(ctx.rand, sampleAll(ctx.hparams, ctx.rand)), as random.go:62 and asha_stopping.go:134 call it."""
    return new_create(rng, sample_all(hps, rng))


class SearchMethod:
    """search_method.go:17-40 SearchMethod with :77-97 defaultSearchMethod's no-ops. ``_STATE`` names
    the attributes a snapshot holds (each method's *SearchState struct)."""
    _STATE: tuple[str, ...] = ()

    def initial_trials(self, rng: NPRand, hps: dict[str, Any]) -> list[Action]:
        """search_method.go:18-20 initialTrials."""
        raise NotImplementedError

    def trial_created(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """search_method.go:79-81."""
        return []

    def validation_completed(self, rng: NPRand, hps: dict[str, Any], rid: str, metrics: dict[str, Any]) -> list[Action]:
        """search_method.go:83-85."""
        return []

    def trial_exited(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """search_method.go:87-90."""
        return []

    def trial_exited_early(self, rng: NPRand, hps: dict[str, Any], rid: str, reason: str) -> list[Action]:
        """search_method.go:92-97 (every method here overrides it)."""
        return [Shutdown(failure=True)]

    def progress(self, trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
        """search_method.go:30-31 progress."""
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """The Snapshot of random.go:125-127, grid.go:276-278, asha_stopping.go:87-89: the state struct."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self._STATE}

    def restore(self, state: dict[str, Any]) -> None:
        """The Restore of random.go:129-134, grid.go:280-285, asha_stopping.go:91-93."""
        for name in self._STATE:
            setattr(self, name, copy.deepcopy(state[name]))


def _closed_progress(trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
    """random.go:70-94 / grid.go:62-85: closed trials count 1, others their reported fraction."""
    return sum(1.0 if closed.get(k) else v for k, v in trial_progress.items()) / len(trial_progress)


class RandomSearch(SearchMethod):
    """random.go:13-53 randomSearch (also ``single``: max_trials 1, max_concurrent_trials 1)."""
    _STATE = ("created_trials", "pending_trials")

    def __init__(self, max_trials: int, max_concurrent_trials: int, kind: str = "random") -> None:
        """random.go:34-53 newRandomSearch / newSingleSearch."""
        self.max_trials, self.max_concurrent_trials, self.kind = max_trials, max_concurrent_trials, kind
        self.created_trials = self.pending_trials = 0

    def initial_trials(self, rng: NPRand, hps: dict[str, Any]) -> list[Action]:
        """random.go:55-68."""
        n = min(self.max_trials, self.max_concurrent_trials) if self.max_concurrent_trials > 0 else self.max_trials
        self.created_trials += n
        self.pending_trials += n
        return [_create(rng, hps) for _ in range(n)]

    def progress(self, trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
        """random.go:70-94."""
        return _closed_progress(trial_progress, closed)

    def trial_exited_early(self, rng: NPRand, hps: dict[str, Any], rid: str, reason: str) -> list[Action]:
        """random.go:96-111: an invalid-hp trial of ``random`` is replaced when it closes."""
        self.pending_trials -= 1
        if self.kind == "random" and reason in _INVALID:
            self.created_trials -= 1
        return []

    def trial_exited(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """random.go:113-123: one trial out, the next in, until max_trials were created."""
        self.pending_trials -= 1
        if self.created_trials < self.max_trials:
            self.created_trials += 1
            self.pending_trials += 1
            return [_create(rng, hps)]
        return []


class GridSearch(SearchMethod):
    """grid.go:13-42 gridSearch: every grid point once, taken from the *end* of the grid list."""
    _STATE = ("pending_trials", "remaining_trials")

    def __init__(self, max_concurrent_trials: int) -> None:
        """grid.go:34-42 newGridSearch."""
        self.max_concurrent_trials = max_concurrent_trials
        self.pending_trials = 0
        self.remaining_trials: list[dict[str, Any]] = []

    def _next(self, rng: NPRand) -> Create:
        """grid.go:53-57 / :99-103: pop the last remaining point."""
        self.pending_trials += 1
        return new_create(rng, self.remaining_trials.pop())

    def initial_trials(self, rng: NPRand, hps: dict[str, Any]) -> list[Action]:
        """grid.go:44-60."""
        self.remaining_trials.extend(hyperparameter_grid(hps))
        n = len(self.remaining_trials)
        if self.max_concurrent_trials > 0:
            n = min(n, self.max_concurrent_trials)
        return [self._next(rng) for _ in range(n)]

    def progress(self, trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
        """grid.go:62-85."""
        return _closed_progress(trial_progress, closed)

    def trial_exited_early(self, rng: NPRand, hps: dict[str, Any], rid: str, reason: str) -> list[Action]:
        """grid.go:87-93: nothing (the point is not retried)."""
        return []

    def trial_exited(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """grid.go:95-106."""
        self.pending_trials -= 1
        return [self._next(rng)] if self.remaining_trials else []


def make_rungs(num_rungs: int, divisor: float, max_length: int) -> list[dict[str, Any]]:
    """asha_stopping.go:54-67 makeRungs: rung i needs max_length / divisor**(num_rungs-i-1) units (>= 1)."""
    return [{"units_needed": max(int(float(max_length) / math.pow(divisor, float(num_rungs - i - 1))), 1),
             "metrics": []} for i in range(num_rungs)]


def insert_metric(rung: dict[str, Any], rid: str, metric: float) -> int:
    """asha_stopping.go:95-111 insertMetric: keep the rung sorted ascending (before equal values)."""
    i = bisect.bisect_left(rung["metrics"], metric, key=lambda m: m["metric"])
    rung["metrics"].insert(i, {"request_id": rid, "metric": metric})
    return i


class AsyncHalvingStoppingSearch(SearchMethod):
    """asha_stopping.go:16-85 asyncHalvingStoppingSearch: ranks each validation of ``metric`` (negated
    unless smaller_is_better) within the rung its ``time_metric`` value reaches, and stops trials
    outside the top 1/divisor of a rung and any trial reaching the top rung."""
    _STATE = ("rungs", "trial_rungs", "early_exit_trials", "trials_completed", "invalid_trials")

    def __init__(self, num_rungs: int, max_trials: int, divisor: float, max_concurrent_trials: int,
                 time_metric: str, max_time: int, smaller_is_better: bool, metric: str) -> None:
        """asha_stopping.go:69-85 newAsyncHalvingStoppingSearch (time_metric/max_time: searcher_config.go:130-136)."""
        self.num_rungs, self.max_trials, self.divisor = num_rungs, max_trials, divisor
        self.max_concurrent_trials, self.time_metric, self.max_time = max_concurrent_trials, time_metric, max_time
        self.smaller_is_better, self.metric = smaller_is_better, metric
        self.rungs = make_rungs(num_rungs, divisor, max_time)
        self.trial_rungs: dict[str, int] = {}
        self.early_exit_trials: dict[str, bool] = {}
        self.trials_completed = self.invalid_trials = 0

    def initial_trials(self, rng: NPRand, hps: dict[str, Any]) -> list[Action]:
        """asha_stopping.go:113-139: max_concurrent_trials of them, else enough to fill the top rung."""
        if self.max_concurrent_trials > 0:
            n = min(self.max_concurrent_trials, self.max_trials)
        else:
            n = min(max(1, int(math.pow(self.divisor, float(self.num_rungs - 1)))), self.max_trials)
        return [_create(rng, hps) for _ in range(n)]

    def trial_created(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """asha_stopping.go:141-146."""
        self.trial_rungs[rid] = 0
        return []

    def trial_exited(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """asha_stopping.go:148-153: no new trial here; those come with stops (below)."""
        self.trials_completed += 1
        return []

    def validation_completed(self, rng: NPRand, hps: dict[str, Any], rid: str, metrics: dict[str, Any]) -> list[Action]:
        """asha_stopping.go:155-172: every stop brings a new trial while fewer than max_trials exist."""
        step, value = self.get_metric(metrics)
        ops = self.do_early_stopping(rid, step, value)
        if ops and len(self.trial_rungs) - self.invalid_trials < self.max_trials:
            ops.append(_create(rng, hps))
        return ops

    def get_metric(self, metrics: dict[str, Any]) -> tuple[int, float]:
        """asha_stopping.go:174-192 getMetric: both values must be numbers (JSON numbers, in Go)."""
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SearchError(f"error parsing searcher metric ({self.metric}) from validation metrics: {metrics}")
        step = metrics.get(self.time_metric)
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            raise SearchError(f"error parsing searcher time metric ({self.time_metric}) in validation metrics: "
                              f"{metrics}")
        if not math.isfinite(step):
            raise SearchError(f"searcher time metric ({self.time_metric}) is not finite: {step}")
        return int(step), float(value) if self.smaller_is_better else -float(value)

    def do_early_stopping(self, rid: str, step: int, metric: float) -> list[Action]:
        """asha_stopping.go:194-235 doEarlyStopping: climb from the trial's rung while ``step`` reaches it."""
        for r in range(self.trial_rungs.get(rid, 0), self.num_rungs):
            rung = self.rungs[r]
            self.trial_rungs[rid] = r
            if step < rung["units_needed"]:
                return []
            index = insert_metric(rung, rid, metric)
            if r == self.num_rungs - 1:
                return [Stop(rid)]
            if index >= max(int(float(len(rung["metrics"])) / self.divisor), 1):
                return [Stop(rid)]
        return []

    def progress(self, trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
        """asha_stopping.go:237-249: trials in the first rung over 1.2 * max_trials."""
        n = len(self.rungs[0]["metrics"])
        progress = n / (1.2 * self.max_trials)
        if n == self.max_trials:
            progress = max((self.trials_completed - self.invalid_trials) / self.max_trials, progress)
        return progress

    def trial_exited_early(self, rng: NPRand, hps: dict[str, Any], rid: str, reason: str) -> list[Action]:
        """asha_stopping.go:251-289: an invalid-hp trial leaves the rungs and is replaced; any other
        early exit ranks last in its rung, and a new trial comes while fewer than max_trials exist."""
        self.early_exit_trials[rid] = True
        if reason in _INVALID:
            self.invalid_trials += 1
            for rung in self.rungs[:self.trial_rungs.get(rid, 0) + 1]:
                rung["metrics"] = [m for m in rung["metrics"] if m["request_id"] != rid]
            return [Stop(rid), _create(rng, hps)]
        insert_metric(self.rungs[self.trial_rungs.get(rid, 0)], rid, ASHA_EXITED_METRIC)
        if len(self.trial_rungs) - self.invalid_trials < self.max_trials:
            return [_create(rng, hps)]
        return []


class TournamentSearch(SearchMethod):
    """tournament.go:11-34 tournamentSearch: sub-searches side by side; each trial's events go to the
    sub-search that created it (TrialTable, unknown ids to the first)."""

    def __init__(self, subs: list[SearchMethod]) -> None:
        """tournament.go:25-34 newTournamentSearch."""
        self.subs = subs
        self.trial_table: dict[str, int] = {}

    def _mark(self, i: int, actions: list[Action]) -> list[Action]:
        """tournament.go:134-142 markCreates."""
        for a in actions:
            if isinstance(a, Create):
                self.trial_table[a.request_id] = i
        return actions

    def initial_trials(self, rng: NPRand, hps: dict[str, Any]) -> list[Action]:
        """tournament.go:60-71."""
        return [a for i, sub in enumerate(self.subs) for a in self._mark(i, sub.initial_trials(rng, hps))]

    def trial_created(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """tournament.go:73-80."""
        i = self.trial_table.get(rid, 0)
        return self._mark(i, self.subs[i].trial_created(rng, hps, rid))

    def validation_completed(self, rng: NPRand, hps: dict[str, Any], rid: str, metrics: dict[str, Any]) -> list[Action]:
        """tournament.go:82-89."""
        i = self.trial_table.get(rid, 0)
        return self._mark(i, self.subs[i].validation_completed(rng, hps, rid, metrics))

    def trial_exited(self, rng: NPRand, hps: dict[str, Any], rid: str) -> list[Action]:
        """tournament.go:91-99."""
        i = self.trial_table.get(rid, 0)
        return self._mark(i, self.subs[i].trial_exited(rng, hps, rid))

    def trial_exited_early(self, rng: NPRand, hps: dict[str, Any], rid: str, reason: str) -> list[Action]:
        """tournament.go:101-108."""
        i = self.trial_table.get(rid, 0)
        return self._mark(i, self.subs[i].trial_exited_early(rng, hps, rid, reason))

    def progress(self, trial_progress: dict[str, float], closed: dict[str, bool]) -> float:
        """tournament.go:110-132: the mean of the sub-searches' progress."""
        total = 0.0
        for i, sub in enumerate(self.subs):
            mine = {k for k in set(trial_progress) | set(closed) if self.trial_table.get(k, 0) == i}
            total += sub.progress({k: v for k, v in trial_progress.items() if k in mine},
                                  {k: v for k, v in closed.items() if k in mine})
        return total / len(self.subs)

    def snapshot(self) -> dict[str, Any]:
        """tournament.go:36-45."""
        return {"trial_table": dict(self.trial_table), "sub_search_states": [s.snapshot() for s in self.subs]}

    def restore(self, state: dict[str, Any]) -> None:
        """tournament.go:47-58."""
        self.trial_table = dict(state["trial_table"])
        for sub, sub_state in zip(self.subs, state["sub_search_states"]):
            sub.restore(sub_state)


def new_adaptive_asha_search(cfg: dict[str, Any]) -> TournamentSearch:
    """adaptive_asha.go:115-132 newAdaptiveASHASearch: one stopping ASHA per bracket."""
    return TournamentSearch([
        AsyncHalvingStoppingSearch(num_rungs, trials, cfg["divisor"], concurrent, cfg["time_metric"],
                                   cfg["max_time"], cfg["smaller_is_better"], cfg["metric"])
        for num_rungs, trials, concurrent in make_brackets(cfg)])


def new_search_method(cfg: dict[str, Any]) -> SearchMethod:
    """search_method.go:59-75 NewSearchMethod (random.go:34-53 for single/random, asha_stopping.go:69-85)."""
    name = cfg["name"]
    if name == "single":
        return RandomSearch(1, 1, "single")
    if name == "random":
        return RandomSearch(cfg["max_trials"], cfg["max_concurrent_trials"])
    if name == "grid":
        return GridSearch(cfg["max_concurrent_trials"])
    if name == "async_halving":
        return AsyncHalvingStoppingSearch(cfg["num_rungs"], cfg["max_trials"], cfg["divisor"],
                                          cfg["max_concurrent_trials"], cfg["time_metric"], cfg["max_time"],
                                          cfg["smaller_is_better"], cfg["metric"])
    return new_adaptive_asha_search(cfg)


class Searcher:
    """searcher.go:18-59 Searcher: the bookkeeping around a search method (requested, created and
    closed trials, early exits, their progress) and the Shutdown once every requested trial closed."""

    def __init__(self, method: SearchMethod, hparams: dict[str, Any], seed: int, metric: str,
                 smaller_is_better: bool) -> None:
        """searcher.go:44-59 NewSearcher."""
        self.method, self.hparams, self.metric, self.smaller_is_better = method, hparams, metric, smaller_is_better
        self.rng = NPRand(seed)
        self.trials_requested = 0
        self.trials_created: dict[str, bool] = {}
        self.trials_closed: dict[str, bool] = {}
        self.exits: dict[str, bool] = {}
        self.cancels: dict[str, bool] = {}
        self.failures: dict[str, bool] = {}
        self.trial_progress: dict[str, float] = {}

    def _record(self, actions: list[Action]) -> list[Action]:
        """searcher.go:217-223 record."""
        self.trials_requested += sum(isinstance(a, Create) for a in actions)
        return actions

    def start(self) -> list[Action]:
        """searcher.go:65-77 InitialTrials."""
        return self._record(self.method.initial_trials(self.rng, self.hparams))

    def on_trial_created(self, request_id: str) -> list[Action]:
        """searcher.go:79-93 TrialCreated, once per trial (experiment.go:598-606 checks TrialIsCreated)."""
        if self.trials_created.get(request_id):
            return []
        self.trials_created[request_id] = True
        self.trial_progress[request_id] = 0.0
        return self._record(self.method.trial_created(self.rng, self.hparams, request_id))

    def on_validation(self, request_id: str, metrics: dict[str, Any]) -> list[Action]:
        """searcher.go:150-163 ValidationCompleted. A method error (the searcher metric or time metric
        missing) puts the experiment in STOPPING_ERROR (experiment.go:624-631): here a failed Shutdown."""
        try:
            return self._record(self.method.validation_completed(self.rng, self.hparams, request_id, metrics))
        except SearchError as exc:
            return [Shutdown(failure=True, reason=f"encountered error error while handling a validation "
                                                  f"completed event: {request_id}: {exc}")]

    def on_trial_exited_early(self, request_id: str, reason: str = ERRORED) -> list[Action]:
        """searcher.go:103-140 TrialExitedEarly; reported at most once per trial."""
        if self.exits.get(request_id):
            return []
        if reason in _INVALID:
            self.trial_progress.pop(request_id, None)
        elif reason == USER_CANCELED:
            self.cancels[request_id] = True
        elif reason == ERRORED:
            self.failures[request_id] = True
        actions = self._record(self.method.trial_exited_early(self.rng, self.hparams, request_id, reason))
        self.exits[request_id] = True
        if self.trials_requested == len(self.trials_closed):
            actions.append(Shutdown(failure=len(self.failures) >= self.trials_requested))
        return actions

    def on_trial_exited(self, request_id: str, early: bool = False, reason: str | None = None) -> list[Action]:
        """searcher.go:165-187 TrialExited; with ``early`` (or a ``reason``) first TrialExitedEarly, as
        experiment.go:555-568 trialExited does for an exit reason (trial.go:780-789: ERRORED for an
        errored trial, USER_CANCELED for a canceled one, none otherwise)."""
        actions: list[Action] = []
        if early or reason is not None:
            actions += self.on_trial_exited_early(request_id, reason or ERRORED)
        self.trials_closed[request_id] = True
        actions += self._record(self.method.trial_exited(self.rng, self.hparams, request_id))
        if self.trials_requested == len(self.trials_closed):
            actions.append(Shutdown(cancel=len(self.cancels) >= self.trials_requested,
                                    failure=len(self.failures) >= self.trials_requested))
        return actions

    def set_trial_progress(self, request_id: str, progress: float) -> None:
        """searcher.go:142-148 SetTrialProgress (from a trial's progress report, experiment.go:318-329)."""
        self.trial_progress[request_id] = float(progress)

    def progress(self) -> float:
        """searcher.go:197-207 Progress: NaN or infinite (e.g. no trials yet) reads as 0."""
        try:
            value = self.method.progress(dict(self.trial_progress), dict(self.trials_closed))
        except ZeroDivisionError:
            return 0.0
        return value if math.isfinite(value) else 0.0

    def snapshot(self) -> dict[str, Any]:
        """searcher.go:225-236 Snapshot: SearcherState's JSON fields, the RNG and the method's state."""
        return copy.deepcopy({
            "trials_requested": self.trials_requested, "trials_created": self.trials_created,
            "trials_closed": self.trials_closed, "exits": self.exits, "cancels": self.cancels,
            "failures": self.failures, "trial_progress": self.trial_progress, "rand": self.rng.state(),
            "search_method_state": self.method.snapshot()})

    @classmethod
    def restore(cls, config: dict[str, Any], seed: int, snapshot: dict[str, Any]) -> Searcher:
        """searcher.go:238-247 Restore: a searcher for ``config`` with ``snapshot``'s state."""
        searcher = make_searcher(config, seed)
        state = copy.deepcopy(snapshot)
        for key in ("trials_requested", "trials_created", "trials_closed", "exits", "cancels", "failures",
                    "trial_progress"):
            setattr(searcher, key, state[key])
        searcher.rng = NPRand.from_state(state["rand"])
        searcher.method.restore(state["search_method_state"])
        return searcher


def make_searcher(config: dict[str, Any], seed: int) -> Searcher:
    """experiment.go:133-136 newExperiment: NewSearcher(experiment_seed, NewSearchMethod(searcher config),
    hyperparameters) (searcher.go:44-59) for an experiment config; ValueError when 0.38.1 refuses it."""
    cfg = searcher_config(config.get("searcher"))
    hparams = config.get("hyperparameters") or {}
    check_hparams(hparams, grid=cfg["name"] == "grid")
    return Searcher(new_search_method(cfg), hparams, seed & 0xFFFFFFFF, cfg["metric"], cfg["smaller_is_better"])
