"""``det-lab runs delete`` and ``det-lab runs prune``: a plan first, ``--yes`` to delete; never a
run that trains; another member's run only with the group's write rights (two real Unix users);
tracker runs tagged, not erased, by a real MLflow server (and later, when it was down); a
deletion killed with -9 finished by the next; bad input is one line and changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid as uuidlib
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from det_lab.settings import load_settings
from det_lab.tracking.mlflow_server import MlflowServer, free_port
from det_lab.volume import init_volume
from tests.conftest import VENV_BIN, Lab, publish_tiny_data
from tests.test_shared_volume import TRIAL, finish, team  # noqa: F401 (team: a fixture of two Unix users)

TINY = Path(__file__).parent / "fixtures" / "tiny"


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A real MLflow server this module stops and starts again (same store, same port)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prune_lab(tmp_path_factory, tracker) -> Lab:
    tmp = tmp_path_factory.mktemp("prune-lab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               HOME=str(tmp / "home"))
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": tracker.uri})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    return lab


def runs_dir(lab: Lab, project: str = "vla") -> Path:
    return lab.root / "outputs" / project / "local-runs"


def fake_run(lab: Lab, name: str, status: str = "finished", age_days: float = 0, project: str = "vla",
             checkpoints: int = 1, user: str | None = None, shared: list[str] = ()) -> Path:
    """A run directory as ``det-lab run --local`` leaves one (run.json, metrics, log), with
    ``checkpoints`` checkpoint directories of its own (and ``shared``: uuids another run made)."""
    d = runs_dir(lab, project) / name
    d.mkdir(parents=True)
    root = lab.root / "checkpoints" / project
    ckpts = []
    for i in range(checkpoints):
        u = str(uuidlib.uuid4())
        (root / u / "code").mkdir(parents=True)
        (root / u / "metadata.json").write_text(json.dumps({"steps_completed": 10 * (i + 1)}))
        (root / u / "state_dict.pth").write_bytes(b"\0" * 4096)
        ckpts.append({"uuid": u, "step": 10 * (i + 1)})
    ckpts = [{"uuid": u, "step": 0} for u in shared] + ckpts
    state = {"kind": "local", "name": name, "run_key": f"local-{name}", "status": status,
             "exp_conf": {"searcher": {"metric": "val_loss"}, "data": {"det_lab": {"project": project}}},
             "checkpoints": ckpts, "latest_checkpoint": ckpts[-1]["uuid"] if ckpts else None}
    if user:
        state["user"] = user
    (d / "run.json").write_text(json.dumps(state))
    (d / "train.log").write_text("trained\n")
    then = time.time() - age_days * 86400
    os.utime(d / "run.json", (then, then))
    return d


def snapshot(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*") if ".det-lab" not in p.parts)


def ckpt_dirs(lab: Lab, run_dir: Path) -> list[Path]:
    state = json.loads((run_dir / "run.json").read_text())
    project = state["exp_conf"]["data"]["det_lab"]["project"]
    return [lab.root / "checkpoints" / project / c["uuid"] for c in state["checkpoints"]]


def test_bad_input_is_one_line_and_changes_nothing(prune_lab):
    kept = fake_run(prune_lab, "bad-input-kept", "failed", age_days=90)
    before = snapshot(prune_lab.root)
    for args, words in [
        (("delete", "no-such-run"), "no run named 'no-such-run'"),
        (("delete", "bad-input-kept", "no-such-run", "--yes"), "no run named 'no-such-run'"),
        (("prune", "--older-than", "soon", "--yes"), "--older-than soon: expected a duration"),
        (("prune", "--status", "failed,exploded", "--yes"), "exploded is not a run status"),
        (("prune", "--status", "running", "--yes"), "a running run is never deleted"),
        (("prune", "--yes"), "say which runs to prune"),
        (("prune", "--project", "nope", "--yes"), "nope"),
    ]:
        proc = prune_lab.cli("runs", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert snapshot(prune_lab.root) == before
    shutil.rmtree(kept)


def test_prune_plans_by_age_status_user_and_project_then_deletes_with_yes(prune_lab):
    old_failed = fake_run(prune_lab, "p-old-failed", "failed", age_days=40, user="alice")
    old_done = fake_run(prune_lab, "p-old-finished", "finished", age_days=40, user="bob")
    new_failed = fake_run(prune_lab, "p-new-failed", "failed", age_days=1, user="alice")
    other = fake_run(prune_lab, "p-other-project", "failed", age_days=40, project="3dgs", user="alice")
    before = snapshot(prune_lab.root)

    def planned(*args: str) -> set[str]:
        proc = prune_lab.cli("runs", "prune", *args, "--json", check=True)
        return {r["name"] for r in json.loads(proc.stdout)["runs"] if r["name"].startswith("p-")}

    assert planned("--older-than", "30d") == {"p-old-failed", "p-old-finished", "p-other-project"}
    assert planned("--status", "failed") == {"p-old-failed", "p-new-failed", "p-other-project"}
    assert planned("--older-than", "30d", "--status", "failed", "--project", "vla") == {"p-old-failed"}
    assert planned("--user", "bob") == {"p-old-finished"}
    plan = prune_lab.cli("runs", "prune", "--older-than", "4w", "--user", "alice", check=True).stdout
    assert "2 run(s) to delete" in plan and "nothing deleted yet: run again with --yes" in plan
    row = next(line.split() for line in plan.splitlines() if "p-old-failed" in line and "KiB" in line)
    assert row[:4] == ["p-old-failed", "vla", "alice", "failed"]
    assert snapshot(prune_lab.root) == before  # a plan changes nothing

    doomed = ckpt_dirs(prune_lab, old_failed)
    done = prune_lab.cli("runs", "prune", "--older-than", "30d", "--status", "failed", "--project", "vla", "--yes",
                         check=True).stdout
    assert "deleted run p-old-failed" in done
    assert not old_failed.exists() and not any(p.exists() for p in doomed)
    for survivor in (old_done, new_failed, other):
        assert all(p.is_dir() for p in ckpt_dirs(prune_lab, survivor)) and survivor.is_dir()
    listed = prune_lab.cli("runs", "list", "--json", check=True).stdout
    assert "p-old-failed" not in listed and "p-new-failed" in listed
    for d in (old_done, new_failed, other):
        shutil.rmtree(d)


def test_a_checkpoint_another_run_starts_from_stays_until_both_go(prune_lab):
    origin = fake_run(prune_lab, "s-origin", checkpoints=2)
    start = ckpt_dirs(prune_lab, origin)[0]
    repro = fake_run(prune_lab, "s-repro", shared=[start.name])  # det-lab reproduce --continue's record
    plan = json.loads(prune_lab.cli("runs", "delete", "s-origin", "--json", check=True).stdout)
    assert plan["runs"][0]["kept_checkpoints"] == {start.name: "s-repro"}
    prune_lab.cli("runs", "delete", "s-origin", "--yes", check=True)
    assert start.is_dir() and not origin.exists()
    prune_lab.cli("runs", "delete", "s-repro", "--yes", check=True)
    assert not start.exists() and not repro.exists()


def _tiny_run(lab: Lab, name: str) -> Path:
    proc = lab.cli("run", str(TINY), "--local", "--run", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return runs_dir(lab) / name


def _mlflow_run_id(run_dir: Path) -> str:
    (backend,) = json.loads((run_dir / "tracking-summary.json").read_text())["backends"]
    return backend["run_id"]


def test_a_deleted_run_is_tagged_in_mlflow_not_erased_and_a_down_tracker_gets_the_tag_later(prune_lab, tracker):
    client = MlflowClient(tracker.uri)
    up = _tiny_run(prune_lab, "t-up")
    down = _tiny_run(prune_lab, "t-down")
    up_id, down_id = _mlflow_run_id(up), _mlflow_run_id(down)
    ckpts = ckpt_dirs(prune_lab, up)
    assert ckpts and all(p.is_dir() for p in ckpts)

    out = prune_lab.cli("runs", "delete", "t-up", "--yes", check=True).stdout
    assert f"mlflow run {up_id}: tagged det_lab.deleted" in out
    assert not up.exists() and not any(p.exists() for p in ckpts)
    run = client.get_run(up_id)  # still there, with its metrics, as it ended
    assert run.info.lifecycle_stage == "active" and run.info.status == "FINISHED"
    assert run.data.tags["det_lab.deleted"] == "true" and run.data.tags["det_lab.deleted_run_dir"] == str(up)
    assert client.get_metric_history(up_id, "validation/val_loss")

    tracker.stop()
    try:
        plan = prune_lab.cli("runs", "delete", "t-down", check=True).stdout
        assert f"mlflow run {down_id}: mlflow is down" in plan and "det-lab tracking sync" in plan
        out = prune_lab.cli("runs", "delete", "t-down", "--yes", check=True).stdout
        assert f"mlflow run {down_id}: tag pending" in out
        assert not down.exists()
    finally:
        tracker.start()
    journal = prune_lab.root / "outputs" / "vla" / "tracking-journal" / "local-t-down"
    assert (journal / "run.json").is_file()  # the pending tag waits beside the cluster trials' journals
    assert "det_lab.deleted" not in client.get_run(down_id).data.tags
    prune_lab.cli("tracking", "sync", check=True)
    run = client.get_run(down_id)
    assert run.data.tags["det_lab.deleted"] == "true" and run.info.status == "FINISHED"
    fake_run(prune_lab, "t-after")  # the next deletion clears the journal that has done its work
    prune_lab.cli("runs", "delete", "t-after", "--yes", check=True)
    assert not journal.exists()


def test_a_run_that_trains_is_never_deleted(prune_lab):
    env = {**prune_lab.env, "TINY_HOLD_AFTER": "40"}  # parked after its first checkpoint
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--local", "--run", "t-live"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run_dir = runs_dir(prune_lab) / "t-live"
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "run.json").is_file() and json.loads((run_dir / "run.json").read_text()).get("checkpoints")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.utime(run_dir / "run.json", (time.time() - 90 * 86400,) * 2)  # old by its record, yet training
        before = ckpt_dirs(prune_lab, run_dir)
        refused = prune_lab.cli("runs", "delete", "t-live", "--yes")
        assert refused.returncode == 2 and refused.stderr.startswith("error: run t-live cannot be deleted: it is training")
        plan = prune_lab.cli("runs", "prune", "--older-than", "30d", "--yes", check=True).stdout
        assert "not deleted: t-live" in plan and "it is training as pid" in plan
        assert run_dir.is_dir() and all(p.is_dir() for p in before)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=240)
    assert proc.returncode == 0
    prune_lab.cli("runs", "delete", "t-live", "--yes", check=True)  # stopped: it may go now
    assert not run_dir.exists()


CHILD = textwrap.dedent("""
    import sys, time
    from det_lab.settings import load_settings
    from det_lab.lifecycle import prune
    from det_lab.runs import retention

    where = sys.argv[2]

    def park():
        print("PARKED", flush=True)
        time.sleep(600)

    real_remove, real_tag, real_rename = retention.remove_checkpoint, prune._tag, prune.os.rename
    calls = {"remove": 0}

    def remove(path):
        calls["remove"] += 1
        if where == "mid-checkpoints" and calls["remove"] == 2:
            park()
        real_remove(path)

    def rename(src, dst):
        if where == "hidden" and str(dst).endswith(".deleting"):
            real_rename(src, dst)
            park()
        real_rename(src, dst)

    def tag(*args):
        if where == "marked":
            park()
        return real_tag(*args)

    retention.remove_checkpoint, prune._tag, prune.os.rename = remove, tag, rename
    settings = load_settings()
    prune.execute(settings, prune.plan_delete(settings, [sys.argv[1]]))
