"""Delivery in its own process: a killed trial or a killed sender loses and doubles nothing, sync
uses the run's recorded tracker, replayed steps are kept once, two processes share the journal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from det_lab.tracking import journal as journal_mod
from det_lab.tracking.events import Metrics, RunInfo
from det_lab.tracking.journal import Cursor, Journal, JournalReader
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.mlflow_backend import RUN_KEY_TAG
from det_lab.tracking.delivery import sender_lock
from tests.aim_fixtures import Relay

ROOT = Path(__file__).parent.parent


def run_info(key: str) -> RunInfo:
    return RunInfo(key=key, name=key, experiment="det_lab-sender-tests")


def mlflow_points(uri: str, key: str, metric: str = "training/loss") -> list[tuple[int, float]]:
    """Every stored point of ``metric`` in the run with ``key``, duplicates included."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("det_lab-sender-tests")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))


def journaled_points(journal: Path, metric: str = "loss") -> list[tuple[int, float]]:
    events = Journal(journal).read_after(0, 10**6)
    return sorted((e.step, e.values[metric]) for _, e in events if isinstance(e, Metrics) and metric in e.values)


def wait_for_senders(journal: Path, timeout: float = 240) -> None:
    """Until the sender has started (it writes its pid into its lock) and exited again."""
    lock = journal / "sender-mlflow.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip()):
        assert time.monotonic() < deadline, "no sender started"
        time.sleep(0.2)
    with sender_lock(journal, "mlflow", timeout=timeout):
        pass


TRIAL = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from det_lab.tracking.events import RunInfo
    from det_lab.tracking.mirror import Mirror
    uri, journal = sys.argv[1], Path(sys.argv[2])
    m = Mirror(RunInfo(key="killed", name="killed", experiment="det_lab-sender-tests"), {"mlflow": uri}, journal)
    for step in range(1, 4001):
        m.log_metrics("training", step, {"loss": step / 7, "lr": 0.1})
        if step == 1000:
            m.flush(timeout=1)
            print("flushed", flush=True)
        time.sleep(0.001)
    print("not killed", flush=True)
