"""The volume's on-disk formats across det_lab versions (det_lab/ondisk.py).

- A volume det_lab 0.1.0 wrote (tests/fixtures/volume-0.1.0, its README names the commit and the
  commands) reads with this det_lab: the run's listing and record, its lineage as reproduce finds
  it, its tracking journal, the GPU lease and lease journal, the caches.
- A file stamped with a newer format version is refused in one line by each reader, and nothing
  of it is overwritten or deleted: run records (save, runs show/list/delete), attempt files,
  tracking journals (sync, mirror, prune's journal cleanup), GPU leases (reap, det-lab gpus), the
  lease journal, model records, caches; a checkpoint a newer run names is never retention's.
- What this det_lab writes carries its stamp.
"""

from __future__ import annotations

import json
import time
import os
import logging
import shutil
from pathlib import Path

import pytest

from det_lab import __version__, ondisk
from det_lab.gpus import journal as lease_journal
from det_lab.gpus.holders import ProcessId
from det_lab.gpus.leases import HostBook, active_leases
from det_lab.models.catalog import _read_record
from det_lab.models.layout import ModelStoreLayout
from det_lab.ondisk import FORMAT_KEY, NewerFormat
from det_lab.settings import load_settings
from det_lab.tracking.events import RunInfo
from det_lab.tracking.journal import Journal
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.sync import pending
from det_lab.runs import cachefile, fence, retention
from det_lab.lifecycle import prune
from det_lab.runs.listing import ListingCache
from det_lab.runs.record import LocalRunRecord
from tests.conftest import Lab
from tests.test_retention import LOSSES, kept_steps, make_run

FIXTURE = Path(__file__).parent / "fixtures" / "volume-0.1.0"
RUN = "vla-010"
RUN_DIR = Path("lab-data/outputs/vla/local-runs") / RUN
LATEST = "1b1fea86-088f-44c7-a547-142e95de3499"
LEASE = "f1b6f4bd4172"


def newer(fmt: ondisk.Format) -> dict:
    return {"name": fmt.name, "version": fmt.version + 1}


def one_line(text: str, path: Path | str, fmt: ondisk.Format) -> None:
    """``text`` is the one refusal line this det_lab gives for ``path``."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert lines[0].removeprefix("error: ").removeprefix("warning: ") == (
        f"{path}: {fmt.name} format version {fmt.version + 1}, newer than det_lab {__version__} reads "
        f"(up to version {fmt.version}); upgrade det_lab to read it")


@pytest.fixture
def old(lab: Lab, tmp_path: Path):
    """The 0.1.0 volume copied under tmp_path: the lab's data root, its GPU state and cache dirs."""
    shutil.copytree(FIXTURE, tmp_path / "v", ignore=shutil.ignore_patterns("README.md"))
    for path in (tmp_path / "v").rglob("*"):  # 0.1.0 wrote it at /tmp/vol010: nothing reads the host's /tmp
        if path.suffix in (".yaml", ".json", ".jsonl") and "/tmp/vol010" in (text := path.read_text()):
            path.write_text(text.replace("/tmp/vol010", str(tmp_path / "v")))
    written = time.time() - 3 * 86400  # as old as 0.1.0's files, whenever the checkout was made
    for path in (tmp_path / "v").rglob("*"):
        os.utime(path, (written, written), follow_symlinks=False)
    root = tmp_path / "v" / "lab-data"
    lab.root = root
    lab.write_config()
    lab.env.update(DET_LAB_GPU_STATE_DIR=str(tmp_path / "v" / "gpus"), XDG_CACHE_HOME=str(tmp_path / "v" / "cache"))
    return lab, load_settings(lab.config, env=lab.env), tmp_path / "v"


# --- a 0.1.0 volume reads ------------------------------------------------------------------------


