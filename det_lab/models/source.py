"""What a downloaded Hugging Face snapshot holds: its files, and the hub commit it came from.

Three shapes are read: a directory ``huggingface-cli download --local-dir DIR`` (or
``snapshot_download(local_dir=...)``) wrote, with its ``.cache/huggingface/`` bookkeeping left
out; a folder of a hub cache, ``models--org--name/`` (``refs/main``, ``snapshots/<commit>/``,
``blobs/``), of which the snapshot ``refs/main`` names is read; and one of its
``snapshots/<commit>/`` directories. Links are followed (a cache snapshot is links into blobs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from det_lab.models.errors import ModelStoreError
from det_lab.models.layout import REVISION

#: a file that makes a directory a model snapshot: a config, a tokenizer or weights
MODEL_FILES = ("config.json", "model_index.json", "tokenizer.json", "tokenizer_config.json",
               "preprocessor_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".h5",
                   ".npz", ".model")
#: what a download leaves beside the model's files: never part of it
SKIPPED_DIRS = (".git", ".cache")
_HINT = ("give the directory 'huggingface-cli download ORG/NAME --local-dir DIR' wrote, or a hub cache's "
         "models--org--name folder")


@dataclass(frozen=True)
class SourceFile:
    """One file of a snapshot: its path in the model (``/``-separated) and where to read it."""

    rel: str
    path: Path
    size: int


@dataclass(frozen=True)
class Snapshot:
    """The files of a downloaded snapshot, read from ``path``."""

    path: Path
    shape: Literal["download", "cache", "cache snapshot"]
    files: tuple[SourceFile, ...]
    hub_commit: str | None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def read_snapshot(path: Path) -> Snapshot:
    """The snapshot at ``path`` (see the module docstring); one error line for anything else."""
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        raise ModelStoreError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; {_HINT}")
    if any(child.name.startswith("models--") for child in _children(path)):
        raise ModelStoreError(f"{path} is a whole hub cache: import one of its models--org--name folders")
    commit: str | None
    if (path / "snapshots").is_dir() and ((path / "refs").is_dir() or (path / "blobs").is_dir()):
        commit = _cache_commit(path)
        files = _files(path / "snapshots" / commit)
        shape: Literal["download", "cache", "cache snapshot"] = "cache"
    else:
        cached = path.parent.name == "snapshots" and REVISION.match(path.name)
        commit = path.name if cached else _download_commit(path)
        files = _files(path)
        shape = "cache snapshot" if cached else "download"
    if not any(f.rel.rsplit("/", 1)[-1] in MODEL_FILES or f.rel.endswith(WEIGHT_SUFFIXES) for f in files):
        raise ModelStoreError(f"{path} is not a Hugging Face snapshot: it has no config.json, tokenizer or weights "
                              f"file (*.safetensors, *.bin, *.pt ...); {_HINT}")
    return Snapshot(path, shape, files, commit)


def _children(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError as exc:
        raise ModelStoreError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _cache_commit(repo: Path) -> str:
    """The commit a cache folder's ``refs/main`` names, or its only snapshot's."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text().strip()
        if (repo / "snapshots" / commit).is_dir():
            return commit
        raise ModelStoreError(f"{ref} names {commit}, which {repo / 'snapshots'} lacks: the download is incomplete; "
                              "download it again, or import one of its snapshots/<commit> directories")
    snapshots = sorted(p.name for p in _children(repo / "snapshots") if p.is_dir())
    if len(snapshots) != 1:
        raise ModelStoreError(f"{repo} has {len(snapshots)} snapshots and no refs/main: import one of its "
                              f"snapshots/<commit> directories ({', '.join(snapshots) or 'none'})")
    return snapshots[0]


def _download_commit(path: Path) -> str | None:
    """The hub commit a ``--local-dir`` download records per file (first line of each
    ``.cache/huggingface/download/*.metadata``), when they all name one."""
    meta = path / ".cache" / "huggingface" / "download"
    commits = set()
    for dirpath, _dirs, names in os.walk(meta):
        for name in names:
            if name.endswith(".metadata"):
                try:
                    commits.add(Path(dirpath, name).read_text().split("\n", 1)[0].strip())
                except OSError:
                    continue
    (commit,) = commits if len(commits) == 1 else (None,)
    return commit if commit and REVISION.match(commit) else None


def _files(root: Path) -> tuple[SourceFile, ...]:
    """Every file under ``root`` (links followed), sorted; a broken link is an error line."""
    found: list[SourceFile] = []
    for dirpath, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(names):
            full = Path(dirpath, name)
            rel = full.relative_to(root).as_posix()
            try:
                st = full.stat()
            except OSError:
                raise ModelStoreError(f"{full}: a broken link or unreadable file (an incomplete download?); "
                                      "download the model again") from None
            if not full.is_file():
                continue  # a socket or fifo: never a model file
            if not os.access(full, os.R_OK):  # e.g. safetensors writes 0600: another member's download
                raise ModelStoreError(f"{full}: not readable by you; let its owner import it, or make the "
                                      f"snapshot readable (chmod -R a+rX {root})")
            found.append(SourceFile(rel, full, st.st_size))
    if not found:
        raise ModelStoreError(f"{root} holds no files; {_HINT}")
    return tuple(found)
