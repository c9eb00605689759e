"""`det-lab cluster backup / restore / backup-timer` and doctor's backup check, against a real
PostgreSQL server (Debian's package, started here on a private socket directory and a free
loopback port, with password authentication) standing in for the master's database. The master's
own database runs in Docker, which cannot run here: the `docker exec` path is covered up to its
command lines."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from det_lab.cluster import backup as b
from det_lab.cluster.settings import ClusterSettings
from det_lab.tracking.mlflow_server import free_port
from tests.conftest import VENV_BIN

PG_BIN = b.newest_pg_bin()
if PG_BIN is None or not (PG_BIN / "initdb").exists():
    pytest.skip("needs Debian's postgresql package (initdb, pg_ctl, pg_dump): tests/setup.sh installs it",
                allow_module_level=True)


class Postgres:
    """A private PostgreSQL: its own data directory, socket directory and loopback port.

    PostgreSQL refuses to run as root; as root the server runs as ``nobody`` (present on every
    Debian machine) through util-linux's ``runuser``."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="det-lab-pg-"))
        self.port = free_port()
        self.password = "Pg" + os.urandom(12).hex()
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []

    def start(self) -> Postgres:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self.as_user:
            shutil.chown(self.root, "nobody")
            shutil.chown(pwfile, "nobody")
        subprocess.run([*self.as_user, str(PG_BIN / "initdb"), "-D", str(self.root / "data"), "-U", "postgres",
                        "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True)
        pwfile.unlink()
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run([*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-o", opts,
                        "-l", str(self.root / "log"), "-w", "start"], check=True, capture_output=True)
        return self

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PGPASSWORD": self.password}

    def psql(self, sql: str, db: str = "postgres") -> str:
        proc = subprocess.run([str(PG_BIN / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                               "-p", str(self.port), "-U", "postgres", "-d", db, "-c", sql],
                              capture_output=True, text=True, env=self.env())
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def databases(self) -> set[str]:
        return set(self.psql("SELECT datname FROM pg_database").split())


@pytest.fixture(scope="module")
def pg():
    server = Postgres().start()
    yield server
    server.stop()


_counter = iter(range(1000))


@pytest.fixture
def cl(lab, pg, tmp_path):
    """A lab whose cluster.yaml points backups at ``pg`` with a database of its own, and whose
    cluster secret directory holds the server's password as its db-password file."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "db-password").write_text(pg.password + "\n")
    os.chmod(private / "db-password", 0o600)
    lab.env["DET_LAB_CLUSTER_DIR"] = str(private)
    db = f"determined_{next(_counter)}"
    write_cluster(lab, pg, db)
    lab.db = db
    lab.backups = lab.root / ".det-lab" / "backups"
    return lab


def write_cluster(lab, pg, db: str, path: Path | None = None, **backup) -> Path:
    path = path or lab.root / ".det-lab" / "cluster.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"db": {"name": db, "user": "postgres"},
                                    "backup": {"host": "127.0.0.1", "port": pg.port, **backup}}))
    return path


def populate(pg, db: str, rows: int = 200) -> None:
    """Tables shaped like the master's (experiments, trials, metrics), every row distinct."""
    pg.psql(f'CREATE DATABASE "{db}"')
    pg.psql(f"""
        CREATE TABLE experiments (id serial PRIMARY KEY, name text UNIQUE NOT NULL, config jsonb NOT NULL);
        CREATE TABLE trials (id serial PRIMARY KEY, experiment_id int REFERENCES experiments(id),
                             hparams jsonb, state text);
        CREATE TABLE metrics (trial_id int REFERENCES trials(id), step int, value double precision,
                              blob bytea, at timestamptz, PRIMARY KEY (trial_id, step));
        CREATE VIEW best AS SELECT trial_id, max(value) AS best FROM metrics GROUP BY trial_id;
        INSERT INTO experiments (name, config)
            SELECT 'exp-' || md5(i::text), jsonb_build_object('lr', i * 0.001, 'seed', i) FROM generate_series(1, {rows}) i;
        INSERT INTO trials (experiment_id, hparams, state)
            SELECT 1 + (i % {rows}), jsonb_build_object('i', i), (ARRAY['ACTIVE','COMPLETED','ERROR'])[1 + i % 3]
            FROM generate_series(1, {rows * 2}) i;
        INSERT INTO metrics SELECT t, s, random(), decode(md5(t || '-' || s), 'hex'),
                                   '2026-01-01'::timestamptz + (t * 1000 + s) * interval '1 second'
            FROM generate_series(1, {rows * 2}) t, generate_series(1, 5) s;
    """, db)


TABLES = ("experiments", "trials", "metrics")


def contents(pg, db: str) -> dict[str, tuple[int, str]]:
    """Per table: row count and a digest of every row."""
    return {t: (int(pg.psql(f"SELECT count(*) FROM {t}", db)),
                pg.psql(f"SELECT md5(string_agg(x::text, '|' ORDER BY x::text)) FROM {t} x", db)) for t in TABLES}


def cli(lab, *args: str, limit_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    pre = None
    if limit_file_bytes is not None:
        def pre() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))
    return subprocess.run([str(VENV_BIN / "det-lab"), *args], env=lab.env, capture_output=True, text=True,
                          timeout=300, preexec_fn=pre)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    return lines[0]


def all_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --- backup, drop, restore ------------------------------------------------------------------------

def test_backup_drop_restore_gives_back_every_table(cl, pg):
    populate(pg, cl.db)
    before = contents(pg, cl.db)
    max_id = int(pg.psql("SELECT max(id) FROM experiments", cl.db))
    proc = cli(cl, "cluster", "backup")
    assert proc.returncode == 0, proc.stderr
    files = all_files(cl.backups)
    assert len(files) == 2 and re.fullmatch(rf"{cl.db}-\d{{8}}T\d{{6}}Z\.dump", files[0]), files
    dump = cl.backups / files[0]
    assert files[1] == files[0].removesuffix(".dump") + ".globals.sql"
    for name in files:
        assert stat.S_IMODE((cl.backups / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(cl.backups.stat().st_mode) == 0o700
    assert dump.read_bytes()[:5] == b"PGDMP" and "CREATE ROLE postgres" in (cl.backups / files[1]).read_text()

    pg.psql(f'DROP DATABASE "{cl.db}"')
    proc = cli(cl, "cluster", "restore", str(dump))
    assert proc.returncode == 0, proc.stderr
    assert contents(pg, cl.db) == before
    assert pg.psql("SELECT count(*) FROM best", cl.db) == str(before["trials"][0])  # the view came back too
    # the sequences came back: a new experiment does not collide with a restored one
    assert int(pg.psql("INSERT INTO experiments (name, config) VALUES ('new', '{}') RETURNING id", cl.db)) > max_id

    # a database that is not empty is refused and left as it is
    proc = cli(cl, "cluster", "restore", str(dump))
    assert "is not empty" in one_error_line(proc) and "--force" in proc.stderr
    assert pg.psql("SELECT count(*) FROM experiments WHERE name = 'new'", cl.db) == "1"

    # --force refuses while something (the master) is connected
    holder = subprocess.Popen([str(PG_BIN / "psql"), "-X", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
                               "-d", cl.db, "-c", "SELECT pg_sleep(60)"], env=pg.env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if pg.psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{cl.db}'") != "0":
                break
            time.sleep(0.1)
        proc = cli(cl, "cluster", "restore", str(dump), "--force")
        assert "other connection" in one_error_line(proc)
    finally:
        holder.kill()
        holder.wait()
    assert pg.psql("SELECT count(*) FROM experiments WHERE name = 'new'", cl.db) == "1"
    # the master stopped: its server process goes too
    pg.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{cl.db}'")
    proc = cli(cl, "cluster", "restore", str(dump), "--force")
    assert proc.returncode == 0, proc.stderr
    assert contents(pg, cl.db) == before
    assert f"{cl.db}_restoring" not in pg.databases()


def test_backup_while_writes_go_on_is_one_consistent_snapshot(cl, pg, tmp_path):
    """A writer commits an order with exactly 3 items and moves 1 unit between two accounts in
    each transaction while the backup runs: the restored copy holds whole transactions only."""
    pg.psql(f'CREATE DATABASE "{cl.db}"')
    pg.psql("""
        CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
        INSERT INTO accounts VALUES (1, 1000000), (2, 0);
        CREATE TABLE orders (id serial PRIMARY KEY, payload text);
        CREATE TABLE items (order_id int REFERENCES orders(id), n int, payload text);
        INSERT INTO orders (payload) SELECT repeat(md5(i::text), 8) FROM generate_series(1, 3000) i;
        INSERT INTO items SELECT o.id, n, repeat(md5(o.id || '-' || n), 8) FROM orders o, generate_series(1, 3) n;
        UPDATE accounts SET balance = balance - 3000 WHERE id = 1;
        UPDATE accounts SET balance = balance + 3000 WHERE id = 2;
    """, cl.db)
    writer = subprocess.Popen([str(PG_BIN / "psql"), "-X", "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
                               "-d", cl.db, "-c", """
        DO $$ DECLARE o int; BEGIN
          FOR i IN 1..1000000 LOOP
            INSERT INTO orders (payload) VALUES (repeat(md5(i::text), 8)) RETURNING id INTO o;
            INSERT INTO items SELECT o, n, repeat(md5(o || '-' || n), 8) FROM generate_series(1, 3) n;
            UPDATE accounts SET balance = balance - 1 WHERE id = 1;
            UPDATE accounts SET balance = balance + 1 WHERE id = 2;
            COMMIT;
          END LOOP;
        END $$;"""], env=pg.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while int(pg.psql("SELECT count(*) FROM orders", cl.db)) < 3500:
            assert writer.poll() is None, writer.stderr.read()
            time.sleep(0.05)
        proc = cli(cl, "cluster", "backup")
        assert proc.returncode == 0, proc.stderr
        assert writer.poll() is None  # the writes went on during the whole backup
        pg.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{cl.db}' "
                "AND pid <> pg_backend_pid()")
    finally:
        writer.kill()
        writer.wait()
    final_orders = int(pg.psql("SELECT count(*) FROM orders", cl.db))
    dump = b.list_backups(cl.backups)[0].dump
    copy = write_cluster(cl, pg, f"{cl.db}_copy", tmp_path / "copy.yaml")
    proc = cli(cl, "cluster", "--cluster-config", str(copy), "restore", str(dump))
    assert proc.returncode == 0, proc.stderr
    copy_db = f"{cl.db}_copy"
    orders = int(pg.psql("SELECT count(*) FROM orders", copy_db))
    assert 3500 <= orders < final_orders  # a snapshot from the middle of the writes
    assert pg.psql("SELECT count(*) FROM items", copy_db) == str(3 * orders)
    assert pg.psql("SELECT count(*) FROM orders o LEFT JOIN (SELECT order_id, count(*) AS n FROM items "
                   "GROUP BY order_id) i ON i.order_id = o.id WHERE i.n IS DISTINCT FROM 3", copy_db) == "0"
    assert pg.psql("SELECT sum(balance) FROM accounts", copy_db) == "1000000"
    assert pg.psql("SELECT balance FROM accounts WHERE id = 2", copy_db) == str(orders)


# --- retention ------------------------------------------------------------------------------------

def _at(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc)


def test_retention_keeps_exactly_the_newest_per_day_and_week(cl, pg):
    populate(pg, cl.db, rows=5)
    conn = b.connection(ClusterSettings.model_validate(yaml.safe_load((cl.root / ".det-lab/cluster.yaml").read_text())),
                        Path(cl.env["DET_LAB_CLUSTER_DIR"]))
    # 2026-11-02 and 2026-11-09 and 2026-11-16 are Mondays (ISO weeks start on Monday)
    taken = ["2026-10-20 03:00", "2026-11-02 01:00", "2026-11-02 23:00", "2026-11-05 12:00", "2026-11-09 03:00",
             "2026-11-15 03:00", "2026-11-15 22:00", "2026-11-16 03:00", "2026-11-17 03:00", "2026-11-17 04:00"]
    made = {t: b.backup(conn, cl.backups, now=_at(t)) for t in taken}
    other = cl.backups / "mlflow-20261001T000000Z.dump"  # another database's backup: not ours to prune
    other.write_bytes(b"PGDMP")
    notes = cl.backups / "README.txt"
    notes.write_text("kept by hand")

    def names(ts: list[str]) -> list[str]:
        return sorted([made[t].dump.name for t in ts] + [made[t].globals_file.name for t in ts]
                      + [other.name, notes.name])

    b.prune(cl.backups, cl.db, keep_daily=3, keep_weekly=4)
    # days: 11-17 (04:00), 11-16, 11-15 (22:00); weeks: 11-16.., 11-09..(11-15 22:00), 11-02..(11-05), 10-19..(10-20)
    assert all_files(cl.backups) == names(["2026-11-17 04:00", "2026-11-16 03:00", "2026-11-15 22:00",
                                           "2026-11-05 12:00", "2026-10-20 03:00"])
    b.prune(cl.backups, cl.db, keep_daily=1, keep_weekly=2)
    assert all_files(cl.backups) == names(["2026-11-17 04:00", "2026-11-15 22:00"])
    # through the CLI: a new backup, then only it is kept (it is the newest day and week)
    proc = cli(cl, "cluster", "backup", "--keep-daily", "1", "--keep-weekly", "0", "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "pruned" in proc.stdout
    new = b.list_backups(cl.backups, cl.db)
    assert len(new) == 1 and new[0].taken > _at("2026-11-30 00:00")
    assert all_files(cl.backups) == sorted([new[0].dump.name, new[0].globals_file.name, other.name, notes.name])


def test_a_manual_backup_the_same_day_keeps_that_mornings_backup(cl, pg):
    """The nightly backup, then two by hand the same day after something went wrong: with the
    default retention (keep_daily 7, keep_weekly 4, keep_last 3) all three stay; the oldest goes
    only once three newer ones exist. (Pruning kept only the newest of each day: the first manual
    backup removed the nightly one.)"""
    populate(pg, cl.db, rows=5)
    conn = b.connection(ClusterSettings.model_validate(yaml.safe_load((cl.root / ".det-lab/cluster.yaml").read_text())),
                        Path(cl.env["DET_LAB_CLUSTER_DIR"]))
    now = datetime.now(timezone.utc).replace(microsecond=0)
    if now.hour == 0 and now.minute < 2:  # the nightly one must be today's, a minute ago
        time.sleep(120)
        now = datetime.now(timezone.utc).replace(microsecond=0)
    nightly = b.backup(conn, cl.backups, now=now - timedelta(seconds=60))
    older = b.backup(conn, cl.backups, now=now - timedelta(days=1))  # yesterday's: kept as that day's
    manual = []
    for _ in range(2):  # the CLI, as a user runs it after a failure (its own clock, one per second)
        time.sleep(1.1)
        proc = cli(cl, "cluster", "backup")
        assert proc.returncode == 0, proc.stderr
        assert "pruned" not in proc.stdout, proc.stdout
        manual.append(b.list_backups(cl.backups, cl.db)[0])
    kept = [x.dump for x in b.list_backups(cl.backups, cl.db)]
    assert kept == [manual[1].dump, manual[0].dump, nightly.dump, older.dump]
    assert nightly.globals_file.exists()
    # a fourth backup today: the oldest of today's goes (newest 3, and one per earlier day)
    time.sleep(1.1)
    proc = cli(cl, "cluster", "backup")
    assert proc.returncode == 0 and f"pruned {nightly.dump.name}" in proc.stdout, proc.stdout + proc.stderr
    kept = [x.dump for x in b.list_backups(cl.backups, cl.db)]
    assert nightly.dump not in kept and older.dump in kept and len(kept) == 4


# --- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_leaves_no_partial_file(cl, pg, tmp_path):
    # no such database
    proc = cli(cl, "cluster", "backup")
    assert f'database "{cl.db}" does not exist' in one_error_line(proc)
    assert all_files(cl.backups) == []
    # no server there
    write_cluster(cl, pg, cl.db, port=free_port())
    proc = cli(cl, "cluster", "backup")
    assert "Connection refused" in one_error_line(proc)
    assert all_files(cl.backups) == []
    write_cluster(cl, pg, cl.db)

    # a full disk: the file size limit of a process (EFBIG, as ENOSPC would) mid-dump
    pg.psql(f'CREATE DATABASE "{cl.db}"')
    pg.psql("CREATE TABLE big AS SELECT i, md5(i::text) || md5((i * 7)::text) AS h FROM generate_series(1, 40000) i",
            cl.db)
    proc = cli(cl, "cluster", "backup", limit_file_bytes=256 * 1024)
    line = one_error_line(proc)
    assert "File too large" in line and "nothing was kept" in line
    assert all_files(cl.backups) == []
    proc = cli(cl, "cluster", "backup")
    assert proc.returncode == 0, proc.stderr
    good = b.list_backups(cl.backups)[0].dump
    assert good.stat().st_size > 256 * 1024

    # files that are not our backups, restored onto an existing database: refused, nothing changed
    plain = tmp_path / "plain.sql"
    subprocess.run([str(PG_BIN / "pg_dump"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-f", str(plain),
                    cl.db], env=pg.env(), check=True)
    gz = tmp_path / "backup.dump.gz"
    subprocess.run(["gzip", "-k", str(good)], check=True)
    Path(str(good) + ".gz").rename(gz)
    empty = tmp_path / "empty.dump"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.dump"
    truncated.write_bytes(good.read_bytes()[:40000])
    pg.psql(f'DROP DATABASE "{cl.db}"')
    for bad, expected in ((plain, "not a pg_dump custom-format archive"), (gz, "not a pg_dump custom-format archive"),
                          (empty, "not a pg_dump custom-format archive"), (tmp_path / "missing.dump", "no such file"),
                          (tmp_path, "is a directory"), (truncated, "pg_restore failed")):
        proc = cli(cl, "cluster", "restore", str(bad))
        assert expected in one_error_line(proc), bad
        assert cl.db not in pg.databases()  # nothing half-restored (nor an empty database) is left
    # the damaged archive with --force over a live database: it stays as it was
    proc = cli(cl, "cluster", "restore", str(good))
    assert proc.returncode == 0, proc.stderr
    before = pg.psql("SELECT md5(string_agg(h, ',' ORDER BY i)) FROM big", cl.db)
    proc = cli(cl, "cluster", "restore", str(truncated), "--force")
    assert "pg_restore failed" in one_error_line(proc)
    assert pg.psql("SELECT md5(string_agg(h, ',' ORDER BY i)) FROM big", cl.db) == before
    assert f"{cl.db}_restoring" not in pg.databases()


def test_a_bad_backup_setting_is_one_line(cl):
    path = cl.root / ".det-lab" / "cluster.yaml"
    for bad, key in (({"keep_daily": 0}, "backup.keep_daily"), ({"dir": "relative/dir"}, "backup.dir"),
                     ({"port": 0}, "backup.port")):
        path.write_text(yaml.safe_dump({"backup": bad}))
        assert key in one_error_line(cli(cl, "cluster", "backup"))


def test_docker_path_runs_the_tools_inside_the_database_container():
    """Without backup.host the tools run in the DB container det deploy local creates (Docker
    cannot run here: its command lines are what is checked)."""
    from det_lab.compat import import_deploy

    cluster = ClusterSettings(cluster_name="lab")
    conn = b.connection(cluster)
    container = f"lab_{import_deploy().DB_NAME}"
    assert conn.argv("pg_dump", "-Fc", "determined") == ["docker", "exec", "-i", container, "pg_dump", "-U",
                                                         "postgres", "-Fc", "determined"]
    assert conn.argv("pg_restore", "--no-owner")[:5] == ["docker", "exec", "-i", container, "pg_restore"]
    assert "PGPASSWORD" not in conn.env({"PGPASSWORD": "leaked"})


# --- the nightly timer and doctor -----------------------------------------------------------------

def test_rendered_timer_runs_a_backup_and_doctor_watches_its_age(cl, pg, tmp_path):
    populate(pg, cl.db, rows=5)
    units = tmp_path / "units"
    proc = cli(cl, "cluster", "backup-timer", "--out", str(units), "--user", "root")
    assert proc.returncode == 0, proc.stderr
    service = (units / "det-lab-backup.service").read_text()
    timer = (units / "det-lab-backup.timer").read_text()
    assert "OnCalendar=*-*-* 03:15:00" in timer and "Persistent=true" in timer
    if shutil.which("systemd-analyze"):
        check = subprocess.run(["systemd-analyze", "verify", str(units / "det-lab-backup.timer"),
                                str(units / "det-lab-backup.service")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    # what systemd would run: ExecStart with the service's Environment= lines
    env = {"PATH": os.environ["PATH"]}
    for line in service.splitlines():
        if line.startswith("Environment="):
            key, _, value = shlex.split(line.removeprefix("Environment="))[0].partition("=")
            env[key] = value
    assert env["DET_LAB_CLUSTER_DIR"] == cl.env["DET_LAB_CLUSTER_DIR"]
    argv = shlex.split(next(ln for ln in service.splitlines() if ln.startswith("ExecStart=")).removeprefix("ExecStart="))
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    newest = b.list_backups(cl.backups)
    assert len(newest) == 1

    def doctor_backups() -> dict:
        out = subprocess.run([str(VENV_BIN / "det-lab"), "doctor", "--json"], env=cl.env, capture_output=True,
                             text=True, timeout=120)
        return next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "backups")

    assert doctor_backups()["status"] == "pass"
    old = newest[0].dump.with_name(f"{cl.db}-{(datetime.now(timezone.utc) - timedelta(days=3)).strftime(b.STAMP_FORMAT)}.dump")
    newest[0].dump.rename(old)
    check = doctor_backups()
    assert check["status"] == "warn" and "3.0 days old" in check["detail"] and "det-lab cluster backup" in check["fix"]


def test_backup_timer_units_are_written_whole_with_the_mode_they_had(cl, tmp_path):
    """A rewrite cut short (the file size limit hit mid-write) leaves the units as they were, no
    half unit and no temp file; a new unit gets the mode a new file gets, a rewritten one keeps its own."""
    units = tmp_path / "units"
    assert cli(cl, "cluster", "backup-timer", "--out", str(units), "--user", "root").returncode == 0
    names = ["det-lab-backup.service", "det-lab-backup.timer"]
    before = {n: (units / n).read_text() for n in names}
    mask = os.umask(0)
    os.umask(mask)
    new_mode = 0o666 & ~(mask & ~0o070)  # det-lab clears the umask's group bits (volume.share_with_group)
    assert {n: stat.S_IMODE((units / n).stat().st_mode) for n in names} == dict.fromkeys(names, new_mode)
    assert all(t.endswith("\n") and len(t) > 200 for t in before.values())

    (units / names[0]).chmod(0o640)
    cut = cli(cl, "cluster", "backup-timer", "--out", str(units), "--user", "nobody", limit_file_bytes=64)
    assert cut.returncode == 2 and f"cannot write to {units}" in one_error_line(cut)
    assert {n: (units / n).read_text() for n in names} == before
    assert sorted(p.name for p in units.iterdir()) == names

    assert cli(cl, "cluster", "backup-timer", "--out", str(units), "--user", "nobody").returncode == 0
    assert "User=nobody\n" in (units / names[0]).read_text()
    assert stat.S_IMODE((units / names[0]).stat().st_mode) == 0o640
    assert stat.S_IMODE((units / names[1]).stat().st_mode) == new_mode

    # a unit kept elsewhere and linked into the directory stays a link; its target is rewritten
    kept = tmp_path / "kept" / names[1]
    kept.parent.mkdir()
    (units / names[1]).rename(kept)
    (units / names[1]).symlink_to(kept)
    assert cli(cl, "cluster", "backup-timer", "--out", str(units), "--user", "root").returncode == 0
    assert (units / names[1]).is_symlink() and (units / names[1]).resolve() == kept
    assert kept.read_text() == before[names[1]] and sorted(p.name for p in kept.parent.iterdir()) == [names[1]]


def test_doctor_ages_the_master_databases_backups_only(tmp_path):
    """A fresh backup of another database in the same directory does not hide a stale one of the master's."""
    from det_lab.settings import LabSettings

    lab = LabSettings(data_root=tmp_path)
    (tmp_path / ".det-lab").mkdir()
    (tmp_path / ".det-lab" / "cluster.yaml").write_text(yaml.safe_dump({"db": {"name": "determined"}}))
    backups = tmp_path / ".det-lab" / "backups"
    backups.mkdir()
    (backups / "determined-20261115T031500Z.dump").write_bytes(b"PGDMP")
    (backups / "mlflow-20261120T000000Z.dump").write_bytes(b"PGDMP")
    status, detail, _fix = b.backup_check(lab, now=_at("2026-11-20 06:00"))
    assert status == "warn" and "determined-20261115T031500Z.dump" in detail and "5.1 days old" in detail


def test_stale_partials_of_this_host_go_even_with_a_dotted_hostname(tmp_path, monkeypatch):
    """A killed backup's temp file goes at the next backup on its host; a live one's, another host's stay."""
    monkeypatch.setattr(b.socket, "gethostname", lambda: "node1.lab.example")
    name = ".determined-20261115T031500Z.dump"
    dead = tmp_path / f"{name}.node1.lab.example.999999999.a1b2c3{b.PARTIAL_SUFFIX}"  # above any pid_max
    alive = tmp_path / f"{name}.node1.lab.example.{os.getpid()}.a1b2c3{b.PARTIAL_SUFFIX}"
    elsewhere = tmp_path / f"{name}.node2.lab.example.999999999.a1b2c3{b.PARTIAL_SUFFIX}"
    odd = tmp_path / f".odd{b.PARTIAL_SUFFIX}"
    for f in (dead, alive, elsewhere, odd):
        f.write_bytes(b"")
    b._remove_stale_partials(tmp_path)
    assert all_files(tmp_path) == sorted(f.name for f in (alive, elsewhere, odd))
