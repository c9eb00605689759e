"""Steps of det_lab's multi-node scenarios on the test bed (tests/multihost.py), shared by
tests/test_multinode_slurm.py and bench/multinode.py: a tiny run's config, its submission, its
record and metrics, the job as Slurm has it, the processes of a run on a host."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import VENV_BIN, Lab
from tests.multihost import Bed, MultiHostCluster
from tests.slurm_cluster import TINY, tiny_config

config_file = tiny_config  # the tiny VLA config with dotted keys changed (tests/slurm_cluster.py)

#: env of the lab's commands, passed into the jobs (DET_LAB_*): a dead trainer's lock expires in 15 s
#: (+10 s clock slop), and a stale copy checks its attempt every second
FAST = {"DET_LAB_LOCK_LIFETIME": "15", "DET_LAB_FENCE_POLL": "1"}


#: 80 batches, a checkpoint every 10, paced so that a node can be lost mid-run on a loaded machine;
#: a report every 5, so that :func:`past_first_checkpoint` holds for 5 batches after each checkpoint
#: (with reports every 10, at the checkpoints' own steps, it held only while a checkpoint was being
#: recorded: a poll once missed it until step 90, and it can miss it to the run's end)
PACED = {"hyperparameters.sleep_per_batch": 0.4, "min_checkpoint_period": {"batches": 10},
         "data.det_lab.reporting_batches": 5}


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def losses(run_dir: Path, group: str, key: str) -> dict[int, float]:
    return {m["step"]: m["metrics"][key] for m in metrics(run_dir) if m["group"] == group}


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def job(cluster: MultiHostCluster, job_id: str) -> tuple[str, str]:
    """(state, node) of the job as squeue has it ("", "") once it is gone."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%N", check=False).stdout.strip()
    return tuple(out.split("|")) if "|" in out else ("", "")  # type: ignore[return-value]


def final(cluster: MultiHostCluster, job_id: str) -> str:
    out = cluster.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return next((kv.split("=", 1)[1] for kv in out.split() if kv.startswith("JobState=")), "")


def submit(lab: Lab, config: Path) -> tuple[Path, str]:
    out = lab.cli("run", str(TINY), "--slurm", "--exp-config", str(config), check=True).stdout
    run_dir = lab.root / "outputs" / "vla" / "slurm-runs" / out.split()[1].rstrip(":")
    return run_dir, state(run_dir)["slurm"]["job_id"]


def straight(lab: Lab, config: Path) -> subprocess.Popen:
    """The same config trained uninterrupted, on the login node (no node to lose), side by side, unpaced
    (the pause after each batch changes no loss: nothing races this run)."""
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", "--exp-config", str(config),
                             "--set", "hyperparameters.sleep_per_batch=0"],
                            env=lab.env, cwd=lab.config.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def local_run(lab: Lab, config: Path) -> Path:
    (run_dir,) = [p.parent for p in (lab.root / "outputs" / "vla" / "local-runs").glob("*/run.json")
                  if state(p.parent)["config"] == str(config.resolve())]
    return run_dir


def past_first_checkpoint(run_dir: Path) -> bool:
    """The run has a complete checkpoint and has reported a step after it (it trains on past it)."""
    if not (run_dir / "run.json").exists() or not (run_dir / "metrics.jsonl").exists():
        return False
    st = state(run_dir)
    steps = [m["step"] for m in metrics(run_dir) if m["group"] == "training"]
    return bool(st.get("latest_checkpoint")) and max(steps, default=0) > st["latest_checkpoint_step"]


def host_of(cluster: MultiHostCluster, node: str):
    return next(h for h in cluster.nodes if h.name == node)


def trial_pids(cluster: MultiHostCluster, host, run_dir: Path) -> list[int]:
    """The processes of ``host`` that train or drive the run (by namespace, then their argv); its
    tracking senders may linger to deliver what was journaled."""
    out = []
    for pid in cluster.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "train.py" in argv or f"det_lab.slurm.job {run_dir}" in argv:  # not its tracking senders
            out.append(pid)
    return out


def ranks_on(cluster: MultiHostCluster, host) -> set[int]:
    """The global ranks of the trial processes running on ``host`` (their RANK, as torchrun set it)."""
    ranks = set()
    for pid in cluster.pids(host):
        try:
            if b"train.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            ranks.add(int(env["RANK"]))
    return ranks


def mlflow_steps(bed: Bed, run_dir: Path, key: str, expected: list[int], timeout: float = 120) -> list[int]:
    """The steps MLflow holds for ``key`` once delivery caught up (or the timeout passed)."""
    client = MlflowClient(bed.mlflow.uri)
    run_id = None

    def delivered():
        nonlocal run_id
        summary = json.loads((run_dir / "tracking-summary.json").read_text())
        run_id = summary["backends"][0]["run_id"]
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        return steps if sorted(set(steps)) == expected else None

    try:
        return wait_for(delivered, timeout, f"MLflow to hold every {key}", poll=1)
    except AssertionError:
        return sorted(m.step for m in client.get_metric_history(run_id, key)) if run_id else []


def job_checkpoints(ckpts: Path, job_id: str) -> dict[str, dict]:
    """The checkpoints under ``ckpts`` that Slurm job ``job_id`` wrote (uuid -> metadata.json)."""
    out = {}
    for p in ckpts.iterdir():
        try:
            meta = json.loads((p / "metadata.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("det_lab", {}).get("slurm_job_id") == job_id:
            out[p.name] = meta
    return out


def orphan_report(ckpts: Path, orphans: set[str], written: dict[str, dict], st: dict, log: str) -> str:
    """Why a checkpoint is outside the run's chain: who wrote it, at which step, and when, beside
    the attempts' start times and the stale copy's own line."""
    lines = [f"attempts: {st['slurm']['attempts']}", f"chain: {[(c['step'], c['uuid']) for c in st['checkpoints']]}"]
    for uuid in sorted(orphans):
        meta, files = written[uuid], sorted((ckpts / uuid).rglob("*"))
        mtimes = {p.name: time.strftime("%H:%M:%S", time.gmtime(p.stat().st_mtime)) + f"{p.stat().st_mtime % 1:.3f}"[1:]
                  for p in files if p.is_file()}
        lines.append(f"orphan {uuid}: step {meta.get('steps_completed')} node {meta['det_lab'].get('slurm_node')} "
                     f"files {mtimes}")
    lines += [x for x in log.splitlines() if "stale" in x or "resum" in x.lower()]
    return "\n".join(lines)


def check_run(bed: Bed, run_dir: Path, straight_dir: Path) -> dict:
    """What every scenario must end with: finished at its last batch in one run record, checkpoints in
    step order with the pointer on the last, every metric once, the losses of the uninterrupted run,
    each step once in MLflow."""
    st = state(run_dir)
    assert st["status"] == "finished" and st["latest_checkpoint_step"] == st["max_length"], st
    steps = [c["step"] for c in st["checkpoints"]]
    assert steps == sorted(set(steps)) and st["latest_checkpoint"] == st["checkpoints"][-1]["uuid"], steps
    seen = [(m["group"], k, m["step"]) for m in metrics(run_dir) for k in m["metrics"]]
    assert len(seen) == len(set(seen)), "a metric recorded twice"
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected, got = losses(straight_dir, group, key), losses(run_dir, group, key)
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)
    expected = sorted(losses(straight_dir, "training", "loss"))
    assert mlflow_steps(bed, run_dir, "training/loss", expected) == expected  # each step once
    return st