""")


def test_sigkill_of_the_trial_delivers_every_journaled_point_once(shared_mlflow_server, tmp_path):
    journal = tmp_path / "journal"
    trial = subprocess.Popen([sys.executable, "-c", TRIAL, shared_mlflow_server.uri, str(journal)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    assert trial.stdout.readline().strip() == "flushed"
    time.sleep(0.5)  # mid-run: more steps journaled since, some only queued
    trial.send_signal(signal.SIGKILL)
    trial.wait(timeout=30)
    wait_for_senders(journal)  # the sender outlives the trial, delivers, exits
    journaled = journaled_points(journal)
    assert len(journaled) >= 1000 and journaled == [(s, s / 7) for s in range(1, len(journaled) + 1)]
    assert mlflow_points(shared_mlflow_server.uri, "killed") == journaled  # each exactly once
    assert Journal(journal).pending("mlflow") == 0


def test_killed_sender_is_restarted_and_nothing_is_lost_or_doubled(shared_mlflow_server, tmp_path):
    mirror = Mirror(run_info("sender-killed"), {"mlflow": shared_mlflow_server.uri}, tmp_path / "journal",
                    interval=0.05)
    sender = mirror._senders[0]
    killed, delivered = 0, 0
    for step in range(1, 2001):  # killed mid-run (restarted by the mirror) and at the end (restarted by close)
        mirror.log_metrics("training", step, {"loss": float(step)})
        if step % 1000 == 0:
            deadline = time.monotonic() + 120
            while mirror.journal.cursor("mlflow").seq <= delivered:  # the (restarted) sender is at work
                assert time.monotonic() < deadline, "the sender delivers nothing"
                time.sleep(0.01)
            delivered = mirror.journal.cursor("mlflow").seq
            # every sender, restarted ones too, only takes CPU time the training loop leaves
            assert os.sched_getscheduler(sender.proc.pid) == os.SCHED_IDLE
            mine = sorted(os.sched_getaffinity(0))  # and keeps off the loop's CPUs where it can
            assert os.sched_getaffinity(sender.proc.pid) == ({mine[-1]} if len(mine) > 1 else set(mine))
            os.kill(sender.proc.pid, signal.SIGKILL)
            sender.proc.wait()
            killed += 1
        time.sleep(0.0005)
    summary = mirror.close(timeout=120)
    assert summary.complete, str(summary)
    assert sender.restarts == killed
    assert mlflow_points(shared_mlflow_server.uri, "sender-killed") == [(s, float(s)) for s in range(1, 2001)]


def test_resumed_trial_replaying_steps_keeps_one_value_per_step(shared_mlflow_server, tmp_path):
    journal = tmp_path / "journal"
    first = Mirror(run_info("replayed"), {"mlflow": shared_mlflow_server.uri}, journal)
    for step in range(1, 101):
        first.log_metrics("training", step, {"loss": float(step)})
        first.log_metrics("validation", step, {"val": 1.0})
    first.close(status="KILLED")  # crashed at step 100, last checkpoint at step 50
    second = Mirror(run_info("replayed"), {"mlflow": shared_mlflow_server.uri}, journal)
    for step in range(51, 151):
        second.log_metrics("training", step, {"loss": step + 0.5, "new": 1.0})
    assert second.close().complete
    expected = [(s, float(s)) for s in range(1, 101)] + [(s, s + 0.5) for s in range(101, 151)]
    assert mlflow_points(shared_mlflow_server.uri, "replayed") == expected
    assert [s for s, _ in mlflow_points(shared_mlflow_server.uri, "replayed", "training/new")] == list(range(51, 151))


def test_sync_delivers_to_the_recorded_tracker_and_a_failed_sync_changes_nothing(lab, shared_mlflow_server, tmp_path):
    journal = lab.root / "outputs" / "vla" / "tracking-journal" / "recorded"
    tracker = Relay(shared_mlflow_server.port)  # not started: the tracker is down while the run goes on
    mirror = Mirror(run_info("recorded"), {"mlflow": tracker.uri}, journal, linger=0)
    for step in range(1, 51):
        mirror.log_metrics("training", step, {"loss": float(step)})
    assert mirror.close(timeout=2).backends[0].pending == 51
    wait_for_senders(journal, timeout=30)  # it gave up at once (linger 0)
    before = {p.name: p.read_bytes() for p in journal.glob("seg-*")}
    # the lab config names no tracker and the shell has no MLFLOW_TRACKING_URI
    failed = lab.cli("tracking", "sync", str(journal))
    assert failed.returncode == 1 and "51 events still undelivered" in failed.stderr
    assert {p.name: p.read_bytes() for p in journal.glob("seg-*")} == before
    tracker.start()
    try:
        proc = lab.cli("tracking", "sync", str(journal))
    finally:
        tracker.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mlflow_points(shared_mlflow_server.uri, "recorded") == [(s, float(s)) for s in range(1, 51)]
    run_json = journal / "run.json"
    data = json.loads(run_json.read_text())
    del data["targets"]  # a journal that does not say where its events go is refused, not guessed
    run_json.write_text(json.dumps(data))
    refused = lab.cli("tracking", "sync", str(journal))
    assert refused.returncode == 2 and refused.stderr.startswith("error:") and len(refused.stderr.splitlines()) == 1
    assert "does not record where its events go" in refused.stderr


GOOD_RUN = {"key": "damaged", "name": "damaged", "experiment": "det_lab-sender-tests", "tags": {}}


@pytest.mark.parametrize("run_json", [
    '{"run": {"key": "damaged", "na',  # torn: not JSON
    "[]",
    json.dumps({"run": "damaged", "backends": ["mlflow"], "targets": {"mlflow": "http://127.0.0.1:9"}}),
    json.dumps({"run": {"id": "damaged"}, "backends": ["mlflow"], "targets": {"mlflow": "http://127.0.0.1:9"}}),
    json.dumps({"run": GOOD_RUN, "backends": "mlflow", "targets": {"mlflow": "http://127.0.0.1:9"}}),
    json.dumps({"run": GOOD_RUN, "backends": ["mlflow"], "targets": {"mlflow": 9}}),
], ids=["torn", "list", "run-a-string", "run-unknown-fields", "backends-a-string", "target-a-number"])
def test_damaged_run_json_is_refused_in_one_line_and_the_journal_left_as_it_was(lab, run_json):
    from typer.testing import CliRunner

    from det_lab.cli.app import app

    journal_dir = lab.root / "outputs" / "vla" / "tracking-journal" / "damaged"
    journal = Journal(journal_dir)
    journal.describe_run(run_info("damaged"), {"mlflow": "http://127.0.0.1:9"})
    journal.append([Metrics("training", s, {"loss": float(s)}) for s in range(1, 6)])
    journal.close()
    (journal_dir / "run.json").write_text(run_json)
    before = {p.name: p.read_bytes() for p in journal_dir.iterdir()}
    sync = CliRunner().invoke(app, ["tracking", "sync", str(journal_dir)], env=lab.env)
    assert sync.exit_code == 2 and sync.stdout == "", (sync.output, sync.exception)
    assert sync.stderr.startswith(f"error: {journal_dir / 'run.json'} is missing or damaged")
    assert len(sync.stderr.splitlines()) == 1
    status = CliRunner().invoke(app, ["tracking", "status"], env=lab.env)
    assert status.exit_code == 1, (status.output, status.exception)
    assert f"5 events waiting  {journal_dir}" in status.stdout  # listed, so that it is looked at
    assert f"damaged: {journal_dir / 'run.json'} " in status.stdout  # named, with what is wrong
    assert "0 journal(s) with undelivered events, 1 damaged" in status.stdout
    assert {p.name: p.read_bytes() for p in journal_dir.iterdir()} == before


def test_reader_takes_only_whole_lines_while_the_writer_appends(tmp_path):
    journal = Journal(tmp_path)
    journal.append([Metrics("training", s, {"loss": float(s)}) for s in range(1, 4)])
    reader = JournalReader(tmp_path)
    segment = journal.segments()[-1]
    line = journal_mod.encode(4, Metrics("training", 4, {"loss": 4.0}))
    with open(segment, "a") as f:
        f.write(line[:15])  # a write in progress (or torn by a crash)
    assert [q for q, _ in reader.read(0, 100)] == [1, 2, 3]
    assert reader.read(3, 100) == []
    with open(segment, "a") as f:
        f.write(line[15:])
    assert [(q, e.values) for q, e in reader.read(3, 100)] == [(4, {"loss": 4.0})]


def test_marks_survive_compaction_and_restarts(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "SEGMENT_EVENTS", 10)
    journal = Journal(tmp_path)
    journal.append([Metrics("training", s, {"loss": 1.0, "acc": 1.0}) for s in range(1, 26)])
    journal.save_marks(20, {"training": {"loss": 20, "acc": 20}})
    journal.append([Metrics("training", s, {"loss": 1.0}) for s in range(26, 31)])
    journal.advance("mlflow", Cursor(30))
    journal.compact(["mlflow"])  # events after the saved marks (21-30) are kept
    assert [q for q, _ in Journal(tmp_path).read_after(0, 100)][0] <= 21
    assert Journal(tmp_path).load_marks() == {"training": {"loss": 30, "acc": 25}}


@pytest.mark.parametrize("port, message", [(0, "is not a TCP port"), (70000, "is not a TCP port"), (None, "is in use")])
def test_serve_refuses_a_bad_or_busy_port_at_once(lab, port, message):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        started = time.monotonic()
        proc = lab.cli("tracking", "serve", "--port", str(busy.getsockname()[1] if port is None else port))
    assert time.monotonic() - started < 30
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _status_for_host(port: int, host: str) -> int:
    """The HTTP status of an API call to 127.0.0.1:port as a client that names the server ``host``."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _on_port(port: int, what: str = "") -> list[int]:
    """The processes whose command line names ``<what>--port <port>``: serve, and the server it started."""
    found = subprocess.run(["pgrep", "-f", "--", f"{what}--port {port}"], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


@contextlib.contextmanager
def _serving(lab, tmp_path: Path, port: int) -> Iterator[subprocess.Popen]:
    """``det-lab tracking serve --port <port>`` over the store local runs write under ``tmp_path``;
    afterwards whatever it left running is killed (a serve that failed to stop leaves its server
    behind: not for the next tests to find)."""
    env = {**lab.env, "XDG_DATA_HOME": str(tmp_path / "xdg-data")}
    serve = subprocess.Popen([str(Path(sys.executable).parent / "det-lab"), "tracking", "serve", "--port", str(port)],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield serve
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for pid in _on_port(port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serve_shows_local_runs_and_stops_its_server_on_a_signal(lab, tmp_path, monkeypatch, stop):
    from det_lab.tracking.mlflow_backend import MlflowBackend
    from det_lab.tracking.mlflow_server import free_port

    # the name the lab's cluster tasks reach it by (det_lab/cluster/render.py tracking_problems asks for one)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": "http://gpu-box-1:5000"})
    with monkeypatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))  # where a local run (no tracking URI) writes
        backend = MlflowBackend()
        run_id = backend.open(run_info("local-run"), None)
        backend.close("FINISHED")
    port = free_port()
    with _serving(lab, tmp_path, port) as serve:
        client = MlflowClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 240
        while True:
            try:
                assert client.get_run(run_id).info.status == "FINISHED"
                break
            except Exception:
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # MLflow 3 answers only Host headers it allows: the configured name and this machine's, not others
        assert _status_for_host(port, "gpu-box-1:5000") == 200
        assert _status_for_host(port, f"{socket.gethostname()}:{port}") == 200
        assert _status_for_host(port, "elsewhere.example:5000") == 403
        serve.send_signal(stop)  # conftest leaves SIGINT at its default in children, as in a terminal
        out, err = serve.communicate(timeout=90)  # the server's own stop waits up to 30 s on its killed workers
        assert serve.returncode == 0 and err == "" and "Ctrl-C stops it" in out, out + err
        assert _on_port(port) == []


def test_ctrl_c_while_the_server_starts_stops_it_cleanly(lab, tmp_path):
    """Ctrl-C before MLflow answers is a stop (exit 0, nothing left running), not a failed start
    (click's Exit is a RuntimeError, which the start-up error handler used to catch)."""
    from det_lab.tracking.mlflow_server import free_port

    port = free_port()
    with _serving(lab, tmp_path, port) as serve:
        deadline = time.monotonic() + 60
        while not _on_port(port)[1:]:
            assert serve.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        serve.send_signal(signal.SIGINT)  # the server process exists; it answers seconds later
        out, err = serve.communicate(timeout=90)  # the server's own stop waits up to 30 s on its killed workers
        assert serve.returncode == 0 and err == "", out + err
        assert _on_port(port) == []


def test_a_stop_that_comes_while_the_server_is_slow_to_answer_its_start_up_check_is_not_lost(lab, tmp_path):
    """SIGTERM while serve waits on MLflow's first answer (here the server is frozen with SIGSTOP the
    moment it listens, so serve's health check hangs in its 2 s time-out): serve stops the server
    and exits 0. Before, the check's error handler swallowed the exit the signal handler raised,
    and serve waited on its server for ever (a CI run's SIGTERM test, 2026-12-06)."""
    from det_lab.tracking.mlflow_server import free_port

    def listening() -> bool:  # a connection attempt: a bind here could take the port from the server
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        return False

    port = free_port()
    group = None
    with _serving(lab, tmp_path, port) as serve:
        try:
            deadline = time.monotonic() + 120
            while not listening():
                assert serve.poll() is None and time.monotonic() < deadline
                time.sleep(0.002)
            group = os.getpgid(_on_port(port, "server --host 127.0.0.1 ")[0])
            os.killpg(group, signal.SIGSTOP)  # listening, and answering nothing
            time.sleep(0.5)  # serve's next health check is under way (one every 0.3 s) and hangs
            serve.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            os.killpg(group, signal.SIGCONT)
            out, err = serve.communicate(timeout=60)
            assert serve.returncode == 0 and err == "", out + err
            assert _on_port(port) == []
        finally:
            if group is not None:
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGCONT)


