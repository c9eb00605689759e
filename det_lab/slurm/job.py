"""The Slurm job: a rendered sbatch script a person can read and resubmit, and the driver it runs.

Why rendered scripts and not submitit: the job is a bash file in the run's directory
(``job.sbatch``) that says everything it does; ``sbatch job.sbatch`` resubmits it; and inside it
the trial runs exactly as ``det-lab run --local`` runs it (Determined's harness off-cluster, the
same run record), so nothing pickled crosses the submit boundary and nothing depends on the
submitting Python.

Preemption and time limits: the script asks Slurm for ``USR1`` ``signal_seconds`` before the
limit (``--signal=B:USR1@N``); its trap passes it to the driver, which asks the trial to
checkpoint and stop (SIGTERM, det_lab's preemption), records how it ended, and the script then
runs ``scontrol requeue``. The requeued job starts the driver again, which resumes the trial from
the run's latest checkpoint in the same tracker run.

The driver (``python -m det_lab.slurm.job RUN_DIR``) runs once per node: the first node records
the attempt (every node of it) and the outcome; ``slots_per_trial`` > 1 runs the trial under
torchrun, one process per GPU. Several nodes meet in torchrun's *static* rendezvous at the job's
first node (``scontrol show hostnames``), each with ``--node_rank=$SLURM_NODEID``: global ranks
follow the node order, so rank 0, the chief that alone writes checkpoints, the run record and the
tracker's metrics, runs on the first node, the one whose driver records the run. (torchrun's
``c10d`` rendezvous ignores ``--node_rank`` and hands out ranks in arrival order.) The first node
is reached by name, or by Slurm's NodeAddr where its name does not resolve
(:mod:`det_lab.slurm.nodes`); Determined's chief broadcast gets the same address
(``DET_CHIEF_IP``, read by ``DistributedContext.from_torch_distributed``).

Fencing (:mod:`det_lab.runs.fence`): each start of the job takes the run's next attempt epoch
before anything else, and its trial gets the attempt's token. Slurm may start a job again while an
earlier copy still runs (a node cut off from the controller: its job is requeued after
``SlurmdTimeout`` and started elsewhere, slurm.conf(5) SlurmdTimeout, sbatch(1) --requeue); the
earlier copy then finds its attempt stale, stops, and its driver records nothing. A start of a job
whose run already finished (a second completion of the job) does nothing.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from det_lab.settings import load_settings
from det_lab.slurm.nodes import NodeAddressError, first_node_address, job_nodes
from det_lab.slurm.record import SlurmRunRecord
from det_lab.runs import local
from det_lab.runs.fence import ATTEMPT_ENV, STALE_EXIT_CODE, Attempt, Fence, StaleAttempt, begin_attempt, read_attempt
from det_lab.runs.record import open_record
from det_lab.runs.run_state import RunStatus

#: environment variables a job carries over from the submitting shell (written into the script)
PASSED_ENV_PREFIXES = ("DET_LAB_", "MLFLOW_", "DET_MASTER", "AIM_")
RENDEZVOUS_PORT = 29500


@dataclass
class JobSpec:
    """What the sbatch header asks for, and how the driver is started."""

    name: str
    output: str
    partition: str | None = None
    time: str | None = None
    account: str | None = None  # with accounting: the run's project, charged for its GPU time
    nodes: int = 1
    gpus_per_node: int = 0
    signal_seconds: int = 300
    array: str | None = None
    python: str = sys.executable

    def header(self) -> list[str]:
        lines = [f"--job-name={self.name}", f"--output={self.output}", "--open-mode=append"]
        if self.partition:
            lines.append(f"--partition={self.partition}")
        if self.time:
            lines.append(f"--time={self.time}")
        if self.account:
            lines.append(f"--account={self.account}")
        lines += [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        if self.gpus_per_node:
            lines.append(f"--gres=gpu:{self.gpus_per_node}")
        lines += [f"--signal=B:USR1@{self.signal_seconds}", "--requeue"]
        if self.array:
            lines.append(f"--array={self.array}")
        return [f"#SBATCH {x}" for x in lines]

    def launcher(self, driver: list[str]) -> str:
        """The command line that starts the driver: under srun (one per node) on several nodes."""
        argv = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"] if self.nodes > 1 else []
        return shlex.join([*argv, self.python, *driver])


def passed_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The det_lab, MLflow and Determined variables of the submitting shell."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(PASSED_ENV_PREFIXES)}


def render_script(spec: JobSpec, driver: list[str], cwd: Path, env: dict[str, str], comment: list[str]) -> str:
    """The sbatch script (see the module docstring)."""
    lines = ["#!/bin/bash", *spec.header(), "#"]
    lines += [f"# {c}" for c in comment]
    lines += ["set -u"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [
        f"cd {shlex.quote(str(cwd))}",
        "",
        f"# Slurm sends USR1 {spec.signal_seconds} s before the time limit: the trial checkpoints and stops,",
        "# then this job requeues itself and the next start resumes from that checkpoint.",
        "requeue=0",
        'trap \'requeue=1; kill -USR1 "$driver" 2>/dev/null\' USR1',
        "# scancel: the trial checkpoints and stops; this script waits for it (Slurm's KillWait)",
        'trap \'kill -TERM "$driver" 2>/dev/null\' TERM',
        f"{spec.launcher(driver)} &",
        "driver=$!",
        'until wait "$driver"; code=$?; ! kill -0 "$driver" 2>/dev/null; do :; done',
        'if [ "$requeue" = 1 ] && [ "$code" = 0 ]; then',
        '  echo "det-lab: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def trial_command(command: list[str], gpus_per_node: int, nodes: int, environ: Mapping[str, str],
                  head: str | None = None) -> list[str]:
    """The trial's command on this node: as is for one GPU (or none), else under torchrun; on
    several nodes a static rendezvous at ``head``, the first node's address (see the module docstring)."""
    if gpus_per_node <= 1 and nodes <= 1:
        return command
    python, rest = command[0], command[1:]
    run = [python, "-m", "torch.distributed.run", f"--nproc_per_node={max(gpus_per_node, 1)}"]
    if nodes <= 1:
        return [*run, "--standalone", *rest]
    head = head or first_node_address(environ)[1]
    return [*run, f"--nnodes={nodes}", f"--node_rank={environ.get('SLURM_NODEID', '0')}",
            "--rdzv_backend=static", f"--master_addr={head}", f"--master_port={RENDEZVOUS_PORT}", *rest]


