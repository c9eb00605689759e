"""``det-lab volume usage`` on a real volume (a DVC dataset pulled, so snapshots are hard links into
the cache; runs and checkpoints; a file of a second Unix user), against GNU ``du`` on the same trees."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from det_lab import data
from det_lab.data.publish import publish_directory
from det_lab.settings import load_settings
from det_lab.volume import VolumeLayout, init_volume
from tests.conftest import Lab

KIND_DIRS = ("dvc-cache", "snapshots", "datasets", "checkpoints", "outputs")
KINDS = ("cache", "snapshots", "datasets", "checkpoints", "outputs")


def du(*paths: Path, links: bool = False) -> list[int]:
    """What GNU du says of each path, in one invocation (a hard-linked inode counts once unless -l)."""
    out = subprocess.run(["du", "-s", "-B1", *(["-l"] if links else []), *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout
    return [int(line.split("\t")[0]) for line in out.splitlines()]


@pytest.fixture(scope="module")
def other_user():
    name = f"dlu{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def volume(tmp_path_factory, other_user):
    """Built once: the tests only read it."""
    tmp_path = tmp_path_factory.mktemp("usage")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    lab = Lab(tmp_path / "data", tmp_path / "lab.yaml", {**env, "DET_LAB_CONFIG": str(tmp_path / "lab.yaml"),
                                                          "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COLUMNS": "200"})
    lab.write_config()
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    layout = VolumeLayout(settings.data_root)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i}.bin").write_bytes(os.urandom(5000 + 3000 * i))
    publish_directory(settings, "vla", "toy", src, "toy v1")
    data.pull("toy", settings)
    ck = layout.project_checkpoints("vla")
    runs = layout.outputs("vla") / "local-runs"
    for name, uuids in (("r1", ["c1", "c2"]), ("r2", ["c3"])):
        run = runs / name
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"name": name, "status": "finished", "kind": "local",
                                                  "checkpoints": [{"uuid": u, "step": 1} for u in uuids]}))
        (run / "metrics.jsonl").write_bytes(os.urandom(20000))
        for u in uuids:
            (ck / u).mkdir(parents=True)
            (ck / u / "state.pt").write_bytes(os.urandom(70000))
            (ck / u / "metadata.json").write_text("{}")
    (ck / "orphan").mkdir()
    (ck / "orphan" / "state.pt").write_bytes(os.urandom(40000))
    os.link(ck / "c1" / "state.pt", runs / "r1" / "exported.pt")  # one inode in a checkpoint and a run
    os.link(runs / "r2" / "metrics.jsonl", runs / "r2" / "metrics.copy")
    theirs = runs / "r2" / "theirs.bin"  # a file of another member (the test's tmp dir is closed to them)
    theirs.write_bytes(os.urandom(90000))
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    return lab, settings, layout


def test_figures_are_du_on_the_same_trees_hard_links_once(volume):
    lab, settings, layout = volume
    report = json.loads(lab.cli("volume", "usage", "--by", "kind", "--json", check=True).stdout)
    for project in settings.projects:
        dirs = [layout.root / d / project for d in KIND_DIRS]
        kinds = report["projects"][project]["kinds"]
        assert [kinds[k] for k in KINDS] == du(*dirs), project
    vla = [layout.root / d / "vla" for d in KIND_DIRS]
    assert du(*vla, links=True)[1] > report["projects"]["vla"]["kinds"]["snapshots"] + 60000  # not du -l
    assert report["total_bytes"] == sum(du(*(layout.root / d / p for p in sorted(settings.projects) for d in KIND_DIRS)))
    by_kind = {r["name"]: r["bytes"] for r in report["rows"]}
    assert by_kind == {k: sum(report["projects"][p]["kinds"][k] for p in settings.projects) for k in KINDS}


def test_by_run_and_by_user(volume, other_user):
    lab, settings, layout = volume
    ck, runs = layout.project_checkpoints("vla"), layout.outputs("vla") / "local-runs"
    rows = {r["name"]: r["bytes"] for r in json.loads(lab.cli("volume", "usage", "--by", "run", "--json",
                                                                check=True).stdout)["rows"]}
    # a run is its directory and the checkpoints its run.json lists; the hard link inside counts once
    assert rows["vla/r1"] == sum(du(ck / "c1", ck / "c2", runs / "r1"))
    assert rows["vla/r2"] == sum(du(ck / "c3", runs / "r2"))
    assert "vla/orphan" not in rows and rows["vla/(no run)"] >= 40960
    users = {r["name"]: r["bytes"] for r in json.loads(lab.cli("volume", "usage", "--by", "user", "--json",
                                                                 check=True).stdout)["rows"]}
    theirs = runs / "r2" / "theirs.bin"
    assert users[other_user.pw_name] == theirs.stat().st_blocks * 512
    assert sum(users.values()) == sum(du(*(layout.root / d / p for p in sorted(settings.projects) for d in KIND_DIRS)))


def test_bad_input_is_one_line(lab):
    """Bad options, and a data root with no volume (not initialised): one error line each."""
    for args, says in ((("volume", "usage", "--by", "colour"), "--by must be project, user, kind or run"),
                       (("volume", "usage", "--days", "-1"), "--days must be 0 or more"),
                       (("volume", "usage"), "run 'det-lab init' there first"),
                       (("data", "gc", "--yes"), "run 'det-lab init' there first")):
        proc = lab.cli(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert not lab.root.exists()


def test_kept_checkpoint_figures_follow_changes(volume, monkeypatch, tmp_path):
    """The figures a walk keeps of complete checkpoints are the same as a fresh walk's, and a
    checkpoint changed since (a file added, one removed) is measured again."""
    from det_lab.lifecycle import space

    lab, settings, layout = volume
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(space, "SETTLED_S", 0.0)
    ck = layout.project_checkpoints("vla")
    dirs = [layout.root / d / "vla" for d in KIND_DIRS]
    first = space.volume_space(settings, reclaimable=False, projects=["vla"])
    assert (tmp_path / "cache" / "det-lab").is_dir()
    assert first.projects["vla"].kinds["checkpoints"] == du(*dirs)[3]
    (ck / "c3" / "extra.bin").write_bytes(os.urandom(50000))
    try:
        again = space.volume_space(settings, reclaimable=False, projects=["vla"])
        assert again.projects["vla"].kinds["checkpoints"] == du(*dirs)[3] > first.projects["vla"].kinds["checkpoints"]
        assert dict(again.by("run"))["vla/r2"] == sum(du(ck / "c3", layout.outputs("vla") / "local-runs" / "r2"))
    finally:
        (ck / "c3" / "extra.bin").unlink()
    third = space.volume_space(settings, reclaimable=False, projects=["vla"])
    assert third.projects["vla"].kinds["checkpoints"] == first.projects["vla"].kinds["checkpoints"]


def test_doctor_warns_at_80_percent_naming_the_largest_consumers(lab):
    """A project at 85 % of its quota: a warning (not at 75 %), naming its largest run."""
    lab.write_config(projects={"vla": {"quota": "1MiB"}})
    lab.cli("init", check=True)
    settings = load_settings(lab.config, env={})
    layout = VolumeLayout(settings.data_root)
    runs = layout.outputs("vla") / "local-runs"
    for name, size in (("big-run", 600_000), ("small-run", 40_000)):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.json").write_text(json.dumps({"name": name, "status": "finished", "kind": "local"}))
        (runs / name / "blob.bin").write_bytes(os.urandom(size))
    from det_lab.volume import project_usage

    def quota_check() -> dict:
        report = json.loads(lab.cli("doctor", "--json").stdout)
        return {c["name"]: c for c in report["checks"]}["quota vla"]

    pad = runs / "small-run" / "pad.bin"
    pad.write_bytes(os.urandom(int(0.75 * 2**20) - project_usage(layout, "vla")))
    assert quota_check()["status"] == "pass"
    pad.write_bytes(os.urandom(len(pad.read_bytes()) + int(0.10 * 2**20)))
    assert 0.8 < project_usage(layout, "vla") / 2**20 < 0.9
    check = quota_check()
    assert check["status"] == "warn" and "largest: vla/big-run" in check["detail"], check
    assert "det-lab volume usage" in check["fix"]


def test_exporter_reports_bytes_per_user_and_what_cleaning_frees(volume, other_user):
    from det_lab.monitoring.source_volume import VolumeSource

    lab, settings, layout = volume
    ck, runs = layout.project_checkpoints("vla"), layout.outputs("vla") / "local-runs"
    old = time.time() - 40 * 86400
    os.utime(runs / "r1" / "run.json", (old, old))  # r1: unchanged for 40 days, not training
    try:
        families = {f.name: f for f in VolumeSource(settings).collect()}
    finally:
        os.utime(runs / "r1" / "run.json")
    users = {s.labels["user"]: s.value for s in families["det_lab_volume_user_bytes"].samples}
    assert users[other_user.pw_name] == (runs / "r2" / "theirs.bin").stat().st_blocks * 512
    freed = {(s.labels["project"], s.labels["by"]): s.value for s in families["det_lab_volume_reclaimable_bytes"].samples}
    assert freed[("vla", "runs_prune")] == sum(du(ck / "c1", ck / "c2", runs / "r1"))
    assert freed[("isaac", "runs_prune")] == 0
    planned = json.loads(lab.cli("data", "gc", "--days", "30", "--json", check=True).stdout)
    assert freed[("vla", "data_gc")] == next(p["freed_bytes"] for p in planned["projects"] if p["project"] == "vla")
