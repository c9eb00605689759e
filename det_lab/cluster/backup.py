"""Backups of the Determined master's database: dump, prune, and the nightly timer (restoring one:
:mod:`det_lab.cluster.restore`).

Everything the Web UI shows (experiments, trials, metrics, the model registry, users, templates)
lives in the master's PostgreSQL, which ``det-lab cluster up`` keeps in a Docker volume on one
machine. A backup is two files on the shared volume (``<data_root>/.det-lab/backups/`` unless
``backup.dir`` says otherwise), both mode 0600, named by the UTC time it started:

- ``<db>-<YYYYmmddTHHMMSSZ>.dump``: ``pg_dump -Fc`` of the database, one consistent snapshot
  (pg_dump reads in one repeatable-read transaction, so writes going on meanwhile are either wholly
  in it or not at all);
- ``<db>-<stamp>.globals.sql``: ``pg_dumpall --globals-only`` (roles and their passwords).

Both are written to hidden temp names and renamed only when complete, the ``.dump`` last, so a
failed or killed backup never leaves a file that looks like a backup. How the tools reach the
database: :class:`Connection` (``docker exec`` into the master's DB container, or a direct
connection to any PostgreSQL).
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from det_lab.errors import UserError
from det_lab.cluster.settings import ClusterSettings
from det_lab.settings import LabSettings

BACKUP_DIR = "backups"
DUMP_SUFFIX = ".dump"
GLOBALS_SUFFIX = ".globals.sql"
PARTIAL_SUFFIX = ".partial"
#: the first bytes of every pg_dump custom-format archive
PGDMP_MAGIC = b"PGDMP"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_NAME = re.compile(r"^(?P<db>[a-z_][a-z0-9_]*)-(?P<stamp>\d{8}T\d{6}Z)\.dump$")
_CHUNK = 1 << 20
TOOL_TIMEOUT_S = 6 * 3600
INSTALL_CLIENT = "install PostgreSQL's client tools (Debian: postgresql-client) or set backup.pg_bin"


class BackupError(UserError, RuntimeError):
    """A backup or restore problem, phrased as one line for the user."""


# --- reaching the database ------------------------------------------------------------------------

@dataclass(frozen=True)
class Connection:
    """How pg_dump, pg_dumpall, pg_restore and psql reach the master's database.

    ``container`` set: the tools run inside that container (``docker exec -i``), which is how the
    database of ``det-lab cluster up`` is reached (it publishes no port; the official postgres image
    trusts local socket connections). Otherwise they run here against ``host``/``port`` with
    ``password`` in ``PGPASSWORD`` (never on a command line).
    """

    db: str
    user: str
    container: str | None = None
    host: str | None = None
    port: int = 5432
    password: str | None = field(default=None, repr=False)
    bin_dir: Path | None = None

    def argv(self, tool: str, *args: str, db: str | None = None) -> list[str]:
        """The command line of ``tool`` connected to ``db`` (default: this connection's database)."""
        target = ["-U", self.user]
        if tool == "pg_dumpall":
            target += ["-l", db or self.db]
        elif tool != "pg_dump":  # pg_dump takes the database as its last argument
            target += ["-d", db or self.db]
        if self.container:
            return ["docker", "exec", "-i", self.container, tool, *target, *args]
        exe = str(self.bin_dir / tool) if self.bin_dir else tool
        return [exe, "-h", self.host or "localhost", "-p", str(self.port), *target, *args]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.pop("PGPASSWORD", None)
        env["PGCONNECT_TIMEOUT"] = "10"
        if self.password and not self.container:
            env["PGPASSWORD"] = self.password
        return env

    def describe(self) -> str:
        if self.container:
            return f"database {self.db} in container {self.container}"
        return f"database {self.db} at {self.host or 'localhost'}:{self.port}"


def default_backup_dir(lab: LabSettings, cluster: ClusterSettings) -> Path:
    """``backup.dir``, else ``<data_root>/.det-lab/backups`` on the shared volume."""
    return cluster.backup.dir or lab.data_root / ".det-lab" / BACKUP_DIR


def newest_pg_bin() -> Path | None:
    """Debian's newest ``/usr/lib/postgresql/<major>/bin`` (its pg_dump reads every older server)."""
    found = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "pg_dump").exists()]
    numeric = [p for p in found if p.parent.name.isdigit()]
    return max(numeric, key=lambda p: int(p.parent.name)) if numeric else None


