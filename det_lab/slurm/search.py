"""Hyperparameter searches on Slurm: an Optuna study driven by a job array.

Determined's searchers live in its master, so on Slurm the experiment config's search is
translated into Optuna (:func:`suggest`, :func:`pruner_for`):

- ``hyperparameters``: ``const`` stays fixed; ``int``, ``double``, ``log`` (``base**x``, x uniform
  in [minval, maxval], i.e. log-uniform in [base**minval, base**maxval]) and ``categorical`` become
  ``suggest_*`` calls named by their dotted path (``model.d_model``); nesting is kept;
- ``searcher``: ``metric`` + ``smaller_is_better`` give the direction; ``max_trials`` the array's
  size; ``max_concurrent_trials`` its ``%`` limit; ``adaptive_asha`` becomes Optuna's
  asynchronous successive halving (``SuccessiveHalvingPruner``: ``divisor`` is its reduction
  factor, rungs from ``max_time / divisor**(max_rungs-1)``), fed by the validation metrics the
  trial already reports; ``random`` prunes nothing.

The study lives in a :class:`~optuna.storages.JournalStorage` file in the search's directory on
the volume (a journal of appends that works over NFS, where SQLite must not go):
``<data root>/outputs/<project>/slurm-searches/<name>/{search.json, optuna.journal, job.sbatch}``.
Each array task asks the study for a trial, records it as a Slurm run (``det-lab runs list``
shows it) and trains it as ``det-lab run --slurm`` does; a requeued task resumes its own trial.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_lab.errors import UserError
from det_lab.slurm.record import SlurmRunRecord
from det_lab.volume import atomic_write_text
from det_lab.runs.run_state import RunStatus

if TYPE_CHECKING:
    import optuna

SEARCH_FILE = "search.json"
SEARCHES_DIR = "slurm-searches"
JOURNAL_FILE = "optuna.journal"
SEARCHERS = ("random", "adaptive_asha")


class SearchConfigError(UserError, ValueError):
    """An experiment config's search that cannot run on Slurm, as one line."""


def is_search(exp_conf: dict[str, Any]) -> bool:
    return ((exp_conf.get("searcher") or {}).get("name") or "single") != "single"


def check_searcher(exp_conf: dict[str, Any], source: str) -> dict[str, Any]:
    """The searcher section, checked: what Optuna needs is there."""
    searcher = exp_conf.get("searcher") or {}
    name = searcher.get("name")
    if name not in SEARCHERS:
        raise SearchConfigError(f"{source}: searcher.name {name!r} does not run on Slurm "
                                f"(use {' or '.join(SEARCHERS)}, or 'single' for one trial)")
    if not searcher.get("metric"):
        raise SearchConfigError(f"{source}: searcher.metric is missing (the validation metric to optimise)")
    if int(searcher.get("max_trials") or 0) < 1:
        raise SearchConfigError(f"{source}: searcher.max_trials must be at least 1")
    _check_space(exp_conf.get("hyperparameters") or {}, source, "hyperparameters")
    return searcher


def _check_space(space: dict[str, Any], source: str, where: str) -> None:
    for name, spec in space.items():
        if not isinstance(spec, dict):
            continue
        kind = spec.get("type")
        key = f"{where}.{name}"
        if kind is None:
            _check_space(spec, source, key)
        elif kind in ("int", "double", "log"):
            if "minval" not in spec or "maxval" not in spec or spec["minval"] > spec["maxval"]:
                raise SearchConfigError(f"{source}: {key}: {kind} needs minval <= maxval")
        elif kind == "categorical":
            if not spec.get("vals"):
                raise SearchConfigError(f"{source}: {key}: categorical needs a non-empty vals list")
        elif kind != "const":
            raise SearchConfigError(f"{source}: {key}: unknown hyperparameter type {kind!r}")


