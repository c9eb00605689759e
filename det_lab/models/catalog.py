"""What the store holds: models and their revisions, and the one-line refusal when a run's model is missing.

A revision exists when its ``snapshots/<revision>`` directory does (the import's last rename);
its record adds who imported it, when and from where. A snapshot without a record (put there by
huggingface_hub itself) is listed with its files read from disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from det_lab.models.errors import ModelMissing, ModelStoreError
from det_lab.ondisk import MODEL_RECORD, NewerFormat, check
from det_lab.models.layout import REVISION, ModelStoreLayout, check_name
from det_lab.models.store import ModelInfo, ModelRevision, Revision, StoredFile

_IMPORT = "huggingface-cli download {name} --local-dir DIR, then det-lab models import DIR {name}"


def model_names(layout: ModelStoreLayout) -> list[str]:
    """Every model with at least one revision on the volume, sorted."""
    try:
        folders = sorted(p for p in layout.hub.iterdir() if p.name.startswith("models--"))
    except FileNotFoundError:
        return []
    names = [p.name.removeprefix("models--").replace("--", "/", 1) for p in folders]
    return [n for n, p in zip(names, folders) if _revision_dirs(p)]


def _revision_dirs(repo: Path) -> list[Path]:
    try:
        return [p for p in (repo / "snapshots").iterdir()
                if REVISION.match(p.name) and p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return []


def _main(repo: Path) -> str | None:
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    return ref if (repo / "snapshots" / ref).is_dir() else None


def _read_record(layout: ModelStoreLayout, name: str, snapshot: Path) -> Revision:
    """The revision's record; without one, what its files say. One a newer det_lab wrote is a
    :class:`~det_lab.ondisk.NewerFormat`."""
    path = layout.record(name, snapshot.name)
    try:
        return Revision.from_json(check(json.loads(path.read_text()), MODEL_RECORD, path))
    except NewerFormat:
        raise
    except (OSError, ValueError, KeyError, TypeError):
        files = []
        for dirpath, _dirs, names in os.walk(snapshot, followlinks=True):
            for fname in names:
                full = Path(dirpath, fname)
                files.append(StoredFile(full.relative_to(snapshot).as_posix(), full.stat().st_size,
                                        Path(os.path.realpath(full)).name))
        return Revision(name, snapshot.name, tuple(sorted(files, key=lambda f: f.path)))


def show_model(layout: ModelStoreLayout, name: str) -> ModelInfo:
    """Model ``name``'s revisions (oldest import first) and ``main``; one error line for an unknown one."""
    repo = layout.repo(name)
    dirs = _revision_dirs(repo)
    if not dirs:
        known = ", ".join(model_names(layout)) or "none"
        raise ModelStoreError(f"no model {name} on the volume (models there: {known}); import it with: "
                              + _IMPORT.format(name=name))
    # by when each became a revision: its rename into snapshots/ (the record's clock may differ, or tie)
    dirs.sort(key=lambda d: (d.stat().st_mtime_ns, d.name))
    return ModelInfo(name, _main(repo), tuple(_read_record(layout, name, d) for d in dirs))


def list_models(layout: ModelStoreLayout) -> list[ModelInfo]:
    """Every model on the volume with its revisions."""
    return [show_model(layout, name) for name in model_names(layout)]


def resolve_model(layout: ModelStoreLayout, name: str, files: Sequence[str] = (),
                  revision: str | None = None) -> ModelRevision:
    """The snapshot huggingface_hub would load for ``name`` (``main``, or ``revision``: a revision or
    a hub commit), checked to hold ``files``; :class:`ModelMissing` naming the import otherwise."""
    repo = layout.repo(check_name(name))
    main = _main(repo)
    wanted = revision or main
    path = repo / "snapshots" / wanted if wanted else None
    if path is None or not path.is_dir():
        which = f" at revision {revision}" if revision else ""
        raise ModelMissing(f"base model {name}{which} is not on the volume ({layout.hub}); import it once: "
                           + _IMPORT.format(name=name))
    missing = [f for f in files if not (path / f).is_file()]
    resolved = path.resolve().name  # a hub commit's alias -> the revision it names
    if missing:
        raise ModelMissing(f"base model {name} (revision {resolved[:12]}) has no {', '.join(missing)}; import a "
                           "snapshot that has it: " + _IMPORT.format(name=name))
    hub_commit = None
    try:
        record = layout.record(name, resolved)
        hub_commit = Revision.from_json(check(json.loads(record.read_text()), MODEL_RECORD, record)).hub_commit
    except (OSError, ValueError, KeyError, TypeError):  # a newer det_lab's record too: the files are what a run needs
        pass
    return ModelRevision(name, resolved, path, resolved == main, hub_commit)


def require_torch_weights(layout: ModelStoreLayout, *files: str) -> list[Path]:
    """The paths of torch hub weight files (``resnet18-f37072fd.pth``) under TORCH_HOME; :class:`ModelMissing`
    naming the import for any that is missing."""
    paths = [layout.torch_checkpoints / f for f in files]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelMissing(f"torch hub weights {', '.join(missing)} are not on the volume ({layout.torch_checkpoints}); "
                           f"import them once: det-lab models import ~/.cache/torch/hub/checkpoints/{missing[0]}")
    return paths
