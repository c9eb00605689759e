"""The master stand-in's records (users, experiments, trials, allocations, checkpoints, metrics, task
logs, templates) and the lifecycle rules Determined 0.38.1's master applies to them.

One lock guards everything (``State.lock``); ``State.changed`` is notified on every change, for the
long polls (preemption, log follow) and the agent's wait for work. The experiment, trial and
allocation rules follow master/internal/experiment.go, trial.go and task/allocation.go; each method
names its lines. Records are plain dataclasses; JSON views are in master_views.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

#: master/pkg/model/experiment.go:150-160 StoppingToTerminalStates
STOPPING_TO_TERMINAL = {"STOPPING_COMPLETED": "COMPLETED", "STOPPING_CANCELED": "CANCELED",
                        "STOPPING_KILLED": "CANCELED", "STOPPING_ERROR": "ERROR"}
TERMINAL = {"COMPLETED", "CANCELED", "ERROR", "DELETED"}
#: model/experiment.go:185-215 TrialTransitions among stopping states: only to a more severe one
_SEVERITY = ["STOPPING_COMPLETED", "STOPPING_CANCELED", "STOPPING_KILLED", "STOPPING_ERROR"]
#: master/internal/task/allocation.go:44-48 and trial.go:769-773: what a stopping trial does to its allocation
_STOP_SIGNALS = {"STOPPING_CANCELED": "terminate", "STOPPING_KILLED": "kill", "STOPPING_ERROR": "kill"}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class User:
    id: int
    username: str
    password: str = ""
    admin: bool = False
    active: bool = True
    display_name: str = ""
    agent_user_group: dict[str, Any] | None = None  # model.AgentUserGroup: agentUid, agentGid, agentUser, agentGroup
    modified_at: str = field(default_factory=now_iso)


@dataclass
class Alloc:
    """One allocation (task/allocation.go): PENDING until the agent takes it, then RUNNING, then TERMINATED."""

    id: str
    trial: Trial  # None for a command's or notebook's (then ``command``: tests/standin/master_ntsc.py)
    resources_id: str
    container_id: str
    slots: int
    state: str = "PENDING"
    ready: bool = False  # allocation.go:362-394: set by AllocationReady or a completed rendezvous
    preempted: bool = False
    acked: bool = False
    killed: bool = False
    kill: threading.Event = field(default_factory=threading.Event)
    start_time: str | None = None
    end_time: str | None = None
    slot_ids: list[int] = field(default_factory=list)
    proxy_address: str | None = None
    accelerator: dict[str, Any] | None = None
    latest_checkpoint: str | None = None
    steps_completed: int = 0
    command: Any = None
    #: the containers of an allocation fitted over several agents (tests/standin/agents.py Resources),
    #: each with its rank; empty for one container of the one-agent stand-in (tests/standin/agent.py)
    resources: list[Any] = field(default_factory=list)


@dataclass
class Trial:
    id: int
    experiment: Experiment
    request_id: str
    hparams: dict[str, Any]
    seed: int
    task_id: str
    state: str
    start_time: str = field(default_factory=now_iso)
    end_time: str | None = None
    restarts: int = 0
    run_id: int = 0
    alloc: Alloc | None = None
    stopped_by_searcher: bool = False  # TrialSearcherState.EarlyStoppedBySearcher
    last_validation: dict[str, Any] | None = None  # the validation metrics the searcher last saw
    stopped_after: dict[str, Any] | None = None  # the validation after which the searcher stopped it
    exited_early: bool = False  # TrialSearcherState.EarlyExitedByUserCode
    user_exit_reason: str | None = None  # trial.userInitiatedExit
    progress: float = 0.0
    runner_state: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    allocation_ids: list[str] = field(default_factory=list)


@dataclass
class Experiment:
    id: int
    config: dict[str, Any]
    original_config: str
    model_def: bytes
    owner: User
    state: str
    searcher: Any
    parent_id: int | None = None
    start_time: str = field(default_factory=now_iso)
    end_time: str | None = None
    trials: dict[str, Trial] = field(default_factory=dict)  # live trials by request id (experiment.go e.trials)
    progress: float = 0.0
    job_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    archived: bool = False
    notes: str = ""
    continue_trials: bool = False  # experiment.go:69: set by ContinueExperiment (api_experiment.go:1553)
    warm_start: str | None = None  # experiment.go:138-143: searcher.source_trial_id's latest checkpoint


@dataclass
class Checkpoint:
    uuid: str
    task_id: str
    allocation_id: str | None
    report_time: str
    resources: dict[str, str]
    metadata: dict[str, Any]
    state: str = "STATE_COMPLETED"
    storage_id: int | None = None
    trial_id: int | None = None


@dataclass
class Metrics:
    id: int
    trial_id: int
    trial_run_id: int
    group: str
    total_batches: int
    metrics: dict[str, Any]  # {"avg_metrics": ..., "batch_metrics": ...} as ReportTrialMetrics sends them
    end_time: str
    archived: bool = False


class State:
    """The master's records and rules. ``searcher_factory(config, seed)`` makes a searcher."""

    def __init__(self, master_config: dict[str, Any], searcher_factory: Callable[[dict[str, Any], int], Any],
                 *, stop_preempts: bool = False) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.master_config = master_config
        self.searcher_factory = searcher_factory
        self.stop_preempts = stop_preempts
        self.users: dict[int, User] = {}
        self.sessions: dict[str, User] = {}
        self.experiments: dict[int, Experiment] = {}
        self.trials: dict[int, Trial] = {}
        self.allocs: dict[str, Alloc] = {}
        self.task_trials: dict[str, Trial] = {}
        self.checkpoints: dict[str, Checkpoint] = {}
        self.metrics: list[Metrics] = []
        self.logs: dict[str, list[dict[str, Any]]] = {}
        self.templates: dict[str, dict[str, Any]] = {}
        self.commands: dict[str, Any] = {}  # task id -> master_ntsc.Command
        self.pending: list[Alloc] = []
        self.agent_slots: dict[str, int] = {}  # the connected agents' slots (agentrm agentService.list)
        self._ids: dict[str, int] = {}
        self.timers: list[threading.Timer] = []

    def next_id(self, kind: str) -> int:
        self._ids[kind] = self._ids.get(kind, 0) + 1
        return self._ids[kind]

    def notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # --- users ------------------------------------------------------------------------------------

    def add_user(self, username: str, password: str = "", admin: bool = False, **kw: Any) -> User:
        with self.lock:
            user = User(self.next_id("user"), username, password, admin, **kw)
            self.users[user.id] = user
            return user

    def user_by_name(self, username: str) -> User | None:
        return next((u for u in self.users.values() if u.username == username), None)

    def login(self, user: User) -> str:
        token = uuid.uuid4().hex
        self.sessions[token] = user
        return token

    # --- experiments: master/internal/experiment.go ----------------------------------------------

    def create_experiment(self, config: dict[str, Any], text: str, model_def: bytes, owner: User,
                          parent_id: int | None, activate: bool) -> Experiment:
        """api_experiment.go:1672-1690 newExperiment + Start + ActivateExperiment: the experiment starts
        PAUSED, the searcher's first trials are created (experiment.go:242-313), then it is activated."""
        with self.lock:
            seed = int((config.get("reproducibility") or {}).get("experiment_seed") or 0)
            searcher = self.searcher_factory(config, seed)
            warm = self.warm_start(config.get("searcher") or {})
            exp = Experiment(self.next_id("experiment"), config, text, model_def, owner, "PAUSED", searcher, parent_id)
            exp.warm_start = warm
            self.experiments[exp.id] = exp
            self.handle_actions(exp, exp.searcher.start())
            if activate:
                self.update_experiment_state(exp, "ACTIVE")
            self.notify()
            return exp

    def warm_start(self, searcher: dict[str, Any]) -> str | None:
        """experiment.go:840-869 checkpointFromTrialIDOrUUID: the source trial's latest checkpoint (the
        Web UI's Continue Trial in New Experiment) or the named one; ValueError when there is none."""
        if searcher.get("source_trial_id") is not None:
            trial = self.trials.get(int(searcher["source_trial_id"]))
            latest = self.latest_checkpoint(trial) if trial else None
            if latest is None:
                raise ValueError(f"no checkpoint found for source trial {searcher['source_trial_id']}")
            return latest.uuid
        if searcher.get("source_checkpoint_uuid") is not None:
            if searcher["source_checkpoint_uuid"] not in self.checkpoints:
                raise ValueError(f"no checkpoint found with UUID {searcher['source_checkpoint_uuid']}")
            return str(searcher["source_checkpoint_uuid"])
        return None

    def transition_ok(self, exp: Experiment, state: str) -> bool | None:
        """model.ExperimentTransitions: None when refused, False when already there, True when moved."""
        if exp.state == state:
            return False
        if exp.state in TERMINAL:
            return None
        if exp.state in STOPPING_TO_TERMINAL and state in ("ACTIVE", "PAUSED"):
            return None
        if exp.state in STOPPING_TO_TERMINAL and state in STOPPING_TO_TERMINAL and \
                _SEVERITY.index(state) < _SEVERITY.index(exp.state):
            return None
        return True

    def update_experiment_state(self, exp: Experiment, state: str) -> bool:
        """experiment.go:771-799 updateState: move, patch every trial to the same state, stop when done."""
        moved = self.transition_ok(exp, state)
        if moved is None:
            return False
        if not moved:
            return True
        exp.state = state
        for trial in list(exp.trials.values()):
            self.patch_trial_state(trial, state)
        self.maybe_stop(exp)
        self.notify()
        return True

    def maybe_stop(self, exp: Experiment) -> None:
        """experiment.go:816-818 canTerminate, :405-437 stop: a stopping experiment without live trials ends."""
        if exp.state in STOPPING_TO_TERMINAL and not exp.trials:
            if exp.state == "STOPPING_COMPLETED":
                exp.progress = 1.0
            exp.state = STOPPING_TO_TERMINAL[exp.state]
            exp.end_time = now_iso()

    def handle_actions(self, exp: Experiment, actions: list[Any]) -> None:
        """experiment.go:615-720 handleSearcherActions."""
        if exp.state in STOPPING_TO_TERMINAL and any(type(a).__name__ != "Shutdown" for a in actions):
            return
        stopped = []
        for action in actions:
            kind = type(action).__name__
            if kind == "Create":
                if action.request_id in exp.trials:
                    continue
                trial = self._continued_trial(exp, action) if exp.continue_trials else None
                if trial is False:
                    continue
                if trial is None:
                    trial = Trial(self.next_id("trial"), exp, action.request_id, dict(action.hparams),
                                  int(action.trial_seed), f"{exp.id}.{action.request_id}", exp.state)
                self.trials[trial.id] = trial
                self.task_trials[trial.task_id] = trial
                exp.trials[trial.request_id] = trial
                self.handle_actions(exp, exp.searcher.on_trial_created(trial.request_id))  # :598-606
                self.maybe_allocate(trial)
            elif kind == "Stop":
                if action.request_id in exp.trials:
                    stopping = exp.trials[action.request_id]
                    if not stopping.stopped_by_searcher:  # the first stop (a 0.38.1 trial trains on after it)
                        stopping.stopped_after = stopping.last_validation
                    stopping.stopped_by_searcher = True
                    stopped.append(exp.trials[action.request_id])
            elif kind == "Shutdown":
                target = "STOPPING_ERROR" if getattr(action, "failure", False) else (
                    "STOPPING_CANCELED" if getattr(action, "cancel", False) else "STOPPING_COMPLETED")
                self.update_experiment_state(exp, target)
        for trial in stopped:  # trial.go:227-248 PatchSearcherState
            self.patch_trial_state(trial, "STOPPING_COMPLETED")

    def _continued_trial(self, exp: Experiment, action: Any) -> Trial | bool | None:
        """experiment.go:724-745 handleContinueExperiment: a trial of a continued experiment with the
        Create's request id goes on under its own id (trial.go:340-367 continueSetup: run id and
        restarts kept, a new task id ``<task>-<n>``); a COMPLETED one exits at once (False); None: none."""
        old = next((t for t in self.trials.values() if t.experiment is exp and t.request_id == action.request_id), None)
        if old is None:
            return None
        if old.state == "COMPLETED":
            self.handle_actions(exp, exp.searcher.on_trial_exited(action.request_id, early=False, reason=None))
            self.maybe_stop(exp)
            return False
        n = sum(1 for t in self.task_trials.values() if t is old)  # db.TrialTaskIDsByTrialID
        old.task_id, old.state = f"{exp.id}.{action.request_id}-{n}", exp.state
        old.hparams, old.seed = dict(action.hparams), int(action.trial_seed)  # t.searcher.Create
        old.stopped_by_searcher = old.exited_early = False
        old.user_exit_reason = old.stopped_after = None
        return old

    def trial_exited(self, trial: Trial, reason: str | None) -> None:
        """experiment.go:555-568 trialExited: the searcher hears of it (with trial.go:193-197 exit's reason:
        ERRORED, USER_CANCELED or none), and a stopping experiment may end."""
        exp = trial.experiment
        exp.trials.pop(trial.request_id, None)
        self.handle_actions(exp, exp.searcher.on_trial_exited(trial.request_id, early=reason is not None,
                                                              reason=reason))
        self.maybe_stop(exp)

    def report_validation(self, trial: Trial, metrics: dict[str, Any]) -> None:
        """experiment.go:331-337 TrialReportValidation (from api_trials.go:1456-1470)."""
        exp = trial.experiment
        trial.last_validation = dict(metrics)
        if trial.request_id in exp.trials:
            self.handle_actions(exp, exp.searcher.on_validation(trial.request_id, metrics))

    def report_progress(self, trial: Trial, progress: float) -> None:
        """experiment.go:318-329: the searcher's view of the trial, and the experiment's progress from it."""
        trial.progress = progress
        searcher = trial.experiment.searcher
        if hasattr(searcher, "set_trial_progress"):
            searcher.set_trial_progress(trial.request_id, progress)
        trial.experiment.progress = float(searcher.progress())

    # --- trials: master/internal/trial.go ---------------------------------------------------------

    def maybe_allocate(self, trial: Trial) -> None:
        """trial.go:371-512 maybeAllocateTask: an ACTIVE trial without an allocation, not stopped by the
        searcher or its own code, gets a new one (run id + 1); it resumes from the trial's latest
        checkpoint (:524-555 buildTaskSpecifier)."""
        if trial.alloc is not None or trial.stopped_by_searcher or trial.exited_early or trial.state != "ACTIVE":
            return
        trial.run_id += 1
        slots = int((trial.experiment.config.get("resources") or {}).get("slots_per_trial") or 1)
        container = str(uuid.uuid4())
        alloc = Alloc(f"{trial.task_id}.{trial.run_id}", trial, container, container, slots)
        latest = self.latest_checkpoint(trial)
        if latest is not None:
            alloc.latest_checkpoint = latest.uuid
            alloc.steps_completed = int(latest.metadata.get("steps_completed") or 0)
        else:  # trial.go:530-537: the warm start checkpoint, with 0 steps completed
            alloc.latest_checkpoint = trial.experiment.warm_start
        trial.alloc = alloc
        trial.allocation_ids.append(alloc.id)
        self.allocs[alloc.id] = alloc
        self.pending.append(alloc)
        self.notify()

    def latest_checkpoint(self, trial: Trial) -> Checkpoint | None:
        """db.LatestCheckpointForTrial: the trial's last completed checkpoint."""
        own = [c for c in self.checkpoints.values() if c.trial_id == trial.id and c.state == "STATE_COMPLETED"]
        return own[-1] if own else None

    def patch_trial_state(self, trial: Trial, state: str) -> None:
        """trial.go:711-731 patchState."""
        if trial.state in TERMINAL or state in TERMINAL:
            return
        if trial.state in STOPPING_TO_TERMINAL and trial.state != state and (
                state not in STOPPING_TO_TERMINAL or _SEVERITY.index(state) < _SEVERITY.index(trial.state)):
            return
        self.transition_trial(trial, state)

    def transition_trial(self, trial: Trial, state: str) -> None:
        """trial.go:733-794 transition: rectify the allocation with the trial's new state."""
        trial.state = state
        if state == "ACTIVE":
            self.maybe_allocate(trial)
        elif state == "PAUSED":
            if trial.alloc is not None:
                self.signal(trial.alloc, "terminate")
        elif state in STOPPING_TO_TERMINAL:
            if trial.alloc is None:
                self.transition_trial(trial, STOPPING_TO_TERMINAL[state])
                return
            action = _STOP_SIGNALS.get(state)
            if action is None and self.stop_preempts:  # the reverted c70dd8c1ad behaviour, on request
                action = "terminate"
            if action is not None:
                self.signal(trial.alloc, action)
        elif state in TERMINAL:
            trial.end_time = now_iso()
            # trial.go:780-789: exit(Errored) from ERROR, exit(UserCanceled) from CANCELED, else exit(nil)
            self.trial_exited(trial, {"ERROR": "ERRORED", "CANCELED": "USER_CANCELED"}.get(state))
        self.notify()

    # --- allocations: master/internal/task/allocation.go ------------------------------------------

    def signal(self, alloc: Alloc, action: str) -> None:
        """allocation.go:300-330 Signal, :918-990 tryExitOrTerminate/preempt/kill."""
        if alloc.state == "PENDING":  # tryExit: not started, so it exits at once (aborted, no error)
            if alloc in self.pending:
                self.pending.remove(alloc)
            self.allocation_exited(alloc, None)
        elif action == "terminate" and alloc.ready:
            if not alloc.preempted:
                alloc.preempted = True
                timeout = (alloc.trial.experiment.config.get("preemption_timeout") if alloc.trial else None) or 3600
                timer = threading.Timer(float(timeout), self._preemption_timeout, (alloc,))
                timer.daemon = True
                self.timers.append(timer)
                timer.start()
        elif alloc.state != "TERMINATED":
            alloc.killed = True
            alloc.kill.set()
        self.notify()

    def _preemption_timeout(self, alloc: Alloc) -> None:
        with self.lock:
            if alloc.state != "TERMINATED":
                self.signal(alloc, "kill")

    def allocation_exited(self, alloc: Alloc, exit_code: int | None) -> None:
        """allocation.go:1145-1190 calculateExitStatus, then trial.go:569-709 handleAllocationExit."""
        if alloc.state == "TERMINATED":
            return
        started = alloc.state != "PENDING"
        alloc.state, alloc.end_time = "TERMINATED", now_iso()
        if alloc.command is not None:  # a command's or notebook's: it ends with its one allocation
            alloc.command.exited(exit_code if started else None)
            self.notify()
            return
        trial = alloc.trial
        trial.alloc = None
        error = started and not alloc.killed and not alloc.acked and exit_code not in (0, None)
        user_stop = started and not alloc.killed and not alloc.acked and exit_code == 0
        if trial.state in STOPPING_TO_TERMINAL:
            self.transition_trial(trial, "ERROR" if error else STOPPING_TO_TERMINAL[trial.state])
        elif trial.stopped_by_searcher:
            self.transition_trial(trial, "ERROR" if error else "COMPLETED")
        elif error:
            trial.restarts += 1
            if trial.restarts > int(trial.experiment.config.get("max_restarts") or 0):
                self.transition_trial(trial, "ERROR")
            else:
                self.maybe_allocate(trial)
        elif user_stop or trial.user_exit_reason is not None:
            self.transition_trial(trial, "COMPLETED")
        else:
            self.maybe_allocate(trial)
        self.notify()

    def wait_preemption(self, alloc: Alloc, timeout: float) -> bool:
        """task/allocation_service.go:283-307 WatchPreemption: true once preempted, else false at the timeout."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not alloc.preempted and alloc.state != "TERMINATED":
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            return alloc.preempted

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
