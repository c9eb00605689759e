"""Password handling: strength, owner-only files created that way, shown once, never left readable."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
from determined.common.api.authentication import check_password_complexity

from typer.testing import CliRunner

from det_lab.cli.app import app
from det_lab.cluster import secrets as sec


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_generated_passwords_are_strong_and_unique():
    seen = set()
    for _ in range(200):
        pw = sec.generate_password()
        check_password_complexity(pw)  # Determined's own rule, or master_up would replace it
        assert len(pw) == sec.PASSWORD_LENGTH and pw.isalnum() and sec.password_problems(pw) == []
        seen.add(pw)
    assert len(seen) == 200
    with pytest.raises(ValueError):
        sec.generate_password(6)


@pytest.mark.parametrize("pw, problem", [
    ("", "blank"), ("Ab1", "fewer than 8"), ("abcdefgh1", "upper-case"), ("ABCDEFGH1", "lower-case"),
    ("Abcdefghi", "digit"),
])
def test_weak_passwords_are_named(pw, problem):
    assert any(problem in p for p in sec.password_problems(pw))


def test_secret_file_is_0600_from_creation_even_with_a_permissive_umask(tmp_path):
    old = os.umask(0)  # a careless umask must not matter
    try:
        directory = sec.ensure_private_dir(tmp_path / "cluster")
        created = sec.ensure_secret(directory / "admin-password")
    finally:
        os.umask(old)
    assert created.created and mode(directory) == 0o700 and mode(created.path) == 0o600
    assert created.path.read_text().strip() == created.value
    again = sec.ensure_secret(directory / "admin-password")
    assert not again.created and again.value == created.value
    assert created.value not in repr(created) and created.value not in str(created)


def test_concurrent_creation_yields_one_password(tmp_path):
    path = sec.ensure_private_dir(tmp_path / "c") / "admin-password"
    results: list[sec.Secret] = []

    def make():
        results.append(sec.ensure_secret(path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8  # none refused the file another was writing
    assert sum(r.created for r in results) == 1 and len({r.value for r in results}) == 1


def test_a_secret_being_written_is_never_read_half_written(tmp_path, monkeypatch):
    """One caller writes its new password slowly; another asks for the secret meanwhile: it gets a
    whole password (its own or the writer's), never the empty file a creation in place left
    visible (CI once saw 'weak password (it is blank)' from the test above)."""
    path = sec.ensure_private_dir(tmp_path / "c") / "admin-password"
    writing, write = threading.Event(), sec._write_fd

    def slow_write(fd: int, text: str) -> None:
        if not writing.is_set():
            writing.set()
            time.sleep(0.5)
        write(fd, text)

    monkeypatch.setattr(sec, "_write_fd", slow_write)
    results: list[sec.Secret] = []
    errors: list[BaseException] = []

    def make():
        try:
            results.append(sec.ensure_secret(path))
        except sec.SecretError as exc:
            errors.append(exc)

    slow = threading.Thread(target=make)
    slow.start()
    assert writing.wait(10)
    make()
    slow.join()
    assert errors == [] and len(results) == 2
    assert sum(r.created for r in results) == 1 and len({r.value for r in results}) == 1
    assert path.read_text().strip() == results[0].value and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["admin-password"]  # no temporary file left


def test_readable_or_linked_secret_is_refused(tmp_path):
    path = sec.ensure_private_dir(tmp_path / "c") / "admin-password"
    sec.ensure_secret(path)
    os.chmod(path, 0o644)
    with pytest.raises(sec.SecretError, match=r"readable by others \(mode 644\); run: chmod 600"):
        sec.read_private(path)
    with pytest.raises(sec.SecretError):
        sec.ensure_secret(path)
    link = path.with_name("link")
    link.symlink_to(path)
    with pytest.raises(sec.SecretError, match="not a regular file"):
        sec.read_private(link)
    with pytest.raises(FileExistsError):  # O_EXCL|O_NOFOLLOW: never writes through a planted link
        sec._open_private(link)


def test_write_private_replaces_atomically_and_leaves_no_temp(tmp_path):
    d = sec.ensure_private_dir(tmp_path / "c")
    target = d / "master.yaml"
    target.write_text("old")
    os.chmod(target, 0o644)
    sec.write_private(target, "security: {initial_user_password: X}\n")
    assert mode(target) == 0o600 and "initial_user_password" in target.read_text()
    assert [p.name for p in d.iterdir()] == ["master.yaml"]


def test_private_dir_is_tightened_and_refused_on_nfs(tmp_path):
    d = tmp_path / "c"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    sec.ensure_private_dir(d)
    assert mode(d) == 0o700
    mounts = tmp_path / "mounts"
    mounts.write_text(f"nas:/export/home {tmp_path} nfs4 rw,hard,vers=4.2 0 0\n")
    with pytest.raises(sec.SecretError, match="is on NFS .* set DET_LAB_CLUSTER_DIR"):
        sec.ensure_private_dir(d, mounts_file=mounts)


def test_private_dir_location(tmp_path):
    assert sec.private_dir({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "det-lab" / "cluster"
    assert sec.private_dir({"XDG_CONFIG_HOME": "/x", "DET_LAB_CLUSTER_DIR": str(tmp_path / "s")}) == tmp_path / "s"


def test_user_given_password_file_must_be_private_and_strong(tmp_path):
    d = tmp_path / "c"
    given = tmp_path / "pw"
    given.write_text("weakpassword\n")
    os.chmod(given, 0o600)
    with pytest.raises(sec.SecretError, match="too weak: it has no upper-case letter; it has no digit"):
        sec.ensure_cluster_secrets(d, given)
    given.write_text("Str0ngEnoughPassw0rd\n")
    os.chmod(given, 0o640)
    with pytest.raises(sec.SecretError, match="readable by others"):
        sec.ensure_cluster_secrets(d, given)
    os.chmod(given, 0o600)
    s = sec.ensure_cluster_secrets(d, given)
    assert s.admin.value == "Str0ngEnoughPassw0rd" and not (d / sec.ADMIN_PASSWORD_FILE).exists()
    assert s.db.created and len(s.db.value) == sec.DB_PASSWORD_LENGTH


def test_password_command_prints_it_once(lab):
    first = lab.cli("cluster", "password")  # the installed script, as an admin runs it
    assert first.returncode == 0, first.stderr
    path = lab.root.parent / "xdg-config" / "det-lab" / "cluster" / "admin-password"
    value = path.read_text().strip()
    assert first.stdout.count(value) == 1 and mode(path) == 0o600 and mode(path.parent) == 0o700
    second = CliRunner().invoke(app, ["cluster", "password"], env=lab.env)
    assert second.exit_code == 0 and value not in second.stdout + second.stderr
    assert "not shown" in second.stdout and str(path) in second.stdout