def run_in_job(run: SlurmRunRecord, stop_signals: tuple[int, ...] = ()) -> int:
    """Run (or resume) the trial of ``run`` inside the job; returns the trial's exit code.

    USR1 (the time limit is near), TERM, INT and ``stop_signals`` ask the trial to checkpoint and stop."""
    settings = load_settings()
    first_node = os.environ.get("SLURM_NODEID", "0") == "0"
    state = run.state()
    if state.get("status") == RunStatus.FINISHED:
        print(f"det-lab: run {state['name']} already finished; nothing to do", flush=True)
        return 0
    slurm = state.get("slurm") or {}
    nodes = int(slurm.get("nodes", 1))
    chief_env: dict[str, str] = {}
    names: list[str] = []
    if nodes > 1:
        try:
            names = job_nodes(os.environ)
            head = first_node_address(os.environ)[1]
        except NodeAddressError as exc:  # refused at submission; a node's name may stop resolving later
            print(f"det-lab: {exc}", flush=True)
            if first_node:
                local.record_exit(run, 2)
            return 2
        chief_env["DET_CHIEF_IP"] = head
    try:
        current = _take_attempt(run) if first_node else _join_attempt(run)
    except StaleAttempt as exc:
        print(f"det-lab: this start of job {os.environ.get('SLURM_JOB_ID', '?')} is stale ({exc}); "
              "it trains and records nothing", flush=True)
        return 0
    fence = Fence(run.dir, current.epoch, current.token)
    if first_node:
        run.fence = fence  # what this driver records, it records as this attempt
        attempt = run.start_attempt(current.epoch, nodes=names)
        if state.get("latest_checkpoint"):
            state = run.update(resumed=state.get("resumed", 0) + 1, trial_status=None, status=RunStatus.RUNNING.value)
            print(f"det-lab: resuming {state['name']} from checkpoint {state['latest_checkpoint']} "
                  f"on {attempt['node']}", flush=True)
        else:
            state = run.update(status=RunStatus.RUNNING.value)
    container = slurm.get("apptainer") or []
    command = trial_command(slurm.get("container_command") if container else state["command"],
                            int(slurm.get("gpus_per_node", 0)), nodes, os.environ, chief_env.get("DET_CHIEF_IP"))
    command = [*container, *command]  # the trial in the image; this driver stays on the node
    cwd = Path(state["cwd"])
    env = {**local.trial_env(run, cwd, settings), **chief_env, ATTEMPT_ENV: current.env_value}
    with open(run.log_file, "ab") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def stop(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # det_lab's preemption: checkpoint, then stop

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, *stop_signals):
        signal.signal(sig, stop)
    code = proc.wait()
    if first_node and (code == STALE_EXIT_CODE or fence.current() is False):
        now = read_attempt(run.dir)
        print(f"det-lab: attempt {current.epoch} is stale: attempt {now.epoch if now else '?'} started on "
              f"{now.node if now else '?'}; this copy stopped and records nothing", flush=True)
        return 0
    if first_node:
        run.end_attempt(current.epoch, code)
        status = local.record_exit(run, code)
        print(f"det-lab: trial {status} (exit code {code})", flush=True)
    return code


def _this_start() -> tuple[str, int, str]:
    """This start of the job as Slurm names it: job id, restart count, node."""
    return (os.environ.get("SLURM_JOB_ID", ""), int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            os.environ.get("SLURMD_NODENAME", ""))


def _take_attempt(run: SlurmRunRecord) -> Attempt:
    """The first node: take the run's next attempt epoch (StaleAttempt if a later restart has it)."""
    job_id, restart, node = _this_start()
    return begin_attempt(run.dir, job_id, restart, node)


def _join_attempt(run: SlurmRunRecord, timeout: float = 120.0) -> Attempt:
    """Another node of the same start: the attempt the first node took (it writes it first)."""
    import time

    job_id, restart, _ = _this_start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            now = read_attempt(run.dir)
        except (OSError, ValueError):
            now = None
        if now is not None and now.job_id == job_id and now.restart >= restart:
            if now.restart > restart:
                raise StaleAttempt(f"restart {now.restart} of job {job_id} already runs")
            return now
        if time.monotonic() > deadline:
            raise StaleAttempt(f"the first node did not take an attempt for restart {restart} in {timeout:.0f} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m det_lab.slurm.job RUN_DIR", file=sys.stderr)
        return 2
    run = open_record(Path(argv[0]))
    if not isinstance(run, SlurmRunRecord):
        print(f"error: {argv[0]} is not a Slurm run (kind {run.kind!r})", file=sys.stderr)
        return 2
    return run_in_job(run)


if __name__ == "__main__":
    sys.exit(main())
