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
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from det_lab.monitoring.exporter import DEFAULT_PORT
from det_lab.tracking.mlflow_server import free_port
from tests import multinode_steps as mn
from tests.conftest import VENV_BIN
from tests.multihost import Bed, multihost, record_timing  # noqa: F401 (fixture)
from tests.slurm_cluster import TINY
from tests.test_monitoring_nvml import build_shim


@pytest.fixture(scope="module")
def bed(multihost: Bed) -> Bed:  # noqa: F811 (the fixture imported above)
    multihost.lab.env.update(mn.FAST)
    return multihost


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
    config = mn.config_file(lab, "tiny-kill.yaml", **mn.PACED)
    run_dir, job_id = mn.submit(bed.lab, config)
    straight = mn.straight(bed.lab, config)
    mn.wait_for(lambda: mn.past_first_checkpoint(run_dir), 180, "the first checkpoint")
    state, node = mn.job(c, job_id)
    assert state == "RUNNING", state
    latest = mn.state(run_dir)["latest_checkpoint"]
    victim = mn.host_of(c, node)
    killed_at = time.monotonic()
    assert c.kill_host(victim) > 2  # slurmd, its stepd, the job's driver and trial (at least)
    mn.wait_for(lambda: mn.job(c, job_id)[0] == "RUNNING" and mn.job(c, job_id)[1] not in ("", node), 120,
          "the job running on another node", poll=0.2)
    record_timing(c, "kill_to_running_elsewhere_s", time.monotonic() - killed_at)
    c.restart_slurmd(victim)  # the node boots again (ReturnToService=2: usable once registered)
    mn.wait_for(lambda: mn.final(c, job_id) == "COMPLETED", 240, "the requeued job to complete", poll=1)
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    straight_dir = mn.local_run(lab, config)

    st = mn.check_run(bed, run_dir, straight_dir)
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


def _files(run_dir: Path, ckpts: Path) -> dict[str, object]:
    st = mn.state(run_dir)
    return {"run": {k: st.get(k) for k in ("status", "latest_checkpoint", "checkpoints")},
            "metrics": (run_dir / "metrics.jsonl").read_bytes(), "ckpts": sorted(p.name for p in ckpts.iterdir())}


def test_a_cut_off_node_s_copy_writes_nothing_after_the_requeued_copy_started(bed: Bed):
    c, lab = bed.cluster, bed.lab
    c.wait_nodes(("idle",))
    # slower and longer than PACED: the cut-off copy must still train when Slurm has requeued the job
    # (under CI's load the requeue once took longer than the 60 paced batches an 80-batch run had left;
    # the requeued copy is unpaced, so the extra batches cost it little)
    config = mn.config_file(lab, "tiny-partition.yaml", **{**mn.PACED, "hyperparameters.sleep_per_batch": 0.5,
                                                           "data.det_lab.max_length.batches": 160})
    run_dir, job_id = mn.submit(bed.lab, config)
    straight = mn.straight(bed.lab, config)
    mn.wait_for(lambda: mn.past_first_checkpoint(run_dir), 180, "the first checkpoint")
    node = mn.job(c, job_id)[1]
    host = mn.host_of(c, node)
    assert mn.trial_pids(c, host, run_dir)
    cut_at = time.monotonic()
    c.link(host, up=False)  # the node's processes run on, with the volume: two live copies
    try:
        mn.wait_for(lambda: mn.job(c, job_id)[0] == "RUNNING" and mn.job(c, job_id)[1] not in ("", node), 120,
              "the requeued copy running on another node", poll=0.2)
        record_timing(c, "partition_to_running_elsewhere_s", time.monotonic() - cut_at)
        mn.wait_for(lambda: not mn.trial_pids(c, host, run_dir), 60, "the cut-off copy to stop", poll=0.2)
        record_timing(c, "partition_to_old_copy_stopped_s", time.monotonic() - cut_at)
        mn.wait_for(lambda: mn.final(c, job_id) == "COMPLETED", 240, "the requeued job to complete", poll=1)
    finally:
        c.link(host, up=True)
    healed_at = time.monotonic()
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    straight_dir = mn.local_run(lab, config)

    st = mn.check_run(bed, run_dir, straight_dir)
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
    written = mn.job_checkpoints(ckpts, job_id)
    orphans = set(written) - mine - {d["uuid"] for d in st.get("checkpoints_deleted", [])}
    assert not orphans, mn.orphan_report(ckpts, orphans, written, st, log)
    by_old = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") == node)
    by_new = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") != node)
    assert by_old and by_new and max(by_old) < min(by_new), (by_old, by_new)

    # healed: the node comes back, and nothing of the run changes any more
    before = _files(run_dir, ckpts)
    mn.wait_for(lambda: c.node_state(host).rstrip("*") == "idle", 90, f"{node} back after the heal", poll=0.5)
    record_timing(c, "heal_to_node_back_s", time.monotonic() - healed_at)
    time.sleep(2)  # a late write would land now
    assert _files(run_dir, ckpts) == before
    assert mn.final(c, job_id) == "COMPLETED"


