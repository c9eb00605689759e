"""The mirror's cost to a training loop, its delivery rate and its memory during an outage.

    python bench/tracking_overhead.py [--steps 2000] [--metrics 20] [--matmul 384] [--outage-steps 20000]

One run, side by side, against a real ``mlflow server`` on 127.0.0.1 and a local Aim repo:

  * step time of a loop (one ``--matmul``-sized matmul per step, standing in for a training
    step) reporting ``--metrics`` metrics every step: no mirror, the MLflow mirror, the Aim
    mirror, both — as ratios to no mirror, and the absolute cost per step;
  * delivered points per second of each mirror, against back-to-back 1000-metric
    ``log_batch`` calls of the same points to the same server;
  * Python memory (tracemalloc peak) held by the mirror while the MLflow server is down and the
    loop logs ``--outage-steps`` more steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from det_lab.tracking.aim_backend import AimBackend
from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.mlflow_backend import MlflowBackend
from det_lab.tracking.mlflow_server import MlflowServer, free_port


def loop(steps: int, n_metrics: int, mirror: Mirror | None, size: int) -> float:
    """Seconds per step of a loop doing a little compute and reporting n_metrics per step."""
    a = torch.randn(size, size)
    names = [f"m{i:02d}" for i in range(n_metrics)]
    start = time.perf_counter()
    for step in range(1, steps + 1):
        b = a @ a
        value = float(b[0, 0])
        if mirror is not None:
            mirror.log_metrics("training", step, {n: value + i for i, n in enumerate(names)})
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--metrics", type=int, default=20)
    ap.add_argument("--matmul", type=int, default=384, help="side of the per-step matmul")
    ap.add_argument("--outage-steps", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    points = args.steps * args.metrics
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-") as tmp_name:
        tmp = Path(tmp_name)
        server = MlflowServer(tmp / "mlflow", free_port()).start()
        aim_repo = str(tmp / "aim")

        def mirror(name: str, kinds: tuple[str, ...]) -> Mirror:
            backends = []
            if "mlflow" in kinds:
                backends.append(MlflowBackend(server.uri))
            if "aim" in kinds:
                backends.append(AimBackend(aim_repo))
            return Mirror(RunInfo(f"bench-{name}", name, "bench"), backends, tmp / f"journal-{name}")

        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.uri)
        ts = int(time.time() * 1000)
        batch = [Metric(f"training/m{i % args.metrics:02d}", float(i), ts + i // args.metrics, i // args.metrics)
                 for i in range(points)]

        def log_batch_rate() -> float:
            run = client.create_run(client.create_experiment(f"bench-batch-{time.monotonic_ns()}"))
            start = time.perf_counter()
            for i in range(0, points, 1000):
                client.log_batch(run.info.run_id, metrics=batch[i:i + 1000])
            return points / (time.perf_counter() - start)

        log_batch_rate()  # warm the server's store up: its first run is much slower than later ones
        batch_rates = [log_batch_rate()]
        loop(200, args.metrics, None, args.matmul)  # warm up
        base = statistics.median(loop(args.steps, args.metrics, None, args.matmul) for _ in range(3))
        rows = [("no mirror", base, None)]
        for name, kinds in (("mlflow", ("mlflow",)), ("aim", ("aim",)), ("both", ("mlflow", "aim"))):
            m = mirror(name, kinds)
            start = time.perf_counter()
            per_step = loop(args.steps, args.metrics, m, args.matmul)
            summary = m.close(timeout=600)
            assert summary.complete, str(summary)
            rows.append((name, per_step, points / (time.perf_counter() - start)))

        batch_rates.append(log_batch_rate())  # before and after the mirrors: the mean is the reference
        batch_rate = statistics.mean(batch_rates)

        m = mirror("outage", ("mlflow",))
        m.flush()
        server.stop()
        tracemalloc.start()
        loop(args.outage_steps, args.metrics, m, 8)
        m.flush(timeout=2)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        journal_bytes = sum(p.stat().st_size for p in (tmp / "journal-outage").glob("seg-*"))
        m.close(timeout=1)

    print(f"\n{args.steps} steps x {args.metrics} metrics = {points} points a run; MLflow server on 127.0.0.1 "
          f"(SQLite, local disk), Aim local repo\n")
    print(f"{'mirror':<12} {'step (ms)':>10} {'vs none':>9} {'overhead':>9} {'µs/step':>8} {'points/s delivered':>19} {'vs log_batch':>13}")
    for name, per_step, rate in rows:
        overhead = per_step / base - 1
        delivered = f"{rate:>19.0f} {rate / batch_rate:>12.0%}" if rate else f"{'':>19} {'':>13}"
        print(f"{name:<12} {per_step * 1000:>10.3f} {per_step / base:>8.3f}x {overhead:>8.1%} "
              f"{(per_step - base) * 1e6:>8.1f} {delivered}")
    print(f"{'log_batch':<12} {'':>10} {'':>9} {'':>9} {'':>8} {batch_rate:>19.0f} {1:>12.0%}   "
          f"(back-to-back, 1000 a call; mean of {', '.join(f'{r:.0f}' for r in batch_rates)})")
    print(f"\noutage: {args.outage_steps * args.metrics} points logged with the server down; mirror's Python "
          f"memory peak {peak / 2**20:.1f} MiB; journal on disk {journal_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
