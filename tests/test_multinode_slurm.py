"""det_lab's Slurm path on several hosts (tests/multihost.py: three namespace hosts, Slurm with
slurmdbd, the lab volume at one path): the test bed itself, a node killed mid-run, and a node cut
off while its copy runs (the double writer the fence prevents).

Slurm behaviours relied on: a batch job submitted with ``--requeue`` is requeued after a node
failure (sbatch(1) --requeue; ``JobRequeue=1``, slurm.conf(5)); a node that does not answer for
``SlurmdTimeout`` is set DOWN (slurm.conf(5)); ``ReturnToService=2`` makes it usable again once its
slurmd registers; a requeued job is started again after ``cred_expire`` (here 5 s);
``SLURM_RESTART_COUNT`` counts the restarts (sbatch(1), OUTPUT ENVIRONMENT VARIABLES); ``sacct
--duplicates`` lists each start of a requeued job (sacct(1)); a cut-off node's copy keeps running
until the node re-registers ("Registered JobId … on wrong node") and slurmctld kills it
(shared/notes/multihost.md).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import VENV_BIN, Lab
from tests.multihost import Bed, MultiHostCluster, multihost, record_timing  # noqa: F401 (fixture)
from tests.slurm_cluster import TINY

#: env of the lab's commands, passed into the jobs (DET_LAB_*): a dead trainer's lock expires in 15 s
#: (+10 s clock slop), and a stale copy checks its attempt every second
FAST = {"DET_LAB_LOCK_LIFETIME": "15", "DET_LAB_FENCE_POLL": "1"}


@pytest.fixture(scope="module")
def bed(multihost: Bed) -> Bed:  # noqa: F811 (the fixture imported above)
    multihost.lab.env.update(FAST)
    return multihost


def _config(lab: Lab, name: str, **changes) -> Path:
    conf = yaml.safe_load((TINY / "const.yaml").read_text())
    for key, value in changes.items():
        node = conf
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = lab.config.parent / name
    path.write_text(yaml.safe_dump(conf))
    return path


#: 80 batches, a checkpoint every 20, paced so that a node can be lost mid-run on a loaded machine
PACED = {"hyperparameters.sleep_per_batch": 0.4, "min_checkpoint_period": {"batches": 20}}


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _losses(run_dir: Path, group: str, key: str) -> dict[int, float]:
    return {m["step"]: m["metrics"][key] for m in _metrics(run_dir) if m["group"] == group}


def _wait(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def _job(cluster: MultiHostCluster, job_id: str) -> tuple[str, str]:
    """(state, node) of the job as squeue has it ("", "") once it is gone."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%N", check=False).stdout.strip()
    return tuple(out.split("|")) if "|" in out else ("", "")  # type: ignore[return-value]


def _final(cluster: MultiHostCluster, job_id: str) -> str:
    out = cluster.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return next((kv.split("=", 1)[1] for kv in out.split() if kv.startswith("JobState=")), "")


def _submit(bed: Bed, config: Path) -> tuple[Path, str]:
    out = bed.lab.cli("run", str(TINY), "--slurm", "--exp-config", str(config), check=True).stdout
    run_dir = bed.lab.root / "outputs" / "vla" / "slurm-runs" / out.split()[1].rstrip(":")
    return run_dir, _state(run_dir)["slurm"]["job_id"]


def _straight(bed: Bed, config: Path) -> subprocess.Popen:
    """The same config trained uninterrupted, on the login node (no node to lose), side by side."""
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", "--exp-config", str(config)],
                            env=bed.lab.env, cwd=bed.lab.config.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _local_run(lab: Lab, config: Path) -> Path:
    (run_dir,) = [p.parent for p in (lab.root / "outputs" / "vla" / "local-runs").glob("*/run.json")
                  if _state(p.parent)["config"] == str(config.resolve())]
    return run_dir


def _past_first_checkpoint(run_dir: Path) -> bool:
    if not (run_dir / "run.json").exists() or not (run_dir / "metrics.jsonl").exists():
        return False
    st = _state(run_dir)
    steps = [m["step"] for m in _metrics(run_dir) if m["group"] == "training"]
    return bool(st.get("latest_checkpoint")) and max(steps, default=0) > st["latest_checkpoint_step"]


def _host_of(cluster: MultiHostCluster, node: str):
    return next(h for h in cluster.nodes if h.name == node)


def _mlflow_steps(bed: Bed, run_dir: Path, key: str, expected: list[int], timeout: float = 120) -> list[int]:
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
        return _wait(delivered, timeout, f"MLflow to hold every {key}", poll=1)
    except AssertionError:
        return sorted(m.step for m in client.get_metric_history(run_id, key)) if run_id else []


