"""Accounting on a real Slurm: MariaDB, slurmdbd, slurmctld and slurmd started by the tests
(``slurm_acct_cluster``), two real Unix users and root, the node's two fake GPUs.

``det-lab slurm accounts`` makes the accounts, members and QOS; Slurm then enforces them: a
member's second run waits on their GPU limit and its reason reads in words, a request beyond the
limit is refused at submission, the user with less usage starts first, ``det-lab usage`` adds up
and joins the run records, records made while slurmdbd was down arrive when it returns, and an
interactive job ends at the lab's limit.

Timing: an interactive allocation and member A's GPU job start when the module starts, so the
interactive limit (1 minute) and the fair-share recalculation (every minute) run out while the
other tests run.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from det_lab.accounting.limits import pending_words
from det_lab.tracking.mlflow_server import free_port
from tests.conftest import Lab
from tests.slurm_cluster import (  # noqa: F401
    TINY,
    SlurmCluster,
    make_slurm_lab,
    slurm_acct_cluster,
    slurm_volume,
)

PID = os.getpid() % 100000
USER_A, USER_B = f"dla{PID}", f"dlb{PID}"
#: a second project of B's, and one that only the sync test adds and removes
SIDE, EXTRA = f"side{PID}", f"extra{PID}"
TINY_SETS = ["--set", "data.det_lab.max_length.batches=10", "--set", "min_validation_period.batches=10",
             "--set", "min_checkpoint_period.batches=10", "--set", "data.det_lab.reporting_batches=5"]


def members(*extra: dict) -> list[dict]:
    return [{"user": "root", "projects": ["vla"], "gpu_limit": 1},
            {"user": USER_A, "projects": ["vla"], "gpu_limit": 2},
            {"user": USER_B, "projects": ["vla", SIDE]}, *extra]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def users() -> list[str]:
    """Two real Unix users, A and B (removed again at the end)."""
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs useradd and runuser (Debian's passwd and util-linux) to make two Unix users")
    made = []
    for name in (USER_A, USER_B):
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", name],
                       check=True, capture_output=True)
        made.append(name)
    yield made
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def acct(tmp_path_factory, slurm_acct_cluster: SlurmCluster, slurm_volume: Path, users) -> dict:
    """The lab on the accounting cluster, its accounts made by a first ``det-lab slurm accounts``, and the
    module's background jobs: root's interactive allocation and A's two-GPU job."""
    tmp = tmp_path_factory.mktemp("slurm-acct-lab")
    cluster = slurm_acct_cluster
    lab = make_slurm_lab(tmp, None, cluster, slurm_volume)
    slurm_yaml = cluster.slurm_yaml(tmp / "slurm.yaml", members=members(), deny_on_limit=True,
                                    projects={SIDE: {"gpu_limit": 1}})
    lab.env["DET_LAB_SLURM_CONFIG"] = str(slurm_yaml)
    first = lab.cli("slurm", "accounts")
    assert first.returncode == 0, first.stdout + first.stderr
    interactive = cluster.run("salloc", "--no-shell", "-A", "root", "-J", "idle-shell")
    a_job = as_user(cluster, USER_A, "--gres=gpu:2", "-J", "a-usage", "--wrap", "sleep 8")
    return {"lab": lab, "cluster": cluster, "tmp": tmp, "slurm_yaml": slurm_yaml, "first_sync": first,
            "interactive": interactive, "interactive_started": time.monotonic(), "a_job": a_job}


def as_user(cluster: SlurmCluster, user: str, *args: str) -> str:
    """``sbatch ARGS`` as Unix user ``user``; the job id."""
    proc = subprocess.run(["runuser", "-u", user, "--", "sbatch", "--parsable", "-D", "/tmp", "-o", "/dev/null",
                           *args], env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def sacctmgr_state(cluster: SlurmCluster) -> str:
    return "\n".join(cluster.run("sacctmgr", "-n", "-P", "show", what, *fmt).stdout for what, *fmt in (
        ("assoc", "format=Account,User,Fairshare,GrpTRES,QOS,DefaultQOS"), ("qos", "format=Name,MaxTRESPU,Flags"),
        ("user", "format=User,DefaultAccount")))


def assocs(cluster: SlurmCluster) -> set[tuple[str, str]]:
    out = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "format=Account,User").stdout
    return {tuple(line.split("|")) for line in out.splitlines() if line.strip()}


