"""The code of a recorded run, checked out again: a scratch git worktree at its commit, with the
run's saved local changes (``code.patch``) applied for a run made from a dirty tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from det_lab.reproduce.find import ReproduceError
from det_lab.runs.lineage import CAPPED_NOTE

_ENV = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=_ENV)


def has_commit(repo_dir: Path, commit: str) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}", cwd=repo_dir).returncode == 0


def local_repo(code: dict[str, Any]) -> Path | None:
    """A local clone that holds the recorded commit: the recorded work tree, or ``repo`` when it
    is a path. None when neither is on this machine or has the commit."""
    for candidate in (code.get("root"), code.get("repo")):
        if candidate and "://" not in candidate and Path(candidate).is_dir() \
                and has_commit(Path(candidate), code["commit"]):
            return Path(candidate)
    return None


def unreachable(code: dict[str, Any]) -> str:
    repo, commit = code.get("repo") or code.get("root"), code["commit"]
    where = code.get("root") or repo
    return (f"commit {commit} is not in repository {repo} any more (nor in {where}): fetch it "
            f"(git -C {where} fetch origin {commit}, or push the branch that holds it) and run again")


def checkout(code: dict[str, Any], dest: Path, patch: Path | None) -> Path:
    """A worktree of the recorded repository at the recorded commit in ``dest`` (which must not
    exist), the patch applied; returns the recorded template directory inside it."""
    commit = code["commit"]
    repo = local_repo(code)
    if repo is not None:
        proc = _git("worktree", "add", "--detach", str(dest), commit, cwd=repo)
        if proc.returncode != 0:
            raise ReproduceError(f"git worktree add {dest} {commit} in {repo} failed: {proc.stderr.strip()}")
    else:
        url = code.get("repo") or ""
        if not url or _git("clone", "--quiet", "--no-checkout", url, str(dest)).returncode != 0 \
                or _git("checkout", "--quiet", "--detach", commit, cwd=dest).returncode != 0:
            raise ReproduceError(unreachable(code))
    if code.get("dirty"):
        apply_patch(code, dest, patch)
    return dest / code.get("subdir", ".")


def apply_patch(code: dict[str, Any], dest: Path, patch: Path | None) -> None:
    """Put back a dirty run's local changes, or refuse naming what is missing."""
    if code.get("patch_capped"):
        raise ReproduceError(f"the run's local changes ({code.get('patch_bytes')} bytes) were over the patch cap "
                             "and were not saved: its code cannot be rebuilt")
    if patch is None or not patch.is_file():
        raise ReproduceError(f"the run was made from a tree with local changes, and their patch "
                             f"{patch or code.get('patch')} is gone")
    if patch.read_bytes().startswith(CAPPED_NOTE.encode()):
        raise ReproduceError(f"{patch}: the run's local changes were not saved (over the cap)")
    proc = _git("apply", "--binary", "--whitespace=nowarn", str(patch.resolve()), cwd=dest)
    if proc.returncode != 0:
        raise ReproduceError(f"{patch} does not apply at commit {code['commit']}: {proc.stderr.strip()}")


def remove(code: dict[str, Any], dest: Path) -> None:
    """Drop a worktree made by :func:`checkout` (its registration in the repository too)."""
    repo = local_repo(code)
    if repo is not None and _git("worktree", "remove", "--force", str(dest), cwd=repo).returncode == 0:
        return
    import shutil

    shutil.rmtree(dest, ignore_errors=True)


def diff_stat(code_a: dict[str, Any], code_b: dict[str, Any]) -> str | None:
    """``git diff --stat`` between two recorded commits, where one local repository holds both."""
    for code in (code_a, code_b):
        repo = local_repo(code)
        if repo is not None and has_commit(repo, code_a["commit"]) and has_commit(repo, code_b["commit"]):
            proc = _git("diff", "--stat", code_a["commit"], code_b["commit"], cwd=repo)
            return proc.stdout.rstrip() if proc.returncode == 0 else None
    return None