def connection(cluster: ClusterSettings, private: Path | None = None) -> Connection:
    """The connection ``cluster``'s settings describe; a direct one reads the DB password file."""
    from det_lab.cluster.plan import DB_NAME

    b = cluster.backup
    if b.host is None:
        return Connection(db=cluster.db.name, user=cluster.db.user,
                          container=f"{cluster.cluster_name}_{DB_NAME}")
    from det_lab.cluster.secrets import (
        DB_PASSWORD_FILE,
        SecretError,
        private_dir,
        read_private,
    )

    pw_file = (private or private_dir()) / DB_PASSWORD_FILE
    password = None
    if pw_file.exists() or pw_file.is_symlink():
        try:
            password = read_private(pw_file)
        except SecretError as exc:
            raise BackupError(str(exc)) from None
    return Connection(db=cluster.db.name, user=cluster.db.user, host=b.host, port=b.port,
                      password=password, bin_dir=b.pg_bin or newest_pg_bin())


def _tool_failure(argv: Sequence[str], stderr: str, code: int) -> BackupError:
    tool = Path(argv[4] if argv[0] == "docker" else argv[0]).name
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    worst = next((ln for ln in lines if "error" in ln.lower() or "FATAL" in ln), lines[0] if lines else "")
    return BackupError(f"{tool} failed: {worst or f'exit status {code}'}")


def run_tool(conn: Connection, argv: list[str], stdin: Path | None = None) -> str:
    try:
        with open(stdin, "rb") if stdin else open(os.devnull, "rb") as inp:
            proc = subprocess.run(argv, stdin=inp, capture_output=True, text=True, env=conn.env(),
                                  timeout=TOOL_TIMEOUT_S)
    except FileNotFoundError:
        raise BackupError(_missing(argv[0])) from None
    if proc.returncode != 0:
        raise _tool_failure(argv, proc.stderr, proc.returncode)
    return proc.stdout


def _missing(exe: str) -> str:
    if exe == "docker":
        return "docker not found: run this on the master machine (or set backup.host to reach the database directly)"
    return f"{Path(exe).name} not found: {INSTALL_CLIENT}"


