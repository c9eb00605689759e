"""The agent stand-in: takes the master stand-in's pending allocations in order, as slots free up, and
runs each with a task runner, then reports the exit back (Determined 0.38.1's agent resource manager
and agent: master/internal/rm/agentrm, agent/internal).

The runner is any callable ``runner(alloc: Allocation, *, kill: threading.Event) -> TaskExit``:
``run_allocation`` of tests/task_standin.py (Determined's whole container chain in bubblewrap, bound
with ``functools.partial``), or ``HostRunner`` below (Determined's ship_logs.py, prep_container and
launch on this machine's Python in a light sandbox that only gives the task its /run/determined and
/determined_shared_fs).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from tests.standin import task_scripts
from tests.standin.master import Master
from tests.standin.master_state import Alloc, now_iso
from tests.standin.master_task_api import task_spec
from tests.standin.model import Allocation, TaskExit
from tests.standin.task_config import RUN_DIR, SHARED_FS_CONTAINER_PATH, WORK_DIR, LinkedUser
from tests.standin.task_env import agent_env, master_env

Runner = Callable[..., TaskExit]


class Agent:
    """One agent with ``slots`` CPU slots, serving ``master`` until ``close()``."""

    def __init__(self, master: Master, runner: Runner, *, slots: int = 1, agent_id: str = "det-lab-standin-agent") -> None:
        self.master, self.runner, self.agent_id = master, runner, agent_id
        self.free = list(range(slots))
        master.state.agent_slots[agent_id] = slots  # connected: the master counts its slots from now on
        self.exits: list[TaskExit] = []
        self.running: dict[str, tuple[Alloc, threading.Thread]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="det-standin-agent", daemon=True)
        self._thread.start()

    def _take(self) -> tuple[Alloc, list[int]] | None:
        """The oldest pending allocation that fits the free slots (the agent RM's FIFO within a pool)."""
        state = self.master.state
        with state.changed:
            alloc = next((a for a in state.pending if a.slots <= len(self.free)), None)
            if alloc is None:
                state.changed.wait(0.5)
                return None
            state.pending.remove(alloc)
            slot_ids = [self.free.pop(0) for _ in range(alloc.slots)]
            alloc.state, alloc.start_time, alloc.slot_ids = "RUNNING", now_iso(), slot_ids
            return alloc, slot_ids

    def _loop(self) -> None:
        while not self._stop.is_set():
            taken = self._take()
            if taken is None or self._stop.is_set():
                continue
            alloc, slot_ids = taken
            spec = task_spec(self.master, alloc, slot_ids)
            thread = threading.Thread(target=self._run, args=(alloc, spec), name=f"task-{alloc.id}", daemon=True)
            self.running[alloc.id] = (alloc, thread)
            thread.start()

    def _run(self, alloc: Alloc, spec: Allocation) -> None:
        try:
            result = self.runner(spec, kill=alloc.kill)
        except Exception:  # the container could not be started: a failed task, as a Docker error is
            result = TaskExit(alloc.id, 1, "", traceback.format_exc())
        state = self.master.state
        with state.lock:
            self.exits.append(result)
            self.free.extend(alloc.slot_ids)
            self.free.sort()
            self.running.pop(alloc.id, None)
            state.allocation_exited(alloc, result.exit_code)

    def close(self, timeout: float = 30) -> None:
        """Stop taking work and kill what runs (SIGKILL, as the agent does when it shuts down)."""
        self._stop.set()
        self.master.state.agent_slots.pop(self.agent_id, None)
        self.master.state.notify()
        for alloc, _ in list(self.running.values()):
            alloc.kill.set()
        deadline = time.monotonic() + timeout
        for _, thread in list(self.running.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))


#: master/static/srv/entrypoint.sh:9,18,20 without task-setup.sh's wheel install and the hooks
CHAIN = ('"$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --download_context_directory --resources --proxy'
         ' && "$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --rendezvous'
         ' && exec "$DET_PYTHON_EXECUTABLE" -m determined.exec.launch')
#: host directories the task does not see (the sandbox gives its own)
_NOT_SHOWN = {"proc", "dev", "sys", "run", "tmp"}


