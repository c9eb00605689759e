"""The few git operations datasets need, run as git itself with prompts disabled."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from det_lab.data.errors import DataError

_SHA = re.compile(r"^[0-9a-f]{40}$")
_ENV = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "SSH_ASKPASS": "true",
        "GIT_SSH_COMMAND": os.environ.get("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")}


def git(*args: str, cwd: Path | None = None, trust: Iterable[str | Path] = ()) -> str:
    """Run git; raise :class:`DataError` with git's own last error line on failure.

    ``trust`` names dataset repositories this one command may read although another user owns
    them (see :func:`_trusting`).
    """
    config = _trusting(trust)
    env = _ENV if config is None else {**_ENV, "GIT_CONFIG_GLOBAL": config}
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    finally:
        if config is not None:
            os.unlink(config)
    if proc.returncode != 0:
        raise DataError(_last_error(proc.stderr) or f"git {args[0]} failed ({proc.returncode})")
    return proc.stdout


def _trusting(repos: Iterable[str | Path]) -> str | None:
    """A global git config that is the user's own plus ``safe.directory`` for the local ``repos``.

    git refuses a repository another user owns ("dubious ownership"), and a team's dataset
    repositories on the volume belong to whoever published them first. git 2.39 reads
    ``safe.directory`` only from the global and system files (not from ``-c``), so det_lab hands
    the one command a global file of its own that includes the user's. None when no repository is
    a local directory (URLs are not checked).
    """
    entries: list[str] = []
    for repo in repos:
        local = _local_dir(str(repo))
        for base in dict.fromkeys([local.absolute(), local.resolve()]) if local else ():
            entries += [str(base), str(base / ".git")]
    if not entries:
        return None
    if os.environ.get("GIT_CONFIG_GLOBAL"):
        includes = [os.environ["GIT_CONFIG_GLOBAL"]]
    else:
        xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        includes = [str(Path(xdg) / "git" / "config"), str(Path.home() / ".gitconfig")]  # git's order
    text = "".join(f"[include]\n\tpath = {_quote(p)}\n" for p in includes)
    text += "[safe]\n" + "".join(f"\tdirectory = {_quote(e)}\n" for e in dict.fromkeys(entries))
    fd, path = tempfile.mkstemp(prefix="det-lab-gitconfig-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _local_dir(repo: str) -> Path | None:
    """``repo`` as a local directory; None for a URL or ``host:path``."""
    path = repo.removeprefix("file://")
    if "://" in path or ":" in path.split("/", 1)[0]:
        return None
    return Path(path) if os.path.isdir(path) else None


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
        out = git("ls-remote", repo, rev, f"refs/tags/{rev}^{{}}", trust=[repo])
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
        git("clone", "--quiet", "--no-checkout", repo, str(dest), trust=[repo])
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
