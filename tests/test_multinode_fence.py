"""The fence of a run's attempts (det_lab.runs.fence) on one temporary volume, without Slurm: the
attempt epoch taken by racing processes, a stale copy's write refused and the copy stopped, the
latest-checkpoint pointer never moved back, a record rename held up past the next attempt's start
refused by the file system, a check that cannot read its file never stopping training, and a second
completion of a finished job doing nothing."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from det_lab.runs.fence import (
    ATTEMPT_ENV,
    POLL_ENV,
    STALE_EXIT_CODE,
    Fence,
    NullFence,
    StaleAttempt,
    begin_attempt,
    read_attempt,
    sweep_unrecorded,
)
from tests.conftest import VENV_BIN, tiny_data_lab

TINY = Path(__file__).parent / "fixtures" / "tiny"

# a stand-in for a trial's chief: it writes a line per "step" to the run's file after the fence's
# check, as LabSession checks before each metric, checkpoint and record write
WRITER = """
import os, sys, time
from pathlib import Path
from det_lab.runs.fence import Fence
run_dir = Path(sys.argv[1])
fence = Fence.from_env(run_dir)
lock = run_dir / "trainer.lock.stand-in"
lock.write_text(str(os.getpid()))
fence.on_stale.append(lock.unlink)  # what the session releases: its trainer lock
if sys.argv[2] == "watch":
    fence.watch()
go = run_dir / "go"
while not go.exists():
    time.sleep(0.01)
for step in range(1, 100000):
    if sys.argv[2] == "check":
        fence.check(f"step {step}")
    with open(run_dir / "writes.log", "a") as f:
        f.write(f"{os.getpid()} {step}\\n")
    time.sleep(0.02)
"""


def _writer(run_dir: Path, epoch_token: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, ATTEMPT_ENV: epoch_token, POLL_ENV: "0.1"}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_racing_starts_each_take_their_own_epoch(tmp_path):
    """Eight starts at once (eight processes): epochs 1..8 each once, the file the last one's."""
    code = ("import sys, json; from pathlib import Path; from det_lab.runs.fence import begin_attempt; "
            "a = begin_attempt(Path(sys.argv[1]), 'job', 0, sys.argv[2]); print(json.dumps([a.epoch, a.token]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"n{i}"], stdout=subprocess.PIPE,
                              text=True) for i in range(8)]
    taken = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(e for e, _ in taken) == list(range(1, 9))
    now = read_attempt(tmp_path)
    assert now is not None and [now.epoch, now.token] == max(taken)


def test_a_later_restart_makes_an_earlier_one_stale(tmp_path):
    begin_attempt(tmp_path, "41", 1, "b")
    with pytest.raises(StaleAttempt, match="restart 1 of job 41 already runs on b"):
        begin_attempt(tmp_path, "41", 0, "a")  # the first start, delayed: it must not take over
    assert begin_attempt(tmp_path, "41", 2, "a").epoch == 2  # the next restart does