def job(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def sacct(cluster: SlurmCluster, *job_ids: str) -> dict[str, dict[str, str]]:
    out = cluster.run("sacct", "-a", "-X", "-P", "-n", "-j", ",".join(job_ids),
                      "--format=JobIDRaw,User,Account,State,ElapsedRaw,Start,End,AllocTRES").stdout
    keys = ("id", "user", "account", "state", "elapsed", "start", "end", "tres")
    return {r["id"]: r for r in (dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip())}


def test_accounts_match_the_config_idempotently_and_leave_root_and_foreign_accounts(acct):
    lab, cluster = acct["lab"], acct["cluster"]
    first = acct["first_sync"].stdout
    assert "add QOS det-lab-gpu1-deny" in first and "add QOS det-lab-gpu2-deny" in first
    assert f"add user {USER_B} to account {SIDE}" in first and "add account vla" in first
    have = assocs(cluster)
    assert {("vla", "root"), ("vla", USER_A), ("vla", USER_B), (SIDE, USER_B), ("root", "root")} <= have
    qos = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", f"user={USER_A}", "format=QOS,DefaultQOS").stdout
    assert qos.strip() == "det-lab-gpu2-deny|det-lab-gpu2-deny"

    again = lab.cli("slurm", "accounts", check=True)
    assert "already match the lab config: nothing to change" in again.stdout

    # an account and association made by hand, and a config with an extra project and a member with no Unix user
    cluster.run("sacctmgr", "-i", "add", "account", f"byhand{PID}", "Description=made by hand")
    cluster.run("sacctmgr", "-i", "add", "user", USER_B, f"account=byhand{PID}")
    ghost = f"ghost{PID}"
    bigger = acct["tmp"] / "slurm-bigger.yaml"
    cluster.slurm_yaml(bigger, members=members({"user": ghost, "projects": [EXTRA]}), deny_on_limit=True,
                       projects={SIDE: {"gpu_limit": 1}, EXTRA: {"gpu_limit": 1}})
    env = {"DET_LAB_SLURM_CONFIG": str(bigger)}
    before = sacctmgr_state(cluster)
    dry = lab_cli(lab, env, "slurm", "accounts", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would add account {EXTRA} (fairshare 1, the project at most 1 GPU)" in dry.stdout
    assert f"would add user {ghost} to account {EXTRA}" in dry.stdout
    assert f"warning: member {ghost} is not a Unix user" in dry.stderr
    assert sacctmgr_state(cluster) == before  # a dry run changes nothing

    assert lab_cli(lab, env, "slurm", "accounts").returncode == 0
    assert {(EXTRA, ""), (EXTRA, ghost)} <= assocs(cluster)
    grp = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", f"account={EXTRA}", "user=", "format=User,GrpTRES")
    assert "|gres/gpu=1" in grp.stdout

    # back to the lab's config: the member and the project leave; root and the hand-made account stay
    removed = lab.cli("slurm", "accounts", check=True).stdout
    assert f"remove user {ghost} (no longer a member)" in removed and f"remove account {EXTRA}" in removed
    have = assocs(cluster)
    assert not {a for a in have if EXTRA in a or ghost in a}
    assert {("root", "root"), ("root", ""), (f"byhand{PID}", USER_B), (f"byhand{PID}", "")} <= have
    assert "nothing to change" in lab.cli("slurm", "accounts", check=True).stdout

    # a project whose account exists but was made by hand is refused, not taken over
    clash = acct["tmp"] / "slurm-clash.yaml"
    cluster.slurm_yaml(clash, members=[*members()[:2], {"user": USER_B, "projects": ["vla", SIDE, f"byhand{PID}"]}],
                       deny_on_limit=True, projects={SIDE: {"gpu_limit": 1}})
    before = sacctmgr_state(cluster)
    proc = lab_cli(lab, {"DET_LAB_SLURM_CONFIG": str(clash)}, "slurm", "accounts")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: account byhand{PID} exists in Slurm but det-lab did not make it: rename the project or remove "
        f"the account by hand (sacctmgr delete account byhand{PID})"]
    assert sacctmgr_state(cluster) == before


def lab_cli(lab: Lab, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    other = Lab(lab.root, lab.config, {**lab.env, **env})
    return other.cli(*args)


@pytest.mark.parametrize("change, key", [
    ({"members": [{"user": "root", "projects": ["vla"], "gpu_limit": "two"}]}, "accounting.members[root].gpu_limit"),
    ({"members": [{"user": "root", "projects": ["Vla Team"]}]}, "accounting.members[root].projects"),
    ({"projects": {"vla": {"gpu_limit": -1}}}, "accounting.projects.vla.gpu_limit"),
    ({"defaults": {"gpus": 1}}, "accounting.defaults.gpus"),
])
def test_a_bad_accounting_value_is_one_line_and_changes_nothing(acct, change, key):
    bad = acct["tmp"] / "slurm-bad.yaml"
    acct["cluster"].slurm_yaml(bad, **change)
    before = sacctmgr_state(acct["cluster"])
    proc = lab_cli(acct["lab"], {"DET_LAB_SLURM_CONFIG": str(bad)}, "slurm", "accounts")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and key in line, line
    assert sacctmgr_state(acct["cluster"]) == before


def _runs_dir(lab: Lab) -> Path:
    return lab.root / "outputs" / "vla" / "slurm-runs"


def _submit(lab: Lab, *args: str) -> Path:
    before = set(_runs_dir(lab).glob("*"))
    proc = lab.cli("run", str(TINY), "--slurm", *TINY_SETS, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = set(_runs_dir(lab).glob("*")) - before
    return run_dir


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_a_members_second_run_waits_on_their_gpu_limit_and_starts_after_the_first(acct):
    lab, cluster = acct["lab"], acct["cluster"]
    # beyond the limit: refused before anything is made, in one line naming the limit
    _runs_dir(lab).mkdir(parents=True, exist_ok=True)
    before = set(_runs_dir(lab).iterdir())
    proc = lab.cli("run", str(TINY), "--slurm", *TINY_SETS, "--set", "resources.slots_per_trial=2")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "asks for 2 GPUs, but root may hold at most 1" in line and "MaxTRESPerUser=gres/gpu=1" in line, line
    assert set(_runs_dir(lab).iterdir()) == before
    # and Slurm itself refuses it at submission (DenyOnLimit on the QOS det-lab made)
    refused = cluster.run("sbatch", "-A", "vla", "--gres=gpu:2", "-o", "/dev/null", "--wrap", "true", check=False)
    assert refused.returncode != 0 and "QOSMaxGRESPerUser" in refused.stderr

    # the first trains long enough (2.5 s a batch) to hold its GPU while the second's wait is read
    # below, even on a loaded machine (a short first run let the second start between two reads)
    first, second = _submit(lab, "--set", "hyperparameters.sleep_per_batch=2.5"), _submit(lab)
    first_id, second_id = _state(first)["slurm"]["job_id"], _state(second)["slurm"]["job_id"]
    assert "#SBATCH --account=vla" in (first / "job.sbatch").read_text()
    wait_until(lambda: job(cluster, first_id).get("JobState") == "RUNNING", 60, "the first run to start")
    wait_until(lambda: job(cluster, second_id)["Reason"] != "None", 15, "the scheduler to look at the second run")
    assert job(cluster, second_id)["Reason"] == "QOSMaxGRESPerUser"
    words = "waiting: root already uses 1 of their 1 GPU (QOSMaxGRESPerUser)"
    rows = {r["name"]: r for r in map(json.loads, lab.cli("runs", "list", "--json", check=True).stdout.splitlines())}
    assert rows[second.name]["status"] == "pending" and rows[second.name]["waiting"] == words
    assert rows[first.name]["waiting"] is None and rows[first.name]["user"] == "root"
    assert words.removeprefix("waiting: ") in lab.cli("runs", "show", second.name, check=True).stdout
    mine = lab.cli("runs", "list", "--user", "root", "--json", check=True).stdout
    assert {first.name, second.name} <= {json.loads(x)["name"] for x in mine.splitlines()}
    assert lab.cli("runs", "list", "--user", USER_A, "--json", check=True).stdout == ""

    wait_until(lambda: _state(second).get("status") == "finished" and _state(first).get("status") == "finished",
               180, "both runs to finish")
    jobs = wait_until(lambda: (j := sacct(cluster, first_id, second_id)) and all(
        r["end"] != "Unknown" for r in j.values()) and len(j) == 2 and j, 30, "both jobs in sacct")
    assert jobs[second_id]["start"] >= jobs[first_id]["end"]  # it started only once the first had ended
    acct["runs"] = (first, second)


def test_a_projects_gpu_limit_holds_across_its_members_jobs(acct, monkeypatch):
    cluster = acct["cluster"]
    assert f"add account {SIDE} (fairshare 1, the project at most 1 GPU)" in acct["first_sync"].stdout
    first = as_user(cluster, USER_B, "-A", SIDE, "--gres=gpu:1", "--wrap", "sleep 4")
    second = as_user(cluster, USER_B, "-A", SIDE, "--gres=gpu:1", "--wrap", "sleep 1")
    wait_until(lambda: job(cluster, first).get("JobState") == "RUNNING", 60, "the first job")
    wait_until(lambda: job(cluster, second)["Reason"] != "None", 15, "the scheduler to look at the second job")
    waiting = job(cluster, second)
    assert waiting["Reason"] == "AssocGrpGRES"
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    assert pending_words(waiting) == f"waiting: project {SIDE} already uses 1 of its 1 GPU (AssocGrpGRES)"
    wait_until(lambda: job(cluster, second).get("JobState") == "COMPLETED", 60, "the second job")
    assert job(cluster, second)["StartTime"] >= job(cluster, first)["EndTime"]


def test_usage_lists_every_run_joined_to_its_record_and_adds_up(acct):
    lab, cluster = acct["lab"], acct["cluster"]
    if "runs" not in acct:
        pytest.skip("needs the runs of the GPU-limit test")
    first, second = acct["runs"]
    ids = {_state(r)["slurm"]["job_id"]: r for r in (first, second)}
    wait_until(lambda: sacct(cluster, acct["a_job"]).get(acct["a_job"], {}).get("state") == "COMPLETED", 60,
               "A's job in sacct")
    damaged = lab.root / "outputs" / "vla" / "local-runs" / "cut-short"  # another run's record, cut short
    damaged.mkdir(parents=True)
    (damaged / "run.json").write_text('{"name": "cut-short", "exp_conf": {"na')
    try:
        usage = lab.cli("usage", "--since", "1h", "--json", check=True)
    finally:
        shutil.rmtree(damaged)
    assert usage.stderr.count("warning:") == 1 and str(damaged / "run.json") in usage.stderr
    report = json.loads(usage.stdout)
    by_id = {j["job_id"]: j for j in report["jobs"]}
    for job_id, run_dir in ids.items():
        j, st = by_id[job_id], _state(run_dir)
        assert (j["user"], j["account"], j["gpus"], j["state"]) == ("root", "vla", 1, "COMPLETED")
        assert (j["run"], j["template"], j["project"]) == (run_dir.name, "tiny", "vla")
        meta = json.loads((lab.root / "checkpoints" / "vla" / st["latest_checkpoint"] / "metadata.json").read_text())
        assert j["code_commit"] == meta["det_lab"]["code_commit"]
        assert meta["det_lab"]["dataset"]["md5"][:12] in j["dataset"] and "tiny" in j["dataset"]
        assert j["gpu_hours"] == pytest.approx(j["elapsed_s"] / 3600, abs=1e-6) and j["elapsed_s"] > 0
    a = by_id[acct["a_job"]]
    assert (a["user"], a["account"], a["gpus"], a["run"]) == (USER_A, "vla", 2, None)
    assert 8 <= a["elapsed_s"] <= 12  # sleep 8
    assert a["gpu_hours"] == pytest.approx(2 * a["elapsed_s"] / 3600, abs=1e-6)
    summary = {r["user"]: r for r in report["summary"]}
    for user in ("root", USER_A):
        jobs = [j for j in report["jobs"] if j["user"] == user]
        assert summary[user]["jobs"] == len(jobs)
        assert summary[user]["gpu_hours"] == pytest.approx(sum(j["gpu_hours"] for j in jobs), abs=1e-5)
    assert summary["root"]["runs"] >= 2 and summary[USER_A]["runs"] == 0

    by_project = json.loads(lab.cli("usage", "--since", "1h", "--by", "project", "--json", check=True).stdout)
    assert sum(r["jobs"] for r in by_project["summary"]) == len(report["jobs"])
    rows = list(csv.DictReader(io.StringIO(lab.cli("usage", "--since", "1h", "--csv", check=True).stdout)))
    assert {r["job_id"] for r in rows} == set(by_id) and {r["run"] for r in rows} >= {first.name, second.name}
    table = lab.cli("usage", "--since", "1h", "--by", "template", check=True).stdout
    assert "tiny" in table and first.name in table

    bad = lab.cli("usage", "--since", "last tuesday")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --since 'last tuesday': give a period (30d, 12h, 2w, 90m) or a date (2026-11-01)"]


def test_jobs_run_while_slurmdbd_is_down_and_their_records_arrive_after(acct):
    lab, cluster = acct["lab"], acct["cluster"]
    running = cluster.run("sbatch", "--parsable", "-A", "vla", "--gres=gpu:1", "-o", "/dev/null",
                          "--wrap", "sleep 5").stdout.strip()
    wait_until(lambda: job(cluster, running).get("JobState") == "RUNNING", 60, "the job to start")
    cluster.stop_daemon("slurmdbd")
    try:
        down = lab.cli("slurm", "accounts")
        assert down.returncode == 2 and len(down.stderr.strip().splitlines()) == 1
        assert down.stderr.startswith("error: sacctmgr") and "slurmdbd" in down.stderr
        usage = lab.cli("usage", "--since", "1h")
        assert usage.returncode == 2 and usage.stderr.startswith("error: sacct")
        # a job submitted and run while slurmdbd is away
        later = cluster.run("sbatch", "--parsable", "-A", "vla", "-o", "/dev/null", "--wrap", "sleep 2").stdout.strip()
        wait_until(lambda: job(cluster, running).get("JobState") == "COMPLETED"
                   and job(cluster, later).get("JobState") == "COMPLETED", 60, "both jobs to complete")
    finally:
        cluster.start_daemon("slurmdbd")
        cluster.wait_dbd()
    records = wait_until(lambda: (r := sacct(cluster, running, later)) and len(r) == 2 and all(
        x["state"] == "COMPLETED" and x["end"] != "Unknown" for x in r.values()) and r, 90, "the records")
    assert 5 <= int(records[running]["elapsed"]) <= 8 and "gres/gpu=1" in records[running]["tres"]
    assert 2 <= int(records[later]["elapsed"]) <= 5 and records[later]["account"] == "vla"


def test_mariadb_unreachable_is_one_line_and_applies_nothing(acct):
    lab, cluster = acct["lab"], acct["cluster"]
    change = acct["tmp"] / "slurm-change.yaml"
    more = [m if m["user"] != USER_B else {**m, "projects": [*m["projects"], EXTRA]} for m in members()]
    cluster.slurm_yaml(change, members=more, deny_on_limit=True, projects={SIDE: {"gpu_limit": 1}})
    cluster.stop_daemon("mariadbd")
    try:
        for args in (("slurm", "accounts"), ("usage", "--since", "1h")):
            proc = lab_cli(lab, {"DET_LAB_SLURM_CONFIG": str(change)}, *args)
            assert proc.returncode == 2 and proc.stdout == "", proc.stdout
            (line,) = proc.stderr.strip().splitlines()
            assert line.startswith("error: sacct") and "Unable to connect to database" in line, line
        (doctor,) = [c for c in json.loads(lab.cli("doctor", "--json").stdout)["checks"]
                     if c["name"] == "slurm accounting"]
        assert doctor["status"] == "warn" and "Unable to connect to database" in doctor["detail"]
    finally:
        cluster.start_daemon("mariadbd")
    cluster.wait_dbd(60)
    assert not {a for a in assocs(cluster) if EXTRA in a}  # nothing of the change was made
    assert "nothing to change" in lab.cli("slurm", "accounts", check=True).stdout
    (doctor,) = [c for c in json.loads(lab.cli("doctor", "--json").stdout)["checks"] if c["name"] == "slurm accounting"]
    assert (doctor["status"], doctor["detail"]) == ("pass", "slurmdbd answers; cluster detlabacct registered")


def _sshare(cluster: SlurmCluster) -> dict[str, float]:
    out = cluster.run("sshare", "-A", "vla", "-a", "-P", "-n", "-o", "User,FairShare").stdout
    return {u: float(f) for u, f in (line.split("|") for line in out.splitlines()) if u and f}


def test_the_member_who_used_less_starts_first(acct):
    cluster = acct["cluster"]
    # A used two GPUs for 8 s when the module started; B nothing: fair-share is recalculated every minute
    wait_until(lambda: (s := _sshare(cluster)) and s.get(USER_A, 1) < s.get(USER_B, 0), 90, "A's usage to count")
    blocker = cluster.run("sbatch", "--parsable", "-A", "root", "--gres=gpu:2", "-o", "/dev/null",
                          "--wrap", "sleep 300").stdout.strip()
    try:
        wait_until(lambda: job(cluster, blocker).get("JobState") == "RUNNING", 60, "the blocker")
        a = as_user(cluster, USER_A, "--gres=gpu:2", "-J", "a-second", "--wrap", "sleep 2")  # A asks first
        b = as_user(cluster, USER_B, "--gres=gpu:2", "-J", "b-first", "--wrap", "sleep 2")
        assert int(job(cluster, b)["Priority"]) > int(job(cluster, a)["Priority"])
    finally:
        cluster.run("scancel", blocker)
    wait_until(lambda: job(cluster, b).get("JobState") in ("RUNNING", "COMPLETED"), 60, "B's job to start")
    pending = job(cluster, a)
    assert pending["JobState"] == "PENDING"  # both GPUs are B's: A's waits behind it, and says so
    assert pending_words(pending) in ("waiting: no free GPUs or CPUs yet (Resources)",
                                      ("waiting: other jobs come first (fair-share: whoever used the GPUs least "
                                       "lately) (Priority)"))
    wait_until(lambda: job(cluster, a).get("JobState") == "COMPLETED", 60, "A's job")
    assert job(cluster, b)["StartTime"] <= job(cluster, a)["StartTime"]


def test_an_idle_interactive_job_ends_at_the_lab_limit(acct):
    cluster, salloc = acct["cluster"], acct["interactive"]
    assert "interactive job: time limit 1 min" in salloc.stderr
    job_id = salloc.stderr.split("Granted job allocation ")[1].split()[0]
    out = cluster.run("sacct", "-X", "-P", "-n", "-j", job_id, "--format=Timelimit,JobName").stdout.strip()
    assert out == "00:01:00|idle-shell"
    # a batch job is not capped: it keeps the partition's default time limit
    assert job(cluster, acct["a_job"])["TimeLimit"] == "1-00:00:00"
    wait_until(lambda: sacct(cluster, job_id)[job_id]["state"] == "TIMEOUT",
               max(10, 120 - (time.monotonic() - acct["interactive_started"])), "the idle allocation to end")
    elapsed = int(sacct(cluster, job_id)[job_id]["elapsed"])
    assert 60 <= elapsed <= 100


def test_usage_join_reads_lineage_only_for_jobs_in_the_period_and_survives_damaged_metadata(tmp_path):
    """No cluster: join with records another run wrote, one of them with a damaged metadata.json."""
    from det_lab.accounting.usage import JobRecord, join

    def job(job_id: str) -> JobRecord:
        return JobRecord(job_id, "j", "root", "vla", "normal", "gpu", "COMPLETED", 1, 60, "", "", "0:0")

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metadata.json").write_text('{"det_lab": {"code_commit": "ab')  # cut off mid-write
    conf = {"data": {"det_lab": {"project": "vla", "dataset": "tiny"}}}
    runs = [({"name": "old", "template": "t", "exp_conf": conf, "latest_checkpoint": "missing",
              "slurm": {"job_id": 7}}, tmp_path),  # its job is outside the period: not joined
            ({"name": "now", "template": "t", "exp_conf": conf, "latest_checkpoint": "damaged",
              "slurm": {"job_id": 8, "attempts": [{"job_id": 8}, {"job_id": 9}]}}, tmp_path)]
    jobs = join([job("8"), job("9"), job("10")], runs)
    assert [(j.run, j.dataset, j.code_commit) for j in jobs] == [
        ("now", "tiny", None), ("now", "tiny", None), (None, None, None)]
    # a record edited by hand, its data section emptied to null (YAML's "data:"): joined, without a project
    bare = {"name": "bare", "template": "t", "exp_conf": {"data": None}, "slurm": {"job_id": 11}}
    (joined,) = join([job("11")], [(bare, None)])
    assert (joined.run, joined.project, joined.dataset) == ("bare", None, None)


def test_a_slurm_yaml_naming_no_cluster_uses_the_running_clusters_name(acct):
    """A slurm.yaml without cluster_name (a cluster det_lab did not configure): the accounts go to the
    cluster slurmdbd runs (scontrol show config's ClusterName), already in place here, so nothing
    changes (it used to add a cluster named det-lab and make the accounts there, exit 0); with no
    cluster answering, or a cluster_name that is not the running cluster's, one line and no change."""
    import yaml

    cluster = acct["cluster"]
    unnamed = acct["tmp"] / "slurm-unnamed.yaml"
    cluster.slurm_yaml(unnamed, members=members(), deny_on_limit=True, projects={SIDE: {"gpu_limit": 1}})
    data = yaml.safe_load(unnamed.read_text())
    data.pop("cluster_name")
    unnamed.write_text(yaml.safe_dump(data, sort_keys=False))
    before = sacctmgr_state(cluster)
    clusters = cluster.run("sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster").stdout.split()
    synced = lab_cli(acct["lab"], {"DET_LAB_SLURM_CONFIG": str(unnamed)}, "slurm", "accounts")
    assert synced.returncode == 0, synced.stderr
    assert "already match the lab config: nothing to change" in synced.stdout
    assert f"on cluster {cluster.settings.cluster_name}" in synced.stdout
    assert cluster.run("sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster").stdout.split() == clusters
    assert sacctmgr_state(cluster) == before

    # slurm.conf naming a controller that does not answer (a port nobody listens on): scontrol gives up
    # after its MessageTimeout retries. No slurm.conf at all is no faster here: scontrol then looks up
    # configless mode's DNS SRV record, which this sandbox's resolver never answers (59 s).
    dead = acct["tmp"] / "dead-controller.conf"
    dead.write_text(re.sub(r"(?m)^SlurmctldPort=.*$", f"SlurmctldPort={free_port()}", cluster.conf.read_text()))
    gone = lab_cli(acct["lab"], {"DET_LAB_SLURM_CONFIG": str(unnamed), "SLURM_CONF": str(dead)}, "slurm", "accounts")
    assert gone.returncode == 2 and gone.stderr.strip().splitlines() == [
        f"error: {unnamed} names no cluster_name and scontrol show config did not answer: set cluster_name: to "
        f"slurm.conf's ClusterName"]
    wrong = acct["tmp"] / "slurm-wrong.yaml"
    wrong.write_text(yaml.safe_dump({**data, "cluster_name": "elsewhere"}, sort_keys=False))
    refused = lab_cli(acct["lab"], {"DET_LAB_SLURM_CONFIG": str(wrong)}, "slurm", "accounts")
    assert refused.returncode == 2 and "but the running Slurm cluster is " + cluster.settings.cluster_name \
        in refused.stderr, refused.stderr
    assert sacctmgr_state(cluster) == before
