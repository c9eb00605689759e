"""``det-lab run <template> --local``: an experiment config run through Determined's local
training mode, with no cluster.

The same entrypoint and hyperparameters as on the cluster (const values, or one sample of a
search), checkpoints under ``<data root>/checkpoints/<project>``, metrics kept (``metrics.jsonl``)
and mirrored, a progress bar, and a summary of where everything went. Each run has a directory
``<data root>/outputs/<project>/local-runs/<name>/`` holding its state (``run.json``), log,
metrics and tracking journal; ``--resume`` continues the latest run from its latest checkpoint,
in the same tracker run.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab import templates
from det_lab.data.git import describe_commit
from det_lab.models import SHADOWING, run_environment
from det_lab.settings import LabSettings, read_yaml_mapping
from det_lab.runs.expconf import ExpConfError, lab_section, training_length
from det_lab.runs.identity import LOCAL_RUN_ENV
from det_lab.runs.lineage import CODE_COMMIT_ENV
from det_lab.runs import run_guard
from det_lab.runs.record import RUN_FILE, LocalRunRecord, open_record
from det_lab.runs.validate import preflight
from det_lab.volume import VolumeLayout
from det_lab.runs.run_state import RunStatus

DEFAULT_CONFIGS = ("const.yaml", "single.yaml", "config.yaml")
LAUNCHERS = ("determined.launch.torch_distributed", "determined.launch.horovod", "determined.launch.deepspeed")


class RunError(UserError, RuntimeError):
    """A problem starting a local run, phrased as one line."""


def resolve_template(name: str) -> Path:
    """A template name (``vla``, ``3dgs``) or a directory holding an experiment config.

    The one place the run path looks a template up (:func:`det_lab.templates.resolve`)."""
    try:
        return templates.resolve(name)
    except templates.TemplateError as exc:
        raise RunError(str(exc)) from None


def load_config(template: Path, config: Path | None) -> tuple[Path, dict[str, Any]]:
    path = config or next((template / c for c in DEFAULT_CONFIGS if (template / c).is_file()), None)
    if path is None:
        raise RunError(f"{template} has no {' / '.join(DEFAULT_CONFIGS)}; pass --exp-config")
    return Path(path), read_yaml_mapping(Path(path), RunError)  # one line for bad YAML or bytes


def sample_hparams(space: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Const values as they are; one sample of each searched hyperparameter."""
    out: dict[str, Any] = {}
    for name, spec in space.items():
        if not isinstance(spec, dict):
            out[name] = spec
            continue
        kind = spec.get("type")
        if kind is None:
            out[name] = sample_hparams(spec, rng)
        elif kind == "const":
            out[name] = spec["val"]
        elif kind == "int":
            out[name] = rng.randint(int(spec["minval"]), int(spec["maxval"]))
        elif kind == "double":
            out[name] = rng.uniform(float(spec["minval"]), float(spec["maxval"]))
        elif kind == "log":
            out[name] = float(spec["base"]) ** rng.uniform(float(spec["minval"]), float(spec["maxval"]))
        elif kind == "categorical":
            out[name] = rng.choice(spec["vals"])
        else:
            raise RunError(f"hyperparameter {name!r}: unknown type {kind!r}")
    return out


def entry_command(entrypoint: str | list[str]) -> list[str]:
    """The local command for an experiment ``entrypoint``.

    Determined's distributed launchers are dropped (one local process), ``python3`` becomes
    this interpreter, and the legacy ``module:Class`` form runs through Determined's harness
    shim in :mod:`det_lab.trials.legacy`.
    """
    argv = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    if len(argv) == 1 and re.fullmatch(r"[\w.]+:\w+", argv[0]):
        return [sys.executable, "-m", "det_lab.trials.legacy", argv[0]]
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in LAUNCHERS:
        rest = argv[3:]
        while rest and rest[0].startswith("--"):  # launcher options such as --trust
            rest = rest[1:]
        argv = rest
    if argv and Path(argv[0]).name in ("python", "python3"):
        argv[0] = sys.executable
    if not argv:
        raise RunError(f"entrypoint {entrypoint!r} has no command")
    return argv


