"""What the master stand-in hands the agent stand-in for one trial's (or command's) task: the fields a Determined
0.38.1 master puts into a trial container (master/pkg/tasks/task.go:194-245 EnvVars,
master/pkg/tasks/task_trial.go:101-140), and what the agent reports back when the task ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Allocation:
    """One allocation of one trial: the agent starts one container per slot group (one here)."""

    master_url: str  # where the master listens on this machine (the task gets the agent's address for it)
    experiment_id: int
    trial_id: int
    trial_run_id: int  # DET_TRIAL_RUN_ID: 1, then one more on every restart/resume
    trial_seed: int
    request_id: str  # the searcher's id of the trial (model.RequestID)
    task_id: str
    allocation_id: str  # "<task_id>.<n>"
    resources_id: str
    container_id: str
    hparams: dict[str, Any]  # DET_HPARAMS: this trial's sampled values
    config: dict[str, Any]  # DET_EXPERIMENT_CONFIG: the merged config with Determined's defaults filled in
    det_user: str  # DET_USER: the Determined username
    session_token: str  # DET_SESSION_TOKEN (and DET_USER_TOKEN)
    slot_ids: list[int]  # DET_SLOT_IDS
    slot_type: str  # "cpu" or "cuda": which environment_variables list applies (task.go:268-272)
    latest_checkpoint: str | None = None  # DET_LATEST_CHECKPOINT on a resume (task_trial.go:124-126)
    steps_completed: int = 0  # DET_STEPS_COMPLETED
    task_container_defaults: dict[str, Any] = field(default_factory=dict)  # the pool's, merged over the master's
    #: a command's or notebook's (task_command.go:63-127 ToTaskSpec): its type, the ExtraEnvVars of its
    #: launch (api_command.go, api_notebook.go), the container's command after the log shipper, its work dir
    task_type: str = "TRIAL"
    extra_env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    work_dir: str | None = None
    #: one of several containers of a multi-agent allocation: Docker's host networking (master/pkg/tasks/
    #: task.go:274-277 UseHostMode, set from resources.go:57 IsMultiAgent = allocation.go:712 len(resources) > 1)
    use_host_mode: bool = False


@dataclass
class TaskExit:
    """What the agent tells the master when a trial's container exits."""

    allocation_id: str
    exit_code: int
    stdout: str = ""
    stderr: str = ""
