"""The cluster's secrets: the initial admin password and the database password.

Where they live: a private directory on the master machine's *local* disk,
``$DET_LAB_CLUSTER_DIR`` or ``$XDG_CONFIG_HOME/det-lab/cluster`` (``~/.config/det-lab/cluster``),
mode 0700, each file mode 0600. Not on the shared volume, because

- with ``root_squash`` the Docker daemon (root) cannot read a 0600 file on NFS, and the master
  config holding the admin password is bind-mounted by that daemon;
- the volume's directories are group-shared (setgid, g+w) and NFSv3/v4 without krb5p sends file
  contents in clear text.

How they are written: created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 in one call,
so no file is ever group/world-readable, not even between open and chmod; rewritten files go
through a private temp file in the same directory and ``os.replace``. A secret file that is
readable by others is refused, never silently used.

Strength: 24 characters from ``[A-Za-z0-9]`` (about 143 bits) with at least one upper-case
letter, lower-case letter and digit, which passes Determined's client-side complexity check;
letters and digits only, so the value needs no quoting in YAML or a shell.
"""

from __future__ import annotations

import os
import secrets
import stat
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from det_lab.errors import UserError
from det_lab.mounts import NETWORK_FS, mount_of, parse_mounts

PASSWORD_LENGTH = 24
DB_PASSWORD_LENGTH = 32
ADMIN_PASSWORD_FILE = "admin-password"
DB_PASSWORD_FILE = "db-password"
_ALPHABET = string.ascii_letters + string.digits


class SecretError(UserError, ValueError):
    """A problem with a secret or its file, phrased as one line."""


def generate_password(length: int = PASSWORD_LENGTH) -> str:
    """A random password with upper- and lower-case letters and digits."""
    if length < 8:
        raise ValueError("passwords shorter than 8 characters are refused by Determined")
    while True:
        pw = "".join(secrets.choice(_ALPHABET) for _ in range(length))
        if not password_problems(pw):
            return pw


def password_problems(password: str | None) -> list[str]:
    """What makes ``password`` weak by Determined's rules (empty: acceptable)."""
    if not password:
        return ["it is blank"]
    problems = []
    if len(password) < 8:
        problems.append("it has fewer than 8 characters")
    if not any(c.isupper() for c in password):
        problems.append("it has no upper-case letter")
    if not any(c.islower() for c in password):
        problems.append("it has no lower-case letter")
    if not any(c.isdigit() for c in password):
        problems.append("it has no digit")
    return problems


def private_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory for secrets and the rendered configs on this machine."""
    env = os.environ if env is None else env
    explicit = env.get("DET_LAB_CLUSTER_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return (xdg / "det-lab" / "cluster").absolute()


def ensure_private_dir(path: Path, mounts_file: Path = Path("/proc/mounts")) -> Path:
    """Create ``path`` mode 0700 (or tighten it if we own it); refuse one on NFS or shared."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise SecretError(f"{path} belongs to uid {st.st_uid}; use a directory of your own "
                          "(set DET_LAB_CLUSTER_DIR)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    try:
        mount = mount_of(path, parse_mounts(mounts_file.read_text()))
    except OSError:
        mount = None
    if mount is not None and mount.fstype in NETWORK_FS:
        raise SecretError(f"{path} is on NFS ({mount.device}); secrets must be on a local disk "
                          "(root_squash hides 0600 files from Docker): set DET_LAB_CLUSTER_DIR to a local directory")
    return path


def _open_private(path: Path) -> int:
    # 0600 at creation: the umask can only remove bits, and O_EXCL refuses an existing file or link
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def _write_fd(fd: int, text: str) -> None:
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _beside(path: Path) -> Path:
    """A temporary name in ``path``'s directory, unique to this call."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_private(path: Path, text: str) -> None:
    """Write ``path`` mode 0600, atomically, never readable by anyone else at any moment."""
    tmp = _beside(path)
    try:
        _write_fd(_open_private(tmp), text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_private(path: Path) -> str:
    """Read a secret file, refusing one that others can read or that is a symlink."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise SecretError(f"{path}: no such file") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise SecretError(f"{path}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SecretError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
    return path.read_text().strip()


@dataclass
class Secret:
    """A secret value and where it is kept. ``created``: generated by this call."""

    path: Path
    value: str = field(repr=False)
    created: bool = False

    def __str__(self) -> str:
        return f"<secret in {self.path}>"


def ensure_secret(path: Path, length: int = PASSWORD_LENGTH) -> Secret:
    """The secret in ``path``, generating and storing a new one if the file does not exist.

    A new secret is written whole to a private temporary file, then linked to ``path``: the link
    is atomic and refuses an existing ``path``, so a concurrent caller finds the file complete or
    not at all (created in place, it was once read blank between its creation and its write)."""
    value = generate_password(length)
    tmp = _beside(path)
    try:
        _write_fd(_open_private(tmp), value + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            value = read_private(path)
            problems = password_problems(value)
            if problems:
                raise SecretError(f"{path}: weak password ({'; '.join(problems)}); delete the file to generate one") \
                    from None
            return Secret(path, value, created=False)
    finally:
        tmp.unlink(missing_ok=True)
    return Secret(path, value, created=True)


@dataclass
class ClusterSecrets:
    admin: Secret
    db: Secret


def ensure_cluster_secrets(directory: Path, admin_password_file: Path | None = None) -> ClusterSecrets:
    """The admin and DB passwords, generated on first use; ``admin_password_file`` overrides."""
    ensure_private_dir(directory)
    if admin_password_file is not None:
        value = read_private(admin_password_file)
        problems = password_problems(value)
        if problems:
            raise SecretError(f"{admin_password_file}: password too weak: {'; '.join(problems)}")
        admin = Secret(admin_password_file, value)
    else:
        admin = ensure_secret(directory / ADMIN_PASSWORD_FILE)
    db = ensure_secret(directory / DB_PASSWORD_FILE, DB_PASSWORD_LENGTH)
    return ClusterSecrets(admin=admin, db=db)
