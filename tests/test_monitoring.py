"""Monitoring on the real thing: det-lab's exporter scraped by a real Prometheus 2.42 on loopback,
over the Slurm test cluster (two users' jobs, one pending), a volume with published data and
checkpoints, a running run and a run whose tracker events were never delivered; the rendered
config and rules checked and unit-tested by promtool; every shipped dashboard panel queried.

What cannot run here: NVML (no NVIDIA driver: the GPU source's absence is tested, its presence is
not), a Determined master and dcgm-exporter (their series are promtool input series), Grafana
(its files are checked for what Grafana reads: the datasource uid each panel names).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from det_lab.tracking.mlflow_server import free_port
from tests.conftest import VENV_BIN, Lab, publish_tiny_data
from tests.monitoring_alert_cases import CASES, promtool_tests
from tests.slurm_cluster import SlurmCluster, slurm_acct_cluster, slurm_cluster  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
#: where the README's pictures come from: set to a directory to keep this run's report there
DOCS_ENV = "MONITORING_REPORT_OUT"
CHECKPOINT_BYTES = 3 << 20


def _need_prometheus() -> None:
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs Debian's prometheus package ({tool}): tests/setup.sh installs it")


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a /metrics page via prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for n, labels, value in parse_exposition(text) if n == name]


# --- a lab: volume, runs, a journal, Slurm jobs ----------------------------------------------------

@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    tmp = tmp_path_factory.mktemp("monitor-lab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg"), COLUMNS="200")
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    # a tracker nobody serves: the journal's events stay undelivered
    lab.write_config(projects={"3dgs": {"quota": "4MiB"}},
                     tracking={"backend": "mlflow", "mlflow_uri": f"http://127.0.0.1:{free_port()}"})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)  # vla: a DVC remote
    from det_lab.data.pull import pull
    from det_lab.data.registry import lookup

    pull(lookup(settings, "tiny-data"), settings, progress=False)  # the shared cache and a snapshot
    ckpt = lab.root / "checkpoints" / "3dgs" / "exp-1" / "state.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(os.urandom(CHECKPOINT_BYTES))
    _make_runs(lab.root)
    return lab


def _make_runs(root: Path) -> None:
    """A Slurm run that trains (status running) but last reported 40 min ago, with 25 events its
    tracker never got; and a finished local run."""
    from det_lab.slurm.record import SlurmRunRecord
    from det_lab.tracking.events import Metrics, RunInfo
    from det_lab.tracking.journal import Journal
    from det_lab.runs.record import LocalRunRecord

    running = SlurmRunRecord(root / "outputs" / "vla" / "slurm-runs" / "vla-hung-1")
    running.dir.mkdir(parents=True)
    running.save({"kind": "slurm", "name": "vla-hung-1", "template": "vla-act", "status": "running",
                  "slurm": {"job_id": "999"}})
    running.append_metrics("training", 10, {"loss": 0.5})
    old = time.time() - 2400
    os.utime(running.metrics_file, (old, old))
    journal = Journal(running.journal_dir)
    journal.describe_run(RunInfo("slurm-vla-hung-1", "vla-hung-1"), {"mlflow": "http://127.0.0.1:9/"})
    journal.append([Metrics("training", s, {"loss": 1.0 / s}, timestamp=time.time() - 1200 + s) for s in range(1, 26)])
    journal.close()
    done = LocalRunRecord(root / "outputs" / "3dgs" / "local-runs" / "splat-done")
    done.dir.mkdir(parents=True)
    done.save({"kind": "local", "name": "splat-done", "template": "3dgs-splat", "status": "finished"})


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):  # noqa: F811
    """root and nobody each run a 1-GPU job (both fake GPUs taken); root's 2-GPU job pends on Resources."""
    import tempfile

    # nobody's job writes its output here: pytest's own tmp tree is root's alone (0700)
    out = Path(tempfile.mkdtemp(prefix="det-lab-monitor-jobs-", dir="/tmp"))
    out.chmod(0o1777)
    # and slurmd runs its batch script from the cluster's spool, under pytest's tmp tree: let nobody
    # pass through (search only, no listing) while the jobs run
    opened = {}
    for d in [*reversed((slurm_cluster.dir / "spool").parents), slurm_cluster.dir / "spool"]:
        mode = d.stat().st_mode & 0o7777
        if d.is_relative_to(Path(tempfile.gettempdir())) and d != Path(tempfile.gettempdir()) and not mode & 0o001:
            opened[d] = mode
            d.chmod(mode | 0o001)

    def submit(*args: str) -> str:
        proc = slurm_cluster.run("sbatch", "--parsable", "-o", str(out / "%j.out"), *args)
        return proc.stdout.strip().split(";")[0]

    try:
        yield from _run_jobs(slurm_cluster, submit)
    finally:
        for d, mode in opened.items():
            d.chmod(mode)
        shutil.rmtree(out, ignore_errors=True)


