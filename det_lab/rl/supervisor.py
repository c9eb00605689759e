"""A Core API supervisor for RL training commands that write rsl_rl's log layout.

The training command (Isaac Lab's ``train.py``, the CPU stand-in, anything that writes
``logs/rsl_rl/<experiment>/<timestamp>/``) runs as a child process in its own process group with
its cwd in a work directory on the volume. While it runs, the supervisor:

- streams its scalars to Determined and det_lab's mirror as they appear (from det_lab's
  LogWriter JSONL or from TensorBoard events), one report per iteration (``/time`` axes are
  skipped: their step is seconds, not iterations);
- registers each complete ``model_<iter>.pt`` as a Determined checkpoint (``steps_completed`` =
  iteration + 1: rsl_rl counts iterations from 0, and reports each at that count; the run's ``params/`` alongside, lineage added by det_lab), with validation metrics
  ``mean_reward`` / ``mean_episode_length`` from that iteration;
- on preemption creates the stop file (``$DET_LAB_RL_STOP_FILE``; children that honour it exit
  right after their next save), waits for that save, then signals the child's group;
- on restart restores the latest checkpoint into ``logs/rsl_rl/<experiment>/det-lab-restore-*/``
  and asks the command builder for a resume command;
- when the child fails, registers what it saved completely and raises :class:`ChildFailed` with
  the child's last log lines.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.rl import log_parsers
from det_lab.rl.tfevents import Scalar

STOP_FILE_ENV = "DET_LAB_RL_STOP_FILE"
CHECKPOINT_INFO = "rsl_rl.json"
VALIDATION_TAGS = {"Train/mean_reward": "mean_reward", "Train/mean_episode_length": "mean_episode_length"}


#: a tag on the tracker run: what its step axis counts
STEP_TAG = "det_lab.step"
STEP_MEANING = "iterations completed: rsl_rl iteration i is step i + 1 (TensorBoard shows it at i)"


class ChildFailed(RuntimeError):
    """The training command exited with an error; the message ends with its last log lines."""


@dataclass
class Restore:
    """A checkpoint restored into the log tree, for the command builder's resume flags."""

    run_dir: Path       # logs/rsl_rl/<experiment>/det-lab-restore-<uuid8>
    model: Path         # run_dir / model_<iter>.pt
    iteration: int
    experiment: str
    checkpoint_uuid: str