def test_two_nodes_train_to_the_losses_of_one_node_with_the_same_global_batch(bed: Bed):
    """slots_per_trial 4 on nodes of 2 GPUs goes out as --nodes=2 (4 gloo ranks of 4 rows a batch);
    a one-process run of 16 rows a batch sees the same 16 rows each step. Global rank 0 runs on the
    job's first node, whose driver records the run; the chief alone writes checkpoints and metrics."""
    c, lab = bed.cluster, bed.lab
    c.wait_nodes(("idle",))
    two = mn.config_file(lab, "tiny-2nodes.yaml", **{"resources.slots_per_trial": 4, "hyperparameters.batch_size": 4})
    one = mn.config_file(lab, "tiny-1node.yaml", **{"resources.slots_per_trial": 1})  # batch_size 16
    run_dir, job_id = mn.submit(bed.lab, two)
    straight = mn.straight(bed.lab, one)
    assert "#SBATCH --nodes=2" in (run_dir / "job.sbatch").read_text()
    a, b = c.nodes
    ranks = mn.wait_for(lambda: (lambda r: r if all(len(x) == 2 for x in r.values()) else None)(
        {h.name: mn.ranks_on(c, h) for h in (a, b)}), 180, "two ranks on each node", poll=0.2)
    assert ranks == {a.name: {0, 1}, b.name: {2, 3}}, ranks  # the job's first node (SLURM_NODEID 0) holds rank 0
    mn.wait_for(lambda: mn.final(c, job_id) in ("COMPLETED", "FAILED"), 240, "the job to end", poll=1)
    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    st = mn.state(run_dir)
    assert mn.final(c, job_id) == "COMPLETED", (run_dir / "train.log").read_text()[-3000:]
    (attempt,) = st["slurm"]["attempts"]
    assert attempt["nodes"] == [a.name, b.name] and attempt["node"] == a.name, attempt

    straight_dir = mn.local_run(lab, one)
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected, got = mn.losses(straight_dir, group, key), mn.losses(run_dir, group, key)
        assert sorted(got) == sorted(expected) and len(got) >= 4
        assert got == pytest.approx(expected, rel=1e-6)
        steps = sorted(expected)  # the neighbouring step's loss is outside that tolerance
        assert all(expected[s] != pytest.approx(expected[t], rel=1e-6) for s, t in zip(steps, steps[1:]))
    seen = [(m["group"], k, m["step"]) for m in mn.metrics(run_dir) for k in m["metrics"]]
    assert len(seen) == len(set(seen)), "a metric recorded twice"
    expected = sorted(mn.losses(straight_dir, "training", "loss"))
    assert mn.mlflow_steps(bed, run_dir, "training/loss", expected) == expected  # each step once
    # written once, by the chief: two checkpoints in the record, no other checkpoint of the job on the volume
    assert [c_["step"] for c_ in st["checkpoints"]] == [40, 80] and st["latest_checkpoint_step"] == 80
    ckpts = lab.root / "checkpoints" / "vla"
    written = [p.name for p in ckpts.iterdir() if (p / "metadata.json").exists() and json.loads(
        (p / "metadata.json").read_text()).get("det_lab", {}).get("slurm_job_id") == job_id]
    assert sorted(written) == sorted(c_["uuid"] for c_ in st["checkpoints"])
    shown = lab.cli("runs", "show", st["name"], check=True).stdout
    assert f"on {a.name}, {b.name} (rank 0 on {a.name}; restart 0)" in shown, shown