def prepare(settings: LabSettings, template: str, config: Path | None, resume: bool | str,
            seed: int | None = None, record_cls: type[LocalRunRecord] = LocalRunRecord,
            overrides: list[str] | tuple[str, ...] = (), name: str | None = None,
            warn: Callable[[str], None] | None = None,
            gpu_check: Callable[[dict[str, Any], str, str], None] | None = None,
            ) -> tuple[LocalRunRecord, Path, list[str]]:
    """Create (or, with ``resume``, reopen) a local-style run of kind ``record_cls``; returns its
    record, its cwd and its command. ``name`` names a new run (default: template, time, random).
    Checks that refuse a run belong before the staging directory is made; ``gpu_check(config, run
    name, template)`` is the last of them (the run's GPUs: :class:`det_lab.gpus.LocalClaim`)."""
    tdir = resolve_template(template)
    cfg_path, conf = load_config(tdir, config)
    if overrides and resume:
        raise RunError("--set applies to new runs; a resumed run keeps the config it started with")
    templates.apply_overrides(conf, list(overrides))
    if not resume:  # what Determined or det_lab would refuse: before anything exists
        preflight(conf, settings, str(cfg_path))
    try:
        lab = lab_section(conf, str(cfg_path))
        length = training_length(conf, lab)
    except ExpConfError as exc:
        raise RunError(str(exc)) from None
    settings.project(lab.project)
    layout = VolumeLayout.from_settings(settings)
    if not layout.outputs(lab.project).is_dir():
        raise RunError(f"{layout.outputs(lab.project)} does not exist: run 'det-lab init' (or set DET_LAB_DATA_ROOT)")
    root = record_cls.runs_root(layout, lab.project)
    if name is not None and not resume:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
            raise RunError(f"run name {name!r} may only hold letters, digits, '.', '_' and '-'")
        if (root / name).exists():
            raise RunError(f"run {name} exists; use --resume to continue it or choose another name")
    root.mkdir(exist_ok=True)
    if resume:
        run = _find_run(root, tdir.name, None if resume is True else str(resume))
        state = run.state()
        if not state.get("latest_checkpoint"):
            raise RunError(f"run {state['name']} has no checkpoint yet to resume from; start a new run")
        if state.get("deleting"):  # det-lab runs delete was stopped mid-way: its checkpoints may be gone
            raise RunError(f"run {state['name']} is being deleted; finish that with: "
                           "det-lab runs prune --status deleting --yes")
        # the config it started with, not the template's: read after the record, which may be unreadable
        preflight(state["exp_conf"], settings, f"{run.run_file} exp_conf")
        _require(tdir, state["hparams"])
        try:  # one trainer per run: refused while one lives; a dead one's lock is broken, with a warning
            stale = run_guard.break_stale(run.dir, state["name"])
        except run_guard.RunBusy as exc:
            raise RunError(str(exc)) from None
        if gpu_check is not None:
            gpu_check(state["exp_conf"], state["name"], tdir.name)
        if stale and warn is not None:
            warn(stale)
        state["resumed"] = state.get("resumed", 0) + 1
        state.pop("trial_status", None)  # the resumed trial reports its own
        run.save(state)
        return run, Path(state["cwd"]), state["command"]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = name or f"{tdir.name}-{stamp}-{uuid.uuid4().hex[:4]}"
    seed = seed if seed is not None else (conf.get("reproducibility") or {}).get("experiment_seed", 0)
    rng = random.Random(seed)
    hparams = sample_hparams(conf.get("hyperparameters") or {}, rng)
    _require(tdir, hparams)
    if gpu_check is not None:
        gpu_check(conf, name, tdir.name)
    # the run directory appears complete (with its run.json) or not at all
    staging = record_cls(root / f".{name}.tmp")
    staging.dir.mkdir()
    command = entry_command(conf.get("entrypoint") or "")
    staging.save({
        "kind": record_cls.kind, "name": name, "run_key": f"local-{name}", "template": tdir.name, "config": str(cfg_path.resolve()),
        "cwd": str(tdir), "command": command, "exp_conf": conf,
        "hparams": hparams,
        "max_length": length.value, "max_length_unit": "batches" if length.batches else "epochs",
        "seed": seed, "latest_checkpoint": None, "checkpoints": [], "created": stamp,
    })
    run = record_cls(root / name)
    staging.dir.rename(run.dir)
    return run, tdir, command