def _check_run(bed: Bed, run_dir: Path, straight_dir: Path) -> dict:
    """What both scenarios must end with: finished at 80 in one run record, checkpoints in step order
    with the pointer on the last, every metric once, the losses of the uninterrupted run, each step
    once in MLflow."""
    st = _state(run_dir)
    assert st["status"] == "finished" and st["latest_checkpoint_step"] == 80, st
    steps = [c["step"] for c in st["checkpoints"]]
    assert steps == sorted(set(steps)) and st["latest_checkpoint"] == st["checkpoints"][-1]["uuid"], steps
    seen = [(m["group"], k, m["step"]) for m in _metrics(run_dir) for k in m["metrics"]]
    assert len(seen) == len(set(seen)), "a metric recorded twice"
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected, got = _losses(straight_dir, group, key), _losses(run_dir, group, key)
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)
    expected = sorted(_losses(straight_dir, "training", "loss"))
    assert _mlflow_steps(bed, run_dir, "training/loss", expected) == expected  # each step once
    return st


def test_the_test_bed_is_three_hosts_with_one_volume(bed: Bed):
    """Each host has its own name and /tmp, sees the volume at the same path, and reaches nothing
    beyond the bridge; Slurm across them was rendered by det_lab with per-node slurmd files."""
    c = bed.cluster
    conf = c.conf.read_text()
    assert f"SlurmdSpoolDir={c.dir / 'spool'}/%n" in conf and "SlurmdPidFile=/run/slurmd-%n.pid" in conf
    assert "AccountingStorageType=accounting_storage/slurmdbd" in conf
    a, b = c.nodes
    marker = f"written on {a.name}"
    assert c.on_host(a, f"hostname; echo {marker!r} > {c.data_root}/hello; echo private > /tmp/mine").stdout.strip() == a.name
    seen = c.on_host(b, f"hostname; cat {c.data_root}/hello; ls /tmp; ip route get 1.1.1.1 2>&1 || true").stdout
    assert seen.splitlines()[:2] == [b.name, marker] and "mine" not in seen and "unreachable" in seen
    out = c.run("srun", "-N2", "-l", "hostname").stdout
    assert sorted(x.split(": ")[1] for x in out.splitlines()) == [a.name, b.name]


def test_a_killed_node_s_run_resumes_elsewhere_with_the_losses_of_an_uninterrupted_run(bed: Bed):
    c, lab = bed.cluster, bed.lab
    config = _config(lab, "tiny-kill.yaml", **PACED)
    run_dir, job_id = _submit(bed, config)
    straight = _straight(bed, config)
    _wait(lambda: _past_first_checkpoint(run_dir), 180, "the first checkpoint")
    state, node = _job(c, job_id)
    assert state == "RUNNING", state
    latest = _state(run_dir)["latest_checkpoint"]
    victim = _host_of(c, node)
    killed_at = time.monotonic()
    assert c.kill_host(victim) > 2  # slurmd, its stepd, the job's driver and trial (at least)
    _wait(lambda: _job(c, job_id)[0] == "RUNNING" and _job(c, job_id)[1] not in ("", node), 120,
          "the job running on another node", poll=0.2)
    record_timing(c, "kill_to_running_elsewhere_s", time.monotonic() - killed_at)
    c.restart_slurmd(victim)  # the node boots again (ReturnToService=2: usable once registered)
    _wait(lambda: _final(c, job_id) == "COMPLETED", 240, "the requeued job to complete", poll=1)
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    straight_dir = _local_run(lab, config)

    st = _check_run(bed, run_dir, straight_dir)
    first, second = st["slurm"]["attempts"]
    assert (first["node"], first["restart"], second["restart"]) == (node, 0, 1) and second["node"] != node
    assert "ended" not in first and second["moved_from"] == node
    assert f"node {node} stopped answering Slurm (NODE_FAIL)" in second["why"], second["why"]
    assert st["resumed"] == 1
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert f"resuming {st['name']} from checkpoint {latest} on {second['node']}" in out  # the latest complete one

    shown = lab.cli("runs", "show", st["name"], check=True).stdout
    assert f"on {node} (restart 0)" in shown and f"on {second['node']} (restart 1)" in shown
    as_json = json.loads(lab.cli("runs", "show", st["name"], "--json", check=True).stdout)
    assert as_json["slurm"]["attempts"][1]["why"] == second["why"]
    c.wait_nodes()


def _trial_pids(cluster: MultiHostCluster, host, run_dir: Path) -> list[int]:
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


