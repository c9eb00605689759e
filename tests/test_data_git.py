"""det_lab's git commands on dataset repositories that another member of the team owns."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from det_lab.data.git import clone_at, git, resolve_revision

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a repository to another uid")

OTHER_UID = 54321  # no passwd entry needed: git compares the owner's uid with ours


def _repo_of_another_user(tmp: Path) -> tuple[Path, str]:
    src = tmp / "src"
    subprocess.run(["git", "init", "-q", "--initial-branch=main", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "-c", "user.name=One", "-c", "user.email=one@lab", "commit", "-q",
                    "--allow-empty", "-m", "first"], check=True)
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    bare = tmp / "volume" / "datasets" / "vla" / "git" / "demo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(bare)], check=True)
    for root, dirs, files in os.walk(bare):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, OTHER_UID, OTHER_UID)
    return bare, head


def test_another_users_repository_is_read_by_det_lab_and_trusted_for_that_command_only(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = Member Two\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bare, head = _repo_of_another_user(tmp_path)
    plain_env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}

    refused = subprocess.run(["git", "ls-remote", str(bare)], env=plain_env, capture_output=True, text=True)
    assert refused.returncode != 0 and "dubious ownership" in refused.stderr

    assert resolve_revision(str(bare), "main") == head
    clone_at(str(bare), head, tmp_path / "clone")
    assert git("rev-parse", "HEAD", cwd=tmp_path / "clone").strip() == head
    # the member's own global config still applies under det_lab's
    assert git("config", "user.name", trust=[bare]).strip() == "Member Two"

    # nothing is trusted for good, and det_lab's config files are gone
    assert subprocess.run(["git", "ls-remote", str(bare)], env=plain_env, capture_output=True).returncode != 0
    assert not (home / ".gitconfig").read_text().count("safe")
    assert list(scratch.iterdir()) == []
