"""Importing base models onto the volume, once and whole, and finding them again.

An import hashes every file of the snapshot (sha256) while copying it into a staging directory
on the volume (``models/.det-lab/staging``, the same file system, so the moves below are renames).
The revision is a digest of the sorted (path, sha256, size) list: the same files imported twice
are one revision, a changed file is another. When every file is copied and fsync'ed, the blobs
move into the model's ``blobs/``, the revision's record is written, and the snapshot directory
is renamed into ``snapshots/<revision>`` (the one step that makes the revision exist), then
``refs/main`` is pointed at it. A kill before that rename leaves only staging debris, which no
listing and no huggingface_hub lookup sees.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from det_lab.models.errors import ModelStoreError
from det_lab.models.layout import ModelStoreLayout, check_name
from det_lab.models.source import Snapshot, SourceFile, read_snapshot
from det_lab.ondisk import MODEL_RECORD, stamped
from det_lab.volume import atomic_write_text, human_bytes

_CHUNK = 4 << 20


@dataclass(frozen=True)
class StoredFile:
    """One file of a revision: its path in the model, size and sha256 (its blob's name)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Revision:
    """One imported revision of a model: what its record on the volume says (``<revision>.json``)."""

    name: str
    revision: str
    files: tuple[StoredFile, ...]
    hub_commit: str | None = None
    source: str | None = None
    imported_by: str | None = None
    imported_at: str | None = None
    host: str | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Revision:
        """The record as written by :func:`import_model` (the one place records are read)."""
        files = tuple(StoredFile(**f) for f in data.get("files") or ())
        keys = ("hub_commit", "source", "imported_by", "imported_at", "host")
        return cls(data["name"], data["revision"], files, **{k: data.get(k) for k in keys})


@dataclass(frozen=True)
class ModelRevision:
    """A revision as a run uses it: its name, revision, the snapshot directory and whether it is ``main``."""

    name: str
    revision: str
    path: Path
    main: bool
    hub_commit: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """A model on the volume: its revisions (oldest import first) and which one ``main`` is."""

    name: str
    main: str | None
    revisions: tuple[Revision, ...]

    @property
    def size(self) -> int:
        """Bytes on the volume: each distinct blob once."""
        return sum({f.sha256: f.size for r in self.revisions for f in r.files}.values())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "main": self.main, "size": self.size,
                "revisions": [r.to_json() for r in self.revisions]}


@dataclass(frozen=True)
class ImportPlan:
    """What an import copies: the snapshot's files, which of them the volume lacks, the revision."""

    name: str
    snapshot: Snapshot
    revision: str
    files: tuple[StoredFile, ...]
    new: tuple[str, ...]  # paths in the model whose content is not on the volume yet
    exists: bool  # the revision is on the volume already

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def new_bytes(self) -> int:
        new = set(self.new)
        return sum(f.size for f in self.files if f.path in new)

    def describe(self) -> list[str]:
        """The plan, a line each (``--dry-run``)."""
        s = self.snapshot
        lines = [f"{self.name}: {len(self.files)} files, {human_bytes(self.size)} from {s.path} ({s.shape}"
                 f"{', hub commit ' + s.hub_commit if s.hub_commit else ''})",
                 f"  revision {self.revision}" + (" is on the volume already: nothing to copy" if self.exists else
                                                  f": {len(self.new)} files to copy, {human_bytes(self.new_bytes)}")]
        new = set(self.new)
        lines += [f"  copy {f.path} ({human_bytes(f.size)})" for f in self.files if f.path in new and not self.exists]
        return lines


@dataclass
class ImportResult:
    """What :func:`import_model` did."""

    name: str
    revision: str
    path: Path
    created: bool
    copied_bytes: int
    size: int
    files: int
    hub_commit: str | None = None
    notes: list[str] = field(default_factory=list)


