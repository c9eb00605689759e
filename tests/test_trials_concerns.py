"""Each concern of the trial layer on its own, against Determined's off-cluster (dummy) Core API
contexts: identity, run record, session, null mirror, the one user-facing surface, and how a
local run's outcome is recorded. No subprocess, no server: seconds."""

from __future__ import annotations

import inspect
import re
import signal
import sys
from pathlib import Path

import determined as det
import pytest
import yaml

from det_lab.settings import LabSettings, TrackingSettings
from det_lab.tracking.mirror import Mirror
from det_lab.tracking.null_mirror import NullMirror
from det_lab.runs import local, record
from det_lab.runs.identity import LOCAL_RUN_ENV, read_identity
from det_lab.trials.session import LabSession
from det_lab.volume import VolumeLayout, init_volume

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lab(tmp_path: Path) -> LabSettings:
    settings = LabSettings(data_root=tmp_path / "volume", tracking=TrackingSettings(backend="none"))
    init_volume(settings)
    return settings


def make_template(tmp_path: Path, max_length: dict) -> Path:
    tdir = tmp_path / "tpl"
    tdir.mkdir()
    (tdir / "const.yaml").write_text(yaml.safe_dump({
        "name": "unit", "entrypoint": "python3 train.py",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "hyperparameters": {"lr": 0.1, "opt": {"type": "categorical", "vals": ["sgd"]}},
        "data": {"det_lab": {"project": "vla", "max_length": max_length}},
    }))
    return tdir


@pytest.fixture
def local_run(lab, tmp_path, monkeypatch):
    """A prepared local run whose trial is this test process."""
    run, _cwd, _command = local.prepare(lab, str(make_template(tmp_path, {"epochs": 2})), None, False)
    monkeypatch.setenv(LOCAL_RUN_ENV, str(run.run_file))
    monkeypatch.delenv("DET_LAB_CODE_COMMIT", raising=False)
    return run