def test_a_stale_copy_writes_nothing_after_the_new_attempt_started_and_stops(tmp_path):
    """The old copy passes its check until the new attempt is taken; then its next write is refused
    and it exits (code 76) after releasing its trainer lock."""
    first = begin_attempt(tmp_path, "7", 0, "node-a")
    old = _writer(tmp_path, first.env_value, "check")
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 60
    while not (tmp_path / "writes.log").exists() or len((tmp_path / "writes.log").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline and old.poll() is None, old.communicate()[0]
        time.sleep(0.02)
    begin_attempt(tmp_path, "7", 1, "node-b")
    written_when_taken = len((tmp_path / "writes.log").read_text().splitlines())
    out = old.communicate(timeout=60)[0]
    assert old.returncode == STALE_EXIT_CODE, out
    lines = (tmp_path / "writes.log").read_text().splitlines()
    # a check passed just before the new epoch landed may finish its one write: never more
    assert len(lines) <= written_when_taken + 1
    (line,) = [x for x in out.splitlines() if "stale" in x]
    assert "attempt 1 of this run is stale: attempt 2 (job 7, restart 1) on node-b took over" in line
    assert not (tmp_path / "trainer.lock.stand-in").exists()  # released for the new attempt


def test_a_stale_copy_between_writes_is_stopped_by_its_watcher(tmp_path):
    first = begin_attempt(tmp_path, "8", 0, "node-a")
    old = _writer(tmp_path, first.env_value, "watch")  # writes without checking: only the watcher stops it
    time.sleep(0.5)
    begin_attempt(tmp_path, "8", 1, "node-b")
    started = time.monotonic()
    assert old.wait(timeout=30) == STALE_EXIT_CODE
    assert time.monotonic() - started < 5  # within a few polls (0.1 s here)


def test_the_latest_pointer_never_moves_backwards(tmp_path):
    from det_lab.slurm.record import SlurmRunRecord

    run = SlurmRunRecord(tmp_path)
    run.save({"kind": "slurm", "name": "r", "latest_checkpoint": None, "checkpoints": []})
    run.add_checkpoint("uuid-40", 40)
    run.add_checkpoint("uuid-80", 80)
    run.add_checkpoint("uuid-60-late", 60)  # a stale copy's report landing late
    st = run.state()
    assert (st["latest_checkpoint"], st["latest_checkpoint_step"]) == ("uuid-80", 80)
    assert [c["step"] for c in st["checkpoints"]] == [40, 80]


def test_a_check_that_cannot_read_the_attempt_never_stops_training(tmp_path, caplog):
    """A volume hiccup (here: attempt.json unreadable) lets the write go ahead, with one warning,
    once the check has kept reading for its unknown_wait_s (30 s by default; 0.5 s here)."""
    first = begin_attempt(tmp_path, "9", 0, "a")
    fence = Fence(tmp_path, first.epoch, first.token, poll_s=0.1, unknown_wait_s=0.5)
    (tmp_path / "attempt.json").unlink()
    (tmp_path / "attempt.json").mkdir()  # reading it fails with an OSError, as a lost mount does
    with caplog.at_level(logging.WARNING, logger="det_lab.trials"):
        started = time.monotonic()
        assert fence.current() is None
        assert 0.45 < time.monotonic() - started < 5  # it kept trying: a healed volume answers again
        fence.check("metrics of step 10")
        fence.check("metrics of step 20")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "writing anyway (a failed check never stops training)" in warning


def test_a_trial_without_an_attempt_gets_the_null_fence(tmp_path):
    fence = Fence.from_env(tmp_path, {})
    assert isinstance(fence, NullFence) and not fence.active and fence.current() is True
    assert fence.lock_wait_s(60) == 0 and fence.watch() is None
    assert Fence.from_env(tmp_path, {ATTEMPT_ENV: "3:abc"}).active


def test_a_second_completion_of_a_finished_job_does_nothing(tmp_path, monkeypatch, capsys):
    """Slurm may run a job once more after a copy finished it ("batch completion sent from wrong
    node"): the driver sees the run finished and neither takes an attempt nor writes the record."""
    from det_lab.slurm.job import run_in_job
    from det_lab.slurm.record import SlurmRunRecord

    monkeypatch.setenv("DET_LAB_DATA_ROOT", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    run = SlurmRunRecord(tmp_path / "run")
    run.dir.mkdir()
    run.save({"kind": "slurm", "name": "done", "status": "finished", "slurm": {"job_id": "12"}})
    before = run.run_file.read_bytes()
    assert run_in_job(run) == 0
    assert "run done already finished; nothing to do" in capsys.readouterr().out
    assert run.run_file.read_bytes() == before and read_attempt(run.dir) is None


def test_a_record_rename_held_up_past_the_next_attempt_s_start_is_refused(tmp_path):
    """A copy cut off from a network volume: what it sent before the cut arrives after the heal.
    Its record is renamed from its attempt's directory, which the next attempt removed first, so
    the file server refuses the late rename and the newer record stays."""
    first = begin_attempt(tmp_path, "7", 0, "a")
    staged = Fence(tmp_path, first.epoch, first.token).stage / ".run.json.1.tmp"
    staged.write_text('{"by": "attempt 1"}')  # written whole before the cut, its rename held up
    second = begin_attempt(tmp_path, "7", 1, "b")
    (tmp_path / "run.json").write_text('{"by": "attempt 2"}')
    with pytest.raises(FileNotFoundError):
        os.replace(staged, tmp_path / "run.json")  # the held-up request reaches the file server
    assert json.loads((tmp_path / "run.json").read_text()) == {"by": "attempt 2"}
    assert [p.name for p in tmp_path.glob(".attempt-*")] == [f".attempt-{second.epoch}"]


PUBLISHER = """
import sys
from pathlib import Path
from det_lab.runs.fence import Fence
from det_lab.slurm.record import SlurmRunRecord
run = SlurmRunRecord(Path(sys.argv[1]))
run.fence = Fence.from_env(run.dir)
run.update(by=sys.argv[2])
print("written")
"""


def test_the_record_is_published_by_the_current_attempt_only(tmp_path):
    """A stale copy's record write stops it (code 76) and changes nothing; the current attempt's
    lands, also when its directory is missing (an attempt an older det_lab began)."""
    from det_lab.slurm.record import SlurmRunRecord

    SlurmRunRecord(tmp_path).save({"kind": "slurm", "name": "r", "by": "nobody"})
    first = begin_attempt(tmp_path, "5", 0, "a")
    second = begin_attempt(tmp_path, "5", 1, "b")

    def publish(attempt, who):
        return subprocess.run([sys.executable, "-c", PUBLISHER, str(tmp_path), who], capture_output=True, text=True,
                              env={**os.environ, ATTEMPT_ENV: attempt.env_value}, timeout=120)

    stale = publish(first, "attempt 1")
    assert stale.returncode == STALE_EXIT_CODE and "attempt 1 of this run is stale" in stale.stderr, stale
    assert SlurmRunRecord(tmp_path).state()["by"] == "nobody"
    Fence(tmp_path, second.epoch, second.token).stage.rmdir()
    current = publish(second, "attempt 2")
    assert current.returncode == 0 and current.stdout.strip() == "written", current
    assert SlurmRunRecord(tmp_path).state()["by"] == "attempt 2"
    assert not list(tmp_path.glob(".attempt-*/.*.tmp"))


def _checkpoint(root: Path, uuid: str, lab: dict | None, step: int = 50) -> Path:
    """A checkpoint directory as Determined 0.38.1's ``store_path`` leaves it
    (harness/determined/core/_checkpoint.py:519-523: the trial's files in the storage manager's
    directory, then ``_write_metadata_file``, :704-707, ``json.dump(metadata, f, indent=2)``), with
    det_lab's lineage under ``det_lab`` (None: the files only, mid-write)."""
    path = root / uuid
    path.mkdir(parents=True)
    (path / "state_dict.pth").write_bytes(b"weights")
    if lab is not None:
        (path / "metadata.json").write_text(json.dumps({"steps_completed": step, "det_lab": lab}, indent=2))
    return path


def test_the_next_attempt_removes_only_the_complete_checkpoints_an_older_attempt_left_unrecorded(tmp_path):
    """A copy found stale between a checkpoint's metadata.json and its pointer switch leaves a
    complete checkpoint nothing names (seen in the cut-off test: step 50 of attempt 1, written as
    attempt 2 began). Attempt 2 removes that one; everything else under the root stays."""
    run = {"run_key": "vla/run-1"}
    orphan = _checkpoint(tmp_path, "orphan", {**run, "attempt": 1})
    keep = [_checkpoint(tmp_path, "recorded", {**run, "attempt": 1}, 40),  # the record names it
            _checkpoint(tmp_path, "current", {**run, "attempt": 2}, 60),  # this attempt's own, not recorded yet
            _checkpoint(tmp_path, "other-run", {"run_key": "vla/run-2", "attempt": 1}),
            _checkpoint(tmp_path, "being-written", None),  # no metadata.json: maybe another run's, mid-write
            _checkpoint(tmp_path, "older-det-lab", run),  # no attempt recorded: not known to be stale
            _checkpoint(tmp_path, "damaged", {**run, "attempt": "one"}),
            _checkpoint(tmp_path, "truncated", None)]
    (keep[-1] / "metadata.json").write_text(json.dumps({"steps_completed": 50, "det_lab": {**run, "attempt": 1}})[:40])
    (tmp_path / "linked").symlink_to(orphan)
    assert sweep_unrecorded(tmp_path, "vla/run-1", 2, ["recorded"]) == [("orphan", 50)]
    assert not orphan.exists() and all((k / "state_dict.pth").exists() for k in keep)
    assert sweep_unrecorded(tmp_path, "vla/run-1", 1, []) == []  # a first attempt has no older one
    assert sweep_unrecorded(tmp_path / "missing", "vla/run-1", 3, []) == []


# Slurm's driver takes the run's attempt before it starts the trial (det_lab/slurm/job.py,
# _take_attempt): here the trial's first Python process does it (its children inherit the token).
# Then the other node takes the next attempt right after this copy's last check before a
# checkpoint's metadata.json (det_lab's checkpoint_written, run as Determined's store_path resumes
# after its yield and before _write_metadata_file: harness/determined/core/_checkpoint.py:522-523):
# the moment the cut-off test on the multi-host bed once caught.
TAKEOVER = """
import os
from pathlib import Path
from det_lab.runs.fence import ATTEMPT_ENV, begin_attempt
from det_lab.runs.identity import LOCAL_RUN_ENV

if LOCAL_RUN_ENV in os.environ and ATTEMPT_ENV not in os.environ:
    os.environ[ATTEMPT_ENV] = begin_attempt(Path(os.environ[LOCAL_RUN_ENV]).parent, "7", 0, "node-a").env_value
if LOCAL_RUN_ENV in os.environ:
    from det_lab.trials import session

    written, seen = session.LabSession.checkpoint_written, []

    def checkpoint_written(self, path):
        written(self, path)
        seen.append(path)
        if len(seen) == 2:
            begin_attempt(self.record.dir, "7", 1, "node-b")

    session.LabSession.checkpoint_written = checkpoint_written
"""


def test_a_checkpoint_a_stale_copy_completed_but_never_recorded_is_removed_by_the_next_attempt(tmp_path):
    """Attempt 1 (a real trial, Determined's checkpoint code) writes its second checkpoint while
    attempt 2 is taken: Determined writes its metadata.json, the pointer check finds the copy stale
    and it stops (code 76), the checkpoint complete and named by no record. Attempt 2 resumes, removes
    it (one log line) and trains to the end; the checkpoint attempt 1 recorded stays."""
    lab = tiny_data_lab(tmp_path)
    conf = yaml.safe_load((TINY / "const.yaml").read_text())
    conf["min_checkpoint_period"] = {"batches": 10}
    conf["data"]["det_lab"]["max_length"] = {"batches": 30}
    config = tmp_path / "takeover.yaml"
    config.write_text(yaml.safe_dump(conf))
    run_dir = lab.root / "outputs" / "vla" / "local-runs" / "takeover"
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "sitecustomize.py").write_text(TAKEOVER)

    def run(*extra: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", "--exp-config", str(config),
                               "--run", "takeover", *extra], env={**lab.env, **env},
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)

    stale = run(PYTHONPATH=str(plug))
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else stale.stdout + stale.stderr
    assert "attempt 1 of this run is stale: attempt 2 (job 7, restart 1) on node-b took over" in log, log
    ckpts = lab.root / "checkpoints" / "vla"
    metas = {p.name: json.loads((p / "metadata.json").read_text()) for p in ckpts.iterdir()}
    recorded = [c["uuid"] for c in json.loads((run_dir / "run.json").read_text())["checkpoints"]]
    (orphan,) = set(metas) - set(recorded)
    assert metas[orphan]["steps_completed"] == 20 and metas[orphan]["det_lab"]["attempt"] == 1
    assert [metas[u]["steps_completed"] for u in recorded] == [10]

    current = read_attempt(run_dir)
    assert current is not None and current.epoch == 2
    resumed = run("--resume", **{ATTEMPT_ENV: current.env_value})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = (run_dir / "train.log").read_text()
    assert f"removed checkpoint {orphan} (step 20): an older attempt of this run wrote it" in log
    st = json.loads((run_dir / "run.json").read_text())
    assert st["status"] == "finished" and [c["step"] for c in st["checkpoints"]] == [10, 20, 30]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(c["uuid"] for c in st["checkpoints"])
    assert st["checkpoints"][0]["uuid"] == recorded[0]