def _run_jobs(slurm_cluster, submit):  # noqa: F811
    ids = {"root": submit("--gres=gpu:1", "-J", "mon-root", "--wrap", "sleep 600"),
           "nobody": submit("--uid=nobody", "--gid=nogroup", "--chdir=/tmp", "--gres=gpu:1", "-J", "mon-nobody", "--wrap", "sleep 600")}
    deadline = time.monotonic() + 60
    while True:
        states = dict(line.split() for line in slurm_cluster.run("squeue", "-h", "--states=all", "-o", "%i %T").stdout.splitlines())
        if all(states.get(i) == "RUNNING" for i in ids.values()):
            break
        if time.monotonic() > deadline or any(states.get(i) not in ("PENDING", "CONFIGURING", "RUNNING") for i in ids.values()):
            raise AssertionError(f"the two users' jobs did not both run: {states}\n{slurm_cluster.log_tail()}")
        time.sleep(0.5)
    try:
        ids["pending"] = submit("--gres=gpu:2", "-J", "mon-wait", "--wrap", "sleep 600")
        deadline = time.monotonic() + 30
        while slurm_cluster.run("squeue", "-h", "-j", ids["pending"], "-o", "%r").stdout.strip() != "Resources":
            assert time.monotonic() < deadline, "the 2-GPU job never pended on Resources"
            time.sleep(0.5)  # a job just submitted has no reason until the scheduler has looked at it
        yield ids
    finally:
        for job in ids.values():
            slurm_cluster.run("scancel", job, check=False)


ACCT_ID = os.getpid() % 100000
ACCT_USER, ACCT_ACCOUNT, ACCT_QOS = f"dlm{ACCT_ID}", f"mon{ACCT_ID}", f"mon{ACCT_ID}gpu1"


@pytest.fixture(scope="module")
def acct_jobs(slurm_acct_cluster: SlurmCluster):  # noqa: F811
    """On the accounting cluster (slurmdbd + MariaDB): a real Unix user under a QOS of one GPU per user,
    whose first 1-GPU job runs and second pends on that limit (QOSMaxGRESPerUser)."""
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs useradd and runuser (Debian's passwd and util-linux) to make a Unix user")
    cluster = slurm_acct_cluster
    env = {**os.environ, **cluster.env}
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", ACCT_USER],
                   check=True, capture_output=True)
    jobs: list[str] = []
    try:
        cluster.run("sacctmgr", "-i", "add", "account", ACCT_ACCOUNT, "Description=monitoring", "Organization=det-lab")
        cluster.run("sacctmgr", "-i", "add", "qos", ACCT_QOS, "MaxTRESPerUser=gres/gpu=1")
        cluster.run("sacctmgr", "-i", "add", "user", ACCT_USER, f"Account={ACCT_ACCOUNT}", f"QOS={ACCT_QOS}",
                    f"DefaultQOS={ACCT_QOS}")
        for name in ("first", "second"):
            proc = subprocess.run(["runuser", "-u", ACCT_USER, "--", "sbatch", "--parsable", "-D", "/tmp", "-o", "/dev/null",
                                   "-A", ACCT_ACCOUNT, "--qos", ACCT_QOS, "--gres=gpu:1", "-J", f"mon-{name}",
                                   "--wrap", "sleep 600"], env=env, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            jobs.append(proc.stdout.strip().split(";")[0])
        deadline = time.monotonic() + 60
        while True:
            states = [cluster.run("squeue", "-h", "-j", j, "-o", "%T %r").stdout.split() for j in jobs]
            if states == [["RUNNING", "None"], ["PENDING", "QOSMaxGRESPerUser"]]:
                break
            assert time.monotonic() < deadline, f"jobs of {ACCT_USER}: {states}"
            time.sleep(0.5)
        yield {"cluster": cluster, "env": env, "running": jobs[0], "pending": jobs[1]}
    finally:
        for j in jobs:
            cluster.run("scancel", j, check=False)
        deadline = time.monotonic() + 30
        while jobs and cluster.run("squeue", "-h", "-j", ",".join(jobs), check=False).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        cluster.run("sacctmgr", "-i", "delete", "user", ACCT_USER, check=False)
        cluster.run("sacctmgr", "-i", "delete", "qos", ACCT_QOS, check=False)
        cluster.run("sacctmgr", "-i", "delete", "account", ACCT_ACCOUNT, check=False)
        subprocess.run(["userdel", ACCT_USER], capture_output=True)


def start_exporter(env: dict[str, str], *sources: str):
    """``det-lab exporter`` as a user starts it, on a loopback port; (url, process)."""
    port = free_port()
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "exporter", "--port", str(port), "--address", "127.0.0.1",
                             *(a for s in sources for a in ("--source", s))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 30
    while True:
        try:
            _get(url)
            return url, proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"exporter did not start: {proc.communicate()[0]}") from None
            time.sleep(0.3)


def stop_exporter(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)


@pytest.fixture(scope="module")
def acct_exporter(lab, acct_jobs):
    """A second exporter, of the accounting cluster's queue only."""
    url, proc = start_exporter({**lab.env, **acct_jobs["cluster"].env}, "slurm")
    yield url
    stop_exporter(proc)


@pytest.fixture(scope="module")
def exporter(lab, slurm_cluster, jobs):  # noqa: F811
    """``det-lab exporter`` as a user starts it, every source, on a loopback port."""
    url, proc = start_exporter({**lab.env, **slurm_cluster.env}, "gpus", "slurm", "volume", "runs", "trackers")
    yield url
    stop_exporter(proc)


