"""The exporter's tracker series on a healthy lab: one finished run, delivered in full to the local MLflow
store (SQLite under XDG_DATA_HOME, the default when the lab config names no tracking URI).

Prometheus' instrumentation practice ("avoid missing metrics"): a known run and backend with nothing
undelivered is a 0, not an absent series, and a local store that is there is up (1), so a panel never
has to tell an empty answer from a healthy one; the store gone is 0, not "no data".
"""

from __future__ import annotations

import json
from pathlib import Path

from det_lab.monitoring.source_trackers import TrackersSource
from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.conftest import publish_tiny_data
from tests.test_monitoring import parse_exposition
from tests.test_trials_local import TINY


def exposition(settings) -> list[tuple[str, dict, float]]:
    from prometheus_client import CollectorRegistry, generate_latest

    source = TrackersSource(settings)

    class Collector:
        def collect(self):
            return source.collect()

    registry = CollectorRegistry()
    registry.register(Collector())
    return parse_exposition(generate_latest(registry).decode())


def series(found, name: str) -> list[tuple[dict, float]]:
    return [(labels, value) for n, labels, value in found if n == name]


def test_a_finished_run_and_a_healthy_local_store_read_zero_and_up(lab, tmp_path):
    lab.write_config(tracking={"backend": "mlflow"})  # no URI: each user's local SQLite store
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp_path)
    lab.cli("run", str(TINY), "--local", "--run", "delivered", check=True)
    run_dir = lab.root / "outputs" / "vla" / "local-runs" / "delivered"
    (backend,) = json.loads((run_dir / "tracking-summary.json").read_text())["backends"]
    assert backend["pending"] == 0
    store = json.loads((run_dir / "tracking-journal" / "run.json").read_text())["targets"]["mlflow"]
    assert store.startswith("sqlite:///") and Path(store.removeprefix("sqlite:///")).is_file()

    found = exposition(settings)
    assert series(found, "det_lab_tracker_undelivered_events") == [
        ({"project": "vla", "run": "delivered", "backend": "mlflow"}, 0)]
    assert series(found, "det_lab_tracker_backlog_events") == [({"backend": "mlflow"}, 0)]
    assert series(found, "det_lab_tracker_up") == [({"backend": "mlflow", "target": store}, 1)]
    assert series(found, "det_lab_tracker_oldest_undelivered_seconds") == []

    Path(store.removeprefix("sqlite:///")).rename(tmp_path / "moved.db")
    assert series(exposition(settings), "det_lab_tracker_up") == [({"backend": "mlflow", "target": store}, 0)]