class HostRunner:
    """Runs a trial's task on this machine: Determined's ship_logs.py (as re-transcribed in
    tests/standin/task_scripts.py) running prep_container and launch (entrypoint.sh:9-20) with this
    Python's harness, in bubblewrap with the host's files, a private /tmp and /run, the run directory
    at /run/determined and shared_fs storage at /determined_shared_fs (task_trial.go:152-157), the
    experiment's bind mounts, and the environment the master and agent give a container
    (tests/standin/task_env.py). No image, no wheel install, no startup hooks, no network namespace:
    the task reaches the master at 127.0.0.1. ``user``: run as that Unix user (default: this one)."""

    def __init__(self, *, user: LinkedUser | None = None, timeout: float = 600, python: str = sys.executable) -> None:
        self.user, self.timeout, self.python = user, timeout, python

    def environment(self, alloc: Allocation) -> dict[str, str]:
        port = alloc.master_url.rsplit(":", 1)[1].strip("/")
        agent = {"master_host": "127.0.0.1", "master_port": port, "agent_id": "det-lab-standin-agent"}
        entries = master_env(alloc, alloc.task_container_defaults) + agent_env(
            alloc, agent, cluster_id="det-lab-standin", master_id="det-lab-standin-master")
        env = {"PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR,
               "LANG": "C.UTF-8", "DET_PYTHON_EXECUTABLE": self.python, "DET_SHIPPER_EMIT_STDOUT_LOGS": "1"}
        for entry in entries:
            name, _, value = entry.partition("=")
            env[name] = value
        env["DET_HPARAMS"] = json.dumps(alloc.hparams, separators=(",", ":"))  # task_trial.go:120: the trial's values
        return env

    def sandbox(self, alloc: Allocation, run: Path) -> list[str]:
        args = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc"]
        for entry in sorted(os.listdir("/")):
            path = f"/{entry}"
            if entry in _NOT_SHOWN or not os.path.isdir(path):
                continue
            args += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--bind", path, path]
        args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run", "--bind", str(run), RUN_DIR]
        # this Python's venv and the checkout its editable det_lab points at, wherever they lie (a CI clone
        # under /tmp, which the task's private /tmp would hide)
        for own in sorted({Path(self.python).parent.parent, Path(__file__).resolve().parents[2]}):
            if str(own).startswith(("/tmp/", "/run/")):
                args += ["--ro-bind", str(own), str(own)]
        storage = alloc.config.get("checkpoint_storage") or {}
        mounts = [(m["host_path"], m["container_path"], bool(m.get("read_only"))) for m in alloc.config.get("bind_mounts") or []]
        if storage.get("type") == "shared_fs":
            mounts.append((storage["host_path"], SHARED_FS_CONTAINER_PATH, False))
        for host, target, ro in sorted(mounts, key=lambda m: Path(m[1]).parts):
            target = target if os.path.isabs(target) else os.path.join(WORK_DIR, target)
            args += ["--ro-bind" if ro else "--bind", host, target]
        return args + ["--chdir", WORK_DIR]

    def __call__(self, alloc: Allocation, *, kill: threading.Event | None = None) -> TaskExit:
        if alloc.task_type != "TRIAL":  # CHAIN is a trial's entrypoint.sh; commands need run_allocation
            return TaskExit(alloc.allocation_id, 1, "", f"stand-in agent: the host runner runs trials only, "
                            f"not a {alloc.task_type} task (start the stand-in with --wheel-dir)\n")
        root = Path(tempfile.mkdtemp(prefix="det-standin-task-"))
        try:
            run = root / "run"
            for d in ("", "workdir", "info", "pythonuserbase"):
                (run / d).mkdir(parents=True, exist_ok=True)
            (run / "ship_logs.py").write_text(task_scripts.SHIP_LOGS_PY)
            if self.user is not None:
                for p in [root, *root.rglob("*")]:
                    os.lchown(p, self.user.uid, self.user.gid)
            argv = self.sandbox(alloc, run) + [self.python, f"{RUN_DIR}/ship_logs.py", "sh", "-c", CHAIN]
            proc = subprocess.Popen(argv, env=self.environment(alloc), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="replace", cwd="/",
                                    user=self.user.uid if self.user else None, group=self.user.gid if self.user else None)
            deadline, code = time.monotonic() + self.timeout, None
            while True:
                try:
                    out, err = proc.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if (kill is not None and kill.is_set()) or time.monotonic() > deadline:
                        code = 137 if kill is not None and kill.is_set() else 124
                        proc.kill()
            if code is None:
                code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode
            return TaskExit(alloc.allocation_id, code, out, err)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"HostRunner(user={self.user!r}, python={shlex.quote(self.python)})"