@pytest.fixture(scope="module")
def rendered(lab, exporter, tmp_path_factory) -> Path:
    """``det-lab monitor config`` for this lab, with a master and two GPU machines named."""
    out = tmp_path_factory.mktemp("monitor-config")
    lab_exporter = urllib.parse.urlparse(exporter).netloc
    cfg = yaml.safe_load(lab.config.read_text())
    cfg["master_url"] = "http://det-master:8080"
    lab.config.write_text(yaml.safe_dump(cfg))
    try:
        proc = lab.cli("monitor", "config", "--out", str(out), "--lab-exporter", lab_exporter,
                       "--machine", "gpu-a", "--machine", "gpu-b", "--scrape-interval", "2s",
                       "--tsdb", str(out / "tsdb"), check=True)
    finally:
        del cfg["master_url"]
        lab.config.write_text(yaml.safe_dump(cfg))
    assert "promtool check config" in proc.stdout
    return out


@pytest.fixture(scope="module")
def prometheus(rendered, exporter, acct_exporter, tmp_path_factory):
    """A real Prometheus on loopback with the rendered rules, scraping the lab exporter and the accounting
    cluster's (the other rendered targets are machines that do not exist here)."""
    _need_prometheus()
    tmp = tmp_path_factory.mktemp("prometheus")
    conf = yaml.safe_load((rendered / "prometheus" / "prometheus.yml").read_text())
    conf["scrape_configs"] = [j for j in conf["scrape_configs"] if j["job_name"] == "det-lab"]
    conf["scrape_configs"][0]["static_configs"].append(
        {"targets": [urllib.parse.urlparse(acct_exporter).netloc], "labels": {"role": "lab", "cluster": "acct"}})
    conf["rule_files"] = [str(rendered / "prometheus" / f) for f in conf["rule_files"]]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(conf))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        # both exporters scraped and the recording rules evaluated over both
        while not all(_has(url, e) for e in (f'lab:user_gpus_allocated:sum{{user="{ACCT_USER}"}}',
                                             'lab:user_gpus_allocated:sum{user="nobody"}',
                                             "lab:project_quota_used:ratio")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"Prometheus had no data from the exporter:\n{(tmp / 'prometheus.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _has(url: str, expr: str) -> bool:
    try:
        return bool(query(url, expr))
    except OSError:  # not listening yet
        return False


def query(url: str, expr: str) -> list[dict]:
    body = json.loads(_get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


# --- rendered files -------------------------------------------------------------------------------

def test_rendered_config_and_rules_pass_promtool(rendered):
    _need_prometheus()
    prom = rendered / "prometheus"
    check = subprocess.run(["promtool", "check", "config", str(prom / "prometheus.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, check.stdout + check.stderr
    rules = sorted((prom / "rules").glob("*.yml"))
    assert [r.name for r in rules] == ["det-lab-alerts.yml", "det-lab-recording.yml"]
    check = subprocess.run(["promtool", "check", "rules", *map(str, rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    conf = yaml.safe_load((prom / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    assert jobs["det-lab-node"]["static_configs"][0]["targets"] == ["gpu-a:9540", "gpu-b:9540"]
    assert jobs["dcgm"]["static_configs"][0]["targets"] == ["gpu-a:9400", "gpu-b:9400"]
    assert jobs["node"]["static_configs"][0]["targets"] == ["gpu-a:9100", "gpu-b:9100"]
    for name, path in (("determined-state", "/prom/det-state-metrics"), ("determined-master", "/debug/prom/metrics")):
        assert jobs[name]["metrics_path"] == path and jobs[name]["static_configs"][0]["targets"] == ["det-master:8080"]
        token = prom / jobs[name]["authorization"]["credentials_file"]
        assert token.is_file() and token.stat().st_mode & 0o077 == 0  # the master token stays private
    unit = (rendered / "systemd" / "det-lab-prometheus.service").read_text()
    assert f"--storage.tsdb.path={rendered / 'tsdb'}" in unit and f"--config.file={prom / 'prometheus.yml'}" in unit
    timer = (rendered / "systemd" / "det-lab-monitor-token.timer").read_text()
    assert "OnUnitActiveSec=" in timer
    assert "monitor token --out" in (rendered / "systemd" / "det-lab-monitor-token.service").read_text()
    # Grafana: the datasource's fixed uid is the one every panel names
    ds = yaml.safe_load((rendered / "grafana" / "provisioning" / "datasources" / "det-lab.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    dashboards = sorted((rendered / "grafana" / "dashboards").glob("*.json"))
    assert len(dashboards) == 5
    for path in dashboards:
        for panel in json.loads(path.read_text())["panels"]:
            assert panel["datasource"]["uid"] == uid and panel["targets"][0]["expr"]


def test_each_alert_fires_names_its_subject_and_resolves(rendered, tmp_path):
    """promtool's unit tests: every alert rule has a case (fires, exact labels and summary, resolves)."""
    _need_prometheus()
    alerts = yaml.safe_load((rendered / "prometheus" / "rules" / "det-lab-alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert names == {c[0] for c in CASES}
    rule_files = [str(rendered / "prometheus" / "rules" / f) for f in ("det-lab-recording.yml", "det-lab-alerts.yml")]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(promtool_tests(rule_files), sort_keys=False))
    proc = subprocess.run(["promtool", "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    # and the tests can fail: the same cases against an idle threshold nobody reaches do
    broken = (rendered / "prometheus" / "rules" / "det-lab-alerts.yml").read_text().replace(
        "lab:gpu_holder_utilization:ratio < 0.1", "lab:gpu_holder_utilization:ratio < 0.01")
    (tmp_path / "broken.yml").write_text(broken)
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(promtool_tests([rule_files[0], "broken.yml"]), sort_keys=False))
    proc = subprocess.run(["promtool", "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "alertname: GPUHeldIdle" in proc.stdout + proc.stderr


# --- the live exporter and Prometheus -------------------------------------------------------------

def test_exporter_reports_the_queue_volume_runs_and_backlog(exporter, jobs, lab):
    text = _get(exporter)
    errors = {labels["source"]: value for labels, value in samples(text, "det_lab_scrape_error")}
    assert errors == {"gpus": 0, "slurm": 0, "volume": 0, "runs": 0, "trackers": 0}
    gpus = {labels["job_id"]: (labels["user"], labels["state"], value) for labels, value in samples(text, "det_lab_slurm_job_gpus")}
    assert gpus == {jobs["root"]: ("root", "RUNNING", 1), jobs["nobody"]: ("nobody", "RUNNING", 1),
                    jobs["pending"]: ("root", "PENDING", 2)}
    pending = samples(text, "det_lab_slurm_job_pending_seconds")
    assert [(p["job_id"], p["user"], p["reason"]) for p, _ in pending] == [(jobs["pending"], "root", "Resources")]
    assert {labels["user"]: v for labels, v in samples(text, "det_lab_slurm_user_gpus_allocated")} == {"root": 1, "nobody": 1}
    assert {labels["state"]: v for labels, v in samples(text, "det_lab_slurm_gpus")} == {"allocated": 2, "idle": 0}
    areas = {(labels["project"], labels["area"]): v for labels, v in samples(text, "det_lab_volume_area_bytes")}
    assert areas[("3dgs", "checkpoints")] >= CHECKPOINT_BYTES and areas[("vla", "checkpoints")] == 0
    assert areas[("vla", "datasets")] > 0 and areas[("vla", "dvc-cache")] > 0
    # the snapshot is hard-linked from the cache: counted once, in the cache
    assert areas[("vla", "snapshots")] < areas[("vla", "dvc-cache")]
    assert {l["project"]: v for l, v in samples(text, "det_lab_volume_snapshots")} == {"vla": 1, "3dgs": 0, "isaac": 0}
    from det_lab.settings import load_settings
    from det_lab.volume import VolumeLayout, project_usage

    layout = VolumeLayout.from_settings(load_settings(lab.config, env={}))
    project = {labels["project"]: v for labels, v in samples(text, "det_lab_volume_project_bytes")}
    assert project["vla"] == project_usage(layout, "vla")  # the quota's own figure, hard links once
    assert project["3dgs"] == project_usage(layout, "3dgs")
    runs = {(l["project"], l["kind"], l["template"], l["status"]): v for l, v in samples(text, "det_lab_runs")}
    assert runs == {("vla", "slurm", "vla-act", "running"): 1, ("3dgs", "local", "3dgs-splat", "finished"): 1}
    (age_labels, age), = samples(text, "det_lab_run_last_metric_age_seconds")
    assert age_labels["run"] == "vla-hung-1" and 2390 < age < 2600
    (backlog, n), = samples(text, "det_lab_tracker_undelivered_events")
    assert (backlog["run"], backlog["backend"], n) == ("vla-hung-1", "mlflow", 25)
    (_, oldest), = samples(text, "det_lab_tracker_oldest_undelivered_seconds")
    assert 1150 < oldest < 1400  # the first undelivered event's own time
    assert samples(text, "det_lab_tracker_up") == [({"backend": "mlflow", "target": yaml.safe_load(
        lab.config.read_text())["tracking"]["mlflow_uri"]}, 0)]  # nothing listens there
    assert not samples(text, "det_lab_gpu_utilization_ratio")  # no NVIDIA driver here: no series, no error


def test_every_dashboard_panel_returns_the_series_it_shows(prometheus, rendered, jobs, acct_jobs):
    from det_lab.monitoring.dashboards import panels_of

    results: dict[str, list[dict]] = {}
    needs_absent = []
    for path in sorted((rendered / "grafana" / "dashboards").glob("*.json")):
        for title, expr, labels, needs in panels_of(json.loads(path.read_text())):
            if needs in ("gpu", "determined"):  # a GPU driver, a Determined master: not on this machine
                needs_absent.append((title, needs))
                continue
            deadline = time.monotonic() + 20
            while not (result := query(prometheus, expr)) and time.monotonic() < deadline:
                time.sleep(1)  # a recording rule's first evaluation
            assert result, f"panel {title!r} ({expr}) returned no series"
            for series in result:
                missing = [lbl for lbl in labels if not series["metric"].get(lbl)]
                assert not missing, f"panel {title!r}: a series without {missing}: {series['metric']}"
            results[title] = result
    assert sorted(n for _, n in needs_absent) == ["determined", "gpu", "gpu", "gpu"]
    users = {s["metric"]["user"] for s in results["GPUs allocated per user (Slurm)"]}
    assert {"root", "nobody", ACCT_USER} <= users
    waits = {(s["metric"].get("cluster", "test"), s["metric"]["job_id"], s["metric"]["user"], s["metric"]["reason"])
             for s in results["Pending jobs' wait so far"]}
    assert {("test", jobs["pending"], "root", "Resources"),
            ("acct", acct_jobs["pending"], ACCT_USER, "QOSMaxGRESPerUser")} <= waits
    assert ACCT_USER in {s["metric"]["user"] for s in results["Fair-share per user"]}
    per_project = {s["metric"]["project"]: float(s["value"][1]) for s in results["Bytes per project"]}
    assert per_project["3dgs"] >= CHECKPOINT_BYTES and per_project["vla"] > 0 and per_project["isaac"] == 0
    quota = {s["metric"]["project"]: float(s["value"][1]) for s in results["Quota used per project"]}
    assert quota["3dgs"] > 0.7  # 3 MiB of its 4 MiB
    # the live rules: the hung run has been silent past the threshold, the backlog is past 10 min
    deadline = time.monotonic() + 20
    while True:
        firing = {a["labels"]["alertname"]: a for a in json.loads(_get(f"{prometheus}/api/v1/alerts"))["data"]["alerts"]
                  if a["state"] == "firing"}
        if {"RunSilent", "TrackerBacklogOld"} <= set(firing) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert firing["RunSilent"]["labels"]["run"] == "vla-hung-1"
    assert firing["TrackerBacklogOld"]["labels"]["run"] == "vla-hung-1"
    assert firing["TrackerBacklogOld"]["labels"]["backend"] == "mlflow"


def test_report_plots_every_panel(prometheus, lab, tmp_path):
    out = tmp_path / "report"
    keep = os.environ.get(DOCS_ENV)
    if keep:
        time.sleep(150)  # the README's pictures: a few minutes of history rather than seconds
    proc = lab.cli("monitor", "report", "--prometheus", prometheus, "--since", "3m" if keep else "2m", "--out", str(out),
                   check=True)
    assert str(out / "index.html") in proc.stdout
    from det_lab.monitoring.dashboards import DASHBOARDS

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == sum(len(d.panels) for d in DASHBOARDS)
    page = (out / "index.html").read_text()
    assert all(f"src='{p}'" in page for p in pngs)
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    if keep:  # how docs/monitoring/ was made
        Path(keep).mkdir(parents=True, exist_ok=True)
        for p in [*out.glob("*.png"), out / "index.html"]:
            shutil.copy(p, Path(keep) / p.name)


def test_finished_job_is_gone_at_the_next_scrape(exporter, jobs, slurm_cluster):  # noqa: F811
    slurm_cluster.run("scancel", jobs["nobody"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = _get(exporter)
        if not any(labels["job_id"] == jobs["nobody"] for labels, _ in samples(text, "det_lab_slurm_job_gpus")):
            break
        time.sleep(1)
    else:
        raise AssertionError("the cancelled job's series stayed")
    assert "nobody" not in {labels["user"] for labels, _ in samples(text, "det_lab_slurm_user_gpus_allocated")}
    # Slurm itself still lists the job (MinJobAge): the exporter leaves it out, not Slurm
    listed = slurm_cluster.run("squeue", "-h", "--states=all", "-j", jobs["nobody"], "-o", "%T").stdout.split()
    assert listed in (["CANCELLED"], ["COMPLETING"])


def test_missing_squeue_is_an_error_not_an_idle_cluster(lab, slurm_cluster):  # noqa: F811
    from prometheus_client import generate_latest

    from det_lab.monitoring.exporter import registry_for
    from det_lab.monitoring.source_slurm import SlurmSource
    from det_lab.monitoring.source_volume import VolumeSource
    from det_lab.settings import load_settings

    env = {**os.environ, **slurm_cluster.env, "PATH": "/nonexistent"}
    registry, collector = registry_for([SlurmSource(env=env), VolumeSource(load_settings(lab.config, env={}))])
    text = generate_latest(registry).decode()
    assert {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")} == {"slurm": 1, "volume": 0}
    assert "squeue is not on PATH" in collector.errors()["slurm"]
    assert not [n for n, _, _ in parse_exposition(text) if n.startswith("det_lab_slurm_")]
    assert samples(text, "det_lab_volume_project_bytes")


def test_stopped_slurmctld_sets_the_slurm_error_while_others_export(exporter, slurm_cluster):  # noqa: F811
    """Last in the module: slurmctld is stopped, then started again on its saved state."""
    slurm_cluster.stop_daemon("slurmctld")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = _get(exporter, timeout=60)
            errors = {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")}
            if errors["slurm"] == 1:
                break
            time.sleep(1)
        assert errors == {"gpus": 0, "slurm": 1, "volume": 0, "runs": 0, "trackers": 0}
        assert not samples(text, "det_lab_slurm_jobs") and not samples(text, "det_lab_slurm_gpus")
        assert samples(text, "det_lab_volume_project_bytes") and samples(text, "det_lab_runs")
    finally:
        slurm_cluster.start_daemon("slurmctld")
        slurm_cluster.wait_idle()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = _get(exporter, timeout=60)
        if {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")}["slurm"] == 0:
            break
        time.sleep(1)
    assert samples(text, "det_lab_slurm_nodes")


# --- no cluster needed ----------------------------------------------------------------------------

def test_doctor_warns_when_the_tsdb_is_on_nfs(tmp_path):
    from det_lab.doctor import _tsdb_checks
    from det_lab.monitoring.render import installed_tsdb_dirs

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nfiler:/lab /srv/lab nfs4 rw,hard 0 0\n")
    (check,) = _tsdb_checks(mounts, [Path("/srv/lab/prometheus")])
    assert (check.status, check.name) == ("warn", "prometheus tsdb") and "nfs4" in check.detail and "--tsdb" in check.fix
    (check,) = _tsdb_checks(mounts, [Path("/var/lib/det-lab/prometheus")])
    assert check.status == "pass"
    # which directory: the one the installed unit names
    unit_dir = tmp_path / "systemd"
    unit_dir.mkdir()
    (unit_dir / "det-lab-prometheus.service").write_text(
        "[Service]\nExecStart=/usr/bin/prometheus --config.file=/x.yml --storage.tsdb.path=/srv/lab/tsdb --web.listen-address=:9090\n")
    assert installed_tsdb_dirs(unit_dir) == [Path("/srv/lab/tsdb")]


def test_master_yaml_enables_prometheus(tmp_path):
    from det_lab.cluster import schema
    from det_lab.cluster.render import render_master
    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings

    master = render_master(LabSettings(data_root=tmp_path), ClusterSettings(master_host="m"))
    assert master["observability"] == {"enable_prometheus": True}
    assert not schema.master_errors(master)


@pytest.mark.parametrize("args, message", [
    (("exporter", "--source", "queue"), "unknown source 'queue'"),
    (("exporter", "--port", "70000"), "--port 70000 is not a TCP port"),
    (("monitor", "report", "--since", "7x"), "'7x' is not a period"),
    (("monitor", "config", "--scrape-interval", "soon"), "'soon' is not a period"),
    (("monitor", "report", "--prometheus", "http://127.0.0.1:9"), "did not answer"),
])
def test_bad_input_is_one_error_line(lab, tmp_path, args, message):
    proc = lab.cli(*args, "--out", str(tmp_path / "out")) if args[0] == "monitor" else lab.cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr
    assert not (tmp_path / "out" / "index.html").exists() and not (tmp_path / "out" / "prometheus").exists()


def test_token_refresh_keeps_the_old_token_when_the_master_is_down(lab, tmp_path):
    token = tmp_path / "det-master.token"
    token.write_text("old-token")
    lab.env.update(DET_USER="prometheus", DET_PASS="secret")
    try:
        proc = lab.cli("monitor", "token", "--out", str(token.parent), "--master", f"http://127.0.0.1:{free_port()}")
    finally:
        del lab.env["DET_USER"], lab.env["DET_PASS"]
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "did not answer the login" in proc.stderr
    assert token.read_text() == "old-token"


def test_squeue_lines_of_other_slurm_versions_and_typed_gpus():
    """squeue's gres column as 22.05 (``gres:gpu:2``), 23.02+ (``gres/gpu:2``) and typed GPUs print it;
    a 2-node job counts its per-node GPUs twice; a name with the separator stays whole; final states go."""
    from det_lab.monitoring.source_slurm import parse_squeue

    text = "\n".join([
        "11|alice|vla|a100|RUNNING|None|2026-12-01T10:00:00|2026-12-01T10:00:05|gres:gpu:2|1|train",
        "12|bob|isaac|a100|RUNNING|None|2026-12-01T10:00:00|2026-12-01T10:00:05|gres/gpu:a100:4|2|rl|sweep",
        "13|carol|(null)|rtx|PENDING|QOSMaxGRESPerUser|2026-12-01T09:00:00|N/A|gres/gpu:1|1|wait",
        "14|dave|vla|rtx|COMPLETED|None|2026-12-01T09:00:00|2026-12-01T09:00:01|gres/gpu:1|1|done",
        "15|erin|vla|cpu|RUNNING|None|2026-12-01T09:00:00|2026-12-01T09:00:01|N/A|1|cpu-only",
    ])
    jobs = {j.job_id: j for j in parse_squeue(text)}
    assert sorted(jobs) == ["11", "12", "13", "15"]
    assert [jobs[i].gpus for i in ("11", "12", "13", "15")] == [2, 8, 1, 0]
    assert jobs["12"].name == "rl|sweep" and jobs["13"].account == "" and jobs["13"].reason == "QOSMaxGRESPerUser"


def test_a_scrape_never_waits_for_a_slow_refresh():
    """After its first read a source past its ttl answers with its last figures while it refreshes in
    the background; the next scrape after the refresh has the new ones (and a vanished series is gone)."""
    import threading

    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily

    from det_lab.monitoring.exporter import registry_for

    class Queue:
        name, ttl = "queue", 0.2

        def __init__(self) -> None:
            self.jobs, self.release = ["7", "8"], threading.Event()
            self.reads = 0

        def collect(self):
            self.reads += 1
            if self.reads > 1:
                self.release.wait(10)  # a slow squeue
            fam = GaugeMetricFamily("det_lab_test_job", "", labels=["job_id"])
            for j in self.jobs:
                fam.add_metric([j], 1)
            return [fam]

    source = Queue()
    registry, collector = registry_for([source])
    assert {l["job_id"] for l, _ in samples(generate_latest(registry).decode(), "det_lab_test_job")} == {"7", "8"}
    source.jobs = ["8"]  # job 7 finished
    time.sleep(0.3)
    start = time.perf_counter()
    text = generate_latest(registry).decode()
    assert time.perf_counter() - start < 0.5  # not the 10 s the refresh could take
    assert {l["job_id"] for l, _ in samples(text, "det_lab_test_job")} == {"7", "8"}
    (_, age), = samples(text, "det_lab_scrape_age_seconds")
    assert age >= 0.3
    source.release.set()
    assert collector.wait_refreshes(10)
    assert {l["job_id"] for l, _ in samples(generate_latest(registry).decode(), "det_lab_test_job")} == {"8"}


def test_sources_are_read_before_the_first_scrape_and_one_still_reading_is_an_error():
    """The exporter reads its sources before it listens (those that wait on a command or a driver
    side by side), so its first scrape answers from memory; a source whose first read outlasts the wait is its scrape's error (no series),
    never a source that answered with nothing, and its series come with its answer."""
    import threading

    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily

    from det_lab.monitoring.exporter import registry_for

    class Slow:
        ttl = 60.0

        def __init__(self, name: str, seconds: float) -> None:
            self.name, self.seconds, self.reads, self.release = name, seconds, 0, threading.Event()

        def collect(self):
            self.reads += 1
            self.release.wait(self.seconds)
            fam = GaugeMetricFamily(f"det_lab_test_{self.name}", "", labels=["source"])
            fam.add_metric([self.name], self.reads)
            return [fam]

    volume, runs, squeue = Slow("volume", 0.6), Slow("runs", 0.6), Slow("squeue", 30)
    registry, collector = registry_for([volume, runs, squeue])
    start = time.perf_counter()
    assert collector.prime(timeout=1.0) == ["squeue"]
    assert time.perf_counter() - start < 1.15  # side by side: not 0.6 + 0.6 + 1.0 s
    start = time.perf_counter()
    text = generate_latest(registry).decode()
    assert time.perf_counter() - start < 0.3  # answered from memory
    assert (volume.reads, runs.reads, squeue.reads) == (1, 1, 1)
    assert {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")} == {"volume": 0, "runs": 0, "squeue": 1}
    assert samples(text, "det_lab_test_volume") == [({"source": "volume"}, 1)] and not samples(text, "det_lab_test_squeue")
    squeue.release.set()
    assert collector.wait_refreshes(10)
    text = generate_latest(registry).decode()
    assert {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")} == {"volume": 0, "runs": 0, "squeue": 0}
    assert samples(text, "det_lab_test_squeue") == [({"source": "squeue"}, 1)]


def test_config_targets_come_from_the_slurm_and_cluster_configs(tmp_path):
    """Without --machine: the Slurm nodes and Determined agents of the lab's configs; GPU machines get
    dcgm-exporter and a GPU exporter, every machine node_exporter; the master comes from cluster.yaml.
    A damaged slurm.yaml is one error line and nothing written."""
    _need_prometheus()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp_path / "lab.yaml"), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    lab = Lab(root=tmp_path / "data", config=tmp_path / "lab.yaml", env=env)
    lab.write_config()
    state = lab.root / ".det-lab"
    state.mkdir(parents=True)
    (state / "slurm.yaml").write_text(yaml.safe_dump({"nodes": [
        {"name": "gpu-a", "cpus": 8, "gpus": 2, "gpu_kind": "a100"}, {"name": "cpu-b", "cpus": 4}]}))
    (state / "cluster.yaml").write_text(yaml.safe_dump({
        "master_host": "det-master", "master_port": 8443,
        "pools": [{"name": "default", "agents": ["gpu-a", "det-c"]}]}))
    out = tmp_path / "out"
    lab.cli("monitor", "config", "--out", str(out), check=True)
    conf = yaml.safe_load((out / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in conf["scrape_configs"]}
    assert targets == {"det-lab": ["localhost:9540"], "det-lab-node": ["det-c:9540", "gpu-a:9540"],
                       "node": ["cpu-b:9100", "det-c:9100", "gpu-a:9100"], "dcgm": ["det-c:9400", "gpu-a:9400"],
                       "determined-state": ["det-master:8443"], "determined-master": ["det-master:8443"]}
    check = subprocess.run(["promtool", "check", "config", str(out / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    (state / "slurm.yaml").write_text("nodes: [{name: gpu-a, gpus: 2}]\n")  # gpus without gpu_kind
    proc = lab.cli("monitor", "config", "--out", str(tmp_path / "out2"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "gpu_kind is needed" in proc.stderr
    assert not (tmp_path / "out2").exists()


def test_a_gpu_process_is_attributed_to_its_user_slurm_job_and_run(tmp_path):
    """What the GPU source labels each NVML process with, read from /proc for a real process of
    another user (NVML itself needs a driver, absent here)."""
    from det_lab.monitoring.source_gpus import process_owner

    if os.geteuid() != 0:
        pytest.skip("starting a process as nobody needs root")
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "4242", "DET_LAB_LOCAL_RUN": str(tmp_path / "vla-act-7" / "run.json")}
    proc = subprocess.Popen(["sleep", "30"], env=env, user="nobody", group="nogroup")
    try:
        time.sleep(0.2)
        assert process_owner(proc.pid) == {"user": "nobody", "slurm_job": "4242", "run": "vla-act-7", "container": ""}
    finally:
        proc.kill()
        proc.wait()
    assert process_owner(proc.pid)["user"] == ""  # gone: nothing to say, no error


def test_a_job_pending_on_its_users_gpu_limit_and_fair_share(acct_exporter, acct_jobs):
    """The accounting cluster's exporter: the second job pends on the user's QOS GPU limit, the first holds
    their one GPU, and their fair-share is what sshare prints."""
    text = _get(acct_exporter)
    assert {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")} == {"slurm": 0}
    pending = {l["job_id"]: (l["user"], l.get("account"), l["reason"])
               for l, _ in samples(text, "det_lab_slurm_job_pending_seconds")}
    assert pending[acct_jobs["pending"]] == (ACCT_USER, ACCT_ACCOUNT, "QOSMaxGRESPerUser")
    held = {(l["user"], l.get("account")): v for l, v in samples(text, "det_lab_slurm_user_gpus_allocated")}
    assert held[(ACCT_USER, ACCT_ACCOUNT)] == 1
    shares = {(l["account"], l["user"]): v for l, v in samples(text, "det_lab_slurm_fairshare")}
    sshare = acct_jobs["cluster"].run("sshare", "-P", "-h", "-o", "Account,User,FairShare", "-A", ACCT_ACCOUNT,
                                      "-u", ACCT_USER).stdout
    (line,) = [ln for ln in sshare.splitlines() if ln.split("|")[1] == ACCT_USER]
    assert shares[(ACCT_ACCOUNT, ACCT_USER)] == float(line.split("|")[2])


def test_textfile_for_node_exporter_is_written_whole(lab, tmp_path):
    out = tmp_path / "textfile"
    proc = lab.cli("exporter", "--textfile", str(out), "--source", "volume", "--source", "runs", check=True)
    assert f"wrote {out / 'det_lab.prom'}" in proc.stdout
    assert [p.name for p in out.iterdir()] == ["det_lab.prom"]  # no temp file left beside it
    text = (out / "det_lab.prom").read_text()
    assert {l["source"]: v for l, v in samples(text, "det_lab_scrape_error")} == {"volume": 0, "runs": 0}
    assert {l["project"] for l, _ in samples(text, "det_lab_volume_project_bytes")} == {"vla", "isaac", "3dgs"}
    assert not samples(text, "det_lab_slurm_jobs")  # only the sources asked for


def test_backlog_counts_from_each_cursor_and_ages_from_the_first_undelivered_event(tmp_path):
    """Cursors past the start and a torn last line (a writer killed mid-append): the oldest
    undelivered event is the one just after each cursor, not its neighbour or the first event."""
    from det_lab.monitoring.source_trackers import backlog
    from det_lab.tracking.events import Metrics, RunInfo
    from det_lab.tracking.journal import Cursor, Journal

    d = tmp_path / "journal"
    journal = Journal(d)
    journal.describe_run(RunInfo("r", "r"), {"mlflow": "http://127.0.0.1:9/", "aim": "aim://127.0.0.1:9"})
    journal.append([Metrics("training", s, {"loss": 1.0}, timestamp=1000.0 + 10 * s) for s in range(1, 31)])
    journal.close()
    journal.advance("mlflow", Cursor(10))
    with open(journal.segments()[-1], "ab") as f:
        f.write(b'{"seq": 31, "kind": "metr')
    assert backlog(d) == {"mlflow": (20, 1110.0), "aim": (30, 1010.0)}
    journal.advance("mlflow", Cursor(30))
    journal.advance("aim", Cursor(30))
    journal.mark_end("FINISHED")
    assert backlog(d) == {"mlflow": (0, None), "aim": (0, None)}
    (d / "run.json").write_text("{")
    with pytest.raises(ValueError, match="missing or damaged"):
        backlog(d)


def test_volume_areas_are_the_directories_the_quota_counts(tmp_path):
    """The volume source splits a project's bytes by its own list of areas; a directory added to
    the quota's list (VolumeLayout.project_dirs) and not to it would go missing from its total."""
    from det_lab.monitoring.source_volume import AREAS, area_dir
    from det_lab.volume import VolumeLayout

    layout = VolumeLayout(tmp_path)
    assert sorted(area_dir(layout, "p", a) for a in AREAS) == sorted(layout.project_dirs("p"))
