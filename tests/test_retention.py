"""Checkpoint retention of local-style runs by Determined's keys (``save_experiment_best``,
``save_trial_best``, ``save_trial_latest``), as Determined 0.38.1's master selects what to delete:
``master/internal/experiment/postgres_experiments.go`` (``ExperimentCheckpointsToGCRaw``, lines
69-105: ranks by ``sign * metric ASC NULLS LAST, v.id ASC`` per trial and per experiment, by
``steps_completed DESC`` for latest; deletes ``(experiment_rank > E AND trial_rank > T OR metric
IS NULL) AND trial_order_rank > L``; keeps warm-start checkpoints). Defaults from
``schemas/expconf/v0/checkpoint-storage.json`` (0, 1, 1).

Unit passes over real files; a pass killed with -9 at each of its steps; a real tiny run whose
retention deletes checkpoints, stopped and resumed, reporting the losses of an uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from det_lab.runs import retention
from det_lab.runs.record import LocalRunRecord
from tests.conftest import VENV_BIN, Lab, tiny_data_lab

TINY = Path(__file__).parent / "fixtures" / "tiny"
# val_loss at steps 10..50: steps 20 and 40 tie for best; 45 is a checkpoint without a validation
LOSSES = {10: 0.5, 20: 0.2, 30: 0.4, 40: 0.2, 50: 0.3}


def make_run(base: Path, name: str, steps: list[int], losses: dict[int, float], storage: dict | None = None,
             smaller_is_better: bool = True, root: Path | None = None) -> tuple[LocalRunRecord, Path]:
    """A run directory as a local run leaves it: run.json listing checkpoints ``steps`` (each a
    directory with metadata.json and a file), metrics.jsonl with the validations ``losses``."""
    root = root or base / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    run = LocalRunRecord(base / "runs" / name)
    run.dir.mkdir(parents=True)
    conf = {"searcher": {"name": "single", "metric": "val_loss", "smaller_is_better": smaller_is_better}}
    if storage is not None:
        conf["checkpoint_storage"] = storage
    ckpts = []
    for step in steps:
        uuid = f"{name}-{step}"
        (root / uuid).mkdir()
        (root / uuid / "metadata.json").write_text(json.dumps({"steps_completed": step}))
        (root / uuid / "state.pt").write_bytes(b"x" * 100)
        ckpts.append({"uuid": uuid, "step": step})
    run.save({"name": name, "exp_conf": conf, "checkpoints": ckpts, "latest_checkpoint": ckpts[-1]["uuid"],
              "latest_checkpoint_step": steps[-1]})
    with open(run.metrics_file, "w") as f:
        for step, loss in losses.items():
            f.write(json.dumps({"group": "training", "step": step, "metrics": {"loss": loss + 1}}) + "\n")
            f.write(json.dumps({"group": "validation", "step": step, "metrics": {"val_loss": loss}}) + "\n")
    return run, root


def kept_steps(run: LocalRunRecord, root: Path) -> list[int]:
    """The steps run.json lists, after checking that exactly those checkpoints are on disk."""
    st = run.state()
    listed = {c["uuid"] for c in st["checkpoints"]}
    on_disk = {p.name for p in root.iterdir() if p.name.startswith(st["name"] + "-")}
    assert listed == on_disk, (listed, on_disk)
    deleted = {c["uuid"] for c in st.get(retention.DELETED_KEY, [])}
    assert not deleted & listed
    return sorted(c["step"] for c in st["checkpoints"])


@pytest.mark.parametrize(("storage", "smaller", "expected"), [
    (None, True, [20, 50]),  # defaults 0/1/1: the best (20 wins its tie with 40: earlier validation) and latest
    ({"save_trial_best": 2}, True, [20, 40, 50]),  # the tie's loser is second best
    ({"save_trial_best": 0, "save_trial_latest": 3}, True, [30, 40, 50]),
    ({"save_trial_best": 0, "save_trial_latest": 0}, True, [50]),  # the resume point stays anyway
    ({"save_trial_best": 1, "save_trial_latest": 0}, False, [10, 50]),  # larger is better: 10 (0.5)
    ({"save_experiment_best": 1, "save_trial_best": 0}, True, [20, 50]),  # one trial: the experiment's best is its own
    ({"save_trial_best": None, "save_trial_latest": None}, True, [20, 50]),  # null: Determined's default
])
def test_each_key_keeps_what_determined_would(tmp_path, storage, smaller, expected):
    run, root = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES, storage, smaller)
    outcome = retention.enforce(run, root)
    assert kept_steps(run, root) == expected
    assert sorted(d["step"] for d in outcome.deleted) == sorted(set(LOSSES) - set(expected))
    assert all(d["reason"].startswith("retention: outside save_trial_best") for d in run.state()[retention.DELETED_KEY])
    # a second pass changes nothing
    assert retention.enforce(run, root).deleted == [] and kept_steps(run, root) == expected


def test_reasons_name_the_rule_and_the_metric(tmp_path):
    run, _ = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES, {"save_trial_best": 2})
    verdicts = {v.step: v.keep for v in retention.plan(run)}
    assert verdicts == {10: (), 20: ("best (val_loss 0.2)",), 30: (), 40: ("best #2 (val_loss 0.2)",),
                        50: ("resume point", "latest")}


def test_a_checkpoint_without_a_validation_goes_unless_it_is_latest(tmp_path):
    # 45: a preemption checkpoint between validations; Determined drops it ("OR val_metric IS NULL")
    run, root = make_run(tmp_path, "r", [10, 20, 45, 50], LOSSES, {"save_trial_best": 10, "save_trial_latest": 1})
    retention.enforce(run, root)
    assert kept_steps(run, root) == [10, 20, 50]


def test_the_experiment_best_of_a_search_spans_its_trials(tmp_path):
    # a sibling trial of the same search validated lower everywhere: this trial keeps no "best"
    sib, root = make_run(tmp_path, "sib", [10, 20], {10: 0.01, 20: 0.02})
    run, _ = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES,
                      {"save_experiment_best": 1, "save_trial_best": 0}, root=root)
    retention.enforce(run, root, siblings=[sib])
    assert kept_steps(run, root) == [50]
    assert kept_steps(sib, root) == [10, 20]  # another trial's checkpoints are never this pass's


def test_a_checkpoint_another_run_starts_from_is_kept(tmp_path):
    run, root = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES)
    # a det-lab reproduce --continue run lists the origin's checkpoint 30 as its start
    repro = LocalRunRecord(tmp_path / "runs" / "repro")
    repro.dir.mkdir()
    repro.save({"name": "repro", "checkpoints": [{"uuid": "r-30", "step": 30}], "latest_checkpoint": "r-30"})
    outcome = retention.enforce(run, root, others=[repro])
    assert kept_steps(run, root) == [20, 30, 50]
    assert ("used by run repro",) in [v.keep for v in outcome.kept]


def test_a_bad_key_is_one_line(tmp_path):
    run, root = make_run(tmp_path, "r", [10, 20], LOSSES, {"save_trial_latest": -1})
    with pytest.raises(retention.RetentionConfigError, match=r"checkpoint_storage.save_trial_latest: -1 .*>= 0"):
        retention.enforce(run, root)
    assert kept_steps(run, root) == [10, 20]


def test_files_already_gone_and_names_outside_the_root(tmp_path):
    run, root = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES)
    st = run.state()
    st["checkpoints"][0]["deleting"] = {"since": "earlier", "reason": "retention"}  # a killed pass's mark...
    run.save(st)
    import shutil

    shutil.rmtree(root / "r-10")  # ...whose files were already gone: no error (Determined PR 5593)
    st["checkpoints"].append({"uuid": "../../etc", "step": 5})  # a damaged run.json: never rm'd
    run.save(st)
    outcome = retention.enforce(run, root)
    st = run.state()
    assert [c["uuid"] for c in st["checkpoints"]] == ["r-20", "r-50", "../../etc"]
    assert {d["uuid"] for d in st[retention.DELETED_KEY]} == {"r-10", "r-30", "r-40"}
    assert any("../../etc" in p for p in outcome.problems)


# --- killed with -9 in the middle ----------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from det_lab.runs import retention
    from det_lab.runs.record import LocalRunRecord

    where = sys.argv[3]
    real_remove, real_save = retention.remove_checkpoint, LocalRunRecord.save
    calls = {"remove": 0, "save": 0}

    def park():
        print("PARKED", flush=True)
        time.sleep(600)

    def remove(path):
        calls["remove"] += 1
        if where == "marked":  # the intent is on disk, no file gone yet
            park()
        if where == "mid-rm" and calls["remove"] == 2:  # the second victim half deleted
            (path / "metadata.json").unlink()
            park()
        real_remove(path)

    def save(self, state):
        calls["save"] += 1
        if where == "removed" and calls["save"] == 2:  # every victim's files gone, the record not yet
            park()
        real_save(self, state)

    retention.remove_checkpoint, LocalRunRecord.save = remove, save
    retention.enforce(LocalRunRecord(Path(sys.argv[1])), Path(sys.argv[2]))
""")


