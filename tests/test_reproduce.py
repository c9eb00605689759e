"""det-lab reproduce and runs diff on real tiny trials: code in a real git repository (its commit
moved on, a run from a dirty tree), a DVC dataset whose branch moves to a new revision, a real
MLflow server, checkpoints on the data root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.conftest import Lab, publish_tiny_data

TINY = Path(__file__).parent / "fixtures" / "tiny"
GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@example.com"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def runs_dir(lab: Lab) -> Path:
    return lab.root / "outputs" / "vla" / "local-runs"


def state(lab: Lab, name: str) -> dict:
    return json.loads((runs_dir(lab) / name / "run.json").read_text())


def losses(lab: Lab, name: str) -> list[tuple[str, int, dict]]:
    lines = (runs_dir(lab) / name / "metrics.jsonl").read_text().splitlines()
    return [(m["group"], m["step"], m["metrics"]) for m in map(json.loads, lines)]


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def world(shared_mlflow_server, tmp_path_factory):
    """A lab tracking to MLflow, the tiny dataset published, the tiny trial committed in a git
    repository of its own, and one run ``orig`` of it at that commit."""
    tmp = tmp_path_factory.mktemp("repro")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER")) and k != "XDG_DATA_HOME"}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               HOME=str(tmp / "home"))
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    # MLflow for every run; an Aim repository for the runs that ask for both (data.det_lab.tracking)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": shared_mlflow_server.uri, "aim_repo": str(tmp / "aim")})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    repo = tmp / "code"
    shutil.copytree(TINY, repo / "trial", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "--quiet", "--initial-branch=main")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "tiny trial")
    lab.repo, lab.settings, lab.tmp = repo, settings, tmp
    lab.first_commit = git(repo, "rev-parse", "HEAD")
    ok(lab.cli("run", str(repo / "trial"), "--local", "--run", "orig"))
    lab.mlflow = MlflowClient(shared_mlflow_server.uri)
    return lab


MSE = "loss = torch.nn.functional.mse_loss(self.model(x), y)"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def moved(world):
    """Main moved on: a new commit changes the loss, the dataset's branch moves to new data, and
    run ``newer`` trains on both with one hyperparameter changed."""
    import numpy as np

    from det_lab.data.publish import publish_directory

    edit(world.repo / "trial" / "train.py", MSE, "loss = torch.nn.functional.smooth_l1_loss(self.model(x), y)")
    git(world.repo, "commit", "--quiet", "-am", "smooth L1 loss")
    src = world.tmp / "tiny-v2"
    src.mkdir()
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (512, 1))
    xy = np.hstack([x, -2 * x + 1.5 + rng.normal(0, 0.05, (512, 1))])
    np.savetxt(src / "train.csv", xy[:400], delimiter=",")
    np.savetxt(src / "val.csv", xy[400:], delimiter=",")
    publish_directory(world.settings, "vla", "tiny-data", src, "tiny regression data v2")
    ok(world.cli("run", str(world.repo / "trial"), "--local", "--run", "newer", "--set", "hyperparameters.lr=0.1"))
    return world


def reproduce(lab: Lab, *args: str) -> tuple[str, dict]:
    """``det-lab reproduce ARGS --run <new>``: its output and the new run's run.json."""
    name = f"repro-{len(list(runs_dir(lab).iterdir()))}"
    out = ok(lab.cli("reproduce", *args, "--run", name))
    return out, state(lab, name)


