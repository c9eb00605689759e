"""Datasets with real git + DVC repositories on a local stand-in for the NFS volume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import shutil
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from det_lab import data
from det_lab.data import DataError, DatasetSpec
from det_lab.data.git import git
from det_lab.data.publish import publish_directory
from det_lab.settings import LabSettings, load_settings
from det_lab.volume import QuotaExceeded, VolumeLayout, disk_usage, init_volume, project_usage
from tests.conftest import VENV_BIN, Lab
from tests.test_bad_inputs import cli as cli_in_process


def make_files(root: Path, n: int, size: int, seed: int = 0) -> dict[str, str]:
    """n files of ``size`` random bytes; returns relpath -> md5."""
    rng = __import__("random").Random(seed)
    out = {}
    for i in range(n):
        p = root / f"part{i % 7}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        blob = rng.randbytes(size)
        p.write_bytes(blob)
        out[str(p.relative_to(root))] = hashlib.md5(blob).hexdigest()
    return out


def tree_md5(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


def cache_objects(layout: VolumeLayout, project: str) -> list[Path]:
    return [p for p in (layout.dvc_cache(project) / "files").rglob("*") if p.is_file()]


@pytest.fixture
def volume(lab):
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    return settings


@dataclass
class Published:
    """A lab whose volume holds published datasets: ``expected`` maps a dataset to its files' md5."""

    lab: Lab
    settings: LabSettings
    spec: DatasetSpec
    expected: dict[str, str]


def _make_writable_and_remove(root: Path) -> None:
    if root.exists():
        for d in (root, *[p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()]):
            os.chmod(d, 0o755)
        shutil.rmtree(root)


