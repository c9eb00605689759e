"""The mirror against a real MLflow server: complete, in order, through outages and restarts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from mlflow.tracking import MlflowClient

from det_lab.tracking.events import RunInfo
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.mlflow_backend import RUN_KEY_TAG, MlflowBackend
from tests.aim_fixtures import Relay


def run_info(key: str) -> RunInfo:
    return RunInfo(key=key, name=f"vla exp 7 trial {key}", experiment="det_lab-tests",
                   tags={"det.experiment_id": "7", "det.trial_id": key, "dataset.commit": "abc123"})


@pytest.fixture
def tracker(shared_mlflow_server):
    """The server as clients reach it: ``stop()`` cuts them off (an outage), ``start()`` ends that."""
    relay = Relay(shared_mlflow_server.port).start()
    yield relay
    relay.stop()


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_every_group_params_tags_and_checkpoints_arrive(shared_mlflow_server, tmp_path):
    mirror = Mirror(run_info("t1"), {"mlflow": shared_mlflow_server.uri}, tmp_path / "journal", interval=0.2)
    mirror.log_params({"lr": 1e-3, "model": {"layers": 4, "width": 256}})
    for step in range(1, 301):
        mirror.log_metrics("training", step, {"loss": 1.0 / step, "grad_norm": step * 0.5, "note": "skipped"})
        if step % 100 == 0:
            mirror.log_metrics("validation", step, {"val_loss": 2.0 / step})
            mirror.log_metrics("rollout", step, {"success_rate": step / 300})
            mirror.log_checkpoint(f"ckpt-{step}", step, {"dataset.md5": "d41d8cd9.dir"})
    summary = mirror.close()
    assert summary.complete, str(summary)
    assert summary.backends[0].delivered > 300

    client = MlflowClient(shared_mlflow_server.uri)
    run = client.get_run(summary.backends[0].run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "vla exp 7 trial t1"
    assert history(client, run.info.run_id, "training/loss") == [(s, 1.0 / s) for s in range(1, 301)]
    assert len(history(client, run.info.run_id, "training/grad_norm")) == 300
    assert history(client, run.info.run_id, "validation/val_loss") == [(s, 2.0 / s) for s in (100, 200, 300)]
    assert history(client, run.info.run_id, "rollout/success_rate")[-1] == (300, 1.0)
    assert run.data.params == {"lr": "0.001", "model.layers": "4", "model.width": "256"}
    tags = run.data.tags
    assert tags[RUN_KEY_TAG] == "t1" and tags["det.experiment_id"] == "7" and tags["dataset.commit"] == "abc123"
    assert tags["det_lab.checkpoint.latest"] == "ckpt-300"
    assert json.loads(tags["det_lab.checkpoint.ckpt-200"]) == {"step": 200, "dataset.md5": "d41d8cd9.dir"}


def test_outage_loses_nothing_and_training_never_waits(tracker, tmp_path):
    mirror = Mirror(run_info("outage"), {"mlflow": tracker.uri}, tmp_path / "journal", interval=0.2)
    for step in range(1, 101):
        mirror.log_metrics("training", step, {"loss": float(step)})
    assert mirror.flush(timeout=30)
    tracker.stop()  # the tracking server goes away mid-training
    start = time.monotonic()
    for step in range(101, 2101):
        mirror.log_metrics("training", step, {"loss": float(step)})
    logging_time = time.monotonic() - start
    assert mirror.flush(timeout=5) is False  # durable in the journal, not delivered
    assert mirror.journal.pending("mlflow") >= 2000
    tracker.start()
    deadline = time.monotonic() + 90
    while not mirror.flush(timeout=5) and time.monotonic() < deadline:
        pass
    summary = mirror.close()
    assert summary.complete, str(summary)
    steps = history(MlflowClient(tracker.uri), summary.backends[0].run_id, "training/loss")
    assert steps == [(s, float(s)) for s in range(1, 2101)]  # all of them, once each
    # 2000 calls while the server was down did not wait on the network
    assert logging_time < 10, logging_time


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from det_lab.tracking.events import RunInfo
    from det_lab.tracking.mirror import Mirror
    uri, journal, first, last = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    m = Mirror(RunInfo(key="restart", name="restart", experiment="det_lab-tests"), {"mlflow": uri}, journal)
    for step in range(first, last + 1):
        m.log_metrics("training", step, {"loss": float(step)})
    print(m.close(timeout=3))
""")