""")


@pytest.mark.parametrize("where", ["marked", "mid-checkpoints", "hidden"])
def test_a_deletion_killed_with_9_is_finished_by_the_next_prune(prune_lab, where):
    name = f"k-{where}"
    run_dir = fake_run(prune_lab, name, checkpoints=3)
    ckpts = ckpt_dirs(prune_lab, run_dir)
    env = {**prune_lab.env}
    child = subprocess.Popen([sys.executable, "-c", CHILD, name, where], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "PARKED"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    if where == "hidden":  # gone from every listing; its hidden remains wait for the next pass
        assert not run_dir.exists() and (run_dir.parent / f".{name}.deleting").is_dir()
    else:  # still there, marked: nothing resumes it, the next pass finishes it
        assert json.loads((run_dir / "run.json").read_text())["deleting"]["by"]
        resume = prune_lab.cli("run", str(TINY), "--local", "--resume", "--run", name)
        assert resume.returncode != 0 and "is being deleted" in resume.stderr + resume.stdout
    out = prune_lab.cli("runs", "prune", "--status", "deleting", "--yes", check=True).stdout
    if where == "hidden":
        assert "left by a deletion that was killed" in out
    else:
        assert f"deleted run {name}" in out
    assert not run_dir.exists() and not (run_dir.parent / f".{name}.deleting").exists()
    assert not any(p.exists() for p in ckpts)


# --- two members of one group ----------------------------------------------------------------------


def test_another_members_run_goes_only_with_the_groups_write_rights(team):  # noqa: F811 (the fixture)
    from tests.test_shared_volume import _publish_tiny_dataset

    assert team.det_lab(team.a, "init").returncode == 0
    _publish_tiny_dataset(team)
    names = []
    for _ in range(2):
        proc = team.det_lab(team.a, "run", str(team.base / "trial"), "--local")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = team.data / "outputs/vla/local-runs"
    names = sorted(p.name for p in runs.iterdir())
    shared, private = runs / names[0], runs / names[1]
    # a keeps one run to itself, as umask 077 or a chmod would: the group may read, not write
    for dirpath, _, _ in os.walk(private):
        os.chmod(dirpath, 0o2755)
    before = snapshot(private)

    refused = team.det_lab(team.b, "runs", "delete", private.name, "--yes")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"error: run {private.name} cannot be deleted: ")
    assert f"is not writable by {team.b.name}" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert snapshot(private) == before
    # what rm -r as b would have said: the same
    rm = subprocess.run(["rm", "-rf", str(private)], user=team.b.uid, group=team.b.gid, extra_groups=[team.gid],
                        capture_output=True, text=True, check=False)
    assert rm.returncode != 0 and private.is_dir()

    plan = team.det_lab(team.b, "runs", "prune", "--project", "vla")
    assert plan.returncode == 0, plan.stderr
    assert f"not deleted: {private.name} ({team.a.name}" in plan.stdout
    row = next(line.split() for line in plan.stdout.splitlines() if line.strip().startswith(shared.name))
    assert row[2] == team.a.name  # the owner, in the plan
    ckpts = [team.data / "checkpoints/vla" / c["uuid"] for c in json.loads((shared / "run.json").read_text())["checkpoints"]]
    done = team.det_lab(team.b, "runs", "delete", shared.name, "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not shared.exists() and ckpts and not any(p.exists() for p in ckpts)
    assert private.is_dir()


def test_a_deleted_runs_aim_run_is_tagged_and_kept(lab, tmp_path):
    from det_lab.tracking.aim_reader import read_runs

    repo = tmp_path / "aim-repo"
    lab.write_config(tracking={"backend": "aim", "aim_repo": str(repo)})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp_path)
    run_dir = _tiny_run(lab, "t-aim")
    out = lab.cli("runs", "delete", "t-aim", "--yes", check=True).stdout
    assert "aim run" in out and "tagged det_lab.deleted" in out and not run_dir.exists()
    (row,) = [r for r in read_runs(settings, "det_lab/vla") if r["run_key"] == "local-t-aim"]
    assert row["tags"]["det_lab.deleted"] == "true" and row["status"] == "FINISHED"
    assert row["metrics"]  # its metrics stay