def consistent(run: LocalRunRecord, root: Path) -> None:
    """run.json names no checkpoint that is gone (unless marked deleting) and loses none that is there."""
    st = run.state()
    listed = {c["uuid"]: c for c in st["checkpoints"]}
    for uuid, entry in listed.items():
        assert entry.get("deleting") or (root / uuid / "metadata.json").is_file(), entry
    for d in root.iterdir():
        assert d.name in listed, f"{d.name} is on disk but not in run.json"
    assert st["latest_checkpoint"] in listed and not listed[st["latest_checkpoint"]].get("deleting")


@pytest.mark.parametrize("where", ["marked", "mid-rm", "removed"])
def test_a_pass_killed_with_9_is_finished_by_the_next(tmp_path, where):
    run, root = make_run(tmp_path, "r", [10, 20, 30, 40, 50], LOSSES)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run.dir), str(root), where],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "PARKED"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    consistent(run, root)
    retention.enforce(run, root)
    consistent(run, root)
    assert kept_steps(run, root) == [20, 50]
    assert sorted(d["step"] for d in run.state()[retention.DELETED_KEY]) == [10, 30, 40]


# --- a real run: retention while training, then a resume -------------------------------------------


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory) -> Lab:
    return tiny_data_lab(tmp_path_factory.mktemp("retention-lab"))


