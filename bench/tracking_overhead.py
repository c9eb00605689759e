"""The mirror's cost to a training loop, its delivery rate, and its memory during an outage.

    python bench/tracking_overhead.py [--reps 5] [--metrics 20] [--outage-steps 20000]

One run, side by side, against a real ``mlflow server`` on 127.0.0.1 and a local Aim repo:

  * step time of a loop (one single-threaded matmul per step, sized to take about 1.2 ms and
    10 ms, standing in for a training step) reporting ``--metrics`` metrics every step: no
    mirror, no mirror beside a busy idle-class process ("busy": the floor for any delivery in
    another process), the MLflow mirror, the Aim mirror, both. Arms are interleaved and repeated
    ``--reps`` times (one mirror per arm, its senders started before the first timed loop); the
    table shows medians, and each arm's ratio to no mirror (≥ 0.99 is "under 1 %");
  * delivery: points per second from the first point to the last one acknowledged by the
    tracker, in the 1.2 ms arms (the loop produces points faster than any tracker takes them),
    against each backend's ceiling measured in the same run: back-to-back 1000-point
    ``MlflowClient.log_batch`` calls, and back-to-back ``Run.track`` calls from a separate process;
  * memory while the MLflow server is down and the loop logs ``--outage-steps`` steps: the
    training process's Python allocations for the mirror (tracemalloc peak), the sender's
    resident memory (peak and growth), the journal on disk.

The MLflow server runs like the senders (idle CPU class, on the last CPU): it stands in for a
server on another machine, so it must not take the loop's CPU either.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from pathlib import Path

import torch

from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.mlflow_server import MlflowServer, free_port
from det_lab.tracking.delivery import yield_the_cpu

ARMS = ("none", "busy", "mlflow", "aim", "both")
#: "busy": no mirror, while a busy loop in SCHED_IDLE (the senders' class) runs in another process.
#: It is the floor any out-of-process delivery has on this machine: what a neighbour that only
#: takes idle CPU still costs the loop (shared caches, memory bandwidth, a hypervisor's vCPUs).
BUSY = "from det_lab.tracking.delivery import yield_the_cpu\nyield_the_cpu()\nwhile True:\n    pass\n"

AIM_CEILING = textwrap.dedent("""
    import sys, time
    from aim import Repo, Run
    repo, steps, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    run = Run(repo=Repo.from_path(repo, init=not Repo.exists(repo)), system_tracking_interval=None,
              capture_terminal_logs=False, log_system_params=False)
    names = [f"m{i:02d}" for i in range(n)]
    start = time.perf_counter()
    for step in range(steps):
        for i, name in enumerate(names):
            run.track(step + i * 0.5, name=name, step=step, context={"subset": "training"})
    print(steps * n / (time.perf_counter() - start))
    run.close()
""")


def loop(steps: int, n_metrics: int, mirror: Mirror | None, size: int, first: int = 1,
         cpu: list[float] | None = None) -> float:
    """Seconds per step of a loop doing a matmul and reporting n_metrics per step from step
    ``first``; appends the process's CPU seconds per step (every thread) to ``cpu``."""
    a = torch.randn(size, size)
    names = [f"m{i:02d}" for i in range(n_metrics)]
    start, start_cpu = time.perf_counter(), time.process_time()
    for step in range(first, first + steps):
        b = a @ a
        value = float(b[0, 0])
        if mirror is not None:
            mirror.log_metrics("training", step, {n: value + i for i, n in enumerate(names)})
    if cpu is not None:
        cpu.append((time.process_time() - start_cpu) / steps)
    return (time.perf_counter() - start) / steps


def calibrate(target_s: float) -> int:
    """The matmul side whose step takes about ``target_s`` here, now."""
    size = 64
    while True:
        per_step = statistics.median(loop(20, 0, None, size) for _ in range(3))
        if per_step >= target_s or size > 4096:
            return size
        size = int(size * min(1.25, max(1.02, (target_s / per_step) ** (1 / 3))))