@dataclass
class ChildCommand:
    """What to run, and how to read its output."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)   # added to the supervisor's environment
    metrics: str = "tfevents"                            # "jsonl" (det_lab LogWriter) or "tfevents"
    description: str = ""


@dataclass
class Outcome:
    """What a supervised run did."""

    returncode: int
    preempted: bool
    checkpoints: list[tuple[int, str]]
    reported_steps: int
    run_dir: Path | None


def _pdeathsig() -> None:  # the child dies with the supervisor (Linux), even on SIGKILL
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RlSupervisor:
    """Runs one training command under a det_lab Core API context (see the module docstring)."""

    def __init__(self, ctx: Any, work_dir: Path, build: Callable[[Restore | None, int], ChildCommand], *,
                 total_iterations: int, poll_s: float = 0.5, settle_s: float = 1.0, tail_lines: int = 30,
                 preempt_timeout_s: float = 90.0, stop_grace_s: float = 20.0) -> None:
        self.ctx, self.work_dir, self.build = ctx, Path(work_dir), build
        self.total = int(total_iterations)
        self.poll_s, self.settle_s, self.preempt_timeout_s, self.stop_grace_s = poll_s, settle_s, preempt_timeout_s, stop_grace_s
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.logs_root = self.work_dir / "logs" / "rsl_rl"
        self.floor = -1                       # iterations <= floor were reported before a restart
        self.pending: dict[int, dict[str, float]] = {}
        self.last: dict[int, dict[str, float]] = {}
        self.registered: dict[int, str] = {}
        self.saved_events: set[int] = set()
        self.reported = 0

    # --- restore ---------------------------------------------------------------------------------

    def restore(self) -> Restore | None:
        """Copy the trial's latest checkpoint into the log tree (None on a fresh start)."""
        uuid = self.ctx.latest_checkpoint
        if not uuid:
            return None
        with self.ctx.checkpoint.restore_path(uuid) as path:
            path = Path(path)
            found = log_parsers.latest_model(path)
            if found is None:
                raise RuntimeError(f"checkpoint {uuid} has no model_<iter>.pt to resume from")
            it, model = found
            info = json.loads((path / CHECKPOINT_INFO).read_text()) if (path / CHECKPOINT_INFO).exists() else {}
            experiment = info.get("experiment") or "default"
            dest = self.logs_root / experiment / f"det-lab-restore-{uuid[:8]}"
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(model, dest / model.name)
            if (path / "params").is_dir():
                shutil.copytree(path / "params", dest / "params", dirs_exist_ok=True)
        self.floor = it
        print(f"[det_lab.rl] resuming from checkpoint {uuid} (iteration {it}) restored into {dest}", flush=True)
        return Restore(dest, dest / model.name, it, experiment, uuid)

    # --- metrics and checkpoints -----------------------------------------------------------------

    def _take(self, points: list[Scalar]) -> None:
        for p in points:
            if p.tag.endswith("/time") or p.step <= self.floor:
                continue
            self.pending.setdefault(p.step + 1, {})[p.tag] = p.value  # iteration i: i + 1 done

    def _report_upto(self, step: int | None) -> None:
        """Report pending iterations < ``step`` (all with None): an iteration is whole once a later one starts."""
        for s in sorted(self.pending):
            if step is not None and s >= step:
                break
            metrics = self.pending.pop(s)
            self.ctx.train.report_training_metrics(s, metrics)
            self.last[s] = metrics
            self.reported += 1

    def _register(self, run_dir: Path, it: int, model: Path) -> None:
        self._report_upto(it + 2)
        meta = {"steps_completed": it + 1, "rsl_rl": {"iteration": it, "experiment": run_dir.parent.name,
                                                   "run": run_dir.name, "model": model.name}}
        with self.ctx.checkpoint.store_path(meta) as (path, uuid):
            path = Path(path)
            shutil.copy2(model, path / model.name)  # a copy, not a hard link: torch.save rewrites files in place
            if (run_dir / "params").is_dir():
                shutil.copytree(run_dir / "params", path / "params", dirs_exist_ok=True)
            (path / CHECKPOINT_INFO).write_text(json.dumps(meta["rsl_rl"], indent=2) + "\n")
        self.registered[it] = uuid
        print(f"[det_lab.rl] registered {model.name} as checkpoint {uuid} (step {it})", flush=True)
        val = {name: self.last.get(it + 1, {}).get(tag) for tag, name in VALIDATION_TAGS.items()}
        val = {k: v for k, v in val.items() if v is not None}
        if val:
            self.ctx.train.report_validation_metrics(it + 1, val)

    def _scan_models(self, run_dir: Path, child_done: bool) -> int:
        """Register complete, new models; returns how many."""
        count = 0
        now = time.time()
        for it, model in log_parsers.models(run_dir):
            if it in self.registered or it <= self.floor:
                continue
            try:
                age = now - model.stat().st_mtime
            except FileNotFoundError:
                continue
            announced = it in self.saved_events
            if not log_parsers.model_complete(model) or not (announced or child_done or age >= self.settle_s):
                break  # keep iteration order: a later model waits for this one
            self._register(run_dir, it, model)
            count += 1
        return count

    # --- the child -------------------------------------------------------------------------------

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            self.tail.append(line.rstrip("\n"))

    def _signal(self, proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGINT the group (rsl_rl/Kit shut down on KeyboardInterrupt), then SIGTERM, then SIGKILL."""
        for sig, wait in ((signal.SIGINT, self.stop_grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                return
            self._signal(proc, sig)
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def run(self) -> Outcome:
        """Run the command to completion, preemption or failure; raises :class:`ChildFailed` on failure."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard shows iteration i at step i; the tracker, like Determined, at i + 1 done
        self.ctx.mirror.set_tags({STEP_TAG: STEP_MEANING})
        restore = self.restore()
        start = restore.iteration if restore else -1
        remaining = self.total - (start + 1)
        if remaining <= 0:
            print(f"[det_lab.rl] nothing left to train: iteration {start} of {self.total} reached", flush=True)
            return Outcome(0, False, [], 0, None)
        cmd = self.build(restore, remaining)
        stop_file = self.work_dir / ".det_lab_stop"
        stop_file.unlink(missing_ok=True)
        before = set(log_parsers.run_dirs(self.logs_root))
        env = {**os.environ, **cmd.env, STOP_FILE_ENV: str(stop_file), "PYTHONUNBUFFERED": "1"}
        print(f"[det_lab.rl] {cmd.description or 'training command'}: {' '.join(cmd.argv)}\n"
              f"[det_lab.rl] cwd {self.work_dir}; metrics from {cmd.metrics}", flush=True)
        proc = subprocess.Popen(cmd.argv, cwd=self.work_dir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_pdeathsig)
        pump = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        pump.start()
        run_dir: Path | None = None
        source = None
        preempt_at: float | None = None
        saves_at_preempt = 0
        stopped_by_us = False
        try:
            while True:
                done = proc.poll() is not None
                if done:
                    pump.join(timeout=10)
                if run_dir is None:
                    new = [d for d in log_parsers.run_dirs(self.logs_root) if d not in before]
                    if new:
                        run_dir = new[-1]
                        source = log_parsers.metric_source(run_dir, cmd.metrics)
                        print(f"[det_lab.rl] run directory {run_dir}", flush=True)
                if run_dir is not None and source is not None:
                    points, saved = source.poll()
                    self.saved_events.update(saved)
                    self._take(points)
                    self._report_upto(None if done else max(self.pending, default=-1))
                    self._scan_models(run_dir, done)
                if done:
                    self._report_upto(None)
                    break
                if preempt_at is None and self.ctx.preempt.should_preempt():
                    preempt_at, saves_at_preempt = time.monotonic(), len(self.registered)
                    stop_file.touch()
                    print("[det_lab.rl] preemption: stopping the child after its next save", flush=True)
                elif preempt_at is not None and not stopped_by_us:
                    saved_since = len(self.registered) > saves_at_preempt
                    waited = time.monotonic() - preempt_at
                    if saved_since or waited > self.preempt_timeout_s:
                        if not saved_since:
                            print(f"[det_lab.rl] no save within {self.preempt_timeout_s:.0f} s of preemption: stopping anyway",
                                  flush=True)
                        try:  # children that honour the stop file are already exiting
                            proc.wait(timeout=self.stop_grace_s)
                        except subprocess.TimeoutExpired:
                            stopped_by_us = True
                            self._stop(proc)
                time.sleep(self.poll_s)
        finally:
            if proc.poll() is None:
                self._stop(proc)
        rc = proc.returncode
        problems = getattr(source, "problems", []) if source is not None else []
        for p in problems[:5]:
            print(f"[det_lab.rl] warning: {p}", flush=True)
        outcome = Outcome(rc, preempt_at is not None, sorted(self.registered.items()), self.reported, run_dir)
        if rc != 0 and not stopped_by_us:
            latest = max(self.registered, default=None)
            kept = f"latest checkpoint: iteration {latest}" if latest is not None else "no new checkpoint"
            raise ChildFailed(f"training command exited with {rc} ({kept}); its last log lines:\n" + "\n".join(self.tail))
        return outcome


def supervise(make_build: Callable[[Any], Callable[[Restore | None, int], ChildCommand]], **kwargs: Any) -> Outcome:
    """Open det_lab's Core API context and run a command under :class:`RlSupervisor`.

    ``make_build(ctx)`` returns ``build(restore, remaining)``: the command that trains
    ``remaining`` more iterations, resuming from ``restore`` when it is not None.
    """
    import det_lab.core

    with det_lab.core.init() as ctx:
        sup = RlSupervisor(ctx, ctx.work_dir, make_build(ctx), total_iterations=ctx.training_length.value, **kwargs)
        return sup.run()
