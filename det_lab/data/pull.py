"""Pulling a DVC dataset revision onto the shared volume, once, for every trial on every machine.

A revision is fetched into the project's shared DVC cache (``dvc-cache/<project>``) under a
cross-machine lock, then materialised once as an immutable, verified, read-only snapshot
(``snapshots/<project>/<md5>/<name>``: hard links into the cache, so no extra space). A small
index maps (repo, commit, path) to the snapshot, so the Nth pull of a revision is two file reads
and, for a branch or tag, one ``git ls-remote``, however many files the dataset has.

A snapshot directory only ever appears by an atomic rename of a fully verified temporary one,
so a pull that is interrupted (Ctrl-C, kill -9, a lost machine) leaves nothing that a later pull
would take as complete. Every reuse compares the snapshot's files with the sizes and mtimes
recorded when it was published (:mod:`det_lab.data.integrity`); a changed or deleted file is
hashed, and if it is damaged, re-fetched from the DVC remote and put back atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from det_lab.data.errors import DataError
from det_lab.data.identity import DatasetIdentity, PulledDataset
from det_lab.data.git import clone_at, resolve_revision
from det_lab.data.integrity import (
    READ_ONLY_DIR_MODE, SNAPSHOT_MARKER, changed_files, file_stats, hash_mismatches, md5_of, read_marker,
    replace_with_link, write_marker,
)
from det_lab.data.lastuse import note_use
from det_lab.data.lock import VolumeLock
from det_lab.settings import LabConfigError, LabSettings, check_writable
from det_lab.volume import SHARED_DIR_MODE, VolumeLayout, atomic_write_text, check_quota

REPAIR_HINT = "det-lab data verify --repair"


@dataclass(frozen=True)
class DatasetSpec:
    """Which data to pull: ``path`` (tracked by ``<path>.dvc``) in git ``repo`` at ``rev``."""

    project: str
    repo: str
    path: str
    rev: str = "HEAD"

    def __post_init__(self) -> None:
        if not self.path or self.path.startswith("/") or ".." in Path(self.path).parts:
            raise DataError(f"dataset path {self.path!r} must be a relative path inside the repository")
        if not self.repo:
            raise DataError("dataset repo must be a git URL or path")


@dataclass(frozen=True)
class _Out:
    md5: str
    size: int
    nfiles: int

    @property
    def is_dir(self) -> bool:
        return self.md5.endswith(".dir")

    @property
    def stem(self) -> str:
        return self.md5.removesuffix(".dir")


def pull(spec: DatasetSpec, settings: LabSettings, *, progress: bool | None = None) -> PulledDataset:
    """Make ``spec`` available on the volume and return where to read it, with its identity."""
    if not isinstance(spec, DatasetSpec):  # a plain directory on the volume: read in place
        from det_lab.data.directory import use_directory

        return use_directory(spec, settings)
    settings.project(spec.project)  # unknown project: clear error before any work
    layout = VolumeLayout.from_settings(settings)
    if not layout.snapshots(spec.project).is_dir():
        raise DataError(f"{layout.snapshots(spec.project)} does not exist: run 'det-lab init' first")
    commit = resolve_revision(spec.repo, spec.rev)
    show = sys.stderr.isatty() if progress is None else progress
    ready = _from_index(layout, spec, commit, show)
    if ready is not None:
        return ready
    _require_writable(layout, spec.project, f"pull {spec.path}@{spec.rev}")
    with tempfile.TemporaryDirectory(prefix="det-lab-pull-") as tmp:
        ws = Path(tmp) / "ws"
        clone_at(spec.repo, commit, ws)
        out = _read_out(ws, spec)
        identity = DatasetIdentity(spec.project, spec.repo, spec.rev, commit, spec.path, out.md5, out.size, out.nfiles)
        snap = layout.snapshots(spec.project) / out.stem
        fetched = False
        if not _complete(snap):
            with VolumeLock(layout.locks / f"{spec.project}-{out.stem}.lock"):
                if not _complete(snap):  # another puller may have finished while we waited
                    cache = layout.dvc_cache(spec.project)
                    _configure_workspace(ws, cache, Path(tmp) / "site-cache")
                    incoming = _bytes_missing(cache, out)
                    if incoming:
                        check_quota(settings, spec.project, incoming)
                    _dvc_fetch(ws, spec, show)
                    _check_fetched(ws, cache, out, spec)
                    _materialise(cache, out, snap, Path(spec.path).name, identity, show)
                    fetched = True
        repaired = () if fetched else ensure_intact(layout, snap, identity, show)
        note_use(layout, spec.project, snap.name)
        _write_index(layout, spec, commit, identity)
    return PulledDataset(snap / Path(spec.path).name, identity, fetched, repaired)


def _require_writable(layout: VolumeLayout, project: str, what: str) -> None:
    try:
        check_writable(layout.locks, layout.dvc_cache(project), layout.snapshots(project))
    except LabConfigError as exc:
        raise DataError(f"cannot {what}: {exc}") from None


# --- the fast path ----------------------------------------------------------------------------

def _index_file(layout: VolumeLayout, spec: DatasetSpec, commit: str) -> Path:
    key = hashlib.sha256(f"{spec.repo}\0{commit}\0{spec.path}".encode()).hexdigest()[:32]
    return layout.snapshots(spec.project) / ".index" / f"{key}.json"


def _from_index(layout: VolumeLayout, spec: DatasetSpec, commit: str, show: bool) -> PulledDataset | None:
    try:
        identity = DatasetIdentity(**{**json.loads(_index_file(layout, spec, commit).read_text()), "rev": spec.rev})
    except (OSError, ValueError, TypeError):
        return None
    snap = layout.snapshots(spec.project) / identity.md5.removesuffix(".dir")
    note_use(layout, spec.project, snap.name)  # before the marker is read: data gc re-checks it after evicting
    marker = read_marker(snap)
    if marker is None:
        return None
    repaired = ensure_intact(layout, snap, identity, show, marker)
    return PulledDataset(snap / Path(spec.path).name, identity, False, repaired)


def _write_index(layout: VolumeLayout, spec: DatasetSpec, commit: str, identity: DatasetIdentity) -> None:
    index = _index_file(layout, spec, commit)
    index.parent.mkdir(mode=SHARED_DIR_MODE, exist_ok=True)
    if not index.exists():
        atomic_write_text(index, json.dumps(asdict(identity), indent=2) + "\n")


def _complete(snap: Path) -> bool:
    return (snap / SNAPSHOT_MARKER).is_file()


# --- reading what the revision tracks ---------------------------------------------------------

def _read_out(ws: Path, spec: DatasetSpec) -> _Out:
    dvc_file = ws / f"{spec.path}.dvc"
    if not dvc_file.is_file():
        raise DataError(
            f"{spec.path!r} is not tracked by DVC at {spec.rev} in {spec.repo} (no {spec.path}.dvc there)"
        )
    try:
        outs = yaml.safe_load(dvc_file.read_text())["outs"]
        out = outs[0]
        return _Out(str(out["md5"]), int(out.get("size", 0)), int(out.get("nfiles", 1)))
    except (KeyError, IndexError, TypeError, ValueError, yaml.YAMLError):
        raise DataError(f"{spec.path}.dvc at {spec.rev} in {spec.repo} is not a valid DVC file") from None


# --- fetching into the shared cache -----------------------------------------------------------

def _configure_workspace(ws: Path, cache: Path, site_cache: Path) -> None:
    """Point the throwaway workspace at the shared cache (``config.local`` stays untracked)."""
    if not (ws / ".dvc").is_dir():
        raise DataError("the dataset repository is not a DVC project (no .dvc directory)")
    (ws / ".dvc" / "config.local").write_text(
        "[core]\n"
        "    hardlink_lock = true\n"  # flock is unreliable on NFS
        f"    site_cache_dir = {site_cache}\n"
        "[cache]\n"
        f"    dir = {cache}\n"
        "    shared = group\n"
        "    type = symlink,copy\n"
    )


def cache_object(cache: Path, md5: str) -> Path:
    return cache / "files" / "md5" / md5[:2] / md5[2:]


def _manifest(cache: Path, out: _Out) -> list[dict] | None:
    try:
        return json.loads(cache_object(cache, out.md5).read_text())
    except (OSError, ValueError):
        return None


def _bytes_missing(cache: Path, out: _Out) -> int:
    """An upper bound of the bytes a fetch will add to the cache."""
    entries = _manifest(cache, out) if out.is_dir else [{"md5": out.md5}]
    if entries is None:
        return out.size
    present = 0
    for e in entries:
        try:
            present += cache_object(cache, e["md5"]).stat().st_size
        except OSError:
            pass
    return max(out.size - present, 0)


def _dvc_fetch(ws: Path, spec: DatasetSpec, show: bool) -> None:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    cmd = [sys.executable, "-m", "dvc", "fetch", f"{spec.path}.dvc"]
    proc = subprocess.run(cmd, cwd=ws, env=env, text=True,
                          stderr=None if show else subprocess.PIPE, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise DataError(_explain_dvc_error(proc.stderr or "", spec))


def _check_fetched(ws: Path, cache: Path, out: _Out, spec: DatasetSpec) -> None:
    """``dvc fetch`` exits 0 when objects are missing or no remote is set: check the cache."""
    entries = _manifest(cache, out) if out.is_dir else [{"md5": out.md5}]
    missing = out.nfiles if entries is None else sum(not cache_object(cache, e["md5"]).is_file() for e in entries)
    if not missing:
        return
    where = f"{spec.path}@{spec.rev} in {spec.repo}"
    remote = subprocess.run([sys.executable, "-m", "dvc", "remote", "default"], cwd=ws, capture_output=True,
                            text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"}).stdout.strip()
    if not remote or remote.startswith("No default remote"):
        raise DataError(f"{where}: the repository has no default DVC remote (run 'dvc remote add -d ...' there)")
    raise DataError(f"{where}: its DVC remote {remote!r} lacks {missing} of {out.nfiles} files (was 'dvc push' run?)")


def _explain_dvc_error(stderr: str, spec: DatasetSpec) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    text = " ".join(errors) if errors else (lines[-1] if lines else "dvc fetch failed")
    where = f"{spec.path}@{spec.rev} in {spec.repo}"
    # what DVC says, without the paths and object names it quotes (a directory 'pytest-401' is no HTTP 401)
    lowered = re.sub(r"'[^']*'|\S*/\S*", " ", text).lower()
    if "no remote" in lowered:
        return f"{where}: the repository has no default DVC remote (run 'dvc remote add -d ...' there)"
    if "credential" in lowered or "access denied" in lowered or re.search(r"\b40[13]\b", lowered):
        return f"{where}: no credentials for its DVC remote: {text.removeprefix('ERROR: ')}"
    if "missing" in lowered or "does not exist" in lowered or "not on remote" in lowered or \
            "failed to download" in lowered or "no such file" in lowered:
        return f"{where}: its DVC remote lacks some files (was 'dvc push' run?): {text.removeprefix('ERROR: ')}"
    return f"{where}: dvc fetch failed: {text.removeprefix('ERROR: ')}"


# --- the immutable snapshot -------------------------------------------------------------------

def _materialise(cache: Path, out: _Out, snap: Path, name: str, identity: DatasetIdentity, show: bool) -> None:
    """Build, verify and atomically publish the read-only snapshot of ``out``."""
    parent = snap.parent
    for stale in parent.glob(f".tmp-{out.stem}-*"):  # left by a killed puller; we hold the lock
        _force_rmtree(stale)
    if out.is_dir:
        entries = _manifest(cache, out)
        if entries is None:
            raise DataError(f"DVC fetched {identity.path} but its manifest {out.md5} is not in {cache}")
    else:
        entries = [{"md5": out.md5, "relpath": ""}]
    tmp = parent / f".tmp-{out.stem}-{uuid.uuid4().hex[:8]}"
    try:
        root = tmp / name
        tmp.mkdir()
        if out.is_dir:
            root.mkdir()  # also when the directory is empty
        for e, obj in _progress(entries, cache, show, f"verifying {identity.path}"):
            dest = root / e["relpath"] if e["relpath"] else root
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(obj, dest)
        relpaths = [_relpath(name, e) for e in entries]
        marker = {"identity": asdict(identity), "files": len(entries), "verified": "md5 of every file",
                  "stat": file_stats(tmp, relpaths)}
        atomic_write_text(tmp / SNAPSHOT_MARKER, json.dumps(marker) + "\n", mode=0o444)
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
            os.chmod(d, READ_ONLY_DIR_MODE)
        os.chmod(tmp, READ_ONLY_DIR_MODE)
        os.rename(tmp, snap)
    except BaseException:
        _force_rmtree(tmp)
        raise


def _progress(entries: list[dict], cache: Path, show: bool, label: str) -> Iterator[tuple[dict, Path]]:
    """Yield (entry, verified cache object), hashing each object once, with a progress bar."""
    sizes = {}
    for e in entries:
        obj = cache_object(cache, e["md5"])
        try:
            sizes[e["md5"]] = obj.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{label.split()[-1]}: {obj} is missing from the cache after dvc fetch") from None
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not show, transient=True) as bar:
        task = bar.add_task(label, total=sum(sizes.values()))
        for e in entries:
            obj = cache_object(cache, e["md5"])
            if md5_of(obj) != e["md5"]:
                raise DataError(f"{obj} is corrupt (md5 mismatch): remove it and pull again")
            bar.advance(task, sizes[e["md5"]])
            yield e, obj


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)  # same volume: no extra space, and the cache object is already 0444
    except OSError:
        shutil.copyfile(src, dest)  # another filesystem, or the hard-link limit reached
        os.chmod(dest, 0o444)


def _force_rmtree(path: Path) -> None:
    if not path.exists():
        return
    for d in [path, *(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink())]:
        try:
            os.chmod(d, 0o2775)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def _relpath(name: str, entry: dict) -> str:
    """Where a manifest entry lives inside its snapshot directory."""
    return f"{name}/{entry['relpath']}" if entry["relpath"] else name


# --- keeping snapshots intact -----------------------------------------------------------------

def ensure_intact(layout: VolumeLayout, snap: Path, identity: DatasetIdentity, show: bool,
                  marker: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The cheap check on every reuse (one ``stat`` per file); repairs what it finds damaged."""
    marker = marker if marker is not None else read_marker(snap)
    changed = changed_files(snap, marker) if marker is not None else None
    if changed == []:
        return ()
    return repair_snapshot(layout, snap, identity, changed, show)