def test_runs_list_and_show_read_a_010_run(old):
    lab, _, _ = old
    listed = json.loads(lab.cli("runs", "list", "--json", check=True).stdout.splitlines()[0])
    assert (listed["name"], listed["status"], listed["step"], listed["of"]) == (RUN, "finished", 20, 20)
    assert listed["metric"] == ["val_loss", 0.4282292127609253]
    shown = json.loads(lab.cli("runs", "show", RUN, "--json", check=True).stdout)
    assert shown["checkpoints"] == [{"uuid": LATEST, "step": 20}] and shown["latest_checkpoint_step"] == 20
    assert [(r["step"], r["state"]) for r in shown["retention"]] == [(10, "deleted"), (20, "kept")]
    assert shown["tracking"][0]["backend"] == "mlflow" and shown["tracking"][0]["delivered"] == 9


def test_lineage_journal_and_caches_of_a_010_volume(old):
    _, settings, v = old
    from det_lab.reproduce.find import locate

    by_run, by_checkpoint = locate(settings, RUN), locate(settings, LATEST)
    for origin in (by_run, by_checkpoint):
        assert origin.lineage["code_commit"] == "aed42e26f8ee71e3b032e552db6d0b2883dfa2a8"
        assert origin.lineage["dataset"]["commit"] == "0993a8c999dcd7fc2cf51ca16f77ff921b0016c1"
    assert by_checkpoint.checkpoint == {"uuid": LATEST, "step": 20, "dir": str(v / "lab-data/checkpoints/vla" / LATEST)}
    assert by_checkpoint.record.dir == v / RUN_DIR and by_run.seed == 0
    j = Journal(v / RUN_DIR / "tracking-journal")
    info, targets = j.run()
    assert (info.key, list(targets), j.last_seq, j.end().status) == ("local-vla-010", ["mlflow"], 9, "FINISHED")
    assert pending(j.directory) == 0 and j.load_marks()["validation"]["val_loss"] == 20
    facts = next((v / "cache/det-lab").glob("run-facts-*.pickle"))
    assert cachefile.load(facts, ondisk.RUN_FACTS_CACHE.version)  # the same shape: read, not rebuilt
    runs_cache = next((v / "cache/det-lab").glob("runs-*.json"))
    mine = ListingCache(settings.data_root)
    mine.path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(runs_cache, mine.path)
    assert ListingCache(settings.data_root).entries == json.loads(runs_cache.read_text())


def test_gpu_lease_and_lease_journal_of_010(old):
    _, settings, v = old
    book = HostBook(v / "gpus")
    live, dead = book.leases()  # its holder exited after writing it
    assert live == [] and [(d.id, d.uuids, d.data["run"]) for d in dead] == \
        [(LEASE, ["GPU-00000000-0000-0000-0000-000000000010"], RUN)]
    [record] = lease_journal.read_records(settings)
    assert (record.lease, record.gpus, record.end) == (LEASE, [(0, "GPU-00000000-0000-0000-0000-000000000010")], None)
    path = v / "gpus" / "leases" / f"{LEASE}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "holder": ProcessId.me().as_dict()}))  # held again, by this process
    with book.lock():
        [held] = book.reap(settings)
    assert (held.id, held.leases()[0].gpu_index, held.leases()[0].user) == (LEASE, 0, data["user"])


def test_this_det_lab_updates_a_010_run_keeping_its_record_and_stamping_it(old):
    _, _, v = old
    before = json.loads((v / RUN_DIR / "run.json").read_text())
    run = LocalRunRecord(v / RUN_DIR)
    run.update(status="finished")
    after = json.loads(run.run_file.read_text())
    assert after.pop(FORMAT_KEY) == {"name": "run-record", "version": 1}
    assert after == before


# --- a newer format is refused in one line, and nothing of it is replaced or deleted --------------