def _require(template: Path, hparams: dict[str, Any]) -> None:
    """Refuse a run whose template needs an optional package that is missing, naming its install."""
    missing = templates.missing_requirements(template, hparams)
    if missing:
        raise RunError("; ".join(missing))


def _find_run(root: Path, template: str, name: str | None) -> LocalRunRecord:
    if name:
        if not (root / name / RUN_FILE).is_file():
            raise RunError(f"no local run named {name!r} under {root}")
        return open_record(root / name)
    candidates = sorted((p for p in root.glob(f"{template}-*") if (p / RUN_FILE).is_file()),
                        key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise RunError(f"no earlier local run of {template!r} under {root} to resume")
    return open_record(candidates[-1])


def trial_env(run: LocalRunRecord, cwd: Path, settings: LabSettings) -> dict[str, str]:
    """The environment a local-style run's trial process starts with."""
    # base models from the volume's store, offline (det_lab.models): Slurm jobs start from this too
    env = {**{k: v for k, v in os.environ.items() if k not in SHADOWING}, **run_environment(settings.data_root),
           LOCAL_RUN_ENV: str(run.run_file), "PYTHONUNBUFFERED": "1", "DET_LAB_DATA_ROOT": str(settings.data_root)}
    if settings.source is not None:
        env["DET_LAB_CONFIG"] = str(settings.source)
    commit = describe_commit(cwd)
    if commit:
        env[CODE_COMMIT_ENV] = commit
    return env


def launch(run: LocalRunRecord, cwd: Path, command: list[str], settings: LabSettings,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the trial process (``extra_env`` added to its environment: its GPUs); its output goes
    to the run's ``train.log``."""
    log = open(run.log_file, "ab")
    # its own session (Ctrl-C reaches det-lab run, which stops the trial gracefully), yet never
    # left training on its own: it gets SIGTERM when det-lab run dies, however that dies
    env = {**trial_env(run, cwd, settings), **(extra_env or {}), run_guard.PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=run_guard.die_with_parent(os.getpid()))


def stop_gracefully(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """Ask the trial to checkpoint and stop (SIGTERM, like a cluster preemption), then wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def record_exit(run: LocalRunRecord, code: int) -> str:
    """Store how the trial process ended in ``run.json``: finished, stopped (resumable) or failed.

    Finished only when the trial itself said so (``trial_status`` FINISHED: it trained to the end
    and was not stopped early), whatever unit its length is in. "busy", recording nothing, when
    the trial found another trainer on the run (two ``--resume`` at once)."""
    if code == run_guard.BUSY_EXIT_CODE:  # another trainer holds the run: its record is that trainer's
        return "busy"
    state = run.state()
    status = (RunStatus.FAILED if code != 0 else RunStatus.FINISHED if state.get("trial_status") == "FINISHED"
              else RunStatus.STOPPED).value
    run.record_end(status=status, exit_code=code)
    return status


def busy_error(run: LocalRunRecord) -> str:
    """The one line for a trial that found its run taken by another trainer."""
    name = run.state().get("name", run.dir.name)
    holder = run_guard.trainer(run.dir)
    return str(holder.busy(name)) if holder else f"run {name} is being trained by another process"


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _interrupt(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    raise KeyboardInterrupt


def wait_with_progress(proc: subprocess.Popen, run: LocalRunRecord, show: bool) -> int:
    """Wait for the trial, drawing a progress bar from its metrics. Ctrl-C, SIGTERM and SIGHUP (a
    closed terminal) stop it gracefully: it checkpoints and stops, and its outcome is recorded."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    state = run.state()
    total = state["max_length"] if state.get("max_length_unit") == "batches" else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task(f"training {state['name']}", total=total)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                step, val = run.progress()
                desc = f"training {state['name']}" + "".join(f"  {k}={v:.4g}" for k, v in list(val.items())[:2])
                bar.update(task, completed=step, description=desc)
        except KeyboardInterrupt:
            bar.update(task, description="stopping: checkpointing first (Ctrl-C again to kill)")
            try:
                return stop_gracefully(proc)
            except KeyboardInterrupt:
                proc.kill()
                return proc.wait()
        step, _ = run.progress()
        bar.update(task, completed=step)
    return proc.returncode