def repair_snapshot(layout: VolumeLayout, snap: Path, identity: DatasetIdentity, suspects: list[str] | None,
                    show: bool = False) -> tuple[str, ...]:
    """Hash ``suspects`` (every file when None) and restore the damaged ones from the DVC remote.

    A damaged file's cache object is the same inode, so it is removed and fetched again (DVC writes
    it by rename), then the snapshot's entry is replaced by one atomic rename: readers see the old
    file or the whole new one. Returns the files restored; raises :class:`DataError` naming them and
    the fix when that is impossible here.
    """
    out = _Out(identity.md5, identity.size, identity.nfiles)
    name = Path(identity.path).name
    try:
        check_writable(snap.parent, layout.locks, layout.dvc_cache(identity.project))
    except LabConfigError as exc:
        what = ", ".join(suspects[:3]) + (" ..." if len(suspects) > 3 else "") if suspects else "its files"
        raise DataError(f"{snap}: {what} changed since it was verified and cannot be repaired here ({exc}); "
                        f"run '{REPAIR_HINT}' where the volume is writable") from None
    cache = layout.dvc_cache(identity.project)
    spec = DatasetSpec(identity.project, identity.repo, identity.path, identity.commit)
    with VolumeLock(layout.locks / f"{identity.project}-{out.stem}.lock"):
        expected = expected_files(cache, out, name, spec, show)
        checked = list(expected) if suspects is None else [s for s in suspects if s in expected]
        damaged = [str(p.relative_to(snap)) for p in hash_mismatches((snap / rel, expected[rel]) for rel in checked)]
        if damaged:
            refetch = {o for rel in damaged if not _good_copy(o := cache_object(cache, expected[rel]), snap / rel)}
            for obj in refetch:
                obj.unlink(missing_ok=True)
            if refetch:
                _refetch(spec, cache, sorted(refetch), damaged, show)
        try:
            for rel in damaged:
                replace_with_link(cache_object(cache, expected[rel]), snap / rel)
            marker = read_marker(snap) or {}
            stats = file_stats(snap, expected)
            if marker.get("stat") != stats:
                write_marker(snap, {**marker, "stat": stats})
        except OSError as exc:  # e.g. a snapshot made by another user
            if damaged:
                raise DataError(f"{snap}: cannot repair {', '.join(damaged[:3])} ({exc.strerror}): run "
                                f"'{REPAIR_HINT}' as the snapshot's owner (uid {snap.stat().st_uid}) or root") from None
    return tuple(damaged)


