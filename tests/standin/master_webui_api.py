"""The master stand-in's endpoints that only Determined 0.38.1's Web UI calls (beside the fork, which is
CreateExperiment with ``parentId``: master_client_api.py): continuing an experiment
(webui/react/src/components/ExperimentContinueModal.tsx, "Resume Current Trial", through
services/apiConfig.ts:698-707 ``continueExperiment``). Notebooks and commands launched with a config
template are in master_ntsc.py. Each handler names the master's handler it follows.
"""

from __future__ import annotations

import json
from typing import Any

from tests.standin.master import ApiError, Request, Route, route
from tests.standin.master_config import ConfigError, merge, parse_any_yaml, parse_create
from tests.standin.master_state import TERMINAL, Experiment
from tests.standin.master_views import experiment_view

ROUTES: list[Route] = []


def _wrapped_status(prefix: str, code_name: str, message: str) -> str:
    """``fmt.Errorf("<prefix>: %w", status.Error(...))``: grpc-go 1.64's FromError keeps the code and
    takes the whole text as the message (status/status.go FromError)."""
    return f"{prefix}: rpc error: code = {code_name} desc = {message}"


def merge_continue_config(exp: Experiment, override: str) -> dict[str, Any]:
    """api_experiment.go:1364-1428 parseAndMergeContinueConfig: the override merged over the active
    config, or the master's InvalidArgument."""
    override = override or "{}"
    name = (exp.config.get("searcher") or {}).get("name") or ""
    single = name == "single"
    if not single and name not in ("grid", "random"):
        raise ApiError(3, f"Unsupported searcher type provided: '{name}'")
    if not single and override.strip() != "{}":
        raise ApiError(3, f"override config is provided and experiment is not single searcher, got '{name}' instead")
    try:
        provided = parse_any_yaml(override)
    except ConfigError as exc:
        raise ApiError(3, f"parsing override config: {exc.message}") from exc
    for key, verb in (("project", "project"), ("workspace", "workspace")):
        if provided.get(key) is not None:
            raise ApiError(3, f"'{key}' in override config cannot be specified, use `det experiment move` first "
                              f"if you want to change the {verb}")
    merged = merge(provided, exp.config)
    got = (merged.get("searcher") or {}).get("name")
    if single and got != "single":
        raise ApiError(3, f"override config must have single searcher type got '{got}' instead")
    return merged


@route(ROUTES, "POST", "/api/v1/experiments/continue")
def continue_experiment(req: Request) -> dict[str, Any]:
    """api_experiment.go:1441-1590 ContinueExperiment: the merged config parsed as a new experiment's
    (parseCreateExperiment), a new searcher on it; then, only for a terminal experiment (and not a
    search whose trials all completed), the experiment PAUSED with progress 0 and that config (the
    original config kept), a single searcher's trial PAUSED, every trial's restarts zeroed; started
    with continueTrials (experiment.go:724-745: a trial of the same request id goes on from its latest
    checkpoint, a COMPLETED one stays) and activated."""
    state = req.master.state
    with state.lock:
        exp = state.experiments.get(int(req.body.get("id") or 0))
        if exp is None:
            raise ApiError(5, f"experiment '{req.body.get('id')}' not found")
        trials = sorted((t for t in state.trials.values() if t.experiment is exp), key=lambda t: t.id)
        merged = merge_continue_config(exp, str(req.body.get("overrideConfig") or ""))
        single = (merged.get("searcher") or {}).get("name") == "single"
        try:
            config = parse_create(json.dumps(merged), None, req.master.config)
        except ConfigError as exc:
            raise ApiError(exc.code, f"parsing continue experiment request: {exc.message}") from exc
        try:  # newExperiment (:1473-1476)
            seed = int((config.get("reproducibility") or {}).get("experiment_seed") or 0)
            searcher = state.searcher_factory(config, seed)
            warm = state.warm_start(config.get("searcher") or {})
        except (ValueError, ImportError) as exc:
            raise ApiError(13, f"failed to create experiment: {exc}") from exc
        if exp.state not in TERMINAL:  # :1482-1485
            raise ApiError(9, _wrapped_status("experiment continue database updates", "FailedPrecondition",
                                              f"experiment in non terminal state '{exp.state}', try again later"))
        if exp.state == "COMPLETED" and not single and all(t.state == "COMPLETED" for t in trials):  # :1487-1497
            raise ApiError(9, _wrapped_status("experiment continue database updates", "FailedPrecondition",
                                              "experiment has been completed, cannot continue this experiment"))
        if single and trials:  # :1498-1505
            trials[0].state = "PAUSED"
        exp.state, exp.progress, exp.end_time = "PAUSED", 0.0, None  # :1507-1515
        exp.config, exp.searcher, exp.continue_trials, exp.warm_start = config, searcher, True, warm  # :1524-1552
        for trial in trials:  # :1539-1550
            trial.restarts, trial.end_time = 0, None
        state.handle_actions(exp, searcher.start())  # e.Start (experiment.go:243-313)
        state.update_experiment_state(exp, "ACTIVE")  # :1567-1570 ActivateExperiment
        state.notify()
        return {"experiment": experiment_view(state, exp), "warnings": []}
