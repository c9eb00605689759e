"""`det-lab cluster restore [--force] --dry-run` against a real PostgreSQL (tests/test_cluster_backup.py's
server): the plan names every table a forced restore replaces, is refused as the restore would be,
changes nothing, and the restore then does what it said."""

from __future__ import annotations

import json

from tests.test_cluster_backup import cl, contents, cli, one_error_line, pg, populate  # noqa: F401  (fixtures)


def test_restore_dry_run_names_what_it_replaces_and_changes_nothing(cl, pg):  # noqa: F811
    populate(pg, cl.db, rows=20)
    backed_up = contents(pg, cl.db)
    assert cli(cl, "cluster", "backup").returncode == 0
    dump = next(cl.backups.glob("*.dump"))

    # into a database that is not there yet: created, nothing replaced
    pg.psql(f'DROP DATABASE "{cl.db}"')
    proc = cli(cl, "cluster", "restore", str(dump), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["exists"] is False and plan["replaces"] is False and plan["tables"] == []
    assert plan["archive_bytes"] == dump.stat().st_size and plan["globals"].endswith(".globals.sql")
    assert cl.db not in pg.databases()
    assert cli(cl, "cluster", "restore", str(dump)).returncode == 0 and contents(pg, cl.db) == backed_up

    # the database moved on since the backup: a new row and a new table
    pg.psql("INSERT INTO experiments (name, config) VALUES ('after-backup', '{}')", cl.db)
    pg.psql("CREATE TABLE extra (id int); INSERT INTO extra VALUES (1)", cl.db)
    moved_on = contents(pg, cl.db)
    # refused as the restore refuses it, in the same one line
    dry, real = cli(cl, "cluster", "restore", str(dump), "--dry-run"), cli(cl, "cluster", "restore", str(dump))
    assert one_error_line(dry) == one_error_line(real) and "is not empty" in dry.stderr

    proc = cli(cl, "cluster", "restore", str(dump), "--force", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    tables = pg.psql("SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
                     cl.db).split()
    assert plan["replaces"] and plan["tables"] == tables == ["public.experiments", "public.extra", "public.metrics",
                                                             "public.trials"]
    text = cli(cl, "cluster", "restore", str(dump), "--force", "--dry-run")
    assert "would REPLACE" in text.stdout and "  replaces public.extra" in text.stdout
    assert contents(pg, cl.db) == moved_on and pg.psql("SELECT count(*) FROM extra", cl.db) == "1"
    assert f"{cl.db}_restoring" not in pg.databases()

    proc = cli(cl, "cluster", "restore", str(dump), "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    done = json.loads(proc.stdout)
    assert done == {**plan, "dry_run": False} and plan["dry_run"] is True  # what it did is what it planned
    assert contents(pg, cl.db) == backed_up  # the row and the table the plan named are gone
    assert pg.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'extra'", cl.db) == "0"


def test_backup_dry_run_names_the_backups_pruning_would_delete_and_the_backup_then_deletes_them(cl, pg):  # noqa: F811
    from datetime import datetime, timezone
    from pathlib import Path

    import yaml

    from det_lab.cluster import backup as b
    from det_lab.cluster.settings import ClusterSettings

    populate(pg, cl.db, rows=5)
    conn = b.connection(ClusterSettings.model_validate(yaml.safe_load((cl.root / ".det-lab/cluster.yaml").read_text())),
                        Path(cl.env["DET_LAB_CLUSTER_DIR"]))
    for t in ("2026-10-20 03:00", "2026-11-02 01:00", "2026-11-16 03:00"):
        b.backup(conn, cl.backups, now=datetime.strptime(t, "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc))
    before = {p.name: p.read_bytes() for p in cl.backups.iterdir()}
    args = ("cluster", "backup", "--keep-daily", "2", "--keep-weekly", "0", "--keep-last", "1")
    proc = cli(cl, *args, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    old = [b.list_backups(cl.backups, cl.db)[i] for i in (1, 2)]  # 11-02 and 10-20: beyond the newest 2 days
    assert sorted(plan["prunes"]) == sorted(str(p) for o in old for p in (o.dump, o.globals_file))
    assert len(plan["writes"]) == 2 and plan["writes"][0].startswith(f"{cl.backups}/{cl.db}-")
    text = cli(cl, *args, "--dry-run").stdout
    assert all(f"would prune {o.dump.name} and {o.globals_file.name}" in text for o in old)
    assert {p.name: p.read_bytes() for p in cl.backups.iterdir()} == before  # nothing dumped, nothing deleted

    proc = cli(cl, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prunes"] == plan["prunes"]
    left = {p.name for p in cl.backups.iterdir()}
    assert left.isdisjoint(Path(p).name for p in plan["prunes"])
    assert set(before) - left == {Path(p).name for p in plan["prunes"]} and len(left) == 4  # 11-16 and the new one