# a checkpoint and a validation every 20 batches, to 80; Determined's default keys
EVERY_20 = ("--set", "min_checkpoint_period.batches=20", "--set", "checkpoint_storage.save_trial_latest=0")


def _metrics(run_dir: Path, group: str, key: str) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["metrics"][key] for m in lines if m["group"] == group}


def test_a_run_stopped_after_retention_resumes_from_its_resume_point_to_the_same_losses(tiny_lab):
    straight = tiny_lab.cli("run", str(TINY), "--local", "--run", "straight", *EVERY_20)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    runs = tiny_lab.root / "outputs" / "vla" / "local-runs"
    ckpts = tiny_lab.root / "checkpoints" / "vla"
    st = json.loads((runs / "straight" / "run.json").read_text())
    # save_trial_latest 0, save_trial_best 1: the best validated checkpoint stays, and the resume point
    assert [c["step"] for c in st["checkpoints"]] == [80]  # 80: best (loss falls) and resume point
    assert [d["step"] for d in st[retention.DELETED_KEY]] == [20, 40, 60]
    assert all(not (ckpts / d["uuid"]).exists() for d in st[retention.DELETED_KEY])

    held = dataclasses.replace(tiny_lab, env={**tiny_lab.env, "TINY_HOLD_AFTER": "45"})
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", "--run", "stopped", *EVERY_20],
                            env=held.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run_dir = runs / "stopped"
    import time

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (run_dir / "run.json").exists() and len(json.loads((run_dir / "run.json").read_text()).get(
                retention.DELETED_KEY) or []) >= 1:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # parked after batch 45
    proc.send_signal(signal.SIGINT)  # Ctrl-C: a checkpoint at the stop step, no validation there
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    st = json.loads((run_dir / "run.json").read_text())
    stop = st["latest_checkpoint_step"]
    assert 40 < stop < 60
    # by the keys the unvalidated stop checkpoint would go; it is the resume point, so it stays
    assert [c["step"] for c in st["checkpoints"]] == [40, stop]
    assert (ckpts / st["latest_checkpoint"] / "metadata.json").is_file()

    resumed = tiny_lab.cli("run", str(TINY), "--local", "--resume", "--run", "stopped")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    st = json.loads((run_dir / "run.json").read_text())
    assert [c["step"] for c in st["checkpoints"]] == [80]
    assert sorted(d["step"] for d in st[retention.DELETED_KEY]) == sorted([20, 40, 60, stop])
    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected = _metrics(runs / "straight", group, key)
        got = _metrics(run_dir, group, key)
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_a_bad_key_refuses_the_run_in_one_line_before_anything_exists(tiny_lab):
    runs = tiny_lab.root / "outputs" / "vla" / "local-runs"
    before = sorted(runs.iterdir()) if runs.is_dir() else []
    proc = tiny_lab.cli("run", str(TINY), "--local", "--set", "checkpoint_storage.save_trial_latest=-1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: ") and "checkpoint_storage.save_trial_latest: -1 is not a whole number" in proc.stderr
    assert (sorted(runs.iterdir()) if runs.is_dir() else []) == before
