"""Hyperparameters, RNG and searcher config for the master stand-in's searcher (tests/standin/searcher.py).

Ports Determined 0.38.1's master/pkg/searcher/hyperparameters.go (random samples), grid.go:108-274
(the grid), master/pkg/nprand/nprand.go (the master's seeded Mersenne Twister) and
adaptive_asha.go:26-113 (bracket sizes), plus the checks of schemas/expconf/v0/hyperparameter*.json,
check-grid-hyperparameter.json, searcher*.json and expconf/searcher_config.go. Every path:line below
is at the tag v0.38.1.
"""

from __future__ import annotations

import copy
import itertools
import math
import numbers
import random
from typing import Any

HP_TYPES = ("const", "int", "double", "log", "categorical")
_HP_KEYS = {"const": {"val"}, "int": {"minval", "maxval", "count"}, "double": {"minval", "maxval", "count"},
            "log": {"minval", "maxval", "base", "count"}, "categorical": {"vals"}}
_MT_N = 624


class NPRand:
    """master/pkg/nprand/nprand.go:20-170 State: numpy's MT19937 seeded by init_genrand.

    CPython's ``random.Random`` runs the same twister, tempering and 53-bit float recipe, so only the
    seeding (nprand.go:34-41) is done here; the draws are then bit-identical to the Go master's."""

    def __init__(self, seed: int = 0, key: list[int] | None = None, pos: int = _MT_N) -> None:
        if key is None:
            key, s = [], seed & 0xFFFFFFFF
            for i in range(_MT_N):
                key.append(s)
                s = (1812433253 * (s ^ (s >> 30)) + i + 1) & 0xFFFFFFFF
        self._r = random.Random()
        self._r.setstate((3, tuple(key) + (pos,), None))

    def bits32(self) -> int:
        """nprand.go:43-71 Bits32."""
        return self._r.getrandbits(32)

    def bits_limit(self, limit: int) -> int:
        """nprand.go:96-128 bitsLimit: uniform in [0, limit] by masking and rejection."""
        if limit == 0:
            return 0
        mask = (1 << limit.bit_length()) - 1
        while True:
            val = (self.bits32() if limit <= 0xFFFFFFFF else (self.bits32() << 32) | self.bits32()) & mask
            if val <= limit:
                return val

    def intn(self, n: int) -> int:
        """nprand.go:138-152 Int64n / Intn: uniform in [0, n)."""
        if n <= 0:
            raise ValueError(f"nprand Intn: n {n} <= 0")
        return self.bits_limit(n - 1)

    def uniform(self, low: float, high: float) -> float:
        """nprand.go:154-170 UnitInterval / Uniform: low + (high-low) * [0, 1)."""
        if high <= low:
            raise ValueError(f"nprand Uniform: high {high} <= low {low}")
        return low + (high - low) * self._r.random()

    def read(self, n: int) -> bytes:
        """nprand.go:80-93 Read: each 32-bit draw gives four bytes, low byte first."""
        words = [self.bits32().to_bytes(4, "little") for _ in range((n + 3) // 4)]
        return b"".join(words)[:n]

    def state(self) -> dict[str, Any]:
        """nprand.go:20-24 State's JSON form (key, pos)."""
        internal = self._r.getstate()[1]
        return {"key": list(internal[:_MT_N]), "pos": internal[_MT_N]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NPRand:
        """The inverse of ``state``."""
        return cls(key=list(state["key"]), pos=int(state["pos"]))


def hp_kind(h: Any) -> str:
    """expconf/hyperparameters_config.go:97-115 UnmarshalJSON: an object without ``type`` nests, a
    non-object is a constant, anything else is the union member its ``type`` names."""
    if isinstance(h, dict):
        return str(h["type"]) if "type" in h else "object"
    return "const"


def _const_val(h: Any) -> Any:
    """hyperparameters_config.go:113 / :139-144: a bare value or a const's ``val``."""
    return h["val"] if isinstance(h, dict) else h


def _is_int(v: Any) -> bool:
    """JSON schema "integer" (hyperparameter-int.json:16-21), bools excluded."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """JSON schema "number" (hyperparameter-double.json:16-21, -log.json), bools excluded."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_hparams(hps: Any, grid: bool, path: str = "hyperparameters") -> None:
    """schemas/expconf/v0/hyperparameter*.json (types, required keys, ``compareProperties`` a<b,
    ``base`` > 0, ``count`` >= 1) and, for grid, check-grid-hyperparameter.json (a count for every
    int/double/log). Raises ValueError with a one-line reason."""
    if not isinstance(hps, dict):
        raise ValueError(f"{path}: must be an object")
    for name, h in hps.items():
        where, kind = f"{path}.{name}", hp_kind(h)
        if kind == "object":
            check_hparams(h, grid, where)
            continue
        if kind == "const":
            if isinstance(h, dict) and "val" not in h:
                raise ValueError(f'{where}: missing required property "val"')
            if isinstance(h, dict) and set(h) - {"type", "val"}:
                raise ValueError(f"{where}: additional properties not allowed: {sorted(set(h) - {'type', 'val'})}")
            continue
        if kind not in HP_TYPES:
            raise ValueError(f'{where}: if a hyperparameter object\'s ["type"] is set, it must be one of "int", '
                             '"double", "log", const", or "categorical"')
        extra = set(h) - _HP_KEYS[kind] - {"type"}
        if extra:
            raise ValueError(f"{where}: additional properties not allowed: {sorted(extra)}")
        if kind == "categorical":
            if not isinstance(h.get("vals"), list):
                raise ValueError(f"{where}.vals: must be an array")
            if not h["vals"]:
                # Go would index an empty list (hyperparameters.go:38) or grid nothing (grid.go:246-252).
                raise ValueError(f"{where}.vals: a categorical hyperparameter needs at least one value")
            continue
        check = _is_int if kind == "int" else _is_num
        for key in ("minval", "maxval") + (("base",) if kind == "log" else ()):
            if not check(h.get(key)):
                raise ValueError(f"{where}.{key}: must be {'an integer' if kind == 'int' else 'a number'}")
        if h["minval"] >= h["maxval"]:
            raise ValueError(f"{where}: minval must be less than maxval")
        if kind == "log" and h["base"] <= 0:
            raise ValueError(f"{where}.base: must be greater than 0")
        count = h.get("count")
        if count is not None and (not _is_int(count) or count < 1):
            raise ValueError(f"{where}.count: must be an integer >= 1")
        if grid and count is None:
            raise ValueError(f"{where}: grid search is in use but count was not provided")


def sample_one(h: Any, rng: NPRand) -> Any:
    """hyperparameters.go:22-48 sampleOne."""
    kind = hp_kind(h)
    if kind == "const":
        return copy.deepcopy(_const_val(h))
    if kind == "int":
        return h["minval"] + rng.intn(h["maxval"] - h["minval"] + 1)
    if kind == "double":
        return rng.uniform(h["minval"], h["maxval"])
    if kind == "log":
        return math.pow(h["base"], rng.uniform(h["minval"], h["maxval"]))
    if kind == "categorical":
        return copy.deepcopy(h["vals"][rng.intn(len(h["vals"]))])
    # Go ranges over the nested map (random order, :41); sorted keys keep a seed reproducible.
    return {key: sample_one(h[key], rng) for key in sorted(h)}


def sample_all(hps: dict[str, Any], rng: NPRand) -> dict[str, Any]:
    """hyperparameters.go:14-20 sampleAll: names in sorted order (hyperparameters_config.go:127-137 Each)."""
    return {name: sample_one(hps[name], rng) for name in sorted(hps)}


def go_round(x: float) -> float:
    """Go's math.Round: half away from zero (Python's round() is half to even)."""
    t = math.trunc(x)
    if abs(x - t) >= 0.5:
        t += math.copysign(1.0, x)
    return float(t)


def grid_axes(route: list[str], h: Any) -> list[list[tuple[list[str], Any]]]:
    """grid.go:183-274 getGridAxes: one axis of (route, value) per leaf hyperparameter."""
    kind = hp_kind(h)
    if kind == "const":
        return [[(route, _const_val(h))]]
    if kind == "categorical":
        return [[(route, v) for v in h["vals"]]]
    if kind == "object":
        if not h:
            return [[(route, {})]]
        return [axis for name in sorted(h) for axis in grid_axes(route + [name], h[name])]
    lo, hi, count = h["minval"], h["maxval"], h["count"]
    if kind == "int":
        count = min(count, hi - lo + 1)
        if count == 1:
            return [[(route, int(go_round(float(lo + hi) / 2.0)))]]
        return [[(route, int(go_round(float(lo) + float(i * (hi - lo)) / float(count - 1)))) for i in range(count)]]
    if count == 1:
        points = [(lo + hi) / 2.0]
    else:
        points = [lo + float(i) * (hi - lo) / float(count - 1) for i in range(count)]
    if kind == "log":
        points = [math.pow(h["base"], p) for p in points]
    return [[(route, p) for p in points]]


def _apply(route: list[str], val: Any, sample: dict[str, Any]) -> None:
    """grid.go:136-152 applyToSample."""
    for key in route[:-1]:
        sample = sample.setdefault(key, {})
    sample[route[-1]] = copy.deepcopy(val)


def hyperparameter_grid(hps: dict[str, Any]) -> list[dict[str, Any]]:
    """grid.go:108-125 newHyperparameterGrid and :154-181 cartesianProduct: the first (sorted) name
    varies slowest; no hyperparameters at all give no points."""
    axes = [axis for name in sorted(hps) for axis in grid_axes([name], hps[name])]
    if not axes:
        return []
    samples = []
    for point in itertools.product(*axes):
        sample: dict[str, Any] = {}
        for route, val in point:
            _apply(route, val, sample)
        samples.append(sample)
    return samples


_COMMON_KEYS = {"name", "metric", "smaller_is_better", "source_trial_id", "source_checkpoint_uuid"}
_KEYS = {  # schemas/expconf/v0/searcher-*.json properties (additionalProperties: false)
    "single": {"max_length"},
    "random": {"max_length", "max_trials", "max_concurrent_trials"},
    "grid": {"max_length", "max_concurrent_trials"},
    "adaptive_asha": {"bracket_rungs", "max_trials", "time_metric", "max_time", "mode", "divisor", "max_rungs",
                      "max_concurrent_trials", "max_length", "stop_once"},
    "async_halving": {"num_rungs", "max_length", "max_trials", "divisor", "max_concurrent_trials", "stop_once",
                      "time_metric", "max_time"},
}
_DEFAULTS = {"smaller_is_better": True, "max_concurrent_trials": 16, "divisor": 4.0, "max_rungs": 5,
             "mode": "standard", "bracket_rungs": []}
_EOL = ("sync_halving", "adaptive", "adaptive_simple", "custom")


def searcher_config(raw: Any) -> dict[str, Any]:
    """The searcher block with its schema defaults (searcher*.json), checked as 0.38.1 refuses it:
    the schema's types/minimums/eventuallyRequired and searcher_config.go:221-283 AssertCurrent."""
    if not isinstance(raw, dict) or not raw.get("name"):
        raise ValueError("invalid searcher configuration: searcher.name is required")
    name = raw["name"]
    if name in _EOL:
        raise ValueError(f"the '{name}' searcher has been removed and is not valid for new experiments")
    if name not in _KEYS:
        raise ValueError("searcher: is not an object where object[\"name\"] is one of 'single', 'random', "
                         "'grid', 'custom', or 'adaptive_asha'")
    extra = sorted(set(raw) - _COMMON_KEYS - _KEYS[name])
    if extra:
        raise ValueError(f"searcher: additional properties not allowed for the {name} searcher: {extra}")
    cfg = {k: v for k, v in raw.items() if v is not None}
    for key, default in _DEFAULTS.items():
        if key in _KEYS[name] | {"smaller_is_better"}:
            cfg.setdefault(key, copy.deepcopy(default))
    if not isinstance(cfg.get("metric"), str):
        raise ValueError("invalid searcher configuration: searcher.metric is required")
    if name in ("random", "adaptive_asha", "async_halving") and "max_trials" not in cfg:
        raise ValueError("invalid searcher configuration: searcher.max_trials is required")
    if name == "async_halving" and "num_rungs" not in cfg:
        raise ValueError("invalid searcher configuration: searcher.num_rungs is required")
    if name in ("adaptive_asha", "async_halving") and ("max_time" not in cfg or "time_metric" not in cfg):
        raise ValueError(f"the `{name}` searcher requires `max_time` and `time_metric` to be set")
    for key, low in (("max_trials", 1), ("num_rungs", 1), ("max_rungs", 1), ("max_concurrent_trials", 0),
                     ("max_time", 1)):
        value = cfg.get(key, low)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            # max_time has no schema minimum, but makeBrackets takes its log (adaptive_asha.go:93).
            raise ValueError(f"searcher.{key}: must be an integer >= {low}")
    divisor = cfg.get("divisor", 4.0)
    if not isinstance(divisor, (int, float)) or isinstance(divisor, bool) or divisor <= 1:
        raise ValueError("searcher.divisor: must be a number greater than 1")
    if name in ("adaptive_asha", "async_halving"):
        cfg["divisor"] = float(divisor)
    rungs = cfg.get("bracket_rungs", [])
    if not isinstance(rungs, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rungs):
        raise ValueError("searcher.bracket_rungs: must be a list of integers >= 1")
    if cfg.get("mode", "standard") not in _MODES:
        raise ValueError(f"searcher.mode: must be one of {sorted(_MODES)}")
    if not isinstance(cfg["smaller_is_better"], bool):
        raise ValueError("searcher.smaller_is_better: must be a boolean")
    return cfg


def get_bracket_max_trials(max_trials: int, divisor: float, brackets: list[int]) -> list[int]:
    """adaptive_asha.go:26-52 getBracketMaxTrials: about equal budget per bracket; the rest to the first."""
    weights = [math.pow(divisor, float(rungs - 1)) / float(rungs) for rungs in brackets]
    total = sum(weights)
    trials = [max(int(w / total * float(max_trials)), 1) for w in weights]
    trials[0] += max(max_trials - sum(trials), 0)
    return trials


def get_bracket_max_concurrent_trials(max_concurrent_trials: int, divisor: float, max_trials: list[int]) -> list[int]:
    """adaptive_asha.go:54-82 getBracketMaxConcurrentTrials."""
    n = len(max_trials)
    if max_concurrent_trials == 0:
        return [max(max_trials[-1], int(divisor))] * n
    max_concurrent_trials = max(max_concurrent_trials, n)
    out = [max_concurrent_trials // n] * n
    for i in range(max_concurrent_trials % n):
        out[i] += 1
    return out


_MODES = {  # adaptive_asha.go:134-167 conservative/standard/aggressive
    "conservative": lambda m: list(range(1, m + 1)),
    "standard": lambda m: list(range((m - 1) // 2 + 1, m + 1)),
    "aggressive": lambda m: [m],
}


def make_brackets(cfg: dict[str, Any]) -> list[tuple[int, int, int]]:
    """adaptive_asha.go:84-113 makeBrackets: (num_rungs, max_trials, max_concurrent_trials) per bracket,
    most rungs first. max_rungs is capped so the top rung holds a trial and needs >= 1 unit."""
    rungs = list(cfg["bracket_rungs"] or [])
    if not rungs:
        max_rungs = min(cfg["max_rungs"],
                        int(math.log(float(cfg["max_time"])) / math.log(cfg["divisor"])) + 1,
                        int(math.log(float(cfg["max_trials"])) / math.log(cfg["divisor"])) + 1)
        rungs = _MODES[cfg["mode"]](max_rungs)
    rungs.sort(reverse=True)
    trials = get_bracket_max_trials(cfg["max_trials"], cfg["divisor"], rungs)
    concurrent = get_bracket_max_concurrent_trials(cfg["max_concurrent_trials"], cfg["divisor"], trials)
    return list(zip(rungs, trials, concurrent))