def idle_class(pgid: int) -> None:
    """Put every thread of process group ``pgid`` (the server and its workers) in SCHED_IDLE, on the
    CPU the senders keep to."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            for task in (proc / "task").iterdir():
                yield_the_cpu(int(task.name))
        except OSError:  # gone meanwhile
            continue


def stolen_jiffies() -> int:
    """CPU time the hypervisor took from this machine's vCPUs so far (``steal`` in /proc/stat)."""
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--metrics", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one timed loop")
    ap.add_argument("--outage-steps", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-") as tmp_name:
        tmp = Path(tmp_name)
        server = MlflowServer(tmp / "mlflow", free_port()).start()
        idle_class(server.proc.pid)
        aim_repo = str(tmp / "aim")
        mirrors: dict[str, Mirror | None] = {"none": None, "busy": None}
        for arm, targets in (("mlflow", {"mlflow": server.uri}), ("aim", {"aim": aim_repo}),
                             ("both", {"mlflow": server.uri, "aim": aim_repo})):
            mirrors[arm] = Mirror(RunInfo(f"bench-{arm}", arm, "bench"), targets, tmp / f"journal-{arm}")
            assert mirrors[arm].flush(timeout=300), "senders did not start"  # imports done, runs open
        next_step = dict.fromkeys(ARMS, 1)

        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.uri)

        def log_batch_rate(points: int) -> float:
            run = client.create_run(client.create_experiment(f"bench-batch-{time.monotonic_ns()}"))
            ts = int(time.time() * 1000)
            batch = [Metric(f"training/m{i % args.metrics:02d}", float(i), ts, i // args.metrics) for i in range(points)]
            start = time.perf_counter()
            for i in range(0, points, 1000):
                client.log_batch(run.info.run_id, metrics=batch[i:i + 1000])
            return points / (time.perf_counter() - start)

        def aim_rate(steps: int) -> float:
            out = subprocess.run([sys.executable, "-c", AIM_CEILING, str(tmp / "aim-ceiling"), str(steps),
                                  str(args.metrics)], capture_output=True, text=True, check=True)
            return float(out.stdout.split()[-1])

        log_batch_rate(20000)  # warm the server's store up: its first run is much slower than later ones
        ceilings: dict[str, list[float]] = {"mlflow": [], "aim": []}
        results: dict[tuple[float, str], list[float]] = {}
        cpu_times: dict[tuple[float, str], list[float]] = {}
        steal: dict[tuple[float, str], list[float]] = {}
        delivery: dict[str, list[float]] = {"mlflow": [], "aim": [], "both/mlflow": [], "both/aim": []}
        sizes = {target: calibrate(target) for target in (0.0012, 0.010)}
        loop(200, args.metrics, None, sizes[0.0012])  # warm up
        for rep in range(args.reps):
            ceilings["mlflow"].append(log_batch_rate(20000))
            ceilings["aim"].append(aim_rate(20000 // args.metrics))
            for target, size in sizes.items():
                steps = max(100, int(args.seconds / target))
                for arm in random.sample(ARMS, len(ARMS)):
                    m = mirrors[arm]
                    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if arm == "busy" else None
                    start, stolen = time.perf_counter(), stolen_jiffies()
                    results.setdefault((target, arm), []).append(
                        loop(steps, args.metrics, m, size, next_step[arm], cpu_times.setdefault((target, arm), [])))
                    steal.setdefault((target, arm), []).append(
                        (stolen_jiffies() - stolen) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - start))
                    next_step[arm] += steps
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                    if m is None:
                        continue
                    deadline = time.monotonic() + 900
                    while not m.flush(timeout=60):  # until delivered, through a tracker's hiccups
                        assert time.monotonic() < deadline, "not delivered"
                    if target == 0.0012:
                        for name in m.targets:
                            finished = _delivered_at(m.journal.directory, name)
                            key = name if arm != "both" else f"both/{name}"
                            delivery[key].append(steps * args.metrics / (finished - start))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

        call_cpu = log_metrics_cpu(tmp, args.metrics)
        for m in mirrors.values():
            if m is not None:
                m.close(timeout=60)
        outage = outage_memory(server, tmp, args.outage_steps, args.metrics)

    ceiling = {k: statistics.median(v) for k, v in ceilings.items()}
    print(f"\n{args.metrics} metrics every step; medians of {args.reps} interleaved repeats; MLflow server on "
          f"127.0.0.1 (SQLite, local disk), Aim local repo; {os.cpu_count()} CPUs\n")
    print("step time (wall) and the training process's CPU time per step (all its threads; what the mirror costs")
    print("it, whatever else the machine runs), each with its ratio to no mirror\n")
    print(f"{'mirror':<8} {'1.2 ms steps':>13} {'ratio':>6} {'µs/step':>8} {'CPU µs':>7} {'ratio':>6}   "
          f"{'10 ms steps':>12} {'ratio':>6} {'µs/step':>8} {'CPU µs':>7} {'ratio':>6}   {'delivered points/s (1.2 ms)':>28}")
    for arm in ARMS:
        cells = []
        for target in sizes:
            base = statistics.median(results[(target, "none")])
            per_step = statistics.median(results[(target, arm)])
            base_cpu = statistics.median(cpu_times[(target, "none")])
            arm_cpu = statistics.median(cpu_times[(target, arm)])
            cells.append(f"{per_step * 1e3:>10.3f} ms {base / per_step:>6.3f} {(per_step - base) * 1e6:>+8.1f} "
                         f"{(arm_cpu - base_cpu) * 1e6:>+7.1f} {base_cpu / arm_cpu:>6.3f}")
        rates = [(name, statistics.median(delivery[name if arm != "both" else f"both/{name}"]))
                 for name in ("mlflow", "aim") if arm in (name, "both")]
        shown = ", ".join(f"{name} {rate:.0f} = {rate / ceiling[name]:.0%}" for name, rate in rates)
        print(f"{arm:<8} {cells[0]}   {cells[1]}   {shown}")
    print("\nCPU taken by the hypervisor from this machine during the loops (steal, % of one CPU): " + "; ".join(
        f"{arm} " + " / ".join(f"{statistics.median(steal[(t, arm)]):.1%}" for t in sizes) for arm in ARMS))
    print(f"\nceilings (medians): MLflow back-to-back log_batch {ceiling['mlflow']:.0f} points/s "
          f"({', '.join(f'{r:.0f}' for r in ceilings['mlflow'])}); Aim back-to-back Run.track from a separate "
          f"process {ceiling['aim']:.0f} points/s ({', '.join(f'{r:.0f}' for r in ceilings['aim'])})")
    print(f"\none log_metrics call with {args.metrics} metrics: {call_cpu * 1e6:.1f} µs of the calling thread's CPU "
          f"(median of 5 x 20000 calls; the writer thread and the senders not included)")
    print(f"\noutage: {outage['points']} points logged with the MLflow server down: training process's Python "
          f"memory for the mirror peaked at {outage['trial_peak'] / 2**20:.1f} MiB; sender resident "
          f"{outage['sender_rss'] / 1024:.0f} MiB at the end, peak {outage['sender_hwm'] / 1024:.0f} MiB, grew "
          f"{outage['sender_growth'] / 1024:.1f} MiB during the outage; journal on disk "
          f"{outage['journal_bytes'] / 2**20:.1f} MiB; {outage['journaled']} events journaled")


def log_metrics_cpu(tmp: Path, n_metrics: int) -> float:
    """CPU seconds of the calling thread per ``log_metrics`` call: the mirror's own cost to a step,
    whatever else the machine runs (to a tracker that is down: delivery does not load the machine)."""
    mirror = Mirror(RunInfo("bench-calls", "calls", "bench"), {"mlflow": f"http://127.0.0.1:{free_port()}"},
                    tmp / "journal-calls", linger=0)
    values = {f"m{i:02d}": 0.5 + i for i in range(n_metrics)}
    samples = []
    for rep in range(5):
        start = time.thread_time()
        for step in range(rep * 20000 + 1, (rep + 1) * 20000 + 1):
            mirror.log_metrics("training", step, values)
        samples.append((time.thread_time() - start) / 20000)
    mirror.close(timeout=1)
    return statistics.median(samples)


def _delivered_at(journal: Path, backend: str) -> float:
    """When the backend's cursor last moved (perf_counter clock)."""
    mtime = (journal / f"cursor-{backend}.json").stat().st_mtime
    return time.perf_counter() - (time.time() - mtime)


def outage_memory(server: MlflowServer, tmp: Path, steps: int, n_metrics: int) -> dict[str, int]:
    m = Mirror(RunInfo("bench-outage", "outage", "bench"), {"mlflow": server.uri}, tmp / "journal-outage", linger=0)
    assert m.flush(timeout=120)
    sender = m._senders[0].proc.pid
    server.stop()
    m.log_metrics("training", 0, {"warm": 1.0})
    m.flush(timeout=30)  # the sender has found the server down
    rss_before = rss_kib(sender, "VmRSS")
    tracemalloc.start()
    loop(steps, n_metrics, m, 8)
    m.flush(timeout=2)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = {"points": steps * n_metrics, "trial_peak": peak, "sender_rss": rss_kib(sender, "VmRSS"),
           "sender_hwm": rss_kib(sender, "VmHWM"), "journaled": m.journal.last_seq,
           "journal_bytes": sum(p.stat().st_size for p in (tmp / "journal-outage").glob("seg-*"))}
    out["sender_growth"] = out["sender_rss"] - rss_before
    m.close(timeout=1)
    return out


if __name__ == "__main__":
    main()
