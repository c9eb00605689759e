"""The few git operations datasets need, run as git itself with prompts disabled."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from det_lab.data.errors import DataError

_SHA = re.compile(r"^[0-9a-f]{40}$")
_ENV = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "SSH_ASKPASS": "true",
        "GIT_SSH_COMMAND": os.environ.get("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")}


def git(*args: str, cwd: Path | None = None) -> str:
    """Run git; raise :class:`DataError` with git's own last error line on failure."""
    proc = subprocess.run(["git", *args], cwd=cwd, env=_ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DataError(_last_error(proc.stderr) or f"git {args[0]} failed ({proc.returncode})")
    return proc.stdout


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
    return (fatal or lines or [""])[-1]


def is_commit(rev: str) -> bool:
    return bool(_SHA.match(rev))


def resolve_revision(repo: str, rev: str) -> str:
    """The commit a branch, tag or full SHA names in ``repo``, without cloning it."""
    if is_commit(rev):
        return rev
    try:
        out = git("ls-remote", repo, rev, f"refs/tags/{rev}^{{}}")
    except DataError as exc:
        msg = str(exc)
        if "Authentication" in msg or "could not read Username" in msg or "Permission denied" in msg:
            raise DataError(f"no credentials for git repository {repo}: {msg}") from None
        raise DataError(f"git repository {repo} not found or not readable: {msg}") from None
    refs = dict(reversed(line.split("\t")) for line in out.splitlines() if "\t" in line)
    for name in (f"refs/tags/{rev}^{{}}", f"refs/heads/{rev}", f"refs/tags/{rev}", rev):
        if name in refs:
            return refs[name]
    raise DataError(f"revision {rev!r} not found in {repo} (give a branch, a tag or a full commit SHA)")


def clone_at(repo: str, commit: str, dest: Path) -> None:
    """A working copy of ``repo`` at ``commit`` in ``dest`` (which must not exist)."""
    try:
        git("clone", "--quiet", "--no-checkout", repo, str(dest))
    except DataError as exc:
        raise DataError(f"git repository {repo} not found or not readable: {exc}") from None
    try:
        git("checkout", "--quiet", "--detach", commit, cwd=dest)
    except DataError:
        raise DataError(f"revision {commit} not found in {repo}") from None


def head_commit(repo_dir: Path) -> str:
    return git("rev-parse", "HEAD", cwd=repo_dir).strip()


def describe_commit(path: Path) -> str | None:
    """HEAD of the working tree holding ``path``, with ``-dirty`` if it has local changes; None
    outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "."], cwd=path, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
