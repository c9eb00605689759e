"""``det-lab data gc`` with real git + DVC repositories sharing one cache, real run records, a
real trainer lock held by another process, and a collection killed with -9."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from det_lab import data
from det_lab.data import DatasetSpec
from det_lab.data.git import git
from det_lab.data.publish import publish_directory
from det_lab.data.pull import _configure_workspace
from det_lab.settings import load_settings
from det_lab.volume import VolumeLayout, init_volume
from tests.conftest import VENV_BIN, Lab

OLD = time.time() - 40 * 86400
DVC_ENV = {**os.environ, "DVC_NO_ANALYTICS": "1"}


def _blob(seed: str, size: int = 3000) -> bytes:
    return (hashlib.sha256(seed.encode()).digest() * (size // 32 + 1))[:size]


def _write(src: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(src, ignore_errors=True)
    for name, blob in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(blob)


def md5(blob: bytes) -> str:
    return hashlib.md5(blob).hexdigest()


def objects(cache: Path) -> set[str]:
    return {p.parent.name + p.name for p in (cache / "files" / "md5").glob("*/*") if p.is_file()}


def age(layout: VolumeLayout, project: str, when: float = OLD) -> None:
    """Make every snapshot of ``project`` look last used at ``when``."""
    snaps = layout.snapshots(project)
    for marker in snaps.glob("*/snapshot.json"):
        os.utime(marker, (when, when))
        last = snaps / ".last-use" / marker.parent.name
        if last.exists():
            os.utime(last, (when, when))


SHARED, A_ONLY, A_OLD, B_ONLY = _blob("shared"), _blob("a"), _blob("a-old"), _blob("b")


@pytest.fixture(scope="module")
def _volume(tmp_path_factory):
    """Dataset repositories alpha (v1, then v2 on main) and beta in project vla, sharing its cache;
    every revision pulled once. A pristine copy is restored for each test."""
    base = tmp_path_factory.mktemp("gc")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    lab = Lab(base / "data", base / "lab.yaml", {**env, "DET_LAB_CONFIG": str(base / "lab.yaml"),
                                                  "XDG_CONFIG_HOME": str(base / "xdg"), "COLUMNS": "200",
                                                  "DET_LAB_GC_GRACE": "0.001"})
    lab.write_config()
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    src = base / "src"
    _write(src, {"shared.bin": SHARED, "a.bin": A_ONLY, "old.bin": A_OLD})
    alpha = publish_directory(settings, "vla", "alpha", src, "alpha v1")
    v1 = git("rev-parse", "main", cwd=Path(alpha.repo)).strip()
    _write(src, {"shared.bin": SHARED, "a.bin": A_ONLY})
    publish_directory(settings, "vla", "alpha", src, "alpha v2")
    _write(src, {"shared.bin": SHARED, "b.bin": B_ONLY})
    publish_directory(settings, "vla", "beta", src, "beta v1")
    old = data.pull(DatasetSpec("vla", alpha.repo, alpha.path, v1), settings)
    data.pull("alpha", settings)
    data.pull("beta", settings)
    pristine = base / "pristine"
    subprocess.run(["cp", "-a", str(lab.root), str(pristine)], check=True)

    def restore():
        if lab.root.exists():
            subprocess.run(["chmod", "-R", "u+w", str(lab.root)], check=True)
            shutil.rmtree(lab.root)
        subprocess.run(["cp", "-a", str(pristine), str(lab.root)], check=True)
        return lab, settings, old.identity

    return restore


@pytest.fixture
def vol(_volume):
    return _volume()


def workspace(repo: str, cache: Path, where: Path) -> Path:
    """A clone of ``repo`` using ``cache`` as its DVC cache, as a user of ``dvc gc`` would have."""
    git("clone", "--quiet", repo, str(where))
    _configure_workspace(where, cache, where.parent / f"{where.name}-site")
    return where


def dvc_gc(ws: Path, *projects: Path) -> None:
    args = [sys.executable, "-m", "dvc", "gc", "-w", "-a", "-T", "-f"]
    for p in projects:
        args += ["--projects", str(p)]
    subprocess.run(args, cwd=ws, env=DVC_ENV, check=True, capture_output=True)


def test_gc_keeps_what_every_repository_sharing_the_cache_uses_as_dvc_gc_with_all_projects(vol, tmp_path):
    lab, settings, _ = vol
    layout = VolumeLayout(settings.data_root)
    cache = layout.dvc_cache("vla")
    before = objects(cache)
    registry = data.load_registry(settings)
    # the references: real `dvc gc` on copies of the cache, once naming both repositories, once one
    for name, named in (("both", ("alpha", "beta")), ("one", ("alpha",))):
        copy = tmp_path / f"cache-{name}"
        shutil.copytree(cache, copy)
        spaces = [workspace(registry[n].repo, copy, tmp_path / f"{name}-{n}") for n in named]
        dvc_gc(spaces[0], *spaces[1:])
    dvc_both, dvc_one = objects(tmp_path / "cache-both"), objects(tmp_path / "cache-one")
    assert md5(B_ONLY) not in dvc_one  # the trap: dvc gc in one repository deletes what only the other uses
    assert md5(A_OLD) in before and md5(A_OLD) not in dvc_both

    dry = lab.cli("data", "gc", "--days", "7", "--json", check=True)
    assert objects(cache) == before  # a dry run by default
    age(layout, "vla")
    plan = json.loads(lab.cli("data", "gc", "--days", "7", "--json", check=True).stdout)
    vla = next(p for p in plan["projects"] if p["project"] == "vla")
    assert not json.loads(dry.stdout)["deleted"] and vla["remove_objects"] == len(before - dvc_both)
    assert vla["freed_bytes"] >= len(A_OLD) and len(vla["evict"]) == 3
    done = lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert "evicted 3 snapshots, removed 2 cache objects" in done.stdout
    assert objects(cache) == dvc_both
    assert not [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")]
    # the next pull links the snapshot again from the cache alone: the DVC remote is not needed
    remote = layout.datasets("vla") / "files"
    remote.rename(remote.with_name("files-away"))
    again = data.pull("beta", settings)
    assert {p.name: p.read_bytes() for p in again.path.iterdir()} == {"shared.bin": SHARED, "b.bin": B_ONLY}


def _run(layout: VolumeLayout, name: str, identity, status: str) -> Path:
    run = layout.outputs("vla") / "local-runs" / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": name, "status": status, "kind": "local",
                                              "lineage": {"dataset": asdict(identity)}}))
    return run


HOLD = """
import sys, time
from pathlib import Path
from det_lab.runs.run_guard import hold
hold(Path(sys.argv[1]), "trainer")
print("held", flush=True)
time.sleep(600)
"""


def test_a_run_lineage_keeps_its_revision_and_a_running_trial_keeps_its_snapshot(vol):
    lab, settings, v1 = vol
    layout = VolumeLayout(settings.data_root)
    cache = layout.dvc_cache("vla")
    beta = data.pull("beta", settings).identity
    _run(layout, "finished-on-v1", v1, "finished")
    running = _run(layout, "training-on-beta", beta, "running")
    trainer = subprocess.Popen([sys.executable, "-c", HOLD, str(running)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "held"
        age(layout, "vla")
        lab.cli("data", "gc", "--days", "7", "--yes", check=True)
        left = {p.name for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")}
        assert left == {beta.md5.removesuffix(".dir")}  # read by a live trainer: kept though unused for 40 days
        assert {md5(A_OLD), v1.md5} <= objects(cache)  # the finished run's revision stays in the cache
    finally:
        trainer.kill()
        trainer.wait()
    # the trainer is gone (the run died): its snapshot is an unused one now
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert not [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")]
    assert {md5(A_OLD), v1.md5, md5(B_ONLY)} <= objects(cache)
    # the run is deleted: nothing keeps v1 any more, and a pull of it fetches from the DVC remote
    shutil.rmtree(layout.outputs("vla") / "local-runs" / "finished-on-v1")
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert md5(A_OLD) not in objects(cache) and v1.md5 not in objects(cache)
    spec = DatasetSpec("vla", v1.repo, v1.path, v1.commit)
    remote_obj = layout.datasets("vla") / "files" / "md5" / md5(A_OLD)[:2] / md5(A_OLD)[2:]
    remote_obj.rename(remote_obj.with_name("aside"))
    with pytest.raises(data.DataError, match=rf"{v1.commit}.*its DVC remote lacks some files \(was 'dvc push' run\?\)"
                                               rf".*{md5(A_OLD)}"):
        data.pull(spec, settings)  # what det-lab reproduce says of such a run, with the revision
    remote_obj.with_name("aside").rename(remote_obj)
    back = data.pull(spec, settings)
    assert back.identity.md5 == v1.md5 and (back.path / "old.bin").read_bytes() == A_OLD


def test_a_pinned_revision_stays(vol):
    lab, settings, _ = vol
    layout = VolumeLayout(settings.data_root)
    pinned = lab.cli("data", "pin", "beta", check=True)
    assert "pinned beta" in pinned.stdout
    registry = layout.state / "datasets.yaml"
    registry.write_text(registry.read_text().split("beta:")[0])  # beta is no longer registered
    age(layout, "vla")
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert md5(B_ONLY) in objects(layout.dvc_cache("vla"))
    lab.cli("data", "pin", "beta", "--remove", check=True)
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert md5(B_ONLY) not in objects(layout.dvc_cache("vla"))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in root.rglob("*") if not p.is_dir() and "locks" not in p.parts}


def test_bad_input_is_one_line_and_changes_nothing(vol):
    lab, settings, _ = vol
    layout = VolumeLayout(settings.data_root)
    age(layout, "vla")
    before = _tree(lab.root)
    for args, says in ((("--days", "-3", "--yes"), "--days must be 0 or more"),
                       (("--yes", "--dry-run"), "not both")):
        proc = lab.cli("data", "gc", *args)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr
    (layout.state / "data-pins.yaml").write_text("beta: [not, an, identity]\n")
    before = _tree(lab.root)
    proc = lab.cli("data", "gc", "--days", "7", "--yes")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "damaged pins file" in proc.stderr, proc.stderr
    assert _tree(lab.root) == before


def test_a_gc_killed_mid_way_is_finished_by_the_next_and_loses_nothing_kept(vol):
    lab, settings, v1 = vol
    layout = VolumeLayout(settings.data_root)
    cache = layout.dvc_cache("vla")
    _run(layout, "finished-on-v1", v1, "finished")
    keep = objects(cache)
    # objects nothing references, as an old DVC version or a removed repository left them
    junk = []
    for i in range(20000):
        blob = f"junk {i}".encode()
        obj = cache / "files" / "md5" / md5(blob)[:2] / md5(blob)[2:]
        obj.parent.mkdir(exist_ok=True)
        obj.write_bytes(blob)
        junk.append(obj)
    age(layout, "vla")
    first = min(junk, key=lambda p: (p.parent.name, p.name))
    gc = subprocess.Popen([str(VENV_BIN / "det-lab"), "data", "gc", "--days", "7", "--yes"], env=lab.env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while first.exists() and gc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    gc.send_signal(signal.SIGKILL)
    gc.wait()
    left = sum(p.exists() for p in junk)
    assert 0 < left < len(junk), f"the kill came at {left} objects left: not mid-way"
    rerun = lab.cli("data", "gc", "--days", "7", "--yes", check=True)  # the dead holder's lock is broken
    assert not any(p.exists() for p in junk)
    assert keep <= objects(cache), rerun.stdout
    for oid in keep:  # what stays is intact
        path = cache / "files" / "md5" / oid[:2] / oid[2:]
        if not oid.endswith(".dir"):
            assert md5(path.read_bytes()) == oid
    assert not list(layout.snapshots("vla").glob(".evict-*"))


def test_a_snapshot_left_half_evicted_by_a_killed_gc_is_removed_and_pulls_again(vol):
    lab, settings, _ = vol
    beta = data.pull("beta", settings)
    snap = beta.path.parent
    aside = snap.with_name(f".evict-{snap.name}-deadbeef")  # where a killed gc renamed it
    os.rename(snap, aside)
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert not aside.exists()
    again = data.pull("beta", settings)
    assert (again.path / "b.bin").read_bytes() == B_ONLY


def test_a_run_record_that_cannot_be_read_keeps_its_projects_cache(vol):
    lab, settings, _ = vol
    layout = VolumeLayout(settings.data_root)
    cache = layout.dvc_cache("vla")
    before = objects(cache)
    broken = layout.outputs("vla") / "local-runs" / "broken"
    broken.mkdir(parents=True)
    (broken / "run.json").write_text('{"name": "broken", "lineage": ')  # a write cut short
    age(layout, "vla")
    proc = lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert f"{broken / 'run.json'} cannot be read" in proc.stderr
    assert objects(cache) == before and md5(A_OLD) in before  # v1's objects: no recorded run keeps them, yet
    (broken / "run.json").unlink()
    lab.cli("data", "gc", "--days", "7", "--yes", check=True)
    assert md5(A_OLD) not in objects(cache)