def test_a_newer_run_record_is_refused_never_saved_over_nor_deleted(old):
    lab, settings, v = old
    path = v / RUN_DIR / "run.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), FORMAT_KEY: newer(ondisk.RUN_RECORD)}))
    kept = path.read_bytes()
    shown = lab.cli("runs", "show", RUN)
    assert shown.returncode == 2
    one_line(shown.stderr, path, ondisk.RUN_RECORD)
    resumed = lab.cli("run", "vla", "--local", "--resume", "--run", RUN)
    assert resumed.returncode == 2
    one_line(resumed.stderr, path, ondisk.RUN_RECORD)
    listed = lab.cli("runs", "list", "--json", check=True)
    assert json.loads(listed.stdout.splitlines()[0])["status"] == "newer"
    one_line(listed.stderr, path, ondisk.RUN_RECORD)
    deleted = lab.cli("runs", "delete", RUN, "--yes")
    assert deleted.returncode != 0 and "upgrade det_lab to read it" in deleted.stderr
    pruned = lab.cli("runs", "prune", "--older-than", "1m", "--yes", check=True)
    assert f"not deleted: {RUN} (" in pruned.stdout and ", newer): " in pruned.stdout
    # by status: its status is unknown, so it is named as refused, not passed over (from the caches and fresh)
    by_status = lab.cli("runs", "prune", "--status", "failed,stopped", "--yes", check=True)
    assert f"not deleted: {RUN} (" in by_status.stdout and ", newer): " in by_status.stdout, by_status.stdout
    fresh = prune.plan_prune(settings, statuses="failed,stopped", fresh=True)
    assert [(r.name, r.status) for r in fresh.refused] == [(RUN, "newer")] and not fresh.runs
    gc = lab.cli("data", "gc", check=True)  # the project's datasets are kept: what the run uses is unknown
    [vla] = [ln for ln in gc.stderr.splitlines() if ln.startswith("warning: vla: ")]  # (the fixture has no git repos)
    one_line(vla.removeprefix("warning: vla: ").removesuffix(": nothing of this project is collected"),
             path, ondisk.RUN_RECORD)
    from det_lab.monitoring.source_runs import RunsSource

    counted = {s.labels["status"]: s.value for fam in RunsSource(settings).collect() for s in fam.samples
               if s.name == "det_lab_runs"}
    assert counted == {"newer": 1}  # the exporter counts it as such, not as damaged
    with pytest.raises(NewerFormat):
        LocalRunRecord(path.parent).save({"name": RUN, "status": "failed"})
    assert path.read_bytes() == kept and (v / "lab-data/checkpoints/vla" / LATEST / "metadata.json").is_file()


def test_retention_keeps_a_checkpoint_a_newer_run_names(tmp_path):
    run, root = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES)
    other = tmp_path / "runs" / "newer"
    other.mkdir()
    # a newer det_lab's run.json whose start point is under a key this det_lab does not know
    (other / "run.json").write_text(json.dumps({FORMAT_KEY: newer(ondisk.RUN_RECORD), "name": "newer",
                                                "starts_from": {"checkpoint": "r-30"}}))
    retention.enforce(run, root, others=[LocalRunRecord(other)])
    assert kept_steps(run, root) == [20, 30, 50]


def test_a_newer_attempt_file_is_refused_and_kept(tmp_path):
    path = fence.attempt_file(tmp_path)
    path.write_text(json.dumps({FORMAT_KEY: newer(ondisk.RUN_ATTEMPT), "epoch": 3, "token": "t"}))
    with pytest.raises(NewerFormat) as exc:
        fence.begin_attempt(tmp_path, job_id="7")
    one_line(str(exc.value), path, ondisk.RUN_ATTEMPT)
    assert json.loads(path.read_text())["epoch"] == 3


