"""det_lab's Slurm path on the multi-host bed with the lab volume on a FUSE network mount: the nodes
mount it with sshfs from host 0 over the bridge (tests/multihost.py, ``multihost_sshfs``), so a node
cut off loses its volume too.

What a network volume adds to the partition of tests/test_multinode_slurm.py: the cut-off copy does
not see the requeued copy take over; it blocks at its next access to the volume, and whatever it had
sent or queued is held up in the TCP connection of its sshfs, to land when the link heals, after
the requeued copy may have finished (shared/notes/multihost.md: "one stale write landed over the
newer value after the heal"). The test heals only then, and checks that nothing of the run changed.

Relied on besides the Slurm behaviours listed in tests/test_multinode_slurm.py: one sshfs connection
per mount (``max_conns=1``, sshfs(1)) and one sftp-server per connection answering in order, so a
request a node sends after the heal is answered after every request the partition held up.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests import multinode_steps as mn
from tests.multihost import Bed, MultiHostCluster, multihost_sshfs, record_timing  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def bed(multihost_sshfs: Bed) -> Bed:  # noqa: F811 (the fixture imported above)
    # the requeued copy waits for the cut-off copy's trainer lock to expire (it cannot release it):
    # 9 s, refreshed every 3 s, plus flufl's 10 s slop
    multihost_sshfs.lab.env.update({**mn.FAST, "DET_LAB_LOCK_LIFETIME": "9"})
    return multihost_sshfs


def _slurmd(cluster: MultiHostCluster, host) -> int:
    """The pid of ``host``'s slurmd: its mount namespace is the one the node's jobs see."""
    for pid in cluster.pids(host):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no slurmd on {host.name}")


def _volume_fs(pid: int, path: Path) -> str:
    """The file system type of the mount at ``path`` as process ``pid`` sees it (the last one mounted there)."""
    types = [line.split(" - ")[1].split()[0] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
             if line.split()[4] == str(path)]
    return types[-1] if types else ""


def _barrier(cluster: MultiHostCluster, host, timeout: float = 90) -> None:
    """Create and remove a file through ``host``'s own sshfs connection (its slurmd's mount): once it
    is answered, every request the partition held up on that connection has been answered."""
    probe = cluster.data_root / f".barrier-{uuid.uuid4().hex}"
    subprocess.run(["nsenter", "-t", str(_slurmd(cluster, host)), "-m", "-n", "--", "sh", "-c",
                    f"touch {probe} && rm {probe}"], check=True, timeout=timeout)


def _snapshot(run_dir: Path, ckpts: Path, job_id: str) -> dict[str, object]:
    """Everything of the run a stale copy could write: its record, metrics, checkpoints (their
    files), its attempt, its tracking journal (events, marks, writer, end)."""
    journal = run_dir / "tracking-journal"
    files = {p.relative_to(journal).as_posix(): p.read_bytes() for p in sorted(journal.rglob("*"))
             if p.is_file() and not p.name.startswith(("cursor-", "sender-", "."))}
    return {"run.json": (run_dir / "run.json").read_bytes(), "attempt.json": (run_dir / "attempt.json").read_bytes(),
            "metrics.jsonl": (run_dir / "metrics.jsonl").read_bytes(), "journal": files,
            "checkpoints": {u: sorted(p.relative_to(ckpts / u).as_posix() for p in (ckpts / u).rglob("*"))
                            for u in mn.job_checkpoints(ckpts, job_id)}}


def _cursors(run_dir: Path) -> dict[str, int]:
    """How far each tracking backend's sender has delivered the run's journal."""
    return {p.name: json.loads(p.read_text())["seq"] for p in (run_dir / "tracking-journal").glob("cursor-*.json")}


def test_a_cut_off_node_s_held_up_writes_land_nothing_after_the_heal(bed: Bed):
    c, lab = bed.cluster, bed.lab
    c.wait_nodes(("idle",))
    # faster than PACED: the cut-off copy blocks at its next access to the volume, whatever its pace
    config = mn.config_file(lab, "tiny-sshfs.yaml", **{**mn.PACED, "hyperparameters.sleep_per_batch": 0.25})
    run_dir, job_id = mn.submit(lab, config)
    straight = mn.straight(lab, config)
    mn.wait_for(lambda: mn.past_first_checkpoint(run_dir), 180, "the first checkpoint")
    node = mn.job(c, job_id)[1]
    host = mn.host_of(c, node)
    slurmd = _slurmd(c, host)  # the job's volume is the network mount
    assert _volume_fs(slurmd, c.data_root) == "fuse.sshfs", Path(f"/proc/{slurmd}/mountinfo").read_text()
    assert mn.trial_pids(c, host, run_dir)
    ckpts = lab.root / "checkpoints" / "vla"
    cut_at = time.monotonic()
    c.link(host, up=False)  # the node's processes run on; its volume stops answering
    try:
        mn.wait_for(lambda: mn.job(c, job_id)[0] == "RUNNING" and mn.job(c, job_id)[1] not in ("", node), 120,
                    "the requeued copy running on another node", poll=0.2)
        record_timing(c, "sshfs_partition_to_running_elsewhere_s", time.monotonic() - cut_at)
        mn.wait_for(lambda: mn.final(c, job_id) == "COMPLETED", 240, "the requeued job to complete", poll=1)
        # the cut-off copy is still there, held up by its volume, with what it was writing
        assert mn.trial_pids(c, host, run_dir), "the cut-off copy ended before the heal"
        before = _snapshot(run_dir, ckpts, job_id)
        cursors = _cursors(run_dir)
    finally:
        c.link(host, up=True)
    healed_at = time.monotonic()
    mn.wait_for(lambda: not mn.trial_pids(c, host, run_dir), 120, "the cut-off copy to stop after the heal",
                poll=0.2)
    record_timing(c, "sshfs_heal_to_old_copy_stopped_s", time.monotonic() - healed_at)
    _barrier(c, host)  # whatever the partition held up has landed now
    assert _snapshot(run_dir, ckpts, job_id) == before, "the cut-off copy wrote after the heal"
    # its tracking sender may deliver what it holds (MLflow keeps an event once): never move a cursor back
    assert {k: v for k, v in _cursors(run_dir).items() if v < cursors.get(k, 0)} == {}, (cursors, _cursors(run_dir))

    straight_out = straight.communicate(timeout=240)[0]
    assert straight.returncode == 0, straight_out
    st = mn.check_run(bed, run_dir, mn.local_run(lab, config))
    first, second = st["slurm"]["attempts"]
    assert first["node"] == node and second["node"] != node and (first["epoch"], second["epoch"]) == (1, 2)
    assert "ended" not in first
    # every checkpoint of the job on the volume is in the chain (or deleted by retention): none
    # left by a late writer, and the cut-off node's were all written before the requeued copy's
    written = mn.job_checkpoints(ckpts, job_id)
    assert set(written) <= {x["uuid"] for x in st["checkpoints"] + st.get("checkpoints_deleted", [])}, written
    by_old = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") == node)
    by_new = sorted(m["steps_completed"] for m in written.values() if m["det_lab"].get("slurm_node") != node)
    assert by_new and (not by_old or max(by_old) < min(by_new)), (by_old, by_new)
    # the tracking journal: each event once, in order (a stale writer's lines would repeat numbers)
    seqs = [json.loads(line)["seq"] for seg in sorted((run_dir / "tracking-journal").glob("seg-*.jsonl"))
            for line in seg.read_text().splitlines() if line.strip()]
    assert seqs == sorted(set(seqs)), "the journal holds an event number twice or out of order"
    assert mn.final(c, job_id) == "COMPLETED"  # the cut-off copy's end changed nothing for Slurm either