def test_a_multi_node_trial_the_partition_cannot_hold_or_reach_is_one_line_before_sbatch(bed: Bed, monkeypatch):
    """More nodes than the partition has, or a partition with a node Slurm knows by a name only that
    the login node does not resolve: one line, no run directory, no job. The bed's node names do
    not resolve on the login node at all; their NodeAddr (slurm.conf) is what reaches them."""
    from det_lab.slurm.nodes import NodeAddressError, first_node_address

    c, lab = bed.cluster, bed.lab
    a, b = c.nodes
    monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])  # the job's view of Slurm, from here
    assert first_node_address({"SLURM_JOB_NODELIST": f"{a.name},{b.name}"}) == (a.name, a.addr)
    runs = lab.root / "outputs" / "vla" / "slurm-runs"
    jobs = c.run("squeue", "-h", "--states=all", "-o", "%i").stdout.split()

    def refused(args: list[str], message: str) -> None:
        before = set(runs.iterdir()) if runs.exists() else set()
        proc = lab.cli("run", str(TINY), "--slurm", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {message}"), line
        assert (set(runs.iterdir()) if runs.exists() else set()) == before

    refused(["--set", "resources.slots_per_trial=6"],
            "resources.slots_per_trial=6: partition fake has 2 node(s) with at most 2 GPUs each, so a trial fits 2 "
            "or fewer GPUs on one node, or a multiple of 2 up to 4 across nodes (6 would take 3 nodes)")
    # Slurm forgets b's address (its name resolves on the hosts: nothing else changes for Slurm)
    c.run("scontrol", "update", f"NodeName={b.name}", f"NodeAddr={b.name}")
    try:
        refused(["--set", "resources.slots_per_trial=4"],
                f"partition fake: node {b.name}: its name does not resolve here and slurm.conf gives it no NodeAddr")
        with pytest.raises(NodeAddressError, match=f"node {b.name}: its name does not resolve"):
            first_node_address({"SLURM_JOB_NODELIST": b.name})
    finally:
        c.run("scontrol", "update", f"NodeName={b.name}", f"NodeAddr={b.addr}")
    assert c.run("squeue", "-h", "--states=all", "-o", "%i").stdout.split() == jobs  # nothing reached sbatch


def test_one_prometheus_scrapes_every_node_s_exporter_from_the_rendered_config(bed: Bed, tmp_path):
    """The lab's slurm.yaml names both hosts; 'det-lab monitor config' renders one scrape target per
    node (its NodeAddr: the names resolve on the hosts, not here); each host runs its det-lab
    exporter, and one Prometheus on the login node scrapes both."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.skip("needs Debian's prometheus package (prometheus, promtool): tests/setup.sh installs it")
    c, lab = bed.cluster, bed.lab
    a, b = c.nodes
    slurm_yaml = lab.root / ".det-lab" / "slurm.yaml"
    slurm_yaml.write_text(yaml.safe_dump({"nodes": [
        {"name": h.name, "addr": h.addr, "cpus": 2, "gpus": 2, "gpu_kind": "fake"} for h in (a, b)]}))
    exporters: list[subprocess.Popen] = []
    try:
        lab.cli("monitor", "config", "--out", str(tmp_path / "mon"), "--scrape-interval", "1s",
                "--tsdb", str(tmp_path / "tsdb"), check=True)
        conf = tmp_path / "mon" / "prometheus" / "prometheus.yml"
        (job,) = [j for j in yaml.safe_load(conf.read_text())["scrape_configs"] if j["job_name"] == "det-lab-node"]
        assert job["static_configs"][0]["targets"] == [f"{a.addr}:{DEFAULT_PORT}", f"{b.addr}:{DEFAULT_PORT}"]
        assert subprocess.run(["promtool", "check", "config", str(conf)], capture_output=True).returncode == 0
        # what the rendered det-lab-exporter-gpus unit runs on every node, each host with two GPUs of
        # the NVML stand-in (in the bed's directory: the hosts' /tmp is their own)
        nvml = build_shim(Path(tempfile.mkdtemp(prefix="nvml-", dir=c.dir)))
        for h in (a, b):
            conf_h = nvml["lib"] / f"{h.name}.conf"
            conf_h.write_text("".join(f"gpu GPU-{h.name}-{g} 0 0 0 1000 Fake GPU\n" for g in range(2)))
            env = {**lab.env, "LD_LIBRARY_PATH": str(nvml["lib"]), "NVML_SHIM_CONFIG": str(conf_h),
                   "DET_LAB_GPU_STATE_DIR": str(nvml["lib"] / f"state-{h.name}")}
            exporters.append(subprocess.Popen(c.host_argv(h, [str(VENV_BIN / "det-lab"), "exporter", "--port",
                                                              str(DEFAULT_PORT), "--source", "gpus"]),
                                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        port = free_port()
        exporters.append(subprocess.Popen(
            ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

        def query(expr: str) -> list[dict]:
            url = f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    return json.loads(resp.read())["data"]["result"]
            except OSError:  # not listening yet
                return []

        def gpus() -> set[tuple[str, str, str]] | None:
            series = query("det_lab_gpu_info")
            return {(r["metric"]["instance"], r["metric"]["host"], r["metric"]["uuid"]) for r in series} \
                if len(series) == 4 else None

        seen = mn.wait_for(gpus, 90, "both hosts' GPUs in Prometheus", poll=0.5)
        assert seen == {(f"{h.addr}:{DEFAULT_PORT}", h.name, f"GPU-{h.name}-{g}") for h in (a, b) for g in range(2)}
        up = {r["metric"]["instance"]: r["value"][1] for r in query('up{job="det-lab-node"}')}
        assert up == {f"{a.addr}:{DEFAULT_PORT}": "1", f"{b.addr}:{DEFAULT_PORT}": "1"}
    finally:
        slurm_yaml.unlink()
        for proc in exporters:
            proc.terminate()
            proc.wait(timeout=20)