def test_reproduce_by_run_name_uses_old_code_and_old_data(moved):
    lab = moved
    out, new = reproduce(lab, "orig")
    assert "verdict: reproduced exactly" in out
    orig, newer = state(lab, "orig"), state(lab, "newer")
    # bitwise the same metrics, step by step; not those of the code and data main has now
    assert losses(lab, new["name"]) == losses(lab, "orig")
    def training(name: str) -> list:
        return [m for m in losses(lab, name) if m[0] == "training"]

    assert training("newer") != training("orig")
    # what it ran: the first commit (in a scratch worktree) and the first dataset revision
    assert new["lineage"]["code"]["commit"] == lab.first_commit != newer["lineage"]["code"]["commit"]
    assert new["lineage"]["code"]["repo"] == str(lab.repo)  # the repository, not the scratch worktree
    assert new["lineage"]["dataset"]["md5"] == orig["lineage"]["dataset"]["md5"] != newer["lineage"]["dataset"]["md5"]
    assert MSE in (Path(new["cwd"]) / "train.py").read_text()
    assert new["reproduces"]["run"] == "orig" and new["reproduction"]["verdict"] == "reproduced exactly"
    # the new tracker run says what it reproduces
    run_id = json.loads((runs_dir(lab) / new["name"] / "tracking-summary.json").read_text())["backends"][0]["run_id"]
    tags = lab.mlflow.get_run(run_id).data.tags
    assert tags["det_lab.reproduces.run"] == "orig" and tags["code.commit"] == lab.first_commit


def test_the_default_tolerance_tells_a_real_runs_neighbouring_steps_apart(world):
    """orig's own metrics, each value moved one reporting step later (a logging off by one step):
    each loss diverges at the first step compared (the epoch counter, the same over neighbouring
    steps, is the one metric a shift may leave equal)."""
    from det_lab.reproduce.compare import compare

    records = [json.loads(line) for line in (runs_dir(world) / "orig" / "metrics.jsonl").read_text().splitlines()]
    for group in sorted({r["group"] for r in records}):
        mine = sorted((r for r in records if r["group"] == group), key=lambda r: r["step"])
        later = [{**r, "step": nxt["step"]} for r, nxt in zip(mine, mine[1:])]
        shifted = compare(mine, later, from_step=mine[0]["step"])  # the first step is missing from later
        beyond = {m.key: m.first_beyond for m in shifted.metrics if m.key.endswith("loss")}
        assert len(mine) >= 4 and beyond and set(beyond.values()) == {mine[1]["step"]}, shifted.as_dict()
        assert shifted.verdict.startswith(f"diverged at step {mine[1]['step']} ")


def test_continue_from_a_middle_checkpoint_uuid_with_an_environment_changed(moved):
    """Found by a checkpoint UUID, re-run from that checkpoint: equal to the original from that
    step on; one recorded version edited gives the difference table and still runs."""
    lab = moved
    orig = state(lab, "orig")
    env_file = Path(orig["lineage"]["environment"]["file"])
    lines = env_file.read_text().splitlines()
    numpy_now = next(line for line in lines if line.startswith("numpy=="))
    env_file.write_text("\n".join("numpy==1.0.0" if line == numpy_now else line for line in lines) + "\n")
    middle = next(c for c in orig["checkpoints"] if c["step"] == 40)
    try:
        out, new = reproduce(lab, middle["uuid"], "--continue")
    finally:
        env_file.write_text("\n".join(lines) + "\n")
    assert "environment: 1 difference(s) from the run's (it runs anyway)" in out
    row = next(line for line in out.splitlines() if "numpy" in line)
    assert "1.0.0" in row and numpy_now.split("==")[1] in row
    assert f"found by checkpoint) as run {new['name']} from checkpoint {middle['uuid']} (step 40)" in out
    assert "verdict: reproduced exactly" in out
    after = [m for m in losses(lab, "orig") if m[1] > 40]
    assert losses(lab, new["name"]) == after  # it started at step 40: nothing before, all after equal
    assert min(m[1] for m in after) == 50


def test_continue_from_the_last_checkpoint_has_nothing_to_compare(moved):
    """--continue from orig's latest checkpoint, at its last step: no step is left to compare,
    and the verdict says so rather than that the run reproduced."""
    lab = moved
    last = state(lab, "orig")["latest_checkpoint_step"]
    assert last == max(m[1] for m in losses(lab, "orig"))
    out, new = reproduce(lab, "orig", "--continue")
    assert f"verdict: nothing to compare: the original run recorded no metrics after step {last}" in out
    assert "reproduced" not in new["reproduction"]["verdict"]


