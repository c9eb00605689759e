"""What every checkpoint and tracker run of a trial records about where it came from.

:func:`collect_lineage` gathers it: versions, host, commit, run key, dataset, the record's extras, and
the parts that let a run be rebuilt, its code and its Python environment:

- :func:`code_lineage`: the git repository holding the trial's code (its ``origin`` URL, else its
  path; for a worktree, the repository's main work tree), the commit, the template's directory
  in it and that directory's tree hash (the template's version), and, for a tree with local
  changes, those changes saved as
  ``code.patch`` next to the run's record (tracked changes and untracked files, as
  ``git apply`` takes them back). A patch over :data:`PATCH_CAP` bytes is not saved: the file
  then holds a one-line note and ``patch_capped`` is true.
- :func:`environment_lineage`: every installed distribution, ``pip freeze`` style, stored once
  per distinct environment as ``<data root>/outputs/<project>/environments/<hash>.txt`` and
  referenced by that hash.

Both are best effort: lineage never stops a trial (a failure leaves the entry out). The base models
the config names (``data.det_lab.base_model``) are the exception: :func:`models_lineage` records the
revision of each that the run loads, and a missing one stops the trial, before it trains, with the
line naming its import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from det_lab import __version__
from det_lab.compat import DETERMINED_VERSION
from det_lab.data import PulledDataset
from det_lab.data.git import describe_commit
from det_lab.models import require_model
from det_lab.settings import LabSettings, load_settings
from det_lab.runs.expconf import base_models_of
from det_lab.runs.identity import TrialIdentity
from det_lab.runs.record import RunRecord
from det_lab.volume import atomic_write_text

PATCH_FILE = "code.patch"
PATCH_CAP = 4 * 1024 * 1024
ENVIRONMENTS_DIR = "environments"
CODE_REPO_ENV = "DET_LAB_CODE_REPO"
CAPPED_NOTE = "# det_lab: local changes not saved"


_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}
_GIT_TIMEOUT = 60


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False, timeout=_GIT_TIMEOUT,
                              env={**os.environ, **_GIT_ENV})
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.decode(errors="surrogateescape")


def working_changes(root: Path, cap: int = PATCH_CAP) -> tuple[bytes, int]:
    """Everything uncommitted in the work tree at ``root``: ``git diff --binary HEAD`` plus each
    untracked, not ignored file as a new-file diff; and its size. Untracked files are not read
    once the total passes ``cap`` (a stray multi-gigabyte file): the size then counts them by
    their length on disk. Four git calls, however many files there are."""
    tracked = (_git(root, "diff", "--binary", "HEAD") or "").encode(errors="surrogateescape")
    listed = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    untracked = [name for name in listed if name]
    if not untracked:
        return tracked, len(tracked)
    if len(tracked) > cap:
        return tracked, len(tracked) + _sizes(root, untracked)
    diffed = _untracked_diff(root, untracked, cap - len(tracked))
    if diffed is None:  # git refused the batch (a file gone since it was listed): file by file
        diffed = _untracked_one_by_one(root, untracked, cap - len(tracked))
    added, started = diffed
    total = len(tracked) + len(added)
    if total > cap:  # cut short: the files git had not reached count by their size
        total += _sizes(root, untracked[started:])
    return tracked + added, total


def _sizes(root: Path, names: list[str]) -> int:
    total = 0
    for name in names:
        try:
            total += (root / name).stat().st_size
        except OSError:
            pass
    return total


def _untracked_one_by_one(root: Path, names: list[str], budget: int) -> tuple[bytes, int]:
    """:func:`_untracked_diff` with one ``git diff --no-index`` per file: a file that cannot be
    diffed (gone, unreadable) is left out alone, not every file with it."""
    parts: list[bytes] = []
    size = 0
    for started, name in enumerate(names):
        if size > budget:
            return b"".join(parts), started
        try:
            proc = subprocess.run(["git", "diff", "--binary", "--no-index", "--", "/dev/null", name], cwd=root,
                                  capture_output=True, check=False, timeout=_GIT_TIMEOUT, env={**os.environ, **_GIT_ENV})
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 1:  # --no-index: 1 is "they differ", the diff is there
            parts.append(proc.stdout)
            size += len(proc.stdout)
    return b"".join(parts), len(names)


def _untracked_diff(root: Path, names: list[str], budget: int) -> tuple[bytes, int] | None:
    """The new-file diffs of untracked ``names`` (in git's path order, as ``ls-files`` lists them)
    and how many of them it began: they are added with ``--intent-to-add`` to a scratch index
    (the repository's own is left alone) and diffed in one ``git diff --binary``, whose output is
    read only while it stays within ``budget`` bytes (git is stopped past it). None when git
    refuses them (one of them gone since it was listed)."""
    with tempfile.TemporaryDirectory(prefix="det-lab-patch-") as scratch:
        env = {**os.environ, **_GIT_ENV, "GIT_INDEX_FILE": os.path.join(scratch, "index"),
               "GIT_LITERAL_PATHSPECS": "1"}  # a name with '*' or ':' is a file, not a pattern
        paths = b"\0".join(os.fsencode(name) for name in names)
        try:
            added = subprocess.run(["git", "add", "--intent-to-add", "--pathspec-from-file=-",
                                    "--pathspec-file-nul"], cwd=root, input=paths, capture_output=True,
                                   check=False, timeout=_GIT_TIMEOUT, env=env)
            if added.returncode != 0:
                return None
            proc = subprocess.Popen(["git", "diff", "--binary"], cwd=root, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return None
        timer = threading.Timer(_GIT_TIMEOUT, proc.kill)
        timer.start()
        chunks: list[bytes] = []
        size = 0
        try:
            assert proc.stdout is not None
            while size <= budget and (chunk := proc.stdout.read1(1 << 16)):
                chunks.append(chunk)
                size += len(chunk)
            if size > budget:
                proc.kill()
        finally:
            timer.cancel()
            proc.stdout.close()
            code = proc.wait()
    out = b"".join(chunks)
    if size <= budget and code != 0:
        return None
    started = out.count(b"\ndiff --git ") + out.startswith(b"diff --git ")
    return out, started


def code_lineage(path: Path, record_dir: Path | None, cap: int = PATCH_CAP) -> dict[str, Any] | None:
    """The repository, commit and local changes of the code at ``path`` (see the module
    docstring); None outside git. The patch is written into ``record_dir`` when given."""
    top = _git(path, "rev-parse", "--show-toplevel")
    commit = _git(path, "rev-parse", "HEAD")
    if not top or not commit:
        return None
    root = Path(top.strip())
    subdir = os.path.relpath(Path(path).resolve(), root.resolve())
    remote = (_git(root, "remote", "get-url", "origin") or "").strip()
    common = Path((_git(root, "rev-parse", "--path-format=absolute", "--git-common-dir") or "").strip() or root)
    main_tree = common.parent if common.name == ".git" else root  # a worktree's repository (det-lab reproduce's)
    tree = _git(root, "rev-parse", f"HEAD:{subdir}" if subdir != "." else "HEAD^{tree}")
    code: dict[str, Any] = {"repo": os.environ.get(CODE_REPO_ENV) or remote or str(main_tree), "root": str(root),
                            "commit": commit.strip(), "subdir": subdir,
                            "template_tree": tree.strip() if tree else None, "dirty": False}
    changes, size = working_changes(root, cap)
    if size:
        code.update(dirty=True, patch=PATCH_FILE, patch_bytes=size, patch_capped=size > cap,
                    patch_sha256=None if size > cap else hashlib.sha256(changes).hexdigest())
        if record_dir is not None:
            try:
                target = Path(record_dir) / PATCH_FILE
                if code["patch_capped"]:
                    target.write_text(f"{CAPPED_NOTE}: {size} bytes exceed the cap of {cap} bytes "
                                      f"(commit them, or keep them smaller, to make this run reproducible)\n")
                else:
                    tmp = target.with_name(f".{PATCH_FILE}.{os.getpid()}.tmp")
                    tmp.write_bytes(changes)
                    tmp.replace(target)
            except OSError:
                code["patch"] = None
    return code


def installed_distributions() -> list[str]:
    """``name==version`` of every distribution this interpreter imports, sorted, each name once
    (the first on ``sys.path`` wins, as for an import)."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            seen.setdefault(canonical(name), f"{canonical(name)}=={dist.version}")
    return sorted(seen.values())


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def environment_lineage(directory: Path | None) -> dict[str, Any]:
    """The environment's hash, Python version and package count; its list written once into
    ``directory`` (``<hash>.txt``) when given."""
    lines = installed_distributions()
    text = "".join(f"{line}\n" for line in lines)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    env: dict[str, Any] = {"hash": digest, "python": platform.python_version(), "packages": len(lines)}
    if directory is not None:
        try:
            target = Path(directory) / f"{digest}.txt"
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(target, text)
            env["file"] = str(target)
        except OSError:
            pass
    return env


def read_environment(path: Path) -> dict[str, str]:
    """A stored environment list as ``{name: version}``."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[canonical(name)] = version
    return out


CODE_COMMIT_ENV = "DET_LAB_CODE_COMMIT"


#: lineage entries too large for tracker tags (checkpoint metadata and run.json keep them)
UNTAGGED = ("config", "hyperparameters")


def collect_lineage(identity: TrialIdentity, dataset: PulledDataset | None, record: RunRecord,
                    environments_dir: Path | None = None, code_and_environment: bool = True) -> dict[str, Any]:
    """Versions, host, code commit, run key, the dataset's identity and the record's own extras;
    the code's repository and local changes, the environment (stored in ``environments_dir``), the
    config as run, seed, template and scheduler (:func:`code_lineage`, :func:`environment_lineage`).

    ``code_and_environment=False`` leaves out the code and environment entries (git diffs, the patch file,
    a scan of every installed distribution): a trial's other ranks, whose checkpoint metadata
    Determined merges into the chief's, need not repeat them."""
    lineage: dict[str, Any] = {
        "det_lab_version": __version__,
        "determined_version": DETERMINED_VERSION,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "code_commit": os.environ.get(CODE_COMMIT_ENV) or describe_commit(Path.cwd()),
        "run_key": identity.run.key,
        "scheduler": record.kind or "determined",
        "template": identity.record_dir and _template_of(record),
        "seed": identity.seed,
        "config": identity.exp_conf,
        "hyperparameters": identity.hparams,
        **record.lineage_extras(),
    }
    if code_and_environment:
        try:  # never stops a trial: a failure leaves the entry out
            if identity.record_dir is None:
                record.dir.mkdir(parents=True, exist_ok=True)
            lineage["code"] = code_lineage(Path.cwd(), record.dir)
            lineage["environment"] = environment_lineage(environments_dir)
        except Exception:  # noqa: BLE001
            pass
    if dataset is not None:
        lineage["dataset"] = asdict(dataset.identity)
    models = models_lineage(identity.exp_conf or {})
    if models:
        lineage["models"] = models
    return {k: v for k, v in lineage.items() if v is not None}


def models_lineage(exp_conf: dict[str, Any], settings: LabSettings | None = None) -> list[dict[str, Any]]:
    """Name, revision and hub commit of each base model ``exp_conf`` names, as the volume's store
    serves it now (what ``from_pretrained`` loads offline); :class:`~det_lab.models.ModelMissing`
    for one that is not there."""
    names = base_models_of(exp_conf)
    if not names:
        return []
    settings = settings or load_settings()
    out = []
    for name in names:
        model = require_model(settings, name)
        out.append({"name": model.name, "revision": model.revision, "hub_commit": model.hub_commit})
    return out


def _template_of(record: RunRecord) -> str | None:
    try:
        return record.state().get("template")
    except (OSError, ValueError):
        return None


def tracker_view(lineage: dict[str, Any]) -> dict[str, Any]:
    """The lineage as tracker tags carry it: without the config and hyperparameters (the tracker
    has those as params; checkpoints and run.json keep the config), with the config's hash."""
    import hashlib
    import json

    out = {k: v for k, v in lineage.items() if k not in UNTAGGED}
    if "config" in lineage:
        out["config_sha256"] = hashlib.sha256(json.dumps(lineage["config"], sort_keys=True, default=str)
                                              .encode()).hexdigest()
    return out


def seed_everything(seed: int) -> None:
    """What Determined does for a trial on a cluster (its local mode seeds nothing)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass
