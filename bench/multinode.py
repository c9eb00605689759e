"""Several hosts, timed: the multi-host test bed up and down, a killed node's job running on another
node, and a cut-off node's copy of a job stopped.

    sudo python bench/multinode.py [--repeats 1] [--volume bind|sshfs]

Uses the tests' bed (tests/multihost.py: three hosts as network + UTS + mount namespaces on a
bridge, Slurm with slurmdbd across them from det_lab's rendered slurm.conf, the lab volume at one
path; root only). Each repeat brings a bed up, then:

- **kill**: a paced tiny run (``det-lab run --slurm``, a checkpoint every 20 batches) trains past
  its first checkpoint; every process of its node is killed, as a machine losing power; timed
  until Slurm runs the job on the other node (slurm.conf ``SlurmdTimeout`` is 5 s on the bed);
- **partition**: another run, its node's link cut (its processes run on with the volume); timed
  until the requeued copy runs on the other node, until the cut-off copy has stopped itself (the
  fence, det_lab/runs/fence.py), and, after the link is healed, until the node is idle again;
- the bed is torn down (timed).

``--volume sshfs``: the nodes mount the volume with sshfs from host 0 (tests/multihost.py), so the
cut-off node loses it too: its copy blocks at its next access to the volume and cannot stop while
cut off; the link is healed once the requeued copy runs, timed until the old copy has stopped.

Tracking is off (this measures the scheduler and the fence). Prints the date, the machine and,
per measure, each repeat and the median.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import multinode_steps as mn  # noqa: E402
from tests.multihost import (  # noqa: E402
    MultiHostCluster,
    lab_volume,
    namespaces_refused,
    sshfs_refused,
    start_bed,
    stop_bed,
)
from tests.slurm_cluster import ACCOUNTING_BINARIES, BINARIES, missing_binaries  # noqa: E402


def kill(cluster: MultiHostCluster, lab) -> dict[str, float]:
    """Kill the node of a running job: seconds until the job runs on the other node."""
    run_dir, job_id = mn.submit(lab, mn.config_file(lab, "bench-kill.yaml", **mn.PACED))
    mn.wait_for(lambda: mn.past_first_checkpoint(run_dir), 300, "the first checkpoint")
    node = mn.job(cluster, job_id)[1]
    victim = mn.host_of(cluster, node)
    t0 = time.monotonic()
    cluster.kill_host(victim)
    mn.wait_for(lambda: mn.job(cluster, job_id)[0] == "RUNNING" and mn.job(cluster, job_id)[1] not in ("", node),
                180, "the job on another node", poll=0.1)
    out = {"kill -> running on another node": time.monotonic() - t0}
    cluster.restart_slurmd(victim)
    cluster.run("scancel", job_id, check=False)
    cluster.wait_nodes(("idle",), timeout=180)
    return out


def partition(cluster: MultiHostCluster, lab) -> dict[str, float]:
    """Cut the node of a running job off: seconds until the requeued copy runs, until the cut-off
    copy stopped, and from the heal until the node is idle again."""
    conf = mn.config_file(lab, "bench-partition.yaml", **{**mn.PACED, "hyperparameters.sleep_per_batch": 0.5})
    run_dir, job_id = mn.submit(lab, conf)
    mn.wait_for(lambda: mn.past_first_checkpoint(run_dir), 300, "the first checkpoint")
    node = mn.job(cluster, job_id)[1]
    host = mn.host_of(cluster, node)
    out = {}
    t0 = time.monotonic()
    cluster.link(host, up=False)
    try:
        mn.wait_for(lambda: mn.job(cluster, job_id)[0] == "RUNNING" and mn.job(cluster, job_id)[1] not in ("", node),
                    180, "the requeued copy", poll=0.1)
        out["partition -> running on another node"] = time.monotonic() - t0
        if not cluster.volume_server:  # on sshfs the cut-off copy waits for its volume: heal first
            mn.wait_for(lambda: not mn.trial_pids(cluster, host, run_dir), 120, "the cut-off copy to stop", poll=0.1)
            out["partition -> old copy stopped"] = time.monotonic() - t0
    finally:
        cluster.link(host, up=True)
    healed = time.monotonic()
    if cluster.volume_server:
        mn.wait_for(lambda: not mn.trial_pids(cluster, host, run_dir), 120, "the cut-off copy to stop", poll=0.1)
        out["heal -> old copy stopped (sshfs)"] = time.monotonic() - healed
    mn.wait_for(lambda: cluster.node_state(host).rstrip("*") == "idle", 180, "the node back", poll=0.2)
    out["heal -> node idle again"] = time.monotonic() - healed
    cluster.run("scancel", job_id, check=False)
    cluster.wait_nodes(("idle",), timeout=180)
    return out


def one(volume: str) -> dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix="det-lab-multihost-bench-", dir="/var/tmp"))
    base.chmod(0o755)
    cluster = None
    try:
        lab = lab_volume(base)
        lab.write_config(tracking={"backend": "none"})
        cluster = start_bed(base, volume)
        lab.env.update({**cluster.env, **mn.FAST})
        out = {"bed up (munged to two idle nodes)": cluster.timings["up_s"]}
        out.update(kill(cluster, lab))
        out.update(partition(cluster, lab))
    finally:
        if cluster is not None:
            stop_bed(cluster)
        shutil.rmtree(base, ignore_errors=True)
    out["bed down"] = cluster.timings["down_s"]
    return out


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--volume", choices=("bind", "sshfs"), default="bind",
                        help="the nodes' volume: a bind mount, or sshfs from host 0 (a cut-off node loses it)")
    args = parser.parse_args()
    missing = missing_binaries(BINARIES + ACCOUNTING_BINARIES)
    if missing:
        sys.exit(f"the test bed needs Slurm, slurmdbd and MariaDB (missing {', '.join(missing)}): run tests/setup.sh")
    if os.geteuid() != 0:
        sys.exit("the test bed makes network namespaces and runs slurmd: run as root")
    refused = namespaces_refused()
    if refused:
        sys.exit(refused)
    started = dt.datetime.now(dt.timezone.utc)
    load = os.getloadavg()[0]  # other work on the machine slows every figure
    if args.volume == "sshfs" and sshfs_refused():
        sys.exit(sshfs_refused())
    runs = [one(args.volume) for _ in range(args.repeats)]
    print(f"# bench/multinode.py, {started:%Y-%m-%d %H:%M} UTC, {machine()}, load {load:.1f} at the start")
    print(f"# three namespace hosts, Slurm 22.05 (SlurmdTimeout 5 s), volume: {args.volume}, "
          f"{args.repeats} repeat(s); seconds")
    print("| measure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |")
    print("|---|" + "---|" * len(runs) + "---|")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"| {key} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