def test_a_run_that_does_not_reproduce_says_where_it_diverged(moved):
    """A copy of ``orig`` whose recorded val_loss at step 60 was changed: the re-run diverges there."""
    lab = moved
    copy = runs_dir(lab) / "tampered"
    shutil.copytree(runs_dir(lab) / "orig", copy)
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    for rec in records:
        if rec["group"] == "validation" and rec["step"] == 60:
            rec["metrics"]["val_loss"] += 1e-3
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = lab.cli("reproduce", "tampered", "--run", "tampered-again")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: diverged at step 60 (validation/val_loss)" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if "validation/val_loss" in line)
    cells = [c.strip() for c in row.split("│")]
    assert (cells[1], cells[2], cells[3], cells[5]) == ("validation/val_loss", "4", "0.001", "60")
    assert state(lab, "tampered-again")["reproduction"]["diverged_at"] == 60


def test_compare_verdicts():
    from det_lab.reproduce.compare import compare

    def recs(*vals):
        return [{"group": "training", "step": 10 * (i + 1), "metrics": {"loss": v}} for i, v in enumerate(vals)]

    assert compare(recs(1.0, 0.5), recs(1.0, 0.5)).verdict == "reproduced exactly"
    within = compare(recs(1.0, 0.5), recs(1.0, 0.5 * (1 + 1e-7)))
    assert within.verdict == "reproduced within tolerance (rtol=1e-05, atol=1e-08)"
    assert within.metrics[0].max_rel == pytest.approx(1e-7)
    missing_step = compare(recs(1.0, 0.5, 0.25), recs(1.0, 0.5))
    assert missing_step.verdict == "diverged at step 30 (training/loss)"
    wide = compare(recs(1.0, 0.5), recs(1.0, 0.6), rtol=0.5)
    assert wide.verdict.startswith("reproduced within tolerance") and wide.metrics[0].max_abs == pytest.approx(0.1)
    # a series shifted by one step is matched by step number, not position: it diverges
    shifted = compare(recs(1.0, 0.5, 0.25), [{"group": "training", "step": 10 * (i + 2), "metrics": {"loss": v}}
                                             for i, v in enumerate((1.0, 0.5, 0.25))])
    assert shifted.verdict == "diverged at step 10 (training/loss)"
    # continued from the original's last checkpoint: no step left to compare is no reproduction
    assert compare(recs(1.0, 0.5), recs(1.0, 0.5), from_step=20).verdict == \
        "nothing to compare: the original run recorded no metrics after step 20"
    assert compare([], []).verdict == "nothing to compare: the original run recorded no metrics"
    # a NaN or an infinity where the original had a number (or the reverse) is no tolerable difference
    for a, b in ((0.5, float("nan")), (float("nan"), 0.5), (float("inf"), 0.5), (0.5, float("-inf"))):
        assert compare(recs(1.0, a), recs(1.0, b), rtol=0.5).verdict == "diverged at step 20 (training/loss)"
    assert compare(recs(float("nan")), recs(float("nan"))).verdict == "reproduced exactly"


def test_dirty_tree_reproduces_from_its_saved_patch_found_by_aim_hash(moved):
    """A run made from a tree with local changes (one file changed, one untracked), tracked to
    MLflow and Aim, found again by its Aim run hash after the tree was cleaned."""
    lab = moved
    train = lab.repo / "trial" / "train.py"
    smooth = "loss = torch.nn.functional.smooth_l1_loss(self.model(x), y)"
    edit(train, smooth, f"loss = scale.FACTOR * {smooth.removeprefix('loss = ')}")
    edit(train, "import numpy as np\n", "import numpy as np\nimport scale\n")
    (lab.repo / "trial" / "scale.py").write_text("FACTOR = 3.0\n")  # untracked
    ok(lab.cli("run", str(lab.repo / "trial"), "--local", "--run", "dirty", "--set", "data.det_lab.tracking=both"))
    git(lab.repo, "checkout", "--", "trial/train.py")
    (lab.repo / "trial" / "scale.py").unlink()
    dirty = state(lab, "dirty")["lineage"]["code"]
    assert dirty["dirty"] and (runs_dir(lab) / "dirty" / "code.patch").is_file()
    backends = json.loads((runs_dir(lab) / "dirty" / "tracking-summary.json").read_text())["backends"]
    aim_hash = next(b["run_id"] for b in backends if b["backend"] == "aim")
    out, new = reproduce(lab, aim_hash)
    assert "reproducing dirty (found by aim run hash)" in out and new["reproduces"]["aim_run_hash"] == aim_hash
    assert "+ its saved local changes" in out and "verdict: reproduced exactly" in out
    assert losses(lab, new["name"]) == losses(lab, "dirty")
    assert (Path(new["cwd"]) / "scale.py").read_text() == "FACTOR = 3.0\n"
    assert new["lineage"]["code"]["patch_sha256"] == dirty["patch_sha256"]
    assert git(lab.repo, "status", "--porcelain") == ""  # the user's tree is left as it was


