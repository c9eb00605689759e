"""The parts of a trial's lineage that let it be rebuilt: its code and its Python environment.

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

Both are best effort: lineage never stops a trial (a failure leaves the entry out).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from det_lab.volume import atomic_write_text

PATCH_FILE = "code.patch"
PATCH_CAP = 4 * 1024 * 1024
ENVIRONMENTS_DIR = "environments"
CODE_REPO_ENV = "DET_LAB_CODE_REPO"
CAPPED_NOTE = "# det_lab: local changes not saved"


def _git(cwd: Path, *args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60,
                              env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode not in ok:
        return None
    return proc.stdout.decode(errors="surrogateescape")


def working_changes(root: Path, cap: int = PATCH_CAP) -> tuple[bytes, int]:
    """Everything uncommitted in the work tree at ``root``: ``git diff --binary HEAD`` plus each
    untracked, not ignored file as a new-file diff; and its size. Untracked files are not read
    once the total passes ``cap`` (a stray multi-gigabyte file): the size is then their sum."""
    parts = [(_git(root, "diff", "--binary", "HEAD") or "").encode(errors="surrogateescape")]
    total = len(parts[0])
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    for name in filter(None, untracked):
        if total > cap:
            try:
                total += (root / name).stat().st_size
            except OSError:
                pass
            continue
        diff = _git(root, "diff", "--binary", "--no-index", "--", "/dev/null", name, ok=(0, 1))
        if diff:
            parts.append(diff.encode(errors="surrogateescape"))
            total += len(parts[-1])
    return b"".join(parts), total


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
