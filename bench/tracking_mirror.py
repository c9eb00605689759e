"""What mirroring costs the training loop, and what an outage costs, side by side in one run.

    python bench/tracking_mirror.py [--points 2000] [--outage-points 2000]

Against a real ``mlflow server`` on 127.0.0.1 (SQLite on local disk), times:

  1. MLflow's sync client: ``mlflow.log_metric`` per point;
  2. ``MlflowClient.log_batch`` in batches of 1000 (the best a loop can do by hand);
  3. det_lab's mirror: time the loop spends in ``log_metrics``, and until all is delivered;
  4. an outage: the server is killed, the loop logs ``--outage-points`` more points, the server
     comes back; how long the loop was blocked, and how many points arrived in the end —
     for MLflow's sync client (with 2 retries, not its default 7 which blocks ~4 min a call)
     and for the mirror.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.mlflow_server import MlflowServer, free_port


def count(client, run_id: str, key: str) -> int:
    return len(client.get_metric_history(run_id, key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=2000)
    ap.add_argument("--outage-points", type=int, default=2000)
    args = ap.parse_args()
    n = args.points
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-") as tmp:
        server = MlflowServer(Path(tmp) / "mlflow", free_port()).start()
        os.environ["MLFLOW_TRACKING_URI"] = server.uri
        import mlflow
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.uri)
        exp = client.create_experiment("bench")
        rows = []

        run = client.create_run(exp, run_name="sync")
        start = time.perf_counter()
        with mlflow.start_run(run_id=run.info.run_id):
            for i in range(n):
                mlflow.log_metric("loss", 1.0 / (i + 1), step=i)
        rows.append(("1. mlflow.log_metric per point (sync)", time.perf_counter() - start, None))

        run = client.create_run(exp, run_name="batch")
        start = time.perf_counter()
        ts = int(time.time() * 1000)
        points = [Metric("loss", 1.0 / (i + 1), ts, i) for i in range(n)]
        for i in range(0, n, 1000):
            client.log_batch(run.info.run_id, metrics=points[i:i + 1000])
        rows.append(("2. MlflowClient.log_batch, 1000 per call", time.perf_counter() - start, None))

        mirror = Mirror(RunInfo("bench-mirror", "mirror", "bench"), {"mlflow": server.uri}, Path(tmp) / "journal")
        start = time.perf_counter()
        for i in range(n):
            mirror.log_metrics("training", i, {"loss": 1.0 / (i + 1)})
        in_loop = time.perf_counter() - start
        summary = mirror.close()
        rows.append(("3. det_lab mirror: time inside the training loop", in_loop, None))
        rows.append(("3. det_lab mirror: until everything is delivered", time.perf_counter() - start, None))
        assert count(client, summary.backends[0].run_id, "training/loss") == n

        # 4. outages
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "2"
        run = client.create_run(exp, run_name="sync-outage")
        mlflow.start_run(run_id=run.info.run_id)
        server.stop()
        threading.Timer(20.0, server.start).start()  # the server comes back after 20 s
        start, lost = time.perf_counter(), 0
        for i in range(args.outage_points):
            try:
                mlflow.log_metric("loss", 1.0, step=i)
            except Exception:
                lost += 1
        blocked = time.perf_counter() - start
        mlflow.end_run()
        while server.proc is None:
            time.sleep(0.5)
        arrived = count(client, run.info.run_id, "loss")
        rows.append((f"4. sync client, 20 s outage: loop blocked; {arrived}/{args.outage_points} arrived", blocked, arrived))

        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        mirror = Mirror(RunInfo("bench-outage", "mirror-outage", "bench"), {"mlflow": server.uri},
                        Path(tmp) / "journal-outage", interval=0.5)
        mirror.flush()
        server.stop()
        threading.Timer(20.0, server.start).start()
        start = time.perf_counter()
        for i in range(args.outage_points):
            mirror.log_metrics("training", i, {"loss": 1.0})
        blocked = time.perf_counter() - start
        while server.proc is None:
            time.sleep(0.5)
        deadline = time.monotonic() + 120
        while not mirror.flush(timeout=5) and time.monotonic() < deadline:
            pass
        summary = mirror.close()
        arrived = count(client, summary.backends[0].run_id, "training/loss")
        rows.append((f"4. det_lab mirror, 20 s outage: loop blocked; {arrived}/{args.outage_points} arrived", blocked, arrived))
        server.stop()

    print(f"\n{n} points; MLflow server on 127.0.0.1 with SQLite on local disk\n")
    print(f"{'what':<78} {'seconds':>9}")
    for what, secs, _ in rows:
        print(f"{what:<78} {secs:>9.3f}")


if __name__ == "__main__":
    main()