def _optuna():
    """Optuna, imported only when a search needs it: importing it takes about half a second."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def suggest(trial: optuna.Trial, space: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Determined's hyperparameter space as Optuna suggestions (see the module docstring)."""
    out: dict[str, Any] = {}
    for name, spec in space.items():
        key = f"{prefix}{name}"
        if not isinstance(spec, dict):
            out[name] = spec
            continue
        kind = spec.get("type")
        if kind is None:
            out[name] = suggest(trial, spec, f"{key}.")
        elif kind == "const":
            out[name] = spec["val"]
        elif kind == "int":
            out[name] = trial.suggest_int(key, int(spec["minval"]), int(spec["maxval"]))
        elif kind == "double":
            out[name] = trial.suggest_float(key, float(spec["minval"]), float(spec["maxval"]))
        elif kind == "log":
            base = float(spec.get("base", 10))
            out[name] = trial.suggest_float(key, base ** float(spec["minval"]), base ** float(spec["maxval"]), log=True)
        elif kind == "categorical":
            vals = list(spec["vals"])
            if all(v is None or isinstance(v, (bool, int, float, str)) for v in vals):
                out[name] = trial.suggest_categorical(key, vals)
            else:  # Optuna's choices are scalars: pick lists/mappings by their index
                out[name] = vals[trial.suggest_categorical(f"{key}.index", list(range(len(vals))))]
    return out


def pruner_for(searcher: dict[str, Any]) -> optuna.pruners.BasePruner:
    """``adaptive_asha`` as asynchronous successive halving; anything else prunes nothing."""
    optuna = _optuna()
    if searcher.get("name") != "adaptive_asha":
        return optuna.pruners.NopPruner()
    divisor = int(searcher.get("divisor", 4))
    rungs = int(searcher.get("max_rungs", 5))
    max_time = int(searcher.get("max_time") or searcher.get("max_length", {}).get("batches", 0) or 0)
    min_resource = max(1, math.floor(max_time / divisor ** (rungs - 1))) if max_time else "auto"
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=divisor)


def direction(searcher: dict[str, Any]) -> str:
    return "minimize" if searcher.get("smaller_is_better", True) else "maximize"


def storage(search_dir: Path) -> optuna.storages.JournalStorage:
    from optuna.storages.journal import JournalFileBackend

    optuna = _optuna()
    return optuna.storages.JournalStorage(JournalFileBackend(str(search_dir / JOURNAL_FILE)))


def array_spec(searcher: dict[str, Any]) -> str:
    """``0-(N-1)%C``: N trials, at most C at a time."""
    n = int(searcher["max_trials"])
    c = int(searcher.get("max_concurrent_trials") or 0) or n
    return f"0-{n - 1}%{min(c, n)}"


@dataclass
class Search:
    """A search's directory on the volume and its state (``search.json``)."""

    dir: Path

    @property
    def state_file(self) -> Path:
        return self.dir / SEARCH_FILE

    @property
    def job_script(self) -> Path:
        return self.dir / "job.sbatch"

    @property
    def tasks_dir(self) -> Path:
        return self.dir / "tasks"

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())

    def update(self, **changes: Any) -> dict[str, Any]:
        state = {**self.state(), **changes}
        atomic_write_text(self.state_file, json.dumps(state, indent=2, default=str) + "\n")
        return state

    def study(self) -> optuna.Study:
        st = self.state()
        return _optuna().load_study(study_name=st["name"], storage=storage(self.dir),
                                 pruner=pruner_for(st["searcher"]))

    def create_study(self) -> optuna.Study:
        st = self.state()
        return _optuna().create_study(study_name=st["name"], storage=storage(self.dir),
                                   direction=direction(st["searcher"]), pruner=pruner_for(st["searcher"]))

    def rows(self) -> list[dict[str, Any]]:
        """One row per trial: number, state, value, hyperparameters, its run."""
        study = self.study()
        rows = []
        for t in study.get_trials(deepcopy=False):
            rows.append({"number": t.number, "state": t.state.name.lower(), "value": t.value,
                         "step": t.last_step, "params": t.params,
                         "run": t.user_attrs.get("run"), "array_task": t.user_attrs.get("array_task")})
        return rows

    def best(self) -> dict[str, Any] | None:
        study = self.study()
        try:
            b = study.best_trial
        except ValueError:
            return None
        return {"number": b.number, "value": b.value, "params": b.params, "run": b.user_attrs.get("run")}


