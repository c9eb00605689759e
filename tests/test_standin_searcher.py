"""Unit tests of the master stand-in's searchers (tests/standin/searcher.py), a port of Determined
0.38.1's master/pkg/searcher. Each test names the Go code (path:line at v0.38.1) it follows; the
``Go test`` ones port that test's numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.standin.searcher import (AsyncHalvingStoppingSearch, Create, Searcher, SearchError, Shutdown, Stop,
                                    TournamentSearch, insert_metric, make_rungs, make_searcher)
from tests.standin.searcher_hparams import (NPRand, get_bracket_max_concurrent_trials, get_bracket_max_trials,
                                            grid_axes, hyperparameter_grid, make_brackets, searcher_config)


def _config(searcher: dict[str, Any], hparams: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"searcher": {"metric": "loss", **searcher}, "hyperparameters": hparams or {}}


@dataclass
class _Trial:
    request_id: str
    hparams: dict[str, Any]
    stopped: bool = False
    stopped_at: int | None = None
    closed: bool = False


@dataclass
class _Runner:
    """master/pkg/searcher/util_test.go:14-143 TestSearchRunner: carries out the actions like the master."""
    searcher: Searcher
    time_metric: str = "batches"
    trials: list[_Trial] = field(default_factory=list)
    shutdowns: list[Shutdown] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)

    def handle(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Create):
                self.trials.append(_Trial(action.request_id, action.hparams))
                self.handle(self.searcher.on_trial_created(action.request_id))
            elif isinstance(action, Stop):
                self.by_id(action.request_id).stopped = True
                self.stops.append(action.request_id)
            else:
                self.shutdowns.append(action)

    def by_id(self, rid: str) -> _Trial:
        return next(t for t in self.trials if t.request_id == rid)

    def live(self) -> int:
        return sum(not t.closed for t in self.trials)

    def validate(self, rid: str, step: int, value: float) -> None:
        self.handle(self.searcher.on_validation(rid, {self.searcher.metric: value, self.time_metric: float(step)}))

    def close(self, rid: str, **kwargs: Any) -> None:
        self.by_id(rid).closed = True
        self.handle(self.searcher.on_trial_exited(rid, **kwargs))

    def run(self, max_units: int, period: int, increasing: bool) -> None:
        """util_test.go:41-60 run: trial by trial, a validation every ``period`` units, worse and worse
        (``increasing``, with smaller_is_better) or better and better, until stopped."""
        metric = 0.0
        self.handle(self.searcher.start())
        i = 0
        while i < len(self.trials):
            assert len(self.trials) <= 100, "the search does not end"
            trial = self.trials[i]
            for step in range(0, max_units + 1, period):
                metric += 1 if increasing else -1
                self.validate(trial.request_id, step, metric)
                if trial.stopped:
                    trial.stopped_at = step
                    break
            self.close(trial.request_id)
            i += 1


# --- the RNG: master/pkg/nprand -------------------------------------------------------------------

def test_nprand_draws_match_numpy() -> None:
    """nprand_test.go:14-25, :67-89, :91-124, :197-229: the master's RNG gives numpy's numbers."""
    rng = NPRand(42)
    assert [rng.intn(10) for _ in range(24)] == [6, 3, 7, 4, 6, 9, 2, 6, 7, 4, 3, 7, 7, 2, 5, 4, 1, 7, 5, 1, 4, 0, 9, 5]
    rng = NPRand(999)
    assert [rng.intn(1 << 31) for _ in range(6)] == [1303213504, 648491356, 118207333, 2129740257, 511579848,
                                                     922722529]
    rng = NPRand(999)
    assert [rng.intn((1 << 60) - 10) for _ in range(3)] == [985573361606668636, 507696633659605473,
                                                            1044297212768526561]
    rng = NPRand(1)
    assert [rng.uniform(0, 1) for _ in range(3)] == [0.417022004702574, 0.7203244934421581, 0.00011437481734488664]


def test_nprand_state_round_trips() -> None:
    """nprand.go:20-24 State (key, pos) as searcher.go:29 snapshots it."""
    rng = NPRand(7)
    rng.intn(100)
    copy_ = NPRand.from_state(json.loads(json.dumps(rng.state())))
    assert [copy_.bits32() for _ in range(5)] == [rng.bits32() for _ in range(5)]


# --- single: random.go:43-53 ----------------------------------------------------------------------

def test_single_creates_one_trial_and_shuts_down_after_it_exits() -> None:
    """random.go:43-68, :113-123 and searcher.go:165-187: one trial, never stopped, never replaced,
    then a completed (not failed) Shutdown; random_test.go:38-53 TestSingleSearchMethod."""
    runner = _Runner(make_searcher(_config({"name": "single"}, {"lr": 0.1}), 5))
    runner.handle(runner.searcher.start())
    assert len(runner.trials) == 1 and runner.trials[0].hparams == {"lr": 0.1}
    runner.validate(runner.trials[0].request_id, 10, 0.5)
    assert runner.stops == [] and runner.shutdowns == []
    runner.close(runner.trials[0].request_id)
    assert len(runner.trials) == 1
    assert runner.shutdowns == [Shutdown(failure=False, cancel=False)]


def test_single_trial_that_errors_fails_the_search() -> None:
    """searcher.go:103-140 TrialExitedEarly (ERRORED is a failure) then :165-187: all requested
    trials failed, so the Shutdown is a failure (experiment.go:680-684: STOPPING_ERROR)."""
    runner = _Runner(make_searcher(_config({"name": "single"}), 5))
    runner.handle(runner.searcher.start())
    runner.close(runner.trials[0].request_id, early=True)
    assert runner.shutdowns == [Shutdown(failure=True)]


# --- random: random.go ----------------------------------------------------------------------------

_HPARAMS = {
    "global_batch_size": 32,
    "units": {"type": "int", "minval": 4, "maxval": 9},
    "dropout": {"type": "double", "minval": 0.1, "maxval": 0.5},
    "lr": {"type": "log", "base": 10, "minval": -4, "maxval": -1},
    "act": {"type": "categorical", "vals": ["relu", "tanh"]},
    "optim": {"name": {"type": "const", "val": "adam"}, "beta": {"type": "double", "minval": 0.8, "maxval": 0.99}},
}


def test_random_creates_max_trials_at_most_max_concurrent_live_within_bounds() -> None:
    """random.go:55-68 initialTrials (min(max_trials, max_concurrent_trials)) and :113-123 trialExited
    (one more per exit until max_trials); hyperparameters.go:22-48 samples; random_test.go:13-36."""
    runner = _Runner(make_searcher(_config({"name": "random", "max_trials": 7, "max_concurrent_trials": 3},
                                           _HPARAMS), 11))
    runner.handle(runner.searcher.start())
    assert len(runner.trials) == 3
    while runner.live():
        assert runner.live() <= 3
        runner.close(next(t.request_id for t in runner.trials if not t.closed))
    assert len(runner.trials) == 7 and runner.stops == []
    assert runner.shutdowns == [Shutdown()]
    assert len({t.request_id for t in runner.trials}) == 7
    for t in runner.trials:
        hp = t.hparams
        assert hp["global_batch_size"] == 32 and hp["optim"]["name"] == "adam"
        assert isinstance(hp["units"], int) and 4 <= hp["units"] <= 9
        assert 0.1 <= hp["dropout"] < 0.5 and 0.8 <= hp["optim"]["beta"] < 0.99
        assert 1e-4 <= hp["lr"] < 1e-1 and hp["act"] in ("relu", "tanh")


def test_random_is_reproducible_by_seed() -> None:
    """searcher.go:44-59 NewSearcher(seed): the same experiment seed gives the same request ids, trial
    seeds and samples (actions.go:34-43 NewCreate); another seed does not."""
    conf = _config({"name": "random", "max_trials": 4}, _HPARAMS)
    one, two, other = make_searcher(conf, 3).start(), make_searcher(conf, 3).start(), make_searcher(conf, 4).start()
    assert one == two and one != other
    assert all(0 <= c.trial_seed < 2 ** 31 and c.request_id[14] == "4" for c in one)


def test_random_progress_counts_closed_trials_as_done() -> None:
    """random.go:70-94 progress and searcher.go:197-207 (NaN, before any trial, reads 0)."""
    searcher = make_searcher(_config({"name": "random", "max_trials": 2}), 1)
    assert searcher.progress() == 0.0
    a, b = searcher.start()
    searcher.on_trial_created(a.request_id)
    searcher.on_trial_created(b.request_id)
    searcher.set_trial_progress(a.request_id, 0.5)
    assert searcher.progress() == pytest.approx(0.25)
    searcher.on_trial_exited(b.request_id)
    assert searcher.progress() == pytest.approx(0.75)


def test_random_replaces_an_invalid_hp_trial() -> None:
    """random.go:96-111 trialExitedEarly: an INVALID_HP trial does not count against max_trials (a reason
    0.38.1's trial.go:780-789 never reports, but searcher.go:103-140 handles it)."""
    runner = _Runner(make_searcher(_config({"name": "random", "max_trials": 2, "max_concurrent_trials": 1}), 2))
    runner.handle(runner.searcher.start())
    runner.close(runner.trials[0].request_id, reason="INVALID_HP")
    while runner.live():
        runner.close(next(t.request_id for t in runner.trials if not t.closed))
    assert len(runner.trials) == 3 and runner.shutdowns == [Shutdown()]


# --- grid: grid.go --------------------------------------------------------------------------------

def _int(lo: int, hi: int, count: int) -> dict[str, Any]:
    return {"type": "int", "minval": lo, "maxval": hi, "count": count}


def test_grid_point_order_and_values() -> None:
    """grid.go:108-181 (first sorted name slowest); grid_test.go:95-115 TestGrid, :117-141 TestNestedGrid,
    :225-259 TestGridIntCount(Negative)."""
    assert hyperparameter_grid({"1": _int(0, 20, 3), "2": _int(0, 10, 3)}) == [
        {"1": a, "2": b} for a in (0, 10, 20) for b in (0, 5, 10)]
    assert hyperparameter_grid({"1": _int(0, 20, 3), "2": {"3": _int(0, 10, 3)}}) == [
        {"1": a, "2": {"3": b}} for a in (0, 10, 20) for b in (0, 5, 10)]
    assert hyperparameter_grid({"1": _int(0, 4, 5)}) == [{"1": v} for v in range(5)]
    assert hyperparameter_grid({"1": _int(-4, -2, 3)}) == [{"1": -4}, {"1": -3}, {"1": -2}]


def test_grid_counts_and_values_per_type() -> None:
    """grid.go:183-274 getGridAxes; grid_test.go:40-47 TestGridFunctionality, :49-93
    TestHyperparameterGridMethod, :143-223 TestNestedGridFurther."""
    for counts in ([1], [4], [1, 4], [3, 4], [2, 3, 4], [2, 2, 3, 3, 4, 5]):
        hps = {str(i): {"type": "double", "minval": -1.0, "maxval": 1.0, "count": c} for i, c in enumerate(counts)}
        expected = 1
        for c in counts:
            expected *= c
        assert len(hyperparameter_grid(hps)) == expected
    assert [v for _, v in grid_axes(["x"], {"type": "double", "minval": 0, "maxval": 2.0, "count": 5})[0]] == [
        0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(grid_axes(["x"], _int(0, 20, 7))[0]) == 7
    assert [v for _, v in grid_axes(["x"], {"type": "log", "base": 10, "minval": -3, "maxval": -2, "count": 2})[0]] \
        == [pytest.approx(1e-3), pytest.approx(1e-2)]
    assert grid_axes(["x"], {"empty": {}, "full": {"type": "categorical", "vals": [1, 2, 3]}}) == [
        [(["x", "empty"], {})], [(["x", "full"], 1), (["x", "full"], 2), (["x", "full"], 3)]]
    assert grid_axes(["x"], 3) == [[(["x"], 3)]]
    further = {"constant": {"type": "const", "val": 2},
               "a": {"b": {"c1": {"type": "categorical", "vals": [3, 5]}, "c2": _int(7, 11, 2)}},
               "f": {"type": "double", "minval": 13.0, "maxval": 17.0, "count": 2},
               "l": {"type": "log", "minval": 1, "maxval": 2, "base": 10, "count": 2}}
    got = {json.dumps(s, sort_keys=True, separators=(",", ":")) for s in hyperparameter_grid(further)}
    assert got == {json.dumps({"a": {"b": {"c1": c1, "c2": c2}}, "constant": 2, "f": f, "l": lv},
                              sort_keys=True, separators=(",", ":"))
                   for c1 in (3, 5) for c2 in (7, 11) for f in (13.0, 17.0) for lv in (10.0, 100.0)}


def test_grid_int_count_clamps_and_rounds_half_away_from_zero() -> None:
    """grid.go:192-213: count clamps to the integers in range; a single point is Go's math.Round of
    the middle (2.5 -> 3, not Python's 2)."""
    assert [v for _, v in grid_axes(["x"], _int(0, 2, 10))[0]] == [0, 1, 2]
    assert grid_axes(["x"], _int(0, 5, 1)) == [[(["x"], 3)]]
    assert grid_axes(["x"], _int(-5, 0, 1)) == [[(["x"], -3)]]
    assert [v for _, v in grid_axes(["x"], _int(0, 3, 3))[0]] == [0, 2, 3]


def test_grid_search_creates_every_point_once_last_first() -> None:
    """grid.go:44-60 and :95-106 take points from the end of the grid; max_concurrent_trials live at
    most; grid_test.go:261-293 TestGridSearchMethod (4 points, concurrency 2, none stopped)."""
    hps = {"a": _int(0, 3, 4), "b": {"type": "categorical", "vals": ["x", "y"]}, "c": 1}
    runner = _Runner(make_searcher(_config({"name": "grid", "max_concurrent_trials": 2}, hps), 9))
    runner.handle(runner.searcher.start())
    assert len(runner.trials) == 2
    while runner.live():
        assert runner.live() <= 2
        runner.close(next(t.request_id for t in runner.trials if not t.closed))
    assert [t.hparams for t in runner.trials] == list(reversed(hyperparameter_grid(hps)))
    assert len(runner.trials) == 8 and runner.stops == [] and runner.shutdowns == [Shutdown()]


# --- stopping ASHA: asha_stopping.go --------------------------------------------------------------

def test_make_rungs() -> None:
    """asha_stopping.go:54-67; asha_stopping_test.go:15-88 TestMakeRungs."""
    units = {(3, 9, 3.0): [1, 3, 9], (4, 10, 2.0): [1, 2, 5, 10], (1, 9, 3.0): [9], (3, 900, 3.0): [100, 300, 900]}
    for (n, max_time, divisor), expected in units.items():
        assert [r["units_needed"] for r in make_rungs(n, divisor, max_time)] == expected


def test_insert_metric() -> None:
    """asha_stopping.go:95-111; asha_stopping_test.go:90-142 TestInsertCompletedMetric, plus a tie:
    sort.Search finds the first metric >= the new one, so a newcomer goes before an equal one."""
    cases = [(1.2, [0.0, 1.5, 2.1], 1), (3.0, [0.0, 1.5, 2.0], 3), (-3.4, [-3.0, -2.0, -1.0], 0), (1.2, [], 0),
             (1.2, [1.0, 1.2, 1.5], 1)]
    for new, existing, index in cases:
        rung = {"units_needed": 0, "metrics": [{"request_id": "", "metric": m} for m in existing]}
        assert insert_metric(rung, "", new) == index
        assert [m["metric"] for m in rung["metrics"]] == sorted(existing + [new])


def _asha(smaller_is_better: bool = True, time_metric: str = "batches") -> AsyncHalvingStoppingSearch:
    return AsyncHalvingStoppingSearch(3, 10, 3.0, 0, time_metric, 10, smaller_is_better, "loss")


def test_get_metric() -> None:
    """asha_stopping.go:174-192; asha_stopping_test.go:144-203 TestGetMetric."""
    assert _asha().get_metric({"loss": 0.25, "batches": 2.0}) == (2, 0.25)
    assert _asha(False).get_metric({"loss": 0.2, "batches": 3.0}) == (3, -0.2)
    assert _asha(time_metric="custom_time_step").get_metric({"loss": 1.2, "custom_time_step": 5.0}) == (5, 1.2)
    with pytest.raises(SearchError, match="error parsing searcher metric"):
        _asha().get_metric({"batches": 2.0})
    with pytest.raises(SearchError, match="error parsing searcher time metric"):
        _asha().get_metric({"loss": 2.0})


def test_stop_trials() -> None:
    """asha_stopping.go:194-235 doEarlyStopping; asha_stopping_test.go:205-392 TestStopTrials."""
    s = _asha()
    s.rungs = make_rungs(3, 3.0, 9)
    s.trial_rungs = {"1": 0}
    assert s.do_early_stopping("1", 1, 0.5) == []
    assert s.trial_rungs == {"1": 1} and s.rungs[0]["metrics"] == [{"request_id": "1", "metric": 0.5}]
    s.trial_rungs["2"] = 0
    assert s.do_early_stopping("2", 1, 0.4) == []  # better than the first: continues
    assert s.trial_rungs == {"1": 1, "2": 1}
    assert [m["request_id"] for m in s.rungs[0]["metrics"]] == ["2", "1"]
    s.rungs = make_rungs(3, 3.0, 9)
    s.rungs[0]["metrics"] = [{"request_id": "1", "metric": 0.5}]
    s.trial_rungs = {"1": 1, "2": 0}
    assert s.do_early_stopping("2", 1, 0.6) == [Stop("2")]  # worse than the first: stopped
    assert s.trial_rungs == {"1": 1, "2": 0}
    assert [m["metric"] for m in s.rungs[0]["metrics"]] == [0.5, 0.6]


def test_asha_stopping_search_method() -> None:
    """asha_stopping_test.go:394-451 TestASHAStoppingSearchMethod: rungs 100/300/900; with worse and
    worse metrics one trial of 10 reaches 900, the 9 others stop at 100."""
    searcher = make_searcher(_config({"name": "async_halving", "max_time": 900, "time_metric": "batches",
                                      "divisor": 3.0, "num_rungs": 3, "max_concurrent_trials": 3,
                                      "max_trials": 10, "metric": "val_loss"}, {"x": _int(0, 10, 3)}), 102932948)
    assert [r["units_needed"] for r in searcher.method.rungs] == [100, 300, 900]
    runner = _Runner(searcher)
    runner.run(900, 100, increasing=True)
    assert len(runner.trials) == 10
    assert sorted(t.stopped_at for t in runner.trials) == [100] * 9 + [900]
    assert runner.shutdowns == [Shutdown()]


# --- adaptive ASHA: adaptive_asha.go + tournament.go ----------------------------------------------

def test_bracket_sizes() -> None:
    """adaptive_asha.go:26-82; adaptive_asha_test.go:16-28 TestBracketMaxTrials / TestBracketMaxConcurrentTrials."""
    assert get_bracket_max_trials(20, 3.0, [3, 2, 1]) == [12, 5, 3]
    assert get_bracket_max_trials(50, 3.0, [4, 3]) == [35, 15]
    assert get_bracket_max_trials(50, 4.0, [3, 2]) == [37, 13]
    assert get_bracket_max_trials(100, 4.0, [4, 3, 2]) == [70, 22, 8]
    assert get_bracket_max_concurrent_trials(0, 3.0, [9, 3, 1]) == [3, 3, 3]
    assert get_bracket_max_concurrent_trials(11, 3.0, [9, 3, 1]) == [4, 4, 3]
    assert get_bracket_max_concurrent_trials(0, 4.0, [40, 10]) == [10, 10]


def test_make_brackets() -> None:
    """adaptive_asha.go:84-113; adaptive_asha_test.go:30-89 TestMakeBrackets (schema defaults filled)."""
    standard = searcher_config({"name": "adaptive_asha", "metric": "loss", "mode": "standard", "max_time": 100,
                                "time_metric": "batches", "max_concurrent_trials": 2, "max_trials": 10})
    assert make_brackets(standard) == [(2, 7, 1), (1, 3, 1)]
    conservative = searcher_config({"name": "adaptive_asha", "metric": "loss", "mode": "conservative",
                                    "max_time": 1000, "time_metric": "batches", "divisor": 3.0,
                                    "max_concurrent_trials": 5, "max_trials": 10})
    assert make_brackets(conservative) == [(3, 7, 2), (2, 2, 2), (1, 1, 1)]


def test_adaptive_asha_search_method() -> None:
    """tournament_test.go:15-120 TestAdaptiveASHASearchMethod: two brackets (rungs 10/30/90 and 30/90),
    9 trials; bracket 1's 6 trials: one reaches 90, five stop at 10; bracket 2's 3: one 90, two 30."""
    searcher = make_searcher(_config({"name": "adaptive_asha", "max_time": 90, "time_metric": "batches",
                                      "divisor": 3.0, "max_rungs": 5, "max_concurrent_trials": 3, "max_trials": 9,
                                      "mode": "standard"}, {"x": _int(0, 10, 3)}), 102932948)
    method = searcher.method
    assert isinstance(method, TournamentSearch)
    assert [[r["units_needed"] for r in s.rungs] for s in method.subs] == [[10, 30, 90], [30, 90]]
    runner = _Runner(searcher)
    runner.run(90, 10, increasing=True)
    assert len(method.trial_table) == 9 and len(runner.trials) == 9
    brackets: list[list[int | None]] = [[], []]
    for t in runner.trials:
        brackets[method.trial_table[t.request_id]].append(t.stopped_at)
    assert sorted(brackets[0]) == [10] * 5 + [90]
    assert sorted(brackets[1]) == [30, 30, 90]
    assert runner.shutdowns == [Shutdown()]


@pytest.mark.parametrize("smaller_is_better", [True, False])
def test_adaptive_asha_stops_worse_trials_never_the_best(smaller_is_better: bool) -> None:
    """asha_stopping.go:155-235: 4 trials, one bracket (aggressive, divisor 2, max_time 4: rungs 1/2/4).
    A trial outside a rung's top half (at least the best so far) is stopped when it reports there; the
    best trial runs to the top rung (where every trial is stopped, as done); the direction follows
    smaller_is_better (getMetric negates otherwise)."""
    sign = 1.0 if smaller_is_better else -1.0
    searcher = make_searcher(_config({"name": "adaptive_asha", "max_trials": 4, "max_time": 4, "divisor": 2,
                                      "time_metric": "batches", "mode": "aggressive", "max_rungs": 3,
                                      "smaller_is_better": smaller_is_better}, {"x": _int(0, 10, 3)}), 1)
    assert searcher.smaller_is_better is smaller_is_better and searcher.metric == "loss"
    runner = _Runner(searcher)
    runner.handle(searcher.start())
    assert len(runner.trials) == 4
    a, b, c, d = (t.request_id for t in runner.trials)
    for rid, step, loss in [(a, 1, 0.5), (b, 1, 0.9), (c, 1, 0.2), (d, 1, 0.7), (c, 2, 0.1), (a, 2, 0.4)]:
        runner.validate(rid, step, sign * loss)
    assert runner.stops == [b, d, a]
    runner.validate(c, 3, sign * 0.08)
    assert runner.stops == [b, d, a]
    runner.validate(c, 4, sign * 0.05)
    assert runner.stops == [b, d, a, c]
    assert len(runner.trials) == 4  # max_trials reached: stops bring no new trials
    for rid in (b, d, a):
        runner.close(rid)
        assert runner.shutdowns == []
    runner.close(c)
    assert runner.shutdowns == [Shutdown()]


def test_adaptive_asha_missing_metric_errors_the_search() -> None:
    """asha_stopping.go:174-192 getMetric's error, which experiment.go:615-631 turns into STOPPING_ERROR."""
    searcher = make_searcher(_config({"name": "adaptive_asha", "max_trials": 4, "max_time": 4,
                                      "time_metric": "batches"}), 1)
    rid = searcher.start()[0].request_id
    searcher.on_trial_created(rid)
    [shutdown] = searcher.on_validation(rid, {"accuracy": 0.3, "batches": 4})
    assert shutdown.failure and "error parsing searcher metric (loss)" in shutdown.reason


def test_adaptive_asha_errored_trial_ranks_last_and_is_replaced() -> None:
    """asha_stopping.go:251-289 trialExitedEarly: an errored trial takes the worst place in its rung
    and a new trial replaces it while fewer than max_trials exist."""
    searcher = make_searcher(_config({"name": "adaptive_asha", "max_trials": 3, "max_time": 4, "divisor": 2,
                                      "time_metric": "batches", "mode": "aggressive", "max_concurrent_trials": 2}),
                             1)
    runner = _Runner(searcher)
    runner.handle(searcher.start())
    assert len(runner.trials) == 2
    runner.close(runner.trials[0].request_id, early=True)
    assert len(runner.trials) == 3
    assert searcher.method.subs[0].rungs[0]["metrics"][-1]["metric"] > 1e300


def test_snapshot_restore_continues_the_same_search() -> None:
    """searcher.go:225-247 Snapshot/Restore: a restored searcher makes the same next trials."""
    conf = _config({"name": "adaptive_asha", "max_trials": 8, "max_time": 4, "divisor": 2, "mode": "aggressive",
                    "time_metric": "batches", "max_concurrent_trials": 2}, _HPARAMS)
    searcher = make_searcher(conf, 3)
    runner = _Runner(searcher)
    runner.handle(searcher.start())
    a, b = (t.request_id for t in runner.trials)
    runner.validate(a, 1, 0.1)
    restored = Searcher.restore(conf, 3, json.loads(json.dumps(searcher.snapshot())))
    assert restored.on_validation(b, {"loss": 0.9, "batches": 1}) == searcher.on_validation(b, {"loss": 0.9,
                                                                                               "batches": 1})
    assert restored.progress() == searcher.progress()


# --- configs 0.38.1 refuses -----------------------------------------------------------------------

@pytest.mark.parametrize("searcher, hparams, message", [
    ({"name": "adaptive_asha", "max_trials": 4}, {}, "requires `max_time` and `time_metric`"),
    ({"name": "random"}, {}, "max_trials is required"),
    ({"name": "single", "max_trials": 2}, {}, "additional properties"),
    ({"name": "adaptive_simple", "max_trials": 2}, {}, "has been removed"),
    ({"name": "bayes"}, {}, "is one of"),
    ({"name": "adaptive_asha", "max_trials": 4, "max_time": 4, "time_metric": "b", "divisor": 1}, {}, "divisor"),
    ({"name": "adaptive_asha", "max_trials": 4, "max_time": 4, "time_metric": "b", "mode": "wild"}, {}, "mode"),
    ({"name": "grid"}, {"x": {"type": "int", "minval": 0, "maxval": 3}}, "count was not provided"),
    ({"name": "random", "max_trials": 1}, {"x": {"type": "int", "minval": 3, "maxval": 3}}, "less than"),
    ({"name": "random", "max_trials": 1}, {"x": {"type": "gauss"}}, "must be one of"),
])
def test_refused_configs(searcher: dict[str, Any], hparams: dict[str, Any], message: str) -> None:
    """searcher_config.go:221-283 AssertCurrent and schemas/expconf/v0/searcher*.json, hyperparameter*.json,
    check-grid-hyperparameter.json."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", "`")):
        make_searcher(_config(searcher, hparams), 0)


def test_missing_metric_is_refused() -> None:
    """schemas/expconf/v0/searcher-single.json eventuallyRequired: metric."""
    with pytest.raises(ValueError, match="metric"):
        make_searcher({"searcher": {"name": "single"}}, 0)