def expected_files(cache: Path, out: _Out, name: str, spec: DatasetSpec | None = None,
                   show: bool = False) -> dict[str, str]:
    """Snapshot-relative path -> md5 for every file, from the (verified) ``.dir`` manifest; a
    damaged manifest is fetched again from the remote of ``spec`` (an error without one)."""
    if not out.is_dir:
        return {name: out.md5}
    manifest = cache_object(cache, out.md5)
    if hash_mismatches([(manifest, out.stem)]):
        if spec is None:
            raise DataError(f"directory manifest {manifest} is damaged or missing")
        manifest.unlink(missing_ok=True)
        _refetch(spec, cache, [manifest], [f"{out.md5} (the directory manifest)"], show)
    return {_relpath(name, e): e["md5"] for e in _manifest(cache, out) or []}


def _object_md5(obj: Path) -> str:
    return obj.parent.name + obj.name.removesuffix(".dir")


def _good_copy(obj: Path, damaged_file: Path) -> bool:
    """The cache object is intact and not the damaged snapshot file itself (that was deleted or
    replaced rather than written through its hard link)."""
    try:
        if os.path.samefile(obj, damaged_file):
            return False
    except OSError:
        pass
    return obj.is_file() and not hash_mismatches([(obj, _object_md5(obj))])


def _refetch(spec: DatasetSpec, cache: Path, objects: list[Path], damaged: list[str], show: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="det-lab-repair-") as tmp:
        ws = Path(tmp) / "ws"
        clone_at(spec.repo, spec.rev, ws)
        _configure_workspace(ws, cache, Path(tmp) / "site-cache")
        _dvc_fetch(ws, spec, show)
    bad = hash_mismatches((o, _object_md5(o)) for o in objects)
    if bad:
        raise DataError(f"{', '.join(damaged[:3])}{' ...' if len(damaged) > 3 else ''} of {spec.path}@"
                        f"{spec.rev[:10]} damaged, and the DVC remote of {spec.repo} cannot restore "
                        f"{len(bad)} of them: restore the remote, then run '{REPAIR_HINT}'")