@pytest.fixture
def session(lab, local_run, tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    with det.core.init(checkpoint_storage=str(tmp_path / "ckpt")) as core:
        s = LabSession(lab, read_identity(), core).start()
        yield s
    signal.signal(signal.SIGTERM, previous)


def checkpoint(core, step: int) -> str:
    with core.checkpoint.store_path({"steps_completed": step}) as (path, storage_id):
        (path / "w").write_text(str(step))
    return storage_id


# --- identity ----------------------------------------------------------------------------------------


def test_identity_of_a_local_run_is_read_from_its_record(local_run):
    ident = read_identity()
    state = local_run.state()
    assert (ident.run.key, ident.project, ident.on_cluster) == (state["run_key"], "vla", False)
    assert ident.record_dir == local_run.dir and ident.hparams == {"lr": 0.1, "opt": "sgd"}
    assert ident.run.experiment == "det_lab/vla"
    assert ident.run.tags == {"det.local_run": local_run.dir.name, "det.local_run_dir": str(local_run.dir)}


def test_identity_outside_any_run_needs_a_config(monkeypatch):
    monkeypatch.delenv(LOCAL_RUN_ENV, raising=False)
    with pytest.raises(RuntimeError, match="det-lab run <template> --local"):
        read_identity()
    ident = read_identity({"name": "nb", "data": {"det_lab": {"project": "3dgs"}}}, {"a": 1})
    assert (ident.run.key, ident.project, ident.record_dir) == ("local-nb", "3dgs", None)


# --- run record --------------------------------------------------------------------------------------


def test_local_record_paths_and_formats(local_run, lab):
    layout = VolumeLayout.from_settings(lab)
    assert local_run.dir.parent == layout.outputs("vla") / "local-runs"
    assert local_run.state()["kind"] == "local" and local_run.state()["max_length_unit"] == "epochs"
    local_run.append_metrics("training", 3, {"loss": 1.5, "note": "text is not a metric"})
    with open(local_run.metrics_file, "a") as f:
        f.write('{"group": "training", "st')  # a line being written right now
    assert local_run.metrics() == [{"group": "training", "step": 3, "metrics": {"loss": 1.5}}]
    assert local_run.progress() == (3, {})
    assert (local_run.journal_dir, local_run.rl_work_dir, local_run.outputs_dir) == (
        local_run.dir / "tracking-journal", local_run.dir / "work", local_run.dir)


def test_cluster_record_keeps_no_progress_of_its_own(lab):
    layout = VolumeLayout.from_settings(lab)
    rec = record.record_for(layout, "vla", "det-c-e1-t2", None)
    assert isinstance(rec, record.ClusterRunRecord)
    assert rec.outputs_dir == layout.outputs("vla") / "trials" / "det-c-e1-t2"
    assert rec.rl_work_dir == rec.outputs_dir / "work"
    assert rec.journal_dir == layout.outputs("vla") / "tracking-journal" / "det-c-e1-t2"
    rec.append_metrics("training", 1, {"loss": 1.0})
    rec.add_checkpoint("abc", 1)
    assert not rec.dir.exists()  # Determined's master keeps those


class SlurmLikeRecord(record.LocalRunRecord):
    """How a new local-style twin slots in: a kind, a runs directory, its own tags and lineage."""

    kind = "slurm-test"
    runs_dirname = "slurm-test-runs"

    def tracker_tags(self):
        return {**super().tracker_tags(), "slurm.job_id": self.state()["job_id"]}

    def lineage_extras(self):
        return {"slurm_job_id": self.state()["job_id"]}


def test_a_new_twin_is_found_by_every_reader(lab, tmp_path, monkeypatch):
    monkeypatch.setitem(record._KINDS, SlurmLikeRecord.kind, SlurmLikeRecord)
    run, _cwd, _cmd = local.prepare(lab, str(make_template(tmp_path, {"batches": 5})), None, False,
                                    record_cls=SlurmLikeRecord)
    run.update(job_id="4242")
    (run.journal_dir).mkdir()
    (run.journal_dir / "run.json").write_text("{}")
    layout = VolumeLayout.from_settings(lab)
    (layout.outputs("vla") / "slurm-test-runs" / ".half-made.tmp").mkdir()  # a run being created
    assert [type(r) for r in record.iter_records(layout, "vla")] == [SlurmLikeRecord]
    assert list(record.find_journals(layout, ["vla"])) == [run.journal_dir]
    monkeypatch.setenv(LOCAL_RUN_ENV, str(run.run_file))
    assert read_identity().run.tags["slurm.job_id"] == "4242"


# --- session -----------------------------------------------------------------------------------------


def test_session_records_metrics_and_complete_checkpoints(session, local_run):
    core = session.core
    core.train.report_training_metrics(4, {"loss": 0.5})
    core.train.report_validation_metrics(4, {"val_loss": 0.4})
    storage_id = checkpoint(core, 4)
    state = local_run.state()
    assert state["latest_checkpoint"] == storage_id and state["checkpoints"] == [{"uuid": storage_id, "step": 4}]
    assert local_run.progress() == (4, {"val_loss": 0.4})
    assert session.lineage["run_key"] == state["run_key"] and "python" in session.lineage


def test_sigterm_stops_a_run_that_then_does_not_count_as_finished(session, local_run):
    """An epoch-based max_length (2 epochs) and 2+ batches reported: still stopped, not finished."""
    core = session.core
    core.train.report_training_metrics(5, {"loss": 0.5})
    assert core.preempt.should_preempt() is False
    signal.raise_signal(signal.SIGTERM)
    assert core.preempt.should_preempt() is True
    checkpoint(core, 5)
    session.close("FINISHED")  # the loop returned normally after the preemption
    assert local_run.state()["trial_status"] == "KILLED"
    assert local.record_exit(local_run, 0) == "stopped"
    assert local_run.state()["status"] == "stopped"


def test_a_trial_that_ends_normally_is_finished(session, local_run):
    session.core.train.report_training_metrics(1, {"loss": 0.5})
    session.close("FINISHED")
    assert local.record_exit(local_run, 0) == "finished"
    assert local.record_exit(local_run, 1) == "failed"


def test_legacy_trial_crashing_is_recorded_failed_at_exit(session, local_run, monkeypatch):
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom"), raising=False)
    session.close_at_exit()
    assert local_run.state()["trial_status"] == "FAILED"
    assert session.record.tracking_summary()["status"] == "FAILED"


def test_a_trial_built_by_determineds_harness_seeds_its_shuffle_and_fails_on_sys_exit(lab, local_run, monkeypatch):
    """The legacy ``module:Class`` entrypoint on a cluster: Determined's harness, not det_lab's
    run(), builds the trial. Its shuffled loader gets the trial seed (resumes are exact there
    too), and a trial method's ``sys.exit(3)`` makes the run FAILED, not FINISHED."""
    from determined import pytorch

    from det_lab.trials import pytorch as lab_pytorch

    monkeypatch.setattr(lab_pytorch, "load_settings", lambda: lab)
    monkeypatch.setattr(lab_pytorch, "_current", None)  # no run() building this trial

    class Trial(lab_pytorch.LabPyTorchTrial):
        def build_training_data_loader(self):
            return pytorch.DataLoader(list(range(64)), batch_size=8, shuffle=True)

        def build_validation_data_loader(self):
            return pytorch.DataLoader(list(range(8)), batch_size=8)

        def train_batch(self, batch, epoch_idx, batch_idx):
            sys.exit(3)

        def evaluate_batch(self, batch):
            return {"loss": 0.0}

    with pytorch.init(hparams={"lr": 0.1, "opt": "sgd"}, exp_conf=read_identity().exp_conf) as ctx:
        trial = Trial(ctx)
        orders = [[int(b) for batch in trial.build_training_data_loader().get_data_loader() for b in batch]
                  for _ in range(2)]
        assert orders[0] == orders[1] and orders[0] != list(range(64))  # shuffled, the same way each time
        with pytest.raises(SystemExit):
            trial.train_batch(None, 0, 0)
        trial.session.close_at_exit()
    assert local_run.state()["trial_status"] == "FAILED"


def test_resume_clears_the_previous_outcome(lab, local_run, tmp_path):
    local_run.update(latest_checkpoint="abc", trial_status="KILLED")
    run, _cwd, _cmd = local.prepare(lab, str(tmp_path / "tpl"), None, True)
    assert run.dir == local_run.dir and "trial_status" not in run.state() and run.state()["resumed"] == 1


# --- null mirror and surface -------------------------------------------------------------------------


def test_null_mirror_has_the_mirrors_api():
    public = {n for n, _ in inspect.getmembers(Mirror, inspect.isfunction) if not n.startswith("_")}
    assert public == {n for n, _ in inspect.getmembers(NullMirror, inspect.isfunction) if not n.startswith("_")}
    for name in public:
        assert list(inspect.signature(getattr(Mirror, name)).parameters) == \
            list(inspect.signature(getattr(NullMirror, name)).parameters), name
    null = NullMirror()
    null.log_artifact("x.png", "renders/x", 1, media="image")
    assert null.flush() is True and null.close("FAILED") is None


class NonChief(det.core.DummyDistributedContext):
    @property
    def rank(self) -> int:
        return 1

    @rank.setter
    def rank(self, value: int) -> None:
        pass


def test_non_chief_ranks_get_a_null_mirror_and_write_no_record(lab, local_run, tmp_path):
    with det.core.init(checkpoint_storage=str(tmp_path / "ckpt"), distributed=NonChief()) as core:
        s = LabSession(lab, read_identity(), core).start()
        assert isinstance(s.mirror, NullMirror)
        core.train.report_training_metrics(1, {"loss": 1.0})
        s.close("FINISHED")
    assert local_run.metrics() == [] and "trial_status" not in local_run.state()


def test_both_trial_kinds_offer_the_same_surface_and_templates_use_only_it():
    from det_lab.core import LabContext
    from det_lab.trials.pytorch import LabPyTorchTrial
    from det_lab.trials.surface import TrialSurface

    names = {n for n, v in vars(TrialSurface).items() if isinstance(v, property)}
    assert {"dataset_path", "training_length", "outputs_dir", "work_dir", "mirror", "lineage", "hparams",
            "latest_checkpoint", "dataset"} <= names
    for cls in (LabContext, LabPyTorchTrial):
        assert issubclass(cls, TrialSurface) and all(getattr(cls, n) is getattr(TrialSurface, n) for n in names)
    for train in REPO.glob("experiment_templates/*/train.py"):
        assert not re.search(r"\.session\b", train.read_text()), f"{train} reaches into the session"


def test_a_twins_module_is_loaded_from_its_kind(local_run):
    import importlib.util

    local_run.update(kind="slurm")
    rec = record.open_record(local_run.dir)
    if importlib.util.find_spec("det_lab.slurm.record") is not None:
        assert type(rec).kind == "slurm"
    local_run.update(kind="no_such_scheduler")
    assert type(record.open_record(local_run.dir)) is record.LocalRunRecord


def test_metrics_since_takes_whole_lines_and_resumes_where_it_stopped(tmp_path):
    # what a pruning watcher polls: a line the trial is still writing is left for the next read
    run = record.LocalRunRecord(tmp_path / "run")
    run.dir.mkdir()
    run.metrics_file.write_text('{"group": "validation", "step": 20, "metrics": {"val_loss": 1.5}}\n'
                                '{"group": "validation", "step": 40, "metr')
    first, offset = run.metrics_since(0)
    assert [m["step"] for m in first] == [20]
    with open(run.metrics_file, "a") as f:
        f.write('ics": {"val_loss": 0.5}}\n')
    second, end = run.metrics_since(offset)
    assert second == [{"group": "validation", "step": 40, "metrics": {"val_loss": 0.5}}]
    assert run.metrics_since(end) == ([], end) and len(run.metrics()) == 2


def test_progress_reads_lines_as_written_and_any_other_json_the_same(tmp_path):
    """progress() reads the step of det_lab's own training lines without parsing them; lines
    written any other way (keys in another order, a torn last line) count the same as JSON says."""
    run = record.LocalRunRecord(tmp_path)
    run.append_metrics("training", 7, {"loss": 1.0, "step": 99})  # a metric called "step" is not the step
    run.append_metrics("validation", 7, {"val_loss": 0.5})
    with open(run.metrics_file, "a") as f:
        f.write('{"step": 12, "group": "training", "metrics": {"loss": 0.1}}\n')
        f.write('{"group": "validation", "step": 12, "metrics": {"val_loss": 0.25}}\n')
        f.write('{"group": "training", "step": 40, "metr')  # being written
    assert run.progress() == (12, {"val_loss": 0.25})
    run.append_metrics("training", 9, {"loss": 0.2})  # after a resume from an earlier checkpoint
    assert run.progress()[0] == 12


def test_a_listing_rereads_exactly_the_runs_whose_files_changed(tmp_path, monkeypatch):
    from det_lab.runs import listing
    from det_lab.runs.listing import ListingCache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runs = []
    for i in range(3):
        run = record.LocalRunRecord(tmp_path / "runs" / f"r{i}")
        run.dir.mkdir(parents=True)
        run.save({"name": f"r{i}", "status": "running", "max_length": 10, "lineage": {"big": "x" * 1000}})
        run.append_metrics("training", i + 1, {"loss": 1.0})
        runs.append(run)
    first = ListingCache(tmp_path)
    assert [x.step for x in first.read_all(runs)] == [1, 2, 3]
    first.save(complete=True)
    assert "lineage" not in first.path.read_text()  # only what a listing shows is kept

    runs[0].update(status="finished")  # run.json replaced
    runs[1].append_metrics("validation", 2, {"val_loss": 0.5})  # metrics grown
    reads = []  # whose run.json is read
    monkeypatch.setattr(listing, "shown_state", lambda data, path, parse=listing.shown_state:
                        reads.append(Path(path).parent.name) or parse(data, path))
    second = ListingCache(tmp_path)
    listed = second.read_all(runs)
    assert reads == ["r0", "r1"]  # r2 came from the cache
    assert [x.state["status"] for x in listed] == ["finished", "running", "running"]
    assert listed[1].validation == {"val_loss": 0.5} and [x.step for x in listed] == [1, 2, 3]

    second.path.write_text("{not json")  # a damaged cache is read around
    assert ListingCache(tmp_path).read_all([runs[2]])[0].step == 3