def test_vla_template_reproduced_from_its_mlflow_run_id(moved):
    """The shipped VLA template (committed into the code repository; a small LeRobot demo as
    ``vla-demo``), shortened with --set, found by its MLflow run id and re-run from the start."""
    from det_lab.data.demo import make_vla_demo
    from det_lab.data.publish import publish_directory
    from det_lab.data.registry import register

    lab = moved
    demo = make_vla_demo(lab.tmp / "vla-src" / "vla-demo", episodes=4, frames_per_episode=10, image_size=16)
    register(lab.settings, "vla-demo", publish_directory(lab.settings, "vla", "vla-demo", demo, "vla demo"))
    shutil.copytree(Path(__file__).resolve().parents[1] / "experiment_templates" / "vla", lab.repo / "vla",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git(lab.repo, "add", "vla")
    git(lab.repo, "commit", "--quiet", "-m", "vla template", "--", "vla")
    sets = ["--set", "data.det_lab.max_length.batches=20", "--set", "min_checkpoint_period.batches=10",
            "--set", "min_validation_period.batches=10", "--set", "data.det_lab.reporting_batches=5",
            "--set", "hyperparameters.global_batch_size=4"]
    ok(lab.cli("run", str(lab.repo / "vla"), "--local", "--run", "vla-orig", *sets))
    orig = state(lab, "vla-orig")
    assert orig["lineage"]["template"] == "vla" and orig["lineage"]["code"]["subdir"] == "vla"
    run_id = json.loads((runs_dir(lab) / "vla-orig" / "tracking-summary.json").read_text())["backends"][0]["run_id"]
    out, new = reproduce(lab, run_id)
    assert "reproducing vla-orig (found by mlflow run id)" in out and "verdict: reproduced exactly" in out
    assert losses(lab, new["name"]) == losses(lab, "vla-orig")
    assert new["reproduces"]["mlflow_run_id"] == run_id
    keys = {f"{g}/{k}" for g, _, m in losses(lab, "vla-orig") for k in m}
    assert {"validation/val_action_l1", "training/action_l1"} <= keys


def test_each_run_is_found_the_same_by_name_checkpoint_uuid_and_mlflow_run_id(moved):
    """What each reproduction above starts from: the tiny trial's and the VLA template's runs
    found by all three names give one lineage (run key, commit, dataset, config); runs diff of a
    run named two ways finds no difference."""
    from det_lab.reproduce.find import locate

    lab = moved
    for name in ("orig", "vla-orig"):
        st = state(lab, name)
        run_id = json.loads((runs_dir(lab) / name / "tracking-summary.json").read_text())["backends"][0]["run_id"]
        found = [locate(lab.settings, ref) for ref in (name, st["checkpoints"][0]["uuid"], run_id)]
        assert [o.found_by for o in found] == ["run", "checkpoint", "mlflow run id"]
        assert {o.record.dir.name for o in found} == {name}
        for o in found:
            assert o.lineage["run_key"] == st["run_key"] and o.config == st["exp_conf"]
            assert o.lineage["code"] == st["lineage"]["code"] and o.lineage["dataset"] == st["lineage"]["dataset"]
    st = state(lab, "orig")
    run_id = json.loads((runs_dir(lab) / "orig" / "tracking-summary.json").read_text())["backends"][0]["run_id"]
    same = json.loads(ok(lab.cli("runs", "diff", st["latest_checkpoint"], run_id, "--json")))
    assert same["differences"] == [] and same["a"] == same["b"] == "orig"


def test_a_checkpoint_without_a_run_record_is_enough_to_rebuild_the_run(moved):
    """As a cluster trial leaves it (the master keeps its state, the volume only the checkpoint;
    its context directory was no git work tree): a copy of orig's last checkpoint whose lineage
    names a Determined trial det_lab has no record of, with no code lineage. The config, seed and
    hyperparameters come from the checkpoint's metadata, the code from its code/ copy."""
    import uuid

    lab = moved
    st = state(lab, "orig")
    ckpts = lab.root / "checkpoints" / "vla"
    ref = str(uuid.uuid4())
    shutil.copytree(ckpts / st["latest_checkpoint"], ckpts / ref)
    meta = json.loads((ckpts / ref / "metadata.json").read_text())
    meta["det_lab"].update(run_key="det-c1-e7-t9", scheduler="determined")
    del meta["det_lab"]["code"]
    (ckpts / ref / "metadata.json").write_text(json.dumps(meta))
    out, new = reproduce(lab, ref)
    assert "reproducing det-c1-e7-t9 (found by checkpoint)" in out
    assert f"code: the copy in checkpoint {ref} (the run's code was not in git)" in out
    assert "the original's metrics are not on this volume (a cluster run)" in out
    assert losses(lab, new["name"]) == losses(lab, "orig")  # the same config, seed, code and data as orig
    diff = json.loads(ok(lab.cli("runs", "diff", ref, "orig", "--json")))
    assert sorted((d["section"], d["field"], d["a"], d["b"]) for d in diff["differences"]) == [
        ("code", "commit", None, lab.first_commit), ("code", "dirty", None, False),
        ("code", "repo", None, str(lab.repo)), ("scheduler", "scheduler", "determined", "local")]
    assert diff["ids"]["a"]["run_key"] == "det-c1-e7-t9"


def test_runs_diff_names_exactly_the_three_differences(moved):
    lab = moved
    result = json.loads(ok(lab.cli("runs", "diff", "orig", "newer", "--json")))
    found = {(d["section"], d["field"]) for d in result["differences"]}
    assert found == {("hyperparameters", "lr"), ("dataset", "commit"), ("dataset", "md5"), ("code", "commit")}
    assert "trial/train.py" in result["code_diff_stat"]
    lr = next(d for d in result["differences"] if d["field"] == "lr")
    assert (lr["a"], lr["b"]) == ("0.05", "0.1")
    assert set(result["final_metrics"]) >= {"training/loss", "validation/val_loss"}
    table = ok(lab.cli("runs", "diff", "orig", "newer"))
    assert "4 difference(s)" in table and "hyperparameters: lr" in table and "code: commit" in table


def refused(lab: Lab, *args: str) -> str:
    """A reproduce that must refuse: exit 2, one error line, and no run or scratch tree left."""
    before = set(runs_dir(lab).iterdir())
    proc = lab.cli("reproduce", *args, "--run", "refused")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert set(runs_dir(lab).iterdir()) == before
    assert not (lab.root / "outputs" / "vla" / "reproduce" / "refused").exists()
    return " ".join(proc.stderr.split())


def test_refuses_an_unreachable_commit_naming_repository_and_how_to_fetch(moved):
    lab = moved
    gone = "0123456789abcdef0123456789abcdef01234567"
    copy = runs_dir(lab) / "gone-commit"
    shutil.copytree(runs_dir(lab) / "orig", copy)
    st = json.loads((copy / "run.json").read_text())
    st["lineage"]["code"]["commit"] = gone
    (copy / "run.json").write_text(json.dumps(st))
    err = refused(lab, "gone-commit")
    assert f"commit {gone} is not in repository {lab.repo}" in err and f"git -C {lab.repo} fetch origin {gone}" in err
    assert "refused" not in git(lab.repo, "worktree", "list")


def test_continue_refuses_a_checkpoint_gone_from_the_volume(moved):
    lab = moved
    copy = runs_dir(lab) / "lost-checkpoint"
    shutil.copytree(runs_dir(lab) / "orig", copy)
    st = json.loads((copy / "run.json").read_text())
    st["latest_checkpoint"] = "00000000-0000-4000-8000-000000000000"
    (copy / "run.json").write_text(json.dumps(st))
    err = refused(lab, "lost-checkpoint", "--continue")
    assert "checkpoint 00000000-0000-4000-8000-000000000000 of run lost-checkpoint is gone from the volume" in err


def test_refuses_a_tracker_run_without_lineage(moved):
    lab = moved
    exp = lab.mlflow.create_experiment("not-det-lab")
    foreign = lab.mlflow.create_run(exp, tags={"team": "x"}).info.run_id
    lab.mlflow.log_metric(foreign, "loss", 1.0)
    err = refused(lab, foreign)
    assert f"mlflow run id {foreign} has no det_lab lineage" in err


def test_refuses_a_checkpoint_whose_metadata_json_is_truncated_naming_the_file(moved):
    """A copy of orig's last checkpoint whose metadata.json was cut off mid-file (a copy interrupted)."""
    lab = moved
    ckpts = lab.root / "checkpoints" / "vla"
    ref = "5d0c6a1e-8b2f-4c3d-9e4a-1f2b3c4d5e6f"
    shutil.copytree(ckpts / state(lab, "orig")["latest_checkpoint"], ckpts / ref)
    meta = ckpts / ref / "metadata.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])
    err = refused(lab, ref)
    assert f"checkpoint {ref}: {meta} is not valid JSON" in err
    assert "reproduce it from another of the run's checkpoints or by its run name" in err


def test_refuses_a_dataset_revision_whose_objects_are_gone(moved):
    """Last: it deletes the first revision's objects from the snapshot, the cache and the remote."""
    lab = moved
    md5 = state(lab, "orig")["lineage"]["dataset"]["md5"]
    snap = lab.root / "snapshots" / "vla" / md5.removesuffix(".dir")
    for d in [snap, *snap.rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)
    shutil.rmtree(snap)
    stem = md5.removesuffix(".dir")
    manifest = json.loads(next((lab.root / "dvc-cache" / "vla").rglob(stem[2:] + ".dir")).read_text())
    for stem in [md5.removesuffix(".dir") + ".dir", *(e["md5"] for e in manifest)]:
        for store in (lab.root / "dvc-cache" / "vla", lab.root / "datasets" / "vla"):
            for obj in store.rglob(stem[2:]):
                obj.chmod(0o644)
                obj.unlink()
    err = refused(lab, "orig")
    assert f"(md5 {md5}) cannot be served" in err and "lacks" in err


def test_a_patch_over_the_cap_is_not_saved_and_the_run_says_so(tmp_path):
    from det_lab.reproduce.code import apply_patch
    from det_lab.reproduce.find import ReproduceError
    from det_lab.runs.lineage import code_lineage

    repo = tmp_path / "code"
    (repo / "t").mkdir(parents=True)
    (repo / "t" / "train.py").write_text("x = 1\n")
    git(repo, "init", "--quiet")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "c")
    (repo / "t" / "train.py").write_text("x = 2\n" * 50)
    record = tmp_path / "run"
    record.mkdir()
    code = code_lineage(repo / "t", record, cap=100)
    assert code["dirty"] and code["patch_capped"] and code["patch_bytes"] > 100 and code["subdir"] == "t"
    note = (record / "code.patch").read_text()
    assert note.startswith("# det_lab: local changes not saved")
    assert f"{code['patch_bytes']} bytes exceed the cap of 100" in note
    with pytest.raises(ReproduceError, match="over the patch cap and were not saved"):
        apply_patch(code, tmp_path, record / "code.patch")
    (repo / "t" / "big.bin").write_bytes(bytes(range(256)) * 40)  # untracked, past the cap: only its size counts
    capped = code_lineage(repo / "t", record, cap=100)
    assert capped["patch_capped"] and capped["patch_bytes"] >= code["patch_bytes"] + 10240
    (repo / "t" / "big.bin").unlink()
    whole = code_lineage(repo / "t", tmp_path / "run", cap=10_000)  # under the cap: the diff itself
    assert not whole["patch_capped"] and (record / "code.patch").read_text().count("+x = 2") == 50