def test_a_port_chosen_for_a_server_is_out_of_reach_of_outgoing_connections():
    """free_port's port is free, and outside the range the kernel gives outgoing connections their
    local ports from (so none takes it in the seconds before ``mlflow server`` binds it: six tests
    of one CI run lost their server that way) and clear of torch.distributed's default ports."""
    from det_lab.tracking.mlflow_server import free_port, port_in_use

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(300)]
    assert all(p < low for p in ports) and not any(29400 <= p < 29600 for p in ports)
    assert len(set(ports)) > 250  # spread out: two workers choosing at once rarely meet
    with socket.socket() as out:  # an outgoing connection's local port: the range the kernel hands out
        listener = socket.create_server(("127.0.0.1", ports[0]))
        out.connect(("127.0.0.1", ports[0]))
        assert low <= out.getsockname()[1] <= high
        listener.close()
    assert not port_in_use("127.0.0.1", free_port())


def test_sender_exits_even_when_a_trackers_exit_handler_hangs(tmp_path):
    # Aim closes its storage in an exit handler that waits without a bound for a cleanup thread;
    # a sender stuck there would hold its journal's lock for ever (seen with a vanished repo)
    script = ("import atexit, threading\n"
              "from det_lab.tracking.delivery import exit_bounded\n"
              "atexit.register(lambda: threading.Event().wait())\n"
              "exit_bounded(1.0, 3)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and time.monotonic() - started < 60
    assert "exit handlers still busy after 1 s" in proc.stderr


class _Tracker:
    """A backend that takes every batch (what a tracker that answers does); ``hold`` keeps a
    delivery in flight until it is set (a sender cut off from its tracker and volume)."""

    def __init__(self, name, target):
        self.delivered: list = []
        self.hold: threading.Event | None = None
        self.in_flight = threading.Event()

    def open(self, run, resume_id):
        return resume_id or "run-1"

    def deliver(self, events):
        if self.hold is not None:
            self.in_flight.set()
            self.hold.wait(30)
        self.delivered.extend(events)

    def close(self, status):
        pass

    def describe(self):
        return "tracker"


def test_a_superseded_trial_s_sender_never_moves_the_cursor_back(tmp_path):
    """The sender of a copy cut off with its volume comes back after the heal with the batch it had
    in flight: meanwhile the requeued copy's trial took the journal over and its sender delivered
    further. The old sender writes no cursor and hands over; a sender without a writer (tracking
    sync) never moves the cursor back either."""
    from det_lab.tracking.delivery import Sender

    journal = Journal(tmp_path)
    journal.describe_run(run_info("k"), {"mlflow": "http://tracker"})
    journal.claim("old-trial")
    journal.append([Metrics("training", s, {"loss": float(s)}) for s in range(1, 5)])
    old = Sender(tmp_path, "mlflow", make_backend=_Tracker)
    old.writer = "old-trial"
    old.backend.hold = threading.Event()
    cut_off = threading.Thread(target=old.step)
    cut_off.start()
    assert old.backend.in_flight.wait(30)  # events 1-4 on their way when the link drops
    journal.claim("new-trial")  # the requeued copy takes the journal over; its sender delivers up to 9
    journal.append([Metrics("training", s, {"loss": float(s)}) for s in range(5, 10)])
    journal.advance("mlflow", Cursor(9, "run-1"))
    old.backend.hold.set()  # the heal
    cut_off.join(30)
    assert journal.cursor("mlflow").seq == 9 and old.handed_over
    sync = Sender(tmp_path, "mlflow", make_backend=_Tracker)
    sync.cursor = Cursor(3, "run-1")
    sync.backend.hold = threading.Event()
    late = threading.Thread(target=sync.step)
    late.start()
    assert sync.backend.in_flight.wait(30)
    journal.advance("mlflow", Cursor(9, "run-1"))  # another sender delivered further meanwhile
    sync.backend.hold.set()
    late.join(30)
    assert journal.cursor("mlflow").seq == 9 and not sync.handed_over