# --- inside an array task -------------------------------------------------------------------------


def _task_trial(search: Search, study: optuna.Study, task: str) -> tuple[optuna.Trial, SlurmRunRecord | None]:
    """This array task's trial: the one it started before a requeue, else a new one."""
    mapping = search.tasks_dir / f"{task}.json"
    if mapping.exists():
        known = json.loads(mapping.read_text())
        trial = _optuna().Trial(study, known["trial_id"])
        run = SlurmRunRecord(Path(known["run_dir"])) if known.get("run_dir") else None
        return trial, run
    return study.ask(), None


def run_task(search: Search, task: str) -> int:
    """Train this array task's trial, report its validation metric to the pruner, tell the result."""
    from det_lab.settings import load_settings
    from det_lab.slurm.job import run_in_job
    from det_lab.runs import local

    st = search.state()
    settings = load_settings()
    study = search.study()
    optuna = _optuna()
    # each task samples from its own seed: tasks asking at once must not draw the same point
    study.sampler = (optuna.samplers.RandomSampler if st["searcher"]["name"] == "random"
                     else optuna.samplers.TPESampler)(seed=int(st["seed"]) + int(task))
    trial, run = _task_trial(search, study, task)
    if run is None:
        hparams = suggest(trial, st["exp_conf"].get("hyperparameters") or {})
        run, _, _ = local.prepare(settings, st["template_dir"], Path(st["config"]), False, int(st["seed"]),
                                  record_cls=SlurmRunRecord)
        run.update(hparams=hparams, search={"dir": str(search.dir), "trial": trial.number, "array_task": task},
                   slurm={**st["slurm"], "job_id": f"{os.environ.get('SLURM_ARRAY_JOB_ID', '')}_{task}"})
        trial.set_user_attr("run", run.dir.name)
        trial.set_user_attr("array_task", task)
        search.tasks_dir.mkdir(exist_ok=True)
        atomic_write_text(search.tasks_dir / f"{task}.json",
                          json.dumps({"trial_id": trial._trial_id, "run_dir": str(run.dir)}) + "\n")
    metric = st["searcher"]["metric"]
    pruned = threading.Event()
    done = threading.Event()
    reported: set[int] = set()
    read_to = 0

    def report_new(may_prune: bool) -> None:
        """Report validation points not yet reported; prune at the first the pruner rejects."""
        nonlocal read_to
        records, read_to = run.metrics_since(read_to)
        for m in records:
            if pruned.is_set():
                return  # points after the prune decision are the trial winding down, not evidence
            if m["group"] != "validation" or m["step"] in reported or metric not in m["metrics"]:
                continue
            reported.add(m["step"])
            trial.report(float(m["metrics"][metric]), m["step"])
            # should_prune also records this trial's value at the rung, which later trials compare with
            if trial.should_prune() and may_prune:
                pruned.set()
                print(f"det-lab: trial {trial.number} pruned at step {m['step']} "
                      f"({metric}={m['metrics'][metric]:.5g})", flush=True)
                os.kill(os.getpid(), signal.SIGUSR2)  # stop the trial: it checkpoints first

    def watch() -> None:
        while not done.is_set():
            report_new(may_prune=True)
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = run_in_job(run, stop_signals=(signal.SIGUSR2,))
    done.set()
    watcher.join()
    # points the trial wrote after the last poll: the rungs need them, though pruning is too late now
    report_new(may_prune=False)
    final = [m["metrics"][metric] for m in run.metrics() if m["group"] == "validation" and metric in m["metrics"]]
    status = run.state().get("status")
    if pruned.is_set():
        run.update(status=RunStatus.PRUNED.value)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    elif status == "finished" and final:
        study.tell(trial, float(final[-1]))
    elif status == "stopped":
        return code  # time limit: the job requeues itself and resumes this trial
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m det_lab.slurm.search SEARCH_DIR", file=sys.stderr)
        return 2
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        print("error: not in a Slurm job array (SLURM_ARRAY_TASK_ID is unset)", file=sys.stderr)
        return 2
    return run_task(Search(Path(argv[0])), task)


if __name__ == "__main__":
    sys.exit(main())
