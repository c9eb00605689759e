"""Restoring a backup of the master's database (``det-lab cluster restore``), and the plan of one.

:func:`restore_plan` asks the database what a restore would replace and refuses what the restore
would refuse, without changing anything; :func:`restore` acts on that plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.cluster.backup import PGDMP_MAGIC, BackupError, Connection, globals_of, query, run_tool

__all__ = ["RestorePlan", "check_archive", "restore", "restore_plan"]

_USER_SCHEMAS = ("n.nspname NOT IN ('pg_catalog', 'information_schema') "
                 "AND n.nspname NOT LIKE 'pg_toast%' AND n.nspname NOT LIKE 'pg_temp%'")
#: a database with no relation outside the system schemas counts as empty
_USER_RELATIONS_SQL = f"SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {_USER_SCHEMAS}"
_USER_TABLES_SQL = ("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    f"WHERE c.relkind IN ('r', 'p') AND {_USER_SCHEMAS} ORDER BY 1")


def check_archive(path: Path) -> None:
    """Refuse what is not a pg_dump custom-format archive, in one line."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(PGDMP_MAGIC))
    except FileNotFoundError:
        raise BackupError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BackupError(f"{path} is a directory, not a backup") from None
    except OSError as exc:
        raise BackupError(f"{path}: {exc.strerror or exc}") from None
    if head != PGDMP_MAGIC:
        raise BackupError(f"{path} is not a pg_dump custom-format archive (a .dump file of det-lab cluster backup)")


@dataclass(frozen=True)
class RestorePlan:
    """What restoring ``archive`` would do to the database: create it, fill an empty one, or
    (``--force``) replace the tables it holds now."""

    archive: Path
    database: str  # Connection.describe()
    exists: bool
    relations: int  # outside the system schemas, now
    tables: list[str]  # schema.table, now: what a forced restore replaces

    @property
    def replaces(self) -> bool:
        return self.relations > 0

    def lines(self) -> list[str]:
        """The plan as text."""
        size = self.archive.stat().st_size
        if not self.exists:
            return [f"would create {self.database} and restore {self.archive} ({size} bytes) into it"]
        if not self.replaces:
            return [f"would restore {self.archive} ({size} bytes) into {self.database} (empty now)"]
        return [f"would REPLACE {self.database}: its {self.relations} relations, these {len(self.tables)} tables "
                f"with their rows, by {self.archive} ({size} bytes), restored beside it first",
                *(f"  replaces {t}" for t in self.tables)]

    def as_dict(self) -> dict[str, Any]:
        """The plan as ``cluster restore --dry-run --json`` prints it."""
        return {"archive": str(self.archive), "archive_bytes": self.archive.stat().st_size,
                "globals": str(globals_of(self.archive)), "database": self.database, "exists": self.exists,
                "replaces": self.replaces, "relations": self.relations, "tables": self.tables}


def restore_plan(conn: Connection, archive: Path, *, force: bool = False) -> RestorePlan:
    """What :func:`restore` would do, refused as it would refuse it (not an archive; a database
    that is not empty without ``force``; one that others are connected to); changes nothing."""
    check_archive(archive)
    exists = query(conn, f"SELECT count(*) FROM pg_database WHERE datname = '{conn.db}'", db="postgres") == "1"
    relations = int(query(conn, _USER_RELATIONS_SQL)) if exists else 0
    if relations and not force:
        raise BackupError(f"{conn.describe()} is not empty ({relations} relations); restore into an empty "
                          "database, or pass --force to replace it (stop the master first)")
    tables: list[str] = []
    if relations:
        others = int(query(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                 f"'{conn.db}' AND pid <> pg_backend_pid()", db="postgres"))
        if others:
            raise BackupError(f"{conn.describe()} has {others} other connection(s) (the master?): stop the "
                              "master first (docker stop <cluster_name>_determined-master_1)")
        tables = query(conn, _USER_TABLES_SQL).splitlines()
    return RestorePlan(archive, conn.describe(), exists, relations, tables)


def restore(conn: Connection, archive: Path, *, force: bool = False) -> RestorePlan:
    """Restore ``archive`` into ``conn``'s database, which must be empty (or missing) unless ``force``;
    returns the plan it carried out.

    The restore runs in one transaction, so it lands whole or not at all. With ``force`` a
    non-empty database is replaced only after the archive restored completely into a new one
    beside it (then the old is dropped and the new renamed), which PostgreSQL allows only while
    nothing else is connected: stop the master first.
    """
    plan = restore_plan(conn, archive, force=force)
    args = ["--no-owner", "--exit-on-error", "--single-transaction"]
    target = f"{conn.db}_restoring" if plan.replaces else conn.db
    if target != conn.db or not plan.exists:
        query(conn, f'DROP DATABASE IF EXISTS "{target}"', db="postgres")
        query(conn, f'CREATE DATABASE "{target}" OWNER "{conn.user}"', db="postgres")
    try:
        if conn.container:
            run_tool(conn, conn.argv("pg_restore", *args, db=target), stdin=archive)
        else:
            run_tool(conn, conn.argv("pg_restore", *args, str(archive), db=target))
    except BackupError:
        if target != conn.db or not plan.exists:
            query(conn, f'DROP DATABASE IF EXISTS "{target}"', db="postgres")
        raise
    if target != conn.db:
        query(conn, f'DROP DATABASE "{conn.db}"', db="postgres")
        query(conn, f'ALTER DATABASE "{target}" RENAME TO "{conn.db}"', db="postgres")
    return plan