def test_untracked_files_in_a_subdirectory_and_binary_are_rebuilt_with_a_constant_number_of_git_calls(
        tmp_path, monkeypatch):
    """A dirty tree with a changed file and untracked ones (in a subdirectory, binary, executable;
    an ignored one): its code.patch rebuilds the tree at the commit byte for byte, the user's index
    is left alone, and saving it takes as many git calls for 23 untracked files as for 3."""
    import hashlib
    import stat

    from det_lab.reproduce.code import checkout
    from det_lab.runs.lineage import code_lineage, working_changes

    repo = tmp_path / "code"
    (repo / "t").mkdir(parents=True)
    (repo / "t" / "train.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "init", "--quiet")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "c")
    (repo / "t" / "train.py").write_text("from helpers.scale import FACTOR\nx = 2 * FACTOR\n")
    (repo / "t" / "helpers").mkdir()
    (repo / "t" / "helpers" / "scale.py").write_text("FACTOR = 3.0\n")
    weights = b"".join(hashlib.sha256(bytes([i])).digest() for i in range(256))  # 8 KiB, no two blocks alike
    (repo / "t" / "weights.bin").write_bytes(weights)
    (repo / "t" / "run.sh").write_text("#!/bin/sh\npython train.py\n")
    (repo / "t" / "run.sh").chmod(0o755)
    (repo / "t" / "debug.log").write_text("ignored\n")
    status = git(repo, "status", "--porcelain", "--untracked-files=all")
    record = tmp_path / "run"
    record.mkdir()
    code = code_lineage(repo / "t", record)
    assert code["dirty"] and not code["patch_capped"]
    assert git(repo, "status", "--porcelain", "--untracked-files=all") == status

    where = checkout(code, tmp_path / "rebuilt", record / "code.patch")
    assert (where / "train.py").read_text() == "from helpers.scale import FACTOR\nx = 2 * FACTOR\n"
    assert (where / "helpers" / "scale.py").read_text() == "FACTOR = 3.0\n"
    assert (where / "weights.bin").read_bytes() == weights
    assert (where / "run.sh").stat().st_mode & stat.S_IXUSR
    assert not (where / "debug.log").exists()

    log = tmp_path / "git-calls"
    shim = tmp_path / "bin" / "git"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$1" >> {log}\nexec {shutil.which("git")} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")

    def calls() -> list[str]:
        log.unlink(missing_ok=True)
        working_changes(repo)
        return log.read_text().split()

    few = calls()
    for i in range(20):
        (repo / "t" / "helpers" / f"part_{i:02d}.py").write_text(f"PART = {i}\n")
    assert calls() == few and len(few) <= 4