def test_a_newer_tracking_journal_is_left_alone(old, caplog):
    _, settings, v = old
    journal = v / "lab-data/outputs/vla/tracking-journal/local-gone"
    shutil.copytree(v / RUN_DIR / "tracking-journal", journal)
    head = journal / "run.json"
    head.write_text(json.dumps({**json.loads(head.read_text()), FORMAT_KEY: newer(ondisk.TRACKING_JOURNAL)}))
    (journal / prune.DELETED_RUN_MARK).write_text("/gone\n")
    files = {p.name: p.read_bytes() for p in journal.iterdir()}
    with pytest.raises(NewerFormat) as exc:
        Journal(journal).run()
    one_line(str(exc.value), head, ondisk.TRACKING_JOURNAL)
    assert pending(journal) > 0
    from det_lab.monitoring import source_trackers

    with pytest.raises(NewerFormat):  # the exporter counts it among the journals it cannot read
        source_trackers.backlog(journal)
    prune.execute(settings, prune.Plan())  # would remove a deleted run's journal once delivered
    with caplog.at_level(logging.WARNING, logger="det_lab"):  # a trial of this det_lab on it: trains on
        mirror = Mirror(RunInfo(key="local-gone", name="gone", experiment="det_lab/vla"),
                        {"mlflow": "sqlite:///nowhere.db"}, journal)
        mirror.log_metrics("training", 30, {"loss": 1.0})
        assert mirror.flush() and not mirror.close().backends
    assert [r.getMessage() for r in caplog.records].count(
        f"{exc.value}; this trial's metrics are not mirrored to its trackers (training goes on)") == 1
    assert {p.name: p.read_bytes() for p in journal.iterdir()} == files


def test_a_newer_gpu_lease_is_refused_and_never_reaped(old):
    lab, settings, v = old
    path = v / "gpus" / "leases" / f"{LEASE}.json"  # its holder is gone: a 0.1.0 lease would be reaped
    path.write_text(json.dumps({**json.loads(path.read_text()), FORMAT_KEY: newer(ondisk.GPU_LEASE)}))
    kept = path.read_bytes()
    with pytest.raises(NewerFormat) as exc, HostBook(v / "gpus").lock():
        HostBook(v / "gpus").reap(settings)
    one_line(str(exc.value), path, ondisk.GPU_LEASE)
    shown = lab.cli("gpus")
    assert shown.returncode == 2
    one_line(shown.stderr, path, ondisk.GPU_LEASE)
    assert path.read_bytes() == kept
    assert "holder gone" not in (v / "lab-data/.det-lab/gpus/journal/vm.root.jsonl").read_text()


def test_a_newer_lease_journal_line_is_refused(old, monkeypatch):
    _, settings, v = old
    path = v / "lab-data/.det-lab/gpus/journal/vm.root.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"event": "end", "lease": LEASE, "at": 1.0, FORMAT_KEY: newer(ondisk.GPU_LEASE_JOURNAL)}) + "\n")
    monkeypatch.setenv("DET_LAB_GPU_STATE_DIR", str(v / "gpus"))
    for read in (lease_journal.read_records, active_leases):
        with pytest.raises(NewerFormat) as exc:
            read(settings)
        one_line(str(exc.value), f"{path} line 2", ondisk.GPU_LEASE_JOURNAL)


def test_a_newer_model_record_is_refused(tmp_path):
    layout = ModelStoreLayout(tmp_path / "models")
    record = layout.record("org/m", "a" * 40)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({FORMAT_KEY: newer(ondisk.MODEL_RECORD), "name": "org/m", "revision": "a" * 40}))
    with pytest.raises(NewerFormat) as exc:
        _read_record(layout, "org/m", tmp_path / ("a" * 40))
    one_line(str(exc.value), record, ondisk.MODEL_RECORD)