def _files(run_dir: Path, ckpts: Path) -> dict[str, object]:
    st = _state(run_dir)
    return {"run": {k: st.get(k) for k in ("status", "latest_checkpoint", "checkpoints")},
            "metrics": (run_dir / "metrics.jsonl").read_bytes(), "ckpts": sorted(p.name for p in ckpts.iterdir())}


def test_a_cut_off_node_s_copy_writes_nothing_after_the_requeued_copy_started(bed: Bed):
    c, lab = bed.cluster, bed.lab
    c.wait_nodes(("idle",))
    # slower than PACED: the cut-off copy must still train when Slurm has requeued the job
    config = _config(lab, "tiny-partition.yaml", **{**PACED, "hyperparameters.sleep_per_batch": 0.5})
    run_dir, job_id = _submit(bed, config)
    straight = _straight(bed, config)
    _wait(lambda: _past_first_checkpoint(run_dir), 180, "the first checkpoint")
    node = _job(c, job_id)[1]
    host = _host_of(c, node)
    assert _trial_pids(c, host, run_dir)
    cut_at = time.monotonic()
    c.link(host, up=False)  # the node's processes run on, with the volume: two live copies
    try:
        _wait(lambda: _job(c, job_id)[0] == "RUNNING" and _job(c, job_id)[1] not in ("", node), 120,
              "the requeued copy running on another node", poll=0.2)
        record_timing(c, "partition_to_running_elsewhere_s", time.monotonic() - cut_at)
        _wait(lambda: not _trial_pids(c, host, run_dir), 60, "the cut-off copy to stop", poll=0.2)
        record_timing(c, "partition_to_old_copy_stopped_s", time.monotonic() - cut_at)
        _wait(lambda: _final(c, job_id) == "COMPLETED", 240, "the requeued job to complete", poll=1)
    finally:
        c.link(host, up=True)
    healed_at = time.monotonic()
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    straight_dir = _local_run(lab, config)

    st = _check_run(bed, run_dir, straight_dir)
    assert len(st["slurm"]["attempts"]) == 2, "the cut-off copy finished before the requeued one started"
    first, second = st["slurm"]["attempts"]
    assert first["node"] == node and second["node"] != node and (first["epoch"], second["epoch"]) == (1, 2)
    # the cut-off copy stopped itself and said so, once, and its driver recorded nothing
    log = (run_dir / "train.log").read_text()
    assert log.count("attempt 1 of this run is stale: attempt 2") == 1, log[-3000:]
    assert "ended" not in first
    # it wrote no checkpoint after the requeued copy took its attempt: every checkpoint on the
    # volume is in the chain (none orphaned by a late writer), and those from the cut-off node
    # were all complete before the second attempt started
    ckpts = lab.root / "checkpoints" / "vla"
    mine = {c_["uuid"] for c_ in st["checkpoints"]}
    written = {p.name: json.loads((p / "metadata.json").read_text()) for p in ckpts.iterdir()
               if (p / "metadata.json").exists() and json.loads((p / "metadata.json").read_text())
               .get("det_lab", {}).get("slurm_job_id") == job_id}
    assert set(written) <= mine | {d["uuid"] for d in st.get("checkpoints_deleted", [])}, set(written) - mine
    by_old = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") == node)
    by_new = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") != node)
    assert by_old and by_new and max(by_old) < min(by_new), (by_old, by_new)

    # healed: the node comes back, and nothing of the run changes any more
    before = _files(run_dir, ckpts)
    _wait(lambda: c.node_state(host).rstrip("*") == "idle", 90, f"{node} back after the heal", poll=0.5)
    record_timing(c, "heal_to_node_back_s", time.monotonic() - healed_at)
    time.sleep(2)  # a late write would land now
    assert _files(run_dir, ckpts) == before
    assert _final(c, job_id) == "COMPLETED"


def _ranks(cluster: MultiHostCluster, host) -> set[int]:
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