def revision_of(files: Iterable[StoredFile]) -> str:
    """The content address of a snapshot: a digest of its sorted (path, sha256, size) list."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.sha256}\0{f.size}\n".encode())
    return h.hexdigest()[:40]


def _hash(src: Path, out: IO[bytes] | None = None) -> str:
    h = hashlib.sha256()
    with open(src, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
    return h.hexdigest()


def plan_import(layout: ModelStoreLayout, source: Path, name: str) -> ImportPlan:
    """What importing ``source`` as ``name`` would copy (every file is read and hashed); writes nothing."""
    check_name(name)
    snapshot = read_snapshot(source)
    files = tuple(StoredFile(f.rel, f.size, _hash(f.path)) for f in snapshot.files)
    return _plan(layout, name, snapshot, files)


def _plan(layout: ModelStoreLayout, name: str, snapshot: Snapshot, files: tuple[StoredFile, ...]) -> ImportPlan:
    blobs = layout.repo(name) / "blobs"
    revision = revision_of(files)
    new = tuple(f.path for f in files if not (blobs / f.sha256).is_file())
    return ImportPlan(name, snapshot, revision, files, new, (layout.repo(name) / "snapshots" / revision).is_dir())


def import_model(layout: ModelStoreLayout, source: Path, name: str) -> ImportResult:
    """Import the snapshot at ``source`` as model ``name`` (see the module docstring); returns what it did."""
    check_name(name)
    snapshot = read_snapshot(source)
    _check_space(layout, snapshot.size)
    repo = layout.repo(name)
    stage = layout.staging / f"{name.replace('/', '--')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stage.mkdir(parents=True)
    try:
        known = repo / "blobs" if (repo / "blobs").is_dir() else None
        files = tuple(_stage(f, stage / "blobs", known) for f in snapshot.files)
        plan = _plan(layout, name, snapshot, files)
        result = ImportResult(name, plan.revision, repo / "snapshots" / plan.revision, not plan.exists, 0,
                              plan.size, len(files), snapshot.hub_commit)
        if not plan.exists:
            result.copied_bytes = _publish(layout, plan, stage)
        _point_main(repo, plan.revision)
        if snapshot.hub_commit:
            _alias(repo, snapshot.hub_commit, plan.revision, result.notes)
        return result
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _check_space(layout: ModelStoreLayout, incoming: int) -> None:
    probe = layout.root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if incoming > free:
        raise ModelStoreError(f"the model needs up to {human_bytes(incoming)} and {probe} has {human_bytes(free)} "
                              "free; free space on the volume first")


def _stage(f: SourceFile, blobs: Path, known: Path | None) -> StoredFile:
    """Copy ``f`` into ``blobs`` (fsync'ed), named by its sha256, hashing it as it is read. With
    ``known`` (the model's blobs: an import of it again) it is hashed first and copied only when new."""
    if known is not None:
        digest = _hash(f.path)
        if (known / digest).is_file():
            return StoredFile(f.rel, f.size, digest)
    blobs.mkdir(exist_ok=True)
    tmp = blobs / f".{uuid.uuid4().hex}.part"
    with open(tmp, "wb") as out:
        digest = _hash(f.path, out)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(tmp, 0o444)  # a blob is never changed in place: a new content is a new blob
    tmp.replace(blobs / digest)
    return StoredFile(f.rel, f.size, digest)


def _publish(layout: ModelStoreLayout, plan: ImportPlan, stage: Path) -> int:
    """Move the staged blobs in, write the record, then rename the snapshot into place; the bytes moved."""
    repo = layout.repo(plan.name)
    for sub in ("blobs", "snapshots", "refs"):
        (repo / sub).mkdir(parents=True, exist_ok=True)
    moved = 0
    for f in {f.sha256: f for f in plan.files}.values():
        target = repo / "blobs" / f.sha256
        if not target.is_file():
            (stage / "blobs" / f.sha256).replace(target)
            moved += f.size
    _fsync_dir(repo / "blobs")
    tree = stage / "snapshot"
    final = repo / "snapshots" / plan.revision
    for f in plan.files:
        link = tree / f.path
        link.parent.mkdir(parents=True, exist_ok=True)
        # relative to where the link will be after the rename: the store moves with its mount point
        link.symlink_to(os.path.relpath(repo / "blobs" / f.sha256, (final / f.path).parent))
    record = Revision(plan.name, plan.revision, plan.files, plan.snapshot.hub_commit, str(plan.snapshot.path),
                      getpass.getuser(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                      socket.gethostname())
    layout.records(plan.name).mkdir(parents=True, exist_ok=True)
    atomic_write_text(layout.record(plan.name, plan.revision), json.dumps(stamped(record.to_json(), MODEL_RECORD), indent=2) + "\n")
    _fsync_tree(tree)
    try:
        os.rename(tree, final)  # the commit point: the revision exists from here on, whole
    except OSError:
        if not final.is_dir():  # else another import of the same files got there first
            raise
    _fsync_dir(final.parent)
    return moved


def _point_main(repo: Path, revision: str) -> None:
    # no newline: huggingface_hub reads a ref as the file's whole text
    atomic_write_text(repo / "refs" / "main", revision)


def _alias(repo: Path, hub_commit: str, revision: str, notes: list[str]) -> None:
    """``snapshots/<hub commit>`` -> the revision, so ``revision=<hub commit>`` resolves offline too."""
    alias = repo / "snapshots" / hub_commit
    if alias == repo / "snapshots" / revision:
        return
    if alias.is_symlink() or alias.exists():
        if not (alias.is_symlink() and os.readlink(alias) == revision):
            notes.append(f"hub commit {hub_commit} already names another revision; kept that one")
        return
    tmp = alias.with_name(f".{hub_commit}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(revision)
    tmp.replace(alias)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some NFS clients refuse fsync on a directory; the renames are still ordered
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        _fsync_dir(Path(dirpath))