def test_newer_caches_are_not_written_over(tmp_path):
    path = tmp_path / "space.pickle"
    cachefile.dump(path, {"a": 1}, ondisk.SPACE_CACHE.version + 1)
    kept = path.read_bytes()
    assert cachefile.load(path, ondisk.SPACE_CACHE.version) is None
    cachefile.dump(path, {"b": 2}, ondisk.SPACE_CACHE.version)
    assert path.read_bytes() == kept
    listing = ListingCache(tmp_path)
    listing.path.parent.mkdir(parents=True, exist_ok=True)
    listing.path.write_text(json.dumps({FORMAT_KEY: newer(ondisk.RUNS_LISTING_CACHE), "/r": {"k": "v"}}))
    kept = listing.path.read_bytes()
    listing = ListingCache(tmp_path)
    assert listing.entries == {}
    listing.read_again, listing.seen = 1, {"/x": {"key": [], "state": {}, "step": 0, "validation": {}}}
    listing.save(complete=True)
    assert listing.path.read_bytes() == kept


# --- what this det_lab writes is stamped ----------------------------------------------------------


def test_writers_stamp_their_format(old):
    _, settings, v = old
    run = LocalRunRecord(v / "lab-data/outputs/vla/local-runs/new")
    run.dir.mkdir()
    run.save({"name": "new"})
    attempt = fence.begin_attempt(run.dir)
    j = Journal(run.journal_dir)
    j.describe_run(RunInfo(key="local-new", name="new", experiment="det_lab/vla"), {"mlflow": "sqlite:///x.db"})
    book = HostBook(v / "gpus")
    with book.lock():
        held = book.take(settings, [(1, "GPU-new")], "new", "vla", "vla", ProcessId.me())
    listing = ListingCache(settings.data_root)
    listing.read_all([run])
    listing.save(complete=True)
    stamps = {fmt.name: json.loads(path.read_text())[FORMAT_KEY] for fmt, path in (
        (ondisk.RUN_RECORD, run.run_file), (ondisk.RUN_ATTEMPT, fence.attempt_file(run.dir)),
        (ondisk.TRACKING_JOURNAL, j.directory / "run.json"), (ondisk.GPU_LEASE, held.path),
        (ondisk.RUNS_LISTING_CACHE, listing.path))}
    line = (v / "lab-data/.det-lab/gpus/journal").glob("*.jsonl")
    stamps[ondisk.GPU_LEASE_JOURNAL.name] = json.loads(sorted(p.read_text() for p in line)[-1].splitlines()[-1])[FORMAT_KEY]
    assert stamps == {f.name: {"name": f.name, "version": 1} for f in (
        ondisk.RUN_RECORD, ondisk.RUN_ATTEMPT, ondisk.TRACKING_JOURNAL, ondisk.GPU_LEASE, ondisk.RUNS_LISTING_CACHE,
        ondisk.GPU_LEASE_JOURNAL)}
    assert fence.read_attempt(run.dir) == attempt and run.state()["name"] == "new"


def test_tracking_sync_of_all_journals_names_the_ones_it_cannot_read_and_goes_on(old):
    """A newer journal and a damaged one waiting on the volume: ``det-lab tracking sync`` names
    each in one line, leaves them byte-equal and exits 1 (it stopped at the first with a
    traceback-free error and never reached the rest)."""
    lab, _, v = old
    journals = v / "lab-data/outputs/vla/tracking-journal"
    newer_j, damaged_j = journals / "local-a-newer", journals / "local-b-damaged"
    for j in (newer_j, damaged_j):
        shutil.copytree(v / RUN_DIR / "tracking-journal", j)
    head = newer_j / "run.json"
    head.write_text(json.dumps({**json.loads(head.read_text()), FORMAT_KEY: newer(ondisk.TRACKING_JOURNAL)}))
    (damaged_j / "run.json").write_text("{not json")
    before = {j: {p.name: p.read_bytes() for p in j.iterdir()} for j in (newer_j, damaged_j)}
    proc = lab.cli("tracking", "sync")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 2 and str(newer_j) in warned[0] and str(damaged_j) in warned[1], proc.stderr
    one_line(warned[0].removesuffix("; left as it is"), head, ondisk.TRACKING_JOURNAL)
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1
    assert {j: {p.name: p.read_bytes() for p in j.iterdir()} for j in (newer_j, damaged_j)} == before