def test_restarted_process_replays_the_journal_into_the_same_run(tracker, tmp_path):
    tracker.stop()
    journal = tmp_path / "journal"

    def child(first: int, last: int) -> str:
        proc = subprocess.run([sys.executable, "-c", CHILD, tracker.uri, str(journal), str(first), str(last)],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr

    # process 1 runs while the server is down: it exits with everything journaled, nothing sent
    out = child(1, 500)
    assert "501 pending" in out, out  # 500 metric events and the run's tags
    tracker.start()
    out = child(501, 600)  # process 2 (a restarted trial) with the server back
    assert "pending" not in out, out
    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name("det_lab-tests")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = 'restart'")
    assert len(runs) == 1
    assert history(client, runs[0].info.run_id, "training/loss") == [(s, float(s)) for s in range(1, 601)]


def test_resume_on_another_machine_continues_the_same_run(shared_mlflow_server, tmp_path):
    first = Mirror(run_info("resume"), {"mlflow": shared_mlflow_server.uri}, tmp_path / "machine-a")
    first.log_params({"lr": 0.1})
    first.log_metrics("training", 1, {"loss": 1.0})
    run_id = first.close().backends[0].run_id
    # no journal on machine B: the run is found by its key; the same params are re-sent harmlessly
    second = Mirror(run_info("resume"), {"mlflow": shared_mlflow_server.uri}, tmp_path / "machine-b")
    second.log_params({"lr": 0.1})
    second.log_metrics("training", 2, {"loss": 0.5})
    summary = second.close()
    assert summary.complete and summary.backends[0].run_id == run_id
    assert history(MlflowClient(shared_mlflow_server.uri), run_id, "training/loss") == [(1, 1.0), (2, 0.5)]


def test_redelivered_batch_is_not_duplicated(shared_mlflow_server, tmp_path):
    """A crash between delivery and the cursor update replays a batch: MLflow must not double it."""
    backend = MlflowBackend(shared_mlflow_server.uri)
    run_id = backend.open(run_info("dupes"), None)
    from det_lab.tracking.events import Metrics
    batch = [Metrics("training", s, {"loss": float(s)}, timestamp=1_700_000_000 + s) for s in range(1, 51)]
    backend.deliver(batch)
    backend.deliver(batch)
    client = MlflowClient(shared_mlflow_server.uri)
    assert history(client, run_id, "training/loss") == [(s, float(s)) for s in range(1, 51)]


def test_tracking_sync_delivers_what_a_finished_run_left_behind(lab, tracker):
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": tracker.uri})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    journal = lab.root / "outputs" / "vla" / "tracking-journal" / "left-behind"
    tracker.stop()
    mirror = Mirror(run_info("left-behind"), {"mlflow": tracker.uri}, journal, linger=0)  # sync's job, not its sender's
    for step in range(1, 51):
        mirror.log_metrics("training", step, {"loss": float(step)})
    assert mirror.close(timeout=2).backends[0].pending == 51
    status = lab.cli("tracking", "status")
    assert "51 events waiting" in status.stdout and str(journal) in status.stdout
    tracker.start()
    proc = lab.cli("tracking", "sync")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name("det_lab-tests")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = 'left-behind'")
    assert history(client, run.info.run_id, "training/loss") == [(s, float(s)) for s in range(1, 51)]
    assert "0 journal(s)" in lab.cli("tracking", "status").stdout


def test_infinite_values_arrive_and_do_not_block_delivery(shared_mlflow_server, tmp_path):
    mirror = Mirror(run_info("inf"), {"mlflow": shared_mlflow_server.uri}, tmp_path / "journal", interval=0.2)
    mirror.log_metrics("training", 1, {"loss": float("inf"), "ok": 1.0})
    mirror.log_metrics("training", 2, {"loss": 2.0, "ok": 2.0})
    summary = mirror.close()
    assert summary.complete, str(summary)
    client = MlflowClient(shared_mlflow_server.uri)
    losses = sorted((m.step, m.value) for m in client.get_metric_history(summary.backends[0].run_id, "training/loss"))
    import sys

    # MLflow's SQL store keeps +inf as the largest double
    assert losses in ([(1, float("inf")), (2, 2.0)], [(1, sys.float_info.max), (2, 2.0)])