def _published_once(tmp_path_factory, name: str, n: int, size: int, seed: int):
    """Publish a dataset once per module (every publish runs git and DVC several times) and keep a
    pristine copy of the volume; ``restore`` puts that copy back at the same path, so the absolute
    paths inside it (registry, DVC remote) stay right and each test starts from a fresh volume."""
    base = tmp_path_factory.mktemp(name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    lab = Lab(base / "data", base / "lab.yaml", {**env, "DET_LAB_CONFIG": str(base / "lab.yaml"),
                                                  "XDG_CONFIG_HOME": str(base / "xdg"), "COLUMNS": "200"})
    lab.write_config()
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    expected = make_files(base / "src", n, size, seed)
    spec = publish_directory(settings, "vla", name, base / "src", f"{name} v1")
    pristine = base / "pristine"
    subprocess.run(["cp", "-a", str(lab.root), str(pristine)], check=True)

    def restore() -> Published:
        _make_writable_and_remove(lab.root)
        subprocess.run(["cp", "-a", str(pristine), str(lab.root)], check=True)
        return Published(lab, settings, spec, expected)

    return restore


@pytest.fixture(scope="module")
def _toy(tmp_path_factory):
    return _published_once(tmp_path_factory, "toy", 60, 4096, 0)


@pytest.fixture
def toy(_toy) -> Published:
    """A fresh volume with a 60-file dataset published as 'toy' in project vla (nothing pulled)."""
    return _toy()


@pytest.fixture(scope="module")
def _big(tmp_path_factory):
    return _published_once(tmp_path_factory, "big", 40, 2 * 1024 * 1024, 7)  # 80 MiB: slow enough to interrupt


def cli_pull(lab, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "data", "pull", "--json", *args], env=lab.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_first_pull_gives_verified_read_only_data_and_lineage(toy):
    volume, spec, expected = toy.settings, toy.spec, toy.expected
    ds = data.pull("toy", volume)
    assert ds.fetched
    assert tree_md5(ds.path) == expected
    ident = ds.identity
    assert ident.commit == git("rev-parse", "main", cwd=Path(spec.repo)).strip()
    assert ident.md5.endswith(".dir") and ident.nfiles == 60 and ident.size == 60 * 4096
    assert ident.as_tags()["dataset.commit"] == ident.commit
    with pytest.raises(PermissionError if os.geteuid() else OSError):
        if os.geteuid() == 0:  # root bypasses modes; the read-only mode bits are what we can check
            assert not os.stat(ds.path).st_mode & 0o222
            raise OSError("read-only")
        (ds.path / "new").write_text("x")
    # the snapshot is hard links into the cache: the revision is stored once
    layout = VolumeLayout(volume.data_root)
    both = disk_usage(layout.dvc_cache("vla"), layout.snapshots("vla"))
    assert both - disk_usage(layout.dvc_cache("vla")) < 64 * 1024


def test_nth_pull_on_another_machine_reuses_the_volume_without_the_remote(toy):
    lab, volume, expected = toy.lab, toy.settings, toy.expected
    data.pull("toy", volume)
    layout = VolumeLayout(volume.data_root)
    objects_before = sorted(cache_objects(layout, "vla"))
    # "another machine": a separate process, and the DVC remote is gone, so nothing can be fetched
    remote_files = layout.datasets("vla") / "files"
    remote_files.rename(remote_files.with_name("files.away"))
    proc = cli_pull(lab, "toy")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["fetched"] is False
    assert tree_md5(Path(result["path"])) == expected
    assert sorted(cache_objects(layout, "vla")) == objects_before


def test_nth_pull_of_a_pinned_revision_needs_neither_git_nor_the_remote(toy):
    """What makes the Nth pull cheap (its time: bench/data_pull.py): a revision pinned to a commit
    is answered from the volume's snapshot, without git or DVC, so it works while both are away."""
    volume = toy.settings
    first = data.pull("toy", volume)
    spec = data.load_registry(volume)["toy"]
    pinned = DatasetSpec(spec.project, spec.repo, spec.path, rev=first.identity.commit)
    remote = VolumeLayout.from_settings(volume).datasets(spec.project)  # the DVC remote and the git repo
    assert Path(spec.repo).is_relative_to(remote)
    away = remote.with_name(f"{remote.name}-away")
    remote.rename(away)
    try:
        again = data.pull(pinned, volume)
        assert not again.fetched and again.path == first.path and tree_md5(again.path) == toy.expected
        with pytest.raises(DataError, match="not found or not readable"):
            data.pull("toy", volume)  # by branch name: git must answer
    finally:
        away.rename(remote)


def test_four_concurrent_pulls_store_each_object_once(toy):
    procs = [cli_pull(toy.lab, "toy") for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert len({r["path"] for r in results}) == 1
    assert sum(r["fetched"] for r in results) == 1  # one did the work, three waited and reused it
    assert tree_md5(Path(results[0]["path"])) == toy.expected
    layout = VolumeLayout(toy.settings.data_root)
    objects = cache_objects(layout, "vla")
    assert len(objects) == 60 + 1  # every file once, plus the .dir manifest
    snaps = [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")]
    assert len(snaps) == 1
    assert not list(layout.snapshots("vla").glob(".tmp-*"))


def test_new_revision_shares_unchanged_objects(toy, tmp_path):
    volume = toy.settings
    first = data.pull("toy", volume)
    src = tmp_path / "src"
    shutil.copytree(first.path, src)
    for d in (src, *[p for p in src.rglob("*") if p.is_dir()]):
        os.chmod(d, 0o755)
    os.chmod(src / "part0" / "f00000.bin", 0o644)
    (src / "part0" / "f00000.bin").write_bytes(b"changed")
    publish_directory(volume, "vla", "toy", src, "v2")
    second = data.pull("toy", volume)
    assert second.fetched and second.path != first.path
    assert (second.path / "part0" / "f00000.bin").read_bytes() == b"changed"
    assert (first.path / "part0" / "f00000.bin").read_bytes() != b"changed"  # old revision intact
    assert tree_md5(first.path) == toy.expected
    layout = VolumeLayout(volume.data_root)
    assert len(cache_objects(layout, "vla")) == 60 + 1 + 1 + 1  # one new file, two manifests


def test_a_published_dataset_is_what_dvcs_own_commands_make(toy, tmp_path):
    """publish_directory drives DVC's Repo API in its own process; the reference is DVC's CLI, one
    ``python -m dvc`` per step as its docs give them (init, remote add --default, config
    core.autostage, add, push) on the same files: the same .dvc file, DVC config and ignore files in
    the commit, and the same objects pushed to the remote."""
    repo = Path(toy.spec.repo)
    src = tmp_path / "src"
    make_files(src, 5, 100, seed=3)
    (src / "sub").mkdir()
    (src / "sub" / "x.txt").write_text("x\n")
    publish_directory(toy.settings, "vla", "toy", src, "toy v2")  # a next revision: dvc remove, then add
    remote = tmp_path / "remote"
    ws = tmp_path / "ws"
    git("init", "--quiet", "--initial-branch=main", str(ws))

    def dvc(*args: str) -> None:
        proc = subprocess.run([str(VENV_BIN / "python"), "-m", "dvc", *args], cwd=ws, capture_output=True, text=True,
                              env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        assert proc.returncode == 0, proc.stderr

    dvc("init", "--quiet")
    dvc("remote", "add", "--default", "volume", str(remote))
    dvc("config", "core.autostage", "true")
    shutil.copytree(src, ws / "data" / "toy")
    dvc("add", "--quiet", "data/toy")
    dvc("push", "--quiet")
    ours = lambda name: git("show", f"main:{name}", cwd=repo)  # noqa: E731
    for name in (".dvc/.gitignore", ".dvcignore", "data/.gitignore", "data/toy.dvc"):
        assert ours(name) == (ws / name).read_text(), name
    config = (ws / ".dvc" / "config").read_text()
    assert ours(".dvc/config") == config.replace(str(remote), str(VolumeLayout(toy.settings.data_root).datasets("vla")))
    pushed = {p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file()}
    volume = VolumeLayout(toy.settings.data_root).datasets("vla")
    assert pushed and all((volume / name).read_bytes() == (remote / name).read_bytes() for name in pushed)


def test_quota_refusal_writes_nothing(toy, tmp_path):
    layout = VolumeLayout(toy.settings.data_root)
    # what publishing wrote (the remote, the git repo) counts; the pull would add 240 KiB of objects
    quota = project_usage(layout, "vla") + 100 * 1024
    config = tmp_path / "quota.yaml"
    config.write_text(f"data_root: {layout.root}\nprojects: {{vla: {{quota: {quota}}}}}\n")
    with pytest.raises(QuotaExceeded, match="project 'vla' would use"):
        data.pull("toy", load_settings(config, env={}))
    assert cache_objects(layout, "vla") == []
    assert [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")] == []


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_pull_leaves_nothing_taken_as_complete(_big, sig):
    big = _big()
    lab, volume, expected = big.lab, big.settings, big.expected
    layout = VolumeLayout(volume.data_root)
    proc = cli_pull(lab, "big")
    started = _wait_for(lambda: bool(cache_objects(layout, "vla")) or proc.poll() is not None)
    assert started and proc.poll() is None, "pull finished before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    if sig == signal.SIGINT:
        assert "Traceback" not in err
    # nothing published: no snapshot, no index entry
    assert [p for p in layout.snapshots("vla").iterdir() if p.name not in (".index",) and not p.name.startswith(".tmp-")] == []
    assert not list((layout.snapshots("vla") / ".index").glob("*.json")) if (layout.snapshots("vla") / ".index").exists() else True
    # the next pull completes (breaking a lock held by a dead process) and verifies everything
    again = cli_pull(lab, "big")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    result = json.loads(out)
    assert result["fetched"] is True
    assert tree_md5(Path(result["path"])) == expected
    assert not list(layout.snapshots("vla").glob(".tmp-*"))


def _forget_snapshots(layout: VolumeLayout, project: str) -> None:
    for snap in layout.snapshots(project).iterdir():
        if snap.name == ".index":
            for idx in snap.glob("*.json"):
                idx.unlink()
            continue
        for d in (snap, *[p for p in snap.rglob("*") if p.is_dir()]):
            os.chmod(d, 0o755)
        shutil.rmtree(snap)


def _rot(path: Path) -> None:
    os.chmod(path, 0o644)
    path.write_bytes(b"bit rot")


def test_corrupt_objects_are_repaired_or_refused(toy):
    volume, expected = toy.settings, toy.expected
    layout = VolumeLayout(volume.data_root)
    data.pull("toy", volume)
    _forget_snapshots(layout, "vla")
    victim = next(p for p in cache_objects(layout, "vla") if not p.name.endswith(".dir"))
    _rot(victim)
    # a rotten cache object with a good remote copy: fetched again, the snapshot is correct
    assert tree_md5(data.pull("toy", volume).path) == expected

    _forget_snapshots(layout, "vla")
    _rot(victim)
    _rot(layout.datasets("vla") / victim.relative_to(layout.dvc_cache("vla")))
    with pytest.raises(DataError, match="corrupt|lacks 1 of 60 files"):
        data.pull("toy", volume)
    assert [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")] == []


# --- bad input: each is one line naming what is wrong -----------------------------------------

def test_missing_repo(volume):
    with pytest.raises(DataError, match="git repository /no/such/repo not found"):
        data.pull(DatasetSpec("vla", "/no/such/repo", "data/x"), volume)


def test_missing_revision(toy):
    volume, spec = toy.settings, toy.spec
    with pytest.raises(DataError, match="revision 'v9' not found"):
        data.pull(DatasetSpec("vla", spec.repo, spec.path, rev="v9"), volume)
    with pytest.raises(DataError, match="revision .* not found"):
        data.pull(DatasetSpec("vla", spec.repo, spec.path, rev="0" * 40), volume)


def test_missing_path(toy):
    volume, spec = toy.settings, toy.spec
    with pytest.raises(DataError, match=r"'data/nope' is not tracked by DVC .* \(no data/nope.dvc there\)"):
        data.pull(DatasetSpec("vla", spec.repo, "data/nope", rev="main"), volume)


def test_missing_remote(toy, tmp_path):
    """A DVC repository whose default remote was taken out of its committed .dvc/config."""
    repo = tmp_path / "noremote"
    git("clone", "--quiet", toy.spec.repo, str(repo))
    config = repo / ".dvc" / "config"
    assert "remote = volume" in config.read_text()
    config.write_text("[core]\n    autostage = true\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "no remote", cwd=repo)
    with pytest.raises(DataError, match="no default DVC remote"):
        data.pull(DatasetSpec("vla", str(repo), toy.spec.path, rev="main"), toy.settings)


def test_remote_without_the_objects(toy):
    volume, spec = toy.settings, toy.spec
    layout = VolumeLayout(volume.data_root)
    files = layout.datasets("vla") / "files"
    files.rename(files.with_name("gone"))
    with pytest.raises(DataError, match="its DVC remote 'volume' lacks 60 of 60 files"):
        data.pull(DatasetSpec(spec.project, spec.repo, spec.path, spec.rev), volume)


#: what ``dvc fetch`` printed (DVC 3.67) for a remote object moved away, its remote under a pytest
#: directory numbered 401: read as "no credentials" (HTTP 401) before the paths were left out
DVC_MISSING_OBJECT = (
    "ERROR: unexpected error - failed to transfer '77914a1095bfa97084f0aee8000b72db' - [Errno 2] No such file "
    "or directory: '/tmp/pytest-of-root/pytest-401/popen-gw0/gc0/data/datasets/vla/files/md5/77/"
    "914a1095bfa97084f0aee8000b72db'\nERROR: failed to fetch data from the cloud - 2 files failed to download")
#: botocore's ClientError text for a refused HeadObject behind DVC's fetch error, written by hand: no S3
#: remote runs here, and s3fs may word a real refusal otherwise; it keeps a 403 in DVC's own words named
DVC_S3_FORBIDDEN = "ERROR: failed to fetch data from the cloud - An error occurred (403) when calling the HeadObject operation: Forbidden"


@pytest.mark.parametrize(("stderr", "words"), [(DVC_MISSING_OBJECT, "its DVC remote lacks some files"),
                                               (DVC_S3_FORBIDDEN, "no credentials for its DVC remote")])
def test_dvc_fetchs_error_is_named_by_its_words_not_by_a_number_in_a_path(stderr, words):
    from det_lab.data.pull import _explain_dvc_error

    spec = DatasetSpec("vla", "/srv/run-403/alpha.git", "data/alpha", rev="main")
    assert _explain_dvc_error(stderr, spec).startswith(f"data/alpha@main in /srv/run-403/alpha.git: {words}")


def test_missing_credentials(volume):
    """A git server that wants a password: git must not prompt; the error says credentials."""

    class NeedsAuth(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), NeedsAuth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/lab/data.git"
        with pytest.raises(DataError, match="no credentials for git repository"):
            data.pull(DatasetSpec("vla", url, "data/x", rev="main"), volume)
    finally:
        server.shutdown()


def test_unknown_project_and_bad_names(toy):
    volume, spec = toy.settings, toy.spec
    with pytest.raises(ValueError, match="unknown project 'nerf'"):
        data.pull(DatasetSpec("nerf", spec.repo, spec.path), volume)
    with pytest.raises(DataError, match="relative path"):
        DatasetSpec("vla", spec.repo, "/abs/path")
    with pytest.raises(DataError, match="no dataset named 'nope'"):
        data.pull("nope", volume)


def test_cli_errors_are_one_line(lab, volume):
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "data", "pull", "--project", "vla", "--repo", "/nowhere",
                           "--path", "d"], env=lab.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "/nowhere" in proc.stderr


def test_register_checks_the_spec_and_list_shows_it(toy):
    lab, volume, spec = toy.lab, toy.settings, toy.spec
    with pytest.raises(DataError, match="not tracked by DVC"):
        data.register("broken", DatasetSpec("vla", spec.repo, "data/missing", "main"), volume)
    ident = data.register("toy-pinned", DatasetSpec("vla", spec.repo, spec.path, "main"), volume)
    assert ident.nfiles == 60
    with pytest.raises(DataError, match="already registered"):
        data.register("toy-pinned", DatasetSpec("vla", spec.repo, spec.path, ident.commit), volume)
    data.pull("toy-pinned", volume)
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "data", "list"], env=lab.env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "toy-pinned" in proc.stdout and "data/toy@" in proc.stdout
    st = data.status("toy-pinned", volume)
    assert st.snapshot is not None and st.cached_files == st.total_files == 60


# --- an empty directory, and snapshots changed after they were verified ----------------------

def test_empty_directory_dataset(toy, tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    publish_directory(toy.settings, "vla", "toy", src, "now an empty directory")
    ds = data.pull("toy", toy.settings)
    assert ds.fetched and ds.path.is_dir() and list(ds.path.iterdir()) == []
    assert ds.identity.nfiles == 0
    assert not data.pull("toy", toy.settings).fetched


def _object(volume, md5: str) -> Path:
    return VolumeLayout(volume.data_root).dvc_cache("vla") / "files" / "md5" / md5[:2] / md5[2:]


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_snapshot_file_rewritten_or_deleted_is_restored_on_the_next_pull(toy):
    lab, volume, expected = toy.lab, toy.settings, toy.expected
    first = data.pull("toy", volume)
    victim = first.path / "part0" / "f00000.bin"
    os.chmod(victim, 0o644)  # what a user does before writing into the read-only snapshot
    victim.write_bytes(b"tampered")  # the same inode as the shared cache object
    assert _md5(_object(volume, expected["part0/f00000.bin"])) != expected["part0/f00000.bin"]
    proc = cli_pull(lab, "toy")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["fetched"] is False and result["repaired"] == ["toy/part0/f00000.bin"]
    assert "warning:" in err and "toy/part0/f00000.bin" in err
    assert tree_md5(first.path) == expected
    obj = _object(volume, expected["part0/f00000.bin"])
    assert _md5(obj) == expected["part0/f00000.bin"] and os.path.samefile(obj, victim)
    assert not os.stat(victim).st_mode & 0o222
    assert data.pull("toy", volume).repaired == ()  # the record follows the repaired file

    # a deleted file is put back from the cache: the remote is not even needed
    layout = VolumeLayout(volume.data_root)
    (layout.datasets("vla") / "files").rename(layout.datasets("vla") / "away")
    victim = first.path / "part3" / "f00003.bin"
    os.chmod(victim.parent, 0o755)
    victim.unlink()
    os.chmod(victim.parent, 0o2555)
    assert data.pull("toy", volume).repaired == ("toy/part3/f00003.bin",)
    assert tree_md5(first.path) == expected


def test_damage_the_remote_cannot_restore_is_refused_in_one_line(toy):
    lab, volume, expected = toy.lab, toy.settings, toy.expected
    first = data.pull("toy", volume)
    layout = VolumeLayout(volume.data_root)
    md5 = expected["part1/f00001.bin"]
    _rot(first.path / "part1" / "f00001.bin")
    _rot(layout.datasets("vla") / "files" / "md5" / md5[:2] / md5[2:])
    proc = lab.cli("data", "pull", "toy")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "toy/part1/f00001.bin" in lines[0] and "det-lab data verify --repair" in lines[0]


def test_verify_finds_what_the_cheap_check_cannot_and_repairs_it(toy):
    lab, volume, expected = toy.lab, toy.settings, toy.expected
    first = data.pull("toy", volume)
    victim = first.path / "part2" / "f00002.bin"
    st = victim.stat()
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(st.st_size))  # same size ...
    os.chmod(victim, 0o444)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and mtime: only a hash sees it
    assert data.pull("toy", volume).repaired == ()
    proc = lab.cli("data", "verify")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(victim) in proc.stdout and "det-lab data verify --repair" in proc.stderr
    proc = lab.cli("data", "verify", "--repair", "toy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"repaired {victim}" in proc.stdout
    assert tree_md5(first.path) == expected
    proc = cli_in_process(lab, "data", "verify")
    assert proc.returncode == 0 and "0 damaged" in proc.stdout, proc.stdout + proc.stderr

    # a damaged cache object no snapshot uses is dropped; the next pull that needs it fetches it
    _forget_snapshots(VolumeLayout(volume.data_root), "vla")
    obj = _object(volume, expected["part4/f00004.bin"])
    os.chmod(obj, 0o644)
    obj.write_bytes(b"bit rot")
    os.chmod(obj, 0o444)  # read-only again: DVC takes such an object as verified
    assert cli_in_process(lab, "data", "verify").returncode == 1
    proc = cli_in_process(lab, "data", "verify", "--repair")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not obj.exists()
    assert tree_md5(data.pull("toy", volume).path) == expected