def test_two_nodes_train_to_the_losses_of_one_node_with_the_same_global_batch(bed: Bed):
    """slots_per_trial 4 on nodes of 2 GPUs goes out as --nodes=2 (4 gloo ranks of 4 rows a batch);
    a one-process run of 16 rows a batch sees the same 16 rows each step. Global rank 0 runs on the
    job's first node, whose driver records the run; the chief alone writes checkpoints and metrics."""
    c, lab = bed.cluster, bed.lab
    c.wait_nodes(("idle",))
    two = _config(lab, "tiny-2nodes.yaml", **{"resources.slots_per_trial": 4, "hyperparameters.batch_size": 4})
    one = _config(lab, "tiny-1node.yaml", **{"resources.slots_per_trial": 1})  # batch_size 16
    run_dir, job_id = _submit(bed, two)
    straight = _straight(bed, one)
    assert "#SBATCH --nodes=2" in (run_dir / "job.sbatch").read_text()
    a, b = c.nodes
    ranks = _wait(lambda: (lambda r: r if all(len(x) == 2 for x in r.values()) else None)(
        {h.name: _ranks(c, h) for h in (a, b)}), 180, "two ranks on each node", poll=0.2)
    assert ranks == {a.name: {0, 1}, b.name: {2, 3}}, ranks  # the job's first node (SLURM_NODEID 0) holds rank 0
    _wait(lambda: _final(c, job_id) in ("COMPLETED", "FAILED"), 240, "the job to end", poll=1)
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    st = _state(run_dir)
    assert _final(c, job_id) == "COMPLETED", (run_dir / "train.log").read_text()[-3000:]
    (attempt,) = st["slurm"]["attempts"]
    assert attempt["nodes"] == [a.name, b.name] and attempt["node"] == a.name, attempt

    straight_dir = _local_run(lab, one)
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected, got = _losses(straight_dir, group, key), _losses(run_dir, group, key)
        assert sorted(got) == sorted(expected) and len(got) >= 4
        assert got == pytest.approx(expected, rel=1e-6)
        steps = sorted(expected)  # the neighbouring step's loss is outside that tolerance
        assert all(expected[s] != pytest.approx(expected[t], rel=1e-6) for s, t in zip(steps, steps[1:]))
    seen = [(m["group"], k, m["step"]) for m in _metrics(run_dir) for k in m["metrics"]]
    assert len(seen) == len(set(seen)), "a metric recorded twice"
    expected = sorted(_losses(straight_dir, "training", "loss"))
    assert _mlflow_steps(bed, run_dir, "training/loss", expected) == expected  # each step once
    # written once, by the chief: two checkpoints in the record, no other checkpoint of the job on the volume
    assert [c_["step"] for c_ in st["checkpoints"]] == [40, 80] and st["latest_checkpoint_step"] == 80
    ckpts = lab.root / "checkpoints" / "vla"
    written = [p.name for p in ckpts.iterdir() if (p / "metadata.json").exists() and json.loads(
        (p / "metadata.json").read_text()).get("det_lab", {}).get("slurm_job_id") == job_id]
    assert sorted(written) == sorted(c_["uuid"] for c_ in st["checkpoints"])
    shown = lab.cli("runs", "show", st["name"], check=True).stdout
    assert f"on {a.name}, {b.name} (rank 0 on {a.name}; restart 0)" in shown, shown


def test_a_multi_node_trial_the_partition_cannot_hold_or_reach_is_one_line_before_sbatch(bed: Bed, monkeypatch):
    """More nodes than the partition has, or a partition whose nodes nobody resolves (bed: the
    ghost nodes, no NodeAddr): one line, no run directory, no job. The bed's own nodes do not
    resolve on the login node either, but slurm.conf gives their addresses: those are used."""
    from det_lab.slurm.nodes import NodeAddressError, first_node_address

    c, lab = bed.cluster, bed.lab
    runs = lab.root / "outputs" / "vla" / "slurm-runs"
    ghost = next(n.name for n in c.settings.nodes if n.partition == "ghost")
    jobs = c.run("squeue", "-h", "--states=all", "-o", "%i").stdout.split()
    for args, message in (
        (["--set", "resources.slots_per_trial=6"],
         "resources.slots_per_trial=6: partition fake has 2 node(s) with at most 2 GPUs each, so a trial fits 2 or "
         "fewer GPUs on one node, or a multiple of 2 up to 4 across nodes (6 would take 3 nodes)"),
        (["--partition", "ghost", "--set", "resources.slots_per_trial=2"],
         f"partition ghost: node {ghost}: its name does not resolve here and slurm.conf gives it no NodeAddr")):
        before = set(runs.iterdir()) if runs.exists() else set()
        proc = lab.cli("run", str(TINY), "--slurm", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {message}"), line
        assert (set(runs.iterdir()) if runs.exists() else set()) == before
    assert c.run("squeue", "-h", "--states=all", "-o", "%i").stdout.split() == jobs  # nothing reached sbatch

    monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])  # the job's view, from the login node
    a, b = c.nodes
    assert first_node_address({"SLURM_JOB_NODELIST": f"{a.name},{b.name}"}) == (a.name, a.addr)
    with pytest.raises(NodeAddressError, match=f"node {ghost}: its name does not resolve"):
        first_node_address({"SLURM_JOB_NODELIST": ghost})