def test_an_untracked_file_gone_before_git_adds_it_leaves_out_itself_alone(tmp_path, monkeypatch):
    """A file deleted between git listing it and the patch being made (here by a git wrapper, just
    before ``git add``): the batch is refused, and the patch holds every other untracked file."""
    from det_lab.runs.lineage import working_changes

    repo = tmp_path / "code"
    repo.mkdir()
    (repo / "train.py").write_text("x = 1\n")
    git(repo, "init", "--quiet")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "c")
    for name in ("a_first.py", "b_gone.py", "c_last.py"):
        (repo / name).write_text(f"NAME = {name!r}\n")
    shim = tmp_path / "bin" / "git"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n[ "$1" = add ] && rm -f {repo / "b_gone.py"}\nexec {shutil.which("git")} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    patch, size = working_changes(repo)
    assert size == len(patch)
    assert b"+NAME = 'a_first.py'" in patch and b"+NAME = 'c_last.py'" in patch and b"b_gone" not in patch


def test_refuses_a_checkpoint_determined_wrote_without_det_lab(tmp_path):
    """A checkpoint whose metadata.json is Determined's own (no ``det_lab`` lineage) is named as such."""
    from det_lab.reproduce.find import ReproduceError, locate
    from det_lab.settings import LabSettings

    settings = LabSettings(data_root=tmp_path)
    uuid = "0b9f7a7e-3c1d-4f5e-9a2b-6c7d8e9f0a1b"
    ckpt = tmp_path / "checkpoints" / "vla" / uuid
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text(json.dumps({"steps_completed": 40, "framework": "torch-2.3.0",
                                                    "format": "pickle", "determined_version": "0.37.0"}))
    with pytest.raises(ReproduceError, match=f"checkpoint {uuid} .* not written by a det_lab trial"):
        locate(settings, uuid)
