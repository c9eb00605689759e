"""A stand-in for a Determined 0.38.1 agent running one trial container, built from Determined's source.

Two ways in:

- ``run_allocation`` (tests/standin/task_run.py, re-exported here) runs Determined's own launch chain
  for an ``Allocation`` from a master stand-in: ship-logs.sh, ship_logs.py, entrypoint.sh and
  task-setup.sh re-transcribed, the harness wheel pip-installed into PYTHONUSERBASE, then
  ``determined.exec.prep_container`` and ``determined.exec.launch`` against the master. Its module
  docstring says what it reproduces and where it differs.
- ``run_trial`` (below, older): no master. The same merges of the master's defaults and the same kind
  of sandbox, but ``det-lab run --local`` (or ``command``) stands in for ``determined.exec.launch``:
  ``det.get_cluster_info()`` is None there, the context is copied in rather than downloaded, the
  harness is the image's, and the image view is the whole host root less ``/home``, ``/root``,
  ``/mnt``, ``/srv``, ``/media`` (with the lab group as a supplementary group for the volume).

Both use bubblewrap (Debian's ``bubblewrap``) for the container's fresh view of the machine:

- the environment: Determined's ``DET_*`` variables, then the task-container defaults (the master's,
  with the pool's block merged over them as the master merges it), then the experiment's
  ``environment_variables``, then the agent's; nothing from the shell that submitted it;
- the filesystem: the image's files (this machine's, read-only), a fresh ``/tmp``, ``/run`` and
  ``/dev/shm`` of the configured size, the configured ``bind_mounts`` with their read-only flags,
  ``shared_fs`` checkpoint storage at ``/determined_shared_fs``, the context in the working
  directory; the user's home, ``/etc/det-lab`` and everything else on the host hidden;
- the linked user's uid and gid (the sandbox is started as that Unix user);
- ``entrypoint.sh``: ``task-setup.sh``, ``set -e``, the startup hook *sourced*, then the launch.

Where both differ from Docker: the image's root is read-only where Docker's is a fresh writable
layer; ``network_mode: bridge`` is a network namespace with only a loopback (run_allocation relays
the master's address into it); no GPUs, no NVIDIA runtime.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.standin.task_config import (  # noqa: F401  (re-exported for the tests that import them here)
    BLOCK_DEFAULTS, PYTHON_USER_BASE, RUN_DIR, SHARED_FS_CONTAINER_PATH, WORK_DIR, Image, LinkedUser, _env_name,
    _merge_env, env_list, experiment_config, pool_defaults)

#: harness/determined/launch/*: off-cluster there is one process and no launcher (as det_lab.runs.local)
LAUNCHERS = ("determined.launch.torch_distributed", "determined.launch.horovod", "determined.launch.deepspeed")


def task_environment(conf: dict[str, Any], user: LinkedUser, trial_id: int) -> dict[str, str]:
    """The container's environment, in Determined's order (a later entry of a name wins: Docker keeps
    both, and ship-logs.sh, the container's first process, is bash).

    master/pkg/tasks/task.go:194-245 (EnvVars: PYTHONUSERBASE and the DET_* task variables),
    task_trial.go:114-134 (the trial's), task.go:272 (ToDockerSpec appends the experiment's variables),
    agent/internal/containers/spec.go:28-33 (then the agent's global variables).
    """
    task_id = f"{trial_id}.{uuid.uuid4()}"
    entries = [
        f"PYTHONUSERBASE={PYTHON_USER_BASE}", f"DET_TASK_ID={task_id}", f"DET_ALLOCATION_ID={task_id}.1",
        f"DET_RESOURCES_ID={uuid.uuid4()}", f"DET_CONTAINER_ID={uuid.uuid4()}", "DET_SESSION_TOKEN=stand-in",
        "DET_USER_TOKEN=stand-in", f"DET_WORKDIR={WORK_DIR}", f"DET_RUN_DIR={RUN_DIR}", f"DET_USER={user.name}",
        "DET_USE_TLS=false", "DET_SEGMENT_ENABLED=false",
        "DET_EXPERIMENT_ID=1", f"DET_TRIAL_ID={trial_id}", "DET_TRIAL_SEED=0", "DET_STEPS_COMPLETED=0",
        f"DET_HPARAMS={json.dumps(conf.get('hyperparameters') or {})}", "DET_TASK_TYPE=TRIAL", "DET_TRIAL_RUN_ID=1",
    ]
    entries += env_list(conf["environment"]["environment_variables"])
    entries += ["DET_MASTER=http://stand-in-master:8080", "DET_AGENT_ID=stand-in-agent"]
    env: dict[str, str] = {}
    for e in entries:
        name, _, value = e.partition("=")
        env[name] = value
    return env


#: master/static/srv/task-setup.sh:15-60 and entrypoint.sh, line for line; where a step needs a master,
#: the stand-in's replacement is said. $1.. is the trial's command.
ENTRYPOINT = """#!/bin/bash
## master/static/srv/task-setup.sh
export PATH="/run/determined/pythonuserbase/bin:$PATH"
if [ -z "$DET_PYTHON_EXECUTABLE" ]; then
    export DET_PYTHON_EXECUTABLE="python3"
fi
if ! "$DET_PYTHON_EXECUTABLE" --version >/dev/null 2>&1; then
    echo "error: unable to find python3 as '$DET_PYTHON_EXECUTABLE'" >&2
    exit 1
fi
# (the pip install of /opt/determined/wheels: the stand-in's image has determined, as DET_SKIP_PIP_INSTALL)
if ! "$DET_PYTHON_EXECUTABLE" -c "import determined" >/dev/null 2>&1; then
    echo "error: unable run without determined package" >&2
    exit 1
fi
TCD_STARTUP_HOOK="$DET_RUN_DIR/dynamic-tcd-startup-hook.sh"
## master/static/srv/entrypoint.sh
set -e
# (prep_container --download_context_directory: the stand-in extracted the context into the workdir)
STARTUP_HOOK="startup-hook.sh"
set -x
test -f "${TCD_STARTUP_HOOK}" && source "${TCD_STARTUP_HOOK}"
test -f "${STARTUP_HOOK}" && source "${STARTUP_HOOK}"
set +x
echo "stand-in: startup hooks done; shell options $-" >&2
# (rendezvous: one container; determined.exec.launch needs a master: the trial runs off-cluster)
exec "$@"
"""


@dataclass
class TaskResult:
    returncode: int
    stdout: str
    stderr: str
    conf: dict[str, Any]
    env: dict[str, str]


#: top-level directories that are not the image's: made fresh, or left out
_NOT_IMAGE = {"proc", "dev", "sys", "tmp", "run", "home", "root", "mnt", "srv", "media", "lost+found"}


def _image_root() -> list[str]:
    """The image's files read-only, on a fresh root where mount points can be made (as Docker's layer)."""
    args: list[str] = []
    for entry in sorted(os.listdir("/")):
        path = f"/{entry}"
        if entry in _NOT_IMAGE:
            continue
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args + ["--dir", "/home", "--dir", "/mnt", "--dir", "/srv", "--dir", "/root"]


def _sandbox_args(conf: dict[str, Any], image: Image, run_dir: Path, shm_bytes: int, network: str) -> list[str]:
    args = ["bwrap", "--die-with-parent", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts",
            "--unshare-cgroup-try", *_image_root(), "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--tmpfs", "/run",
            "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    if network != "host":  # bridge: the container's own network namespace
        args.append("--unshare-net")
    for hidden in ("/etc/det-lab", "/var/cache/det-lab"):  # the host's, not the image's
        if Path(hidden).is_dir():
            args += ["--tmpfs", hidden]
    for own in image.dirs:  # the image's own files that lie under a directory hidden above
        args += ["--ro-bind", str(own), str(own)]
    args += ["--bind", str(run_dir), RUN_DIR]
    mounts = [(m["host_path"], m["container_path"], bool(m.get("read_only"))) for m in conf["bind_mounts"]]
    storage = conf.get("checkpoint_storage") or {}
    if storage.get("type") == "shared_fs":  # master/pkg/tasks/task_trial.go:152-157
        mounts.append((storage["host_path"], SHARED_FS_CONTAINER_PATH, False))
    # Docker mounts a parent before what lies below it (daemon/volumes.go sortMounts)
    for host, target, ro in sorted(mounts, key=lambda m: Path(m[1]).parts):
        if not os.path.exists(host):  # Docker refuses a missing bind source
            raise FileNotFoundError(f"bind mount source {host} does not exist on this agent")
        args += ["--ro-bind" if ro else "--bind", host, target]
    return args + ["--chdir", WORK_DIR]


def run_trial(master: dict[str, Any], expconf: dict[str, Any], context: Path, *, user: LinkedUser,
              image: Image, pool: str = "default", trial_id: int = 1, timeout: float = 600,
              command: list[str] | None = None) -> TaskResult:
    """Run one trial of ``expconf`` (from the context directory ``context``) as Determined's agent
    would, with ``command`` in place of the launch layer (default: the experiment run off-cluster by
    ``det-lab run --local`` on the context)."""
    conf = experiment_config(master, pool, expconf)
    tcd = conf["_task_container_defaults"]
    shm = int((conf.get("resources") or {}).get("shm_size") or tcd["shm_size_bytes"])  # task_trial.go:141-143
    env = {"PATH": f"{image.bin_dir}:/usr/local/bin:/usr/bin:/bin", **image.env,
           **task_environment(conf, user, trial_id)}
    # the linked user's passwd entry has the working directory as its home (task.go:389-392)
    env.setdefault("HOME", WORK_DIR)
    run_dir = Path(tempfile.mkdtemp(prefix="det-task-"))
    try:
        work = run_dir / "workdir"
        shutil.copytree(context, work, symlinks=True)  # harness/determined/exec/prep_container.py:40
        (run_dir / "pythonuserbase").mkdir()
        info = run_dir / "info"
        info.mkdir()
        saved = {k: v for k, v in conf.items() if not k.startswith("_")}
        (info / "experiment.json").write_text(json.dumps(saved))
        (run_dir / "entrypoint.sh").write_text(ENTRYPOINT)
        for p in [run_dir, *run_dir.rglob("*")]:
            os.lchown(p, user.uid, user.gid)  # the run archives are the task user's (task.go:331-344)
        if command is None:
            command = [f"{image.bin_dir}/det-lab", "run", WORK_DIR, "--local",
                       "--config", f"{RUN_DIR}/info/experiment.json"]
        argv = _sandbox_args(conf, image, run_dir, shm, tcd.get("network_mode", "bridge"))
        argv += ["/bin/bash", f"{RUN_DIR}/entrypoint.sh", *command]
        proc = subprocess.run(argv, env=env, user=user.uid, group=user.gid, extra_groups=user.groups or None,
                              capture_output=True, text=True, timeout=timeout, cwd="/")
        return TaskResult(proc.returncode, proc.stdout, proc.stderr, conf, env)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # AutoRemove (agent/internal/containers/spec.go:35)


def off_cluster_entrypoint(entrypoint: str | list[str]) -> str:
    """The experiment's entrypoint without Determined's launcher layer (which needs a master)."""
    argv = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in LAUNCHERS:
        argv = argv[3:]
    return shlex.join(argv)


from tests.standin.task_run import DETERMINED_VERSION, run_allocation  # noqa: E402,F401  (the new entry point)