def query(conn: Connection, sql: str, db: str | None = None) -> str:
    """One psql query's unaligned output."""
    return run_tool(conn, conn.argv("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql, db=db)).strip()


# --- dumping --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backup:
    """One complete backup: the dump and (when present) its globals file."""

    dump: Path
    taken: datetime

    @property
    def globals_file(self) -> Path:
        return globals_of(self.dump)


def globals_of(dump: Path) -> Path:
    """The ``.globals.sql`` file written beside ``dump``."""
    return dump.with_name(dump.name.removesuffix(DUMP_SUFFIX) + GLOBALS_SUFFIX)


def _stream_to(argv: list[str], conn: Connection, tmp: Path, magic: bytes | None) -> None:
    """Run ``argv`` and write its stdout to ``tmp`` (created 0600, exclusive)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=conn.env())
    except FileNotFoundError:
        os.close(fd)
        raise BackupError(_missing(argv[0])) from None
    written = 0
    try:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(_CHUNK):
            if written == 0 and magic is not None and not chunk.startswith(magic[:len(chunk)]):
                raise BackupError(f"{Path(argv[0]).name} wrote something that is not a custom-format dump")
            written += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        proc.kill()
        raise BackupError(f"writing {tmp.parent}: {exc.strerror or exc} (nothing was kept)") from None
    except BaseException:
        proc.kill()
        raise
    finally:
        os.close(fd)
        stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        proc.wait()
    if proc.returncode != 0:
        raise _tool_failure(argv, stderr, proc.returncode)
    if magic is not None and written < len(magic):
        raise BackupError(f"{Path(argv[0]).name} wrote nothing")


def _remove_stale_partials(directory: Path) -> None:
    """Temp files of backups killed on this host (their process is gone)."""
    host = socket.gethostname()
    for p in directory.glob(f".*{PARTIAL_SUFFIX}"):
        # .<name>.<host>.<pid>.<token>.partial (the host may have dots of its own: node1.lab.example)
        head, *tail = p.name.removesuffix(PARTIAL_SUFFIX).rsplit(".", 2)
        pid = tail[0] if len(tail) == 2 else ""
        if head.endswith(f".{host}") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            p.unlink(missing_ok=True)


def planned_backup(conn: Connection, directory: Path, now: datetime | None = None) -> Backup:
    """The backup :func:`backup` would write now (its file names); writes nothing."""
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return Backup(directory / f"{conn.db}-{now.strftime(STAMP_FORMAT)}{DUMP_SUFFIX}", now)


def backup(conn: Connection, directory: Path, now: datetime | None = None) -> Backup:
    """Dump ``conn``'s database and the cluster's globals into ``directory``; nothing partial stays."""
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise BackupError(f"cannot create {directory}: {exc.strerror or exc}") from None
    _remove_stale_partials(directory)
    result = planned_backup(conn, directory, now)
    if result.dump.exists():
        raise BackupError(f"{result.dump} already exists (one backup per second)")
    tag = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}{PARTIAL_SUFFIX}"
    tmp_dump = directory / f".{result.dump.name}.{tag}"
    tmp_globals = directory / f".{result.globals_file.name}.{tag}"
    try:
        _stream_to(conn.argv("pg_dump", "-Fc", conn.db), conn, tmp_dump, PGDMP_MAGIC)
        _stream_to(conn.argv("pg_dumpall", "--globals-only"), conn, tmp_globals, None)
        os.replace(tmp_globals, result.globals_file)
        os.replace(tmp_dump, result.dump)
    finally:
        tmp_dump.unlink(missing_ok=True)
        tmp_globals.unlink(missing_ok=True)
    return result


# --- retention ------------------------------------------------------------------------------------

def list_backups(directory: Path, db: str | None = None) -> list[Backup]:
    """Complete backups in ``directory`` (of ``db`` only, if given), newest first."""
    found = []
    try:
        names = [p.name for p in directory.iterdir()]
    except FileNotFoundError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m and (db is None or m.group("db") == db):
            taken = datetime.strptime(m.group("stamp"), STAMP_FORMAT).replace(tzinfo=timezone.utc)
            found.append(Backup(directory / name, taken))
    return sorted(found, key=lambda b: b.taken, reverse=True)


def to_keep(backups: Sequence[Backup], keep_daily: int, keep_weekly: int, keep_last: int = 1) -> set[Path]:
    """The newest ``keep_last`` backups whatever their day, the newest backup of each of the newest
    ``keep_daily`` days that have one (UTC), and of each of the newest ``keep_weekly`` ISO weeks
    that have one.

    ``keep_last`` is what keeps backups taken the same day from pruning each other: a manual
    backup after something went wrong must not remove that morning's good one."""
    newest = sorted(backups, key=lambda b: b.taken, reverse=True)
    keep: set[Path] = {b.dump for b in newest[:max(keep_last, 1)]}
    for count, key in ((keep_daily, lambda b: b.taken.date()),
                       (keep_weekly, lambda b: b.taken.isocalendar()[:2])):
        seen: list[object] = []
        for b in newest:
            k = key(b)
            if k not in seen:
                if len(seen) == count:
                    break
                seen.append(k)
                keep.add(b.dump)
    return keep


def prune_plan(directory: Path, db: str, keep_daily: int, keep_weekly: int, keep_last: int = 1,
               adding: Backup | None = None) -> list[Backup]:
    """The backups of ``db`` that :func:`prune` would delete (once ``adding`` is written too); deletes nothing."""
    backups = list_backups(directory, db) + ([adding] if adding else [])
    keep = to_keep(backups, keep_daily, keep_weekly, keep_last)
    return [b for b in backups if b.dump not in keep]


def prune(directory: Path, db: str, keep_daily: int, keep_weekly: int, keep_last: int = 1) -> list[Backup]:
    """Delete the backups of ``db`` that :func:`to_keep` does not keep; returns the deleted ones."""
    removed = prune_plan(directory, db, keep_daily, keep_weekly, keep_last)
    for b in removed:
        b.dump.unlink(missing_ok=True)
        b.globals_file.unlink(missing_ok=True)
    return removed


def newest_age(directory: Path, db: str | None = None,
               now: datetime | None = None) -> tuple[Backup, timedelta] | None:
    """The newest backup in ``directory`` (of ``db`` only, if given) and its age, or None without any."""
    backups = list_backups(directory, db)
    if not backups:
        return None
    return backups[0], (now or datetime.now(timezone.utc)) - backups[0].taken


# --- the nightly timer ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Units:
    service: str
    timer: str


UNIT_NAME = "det-lab-backup"


def render_units(cluster: ClusterSettings, *, det_lab: str | None = None, user: str = "root",
                 env: Mapping[str, str] | None = None) -> Units:
    """A oneshot service running ``det-lab cluster backup`` and a timer starting it nightly.

    ``env`` (``DET_LAB_CONFIG``, ``DET_LAB_CLUSTER_CONFIG``, ``DET_LAB_CLUSTER_DIR``) is carried
    into the service, so it finds the same lab, cluster and password as the one who rendered it.
    """
    exe = det_lab or str(Path(sys.executable).parent / "det-lab")
    env = env if env is not None else {k: v for k, v in os.environ.items()
                                       if k in ("DET_LAB_CONFIG", "DET_LAB_CLUSTER_CONFIG", "DET_LAB_CLUSTER_DIR")}
    env_lines = "".join(f"Environment={shlex.quote(f'{k}={v}')}\n" for k, v in sorted(env.items()))
    service = (
        "[Unit]\n"
        "Description=det-lab: back up the Determined master's database\n"
        "After=docker.service network-online.target remote-fs.target\n"
        "Wants=network-online.target\n\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"User={user}\n"
        f"{env_lines}"
        f"ExecStart={shlex.quote(exe)} cluster backup\n"
        "Nice=10\n"
        "IOSchedulingClass=idle\n"
    )
    timer = (
        "[Unit]\n"
        "Description=det-lab: nightly backup of the Determined master's database\n\n"
        "[Timer]\n"
        f"OnCalendar={cluster.backup.on_calendar}\n"
        "Persistent=true\n"
        "RandomizedDelaySec=10min\n"
        f"Unit={UNIT_NAME}.service\n\n"
        "[Install]\n"
        "WantedBy=timers.target\n"
    )
    return Units(service, timer)


# --- det-lab doctor -------------------------------------------------------------------------------

def backup_check(lab: LabSettings, now: datetime | None = None) -> tuple[str, str, str] | None:
    """(status, detail, fix) of the newest backup for ``det-lab doctor``; None where this lab has
    neither a cluster config on the volume nor any backup (a laptop in local mode)."""
    from det_lab.cluster.settings import ClusterConfigError, load_cluster_settings

    try:
        cluster = load_cluster_settings(lab)
    except ClusterConfigError as exc:
        return "warn", f"cannot tell where backups are: {exc}", "fix the cluster config"
    directory = default_backup_dir(lab, cluster)
    newest = newest_age(directory, cluster.db.name, now)  # another database's backup there says nothing
    fix = f"run 'det-lab cluster backup' on the master machine; check its timer ({UNIT_NAME}.timer)"
    if newest is None:
        if cluster.source is None:  # no cluster.yaml on the volume: no cluster to back up
            return None
        return "warn", f"no backup of the master's database in {directory}", fix
    last, age = newest
    hours = age.total_seconds() / 3600
    if hours > cluster.backup.max_age_hours:
        return "warn", f"newest backup {last.dump.name} is {hours / 24:.1f} days old (limit {cluster.backup.max_age_hours} h)", fix
    return "pass", f"newest backup {last.dump.name} is {hours:.1f} h old", ""
