"""`det-lab cluster config`: master.yaml/agent.yaml rendered from the lab config, validated
against the documented 0.38 fields, and one-line errors for every bad cluster config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from det_lab.cli.app import app
from det_lab.cluster.render import render_agent, render_master
from det_lab.cluster.schema import agent_errors, master_errors
from det_lab.cluster.settings import ClusterConfigError, load_cluster_settings
from det_lab.settings import load_settings
from tests import expconf

THREE_MACHINES = {
    "master_host": "gpu-a.lab",
    "pools": [
        {"name": "default", "description": "gpu-a: 2x RTX 4090", "agents": ["gpu-a"], "gpu_kind": "rtx4090"},
        {"name": "a6000", "agents": ["gpu-b"], "gpu_kind": "a6000"},
        {"name": "l40s", "agents": ["gpu-c"]},
    ],
    "default_aux_pool": "a6000",
    "scheduler": {"default_priority": 50, "preemption": True},
    "gc": {"save_experiment_best": 2},
    "images": {"task": "registry.lab:5000/robotics:cu124"},
}


def invoke(lab, *args: str):
    """det-lab in this process (fast); other tests run the installed console script."""
    return CliRunner().invoke(app, list(args), env=lab.env)


def write_cluster(lab, data: dict) -> None:
    path = lab.root / ".det-lab" / "cluster.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def rendered(lab, *args: str, script: bool = False) -> dict[str, dict]:
    """The documents `det-lab cluster config` prints; with ``script`` through the installed script."""
    if script:
        proc = lab.cli("cluster", "config", *args)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        res = invoke(lab, "cluster", "config", *args)
        code, out, err = res.exit_code, res.stdout, res.stderr
    assert code == 0, err
    docs: dict[str, dict] = {}
    for chunk in out.split("# --- ")[1:]:
        name, _, body = chunk.partition(" ---\n")
        docs[name] = yaml.safe_load(body)
    return docs


def test_one_machine_defaults(lab):
    docs = rendered(lab, script=True)
    master = docs["master.yaml"]
    assert master_errors(master) == []
    root = str(lab.root)
    assert master["checkpoint_storage"] == {
        "type": "shared_fs", "host_path": root, "storage_path": "checkpoints",
        "save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 1,
    }
    mounts = {m["container_path"]: m for m in master["task_container_defaults"]["bind_mounts"]}
    m = mounts[f"{root}/datasets"]
    assert m["host_path"] == m["container_path"] and m["read_only"] is True and m["propagation"] == "rslave"
    # a trial's first pull fills the cache, publishes a (read-only) snapshot, takes the volume's locks
    for sub in ("snapshots", "dvc-cache", ".det-lab", "outputs", "checkpoints"):
        assert mounts[f"{root}/{sub}"]["read_only"] is False and mounts[f"{root}/{sub}"]["propagation"] == "rslave"
    # a dataset read in place ({dir: teams/scenes/garden}) is wherever on the volume: all of it, read-only
    assert mounts[root]["read_only"] is True and mounts[root]["host_path"] == root
    # a user master.yaml replaces the built-in one: the db section must be complete (password via env)
    assert master["db"] == {"user": "postgres", "host": "determined-db", "port": 5432, "name": "determined",
                            "ssl_mode": "disable"}
    assert [p["pool_name"] for p in master["resource_pools"]] == ["default"]
    rm = master["resource_manager"]
    assert rm["default_compute_resource_pool"] == rm["default_aux_resource_pool"] == "default"
    assert rm["scheduler"] == {"type": "priority", "fitting_policy": "best", "preemption": False, "default_priority": 42}
    assert master["telemetry"] == {"enabled": False} and "prevent_blank_password" in master["feature_switches"]
    assert master["port"] == 8080
    # nothing secret in what `config` prints
    assert "security" not in master and "password" not in master["db"]
    (agent_name, agent), = [(k, v) for k, v in docs.items() if k.startswith("agent-")]
    assert agent_errors(agent, master) == []
    assert agent["master_port"] == 8080 and agent["resource_pool"] == "default"


def test_three_machines_with_pools(lab):
    write_cluster(lab, THREE_MACHINES)
    docs = rendered(lab)
    master = docs["master.yaml"]
    assert master_errors(master) == []
    pools = {p["pool_name"]: p for p in master["resource_pools"]}
    assert list(pools) == ["default", "a6000", "l40s"]
    # the block repeats the master's scalars: Determined would reset them to its defaults otherwise
    # (master/pkg/model/task_container_defaults.go:80-89; tests/test_task_standin.py merges it as the master does)
    assert pools["a6000"]["task_container_defaults"] == {
        "shm_size_bytes": 4 * 1024**3, "network_mode": "bridge", "preemption_timeout": 3600,
        "environment_variables": ["DET_LAB_GPU_KIND=a6000"]}
    assert "task_container_defaults" not in pools["l40s"]
    assert master["resource_manager"]["default_aux_resource_pool"] == "a6000"
    assert master["resource_manager"]["scheduler"]["default_priority"] == 50
    assert master["checkpoint_storage"]["save_experiment_best"] == 2
    assert master["task_container_defaults"]["image"] == {"cpu": THREE_MACHINES["images"]["task"],
                                                         "cuda": THREE_MACHINES["images"]["task"]}
    expected = {"gpu-a": "default", "gpu-b": "a6000", "gpu-c": "l40s"}
    assert {k.removeprefix("agent-").removesuffix(".yaml") for k in docs if k != "master.yaml"} == set(expected)
    for agent_id, pool in expected.items():
        agent = docs[f"agent-{agent_id}.yaml"]
        assert agent_errors(agent, master) == []
        assert agent["resource_pool"] == pool and agent["agent_id"] == agent_id
        assert agent["master_host"] == agent["container_master_host"] == "gpu-a.lab"


def test_config_out_dir_writes_files(lab, tmp_path):
    out = tmp_path / "rendered"
    proc = invoke(lab, "cluster", "config", "--out", str(out), "--agent", "spare-box")
    assert proc.exit_code == 0, proc.stderr
    assert (out / "master.yaml").is_file() and (out / "agent-spare-box.yaml").is_file()
    assert yaml.safe_load((out / "agent-spare-box.yaml").read_text())["resource_pool"] == "default"


@pytest.mark.parametrize("data, message", [
    ({"pools": [{"name": "gpu"}, {"name": "gpu"}], "default_compute_pool": "gpu", "default_aux_pool": "gpu"},
     "duplicate pool name 'gpu'"),
    ({"pools": [{"name": "rtx"}]}, "default_compute_pool: pool 'default' is not defined (pools: rtx)"),
    ({"pools": [{"name": "bad pool!"}]}, "pool name 'bad pool!' must be"),
    ({"pools": []}, "at least one pool"),
    ({"pools": [{"name": "default", "agents": ["a"]}, {"name": "b", "agents": ["a"]}]},
     "agent 'a' is listed in both 'default' and 'b'"),
    ({"bind_mounts": [{"host_path": "isaac/assets"}]}, "bind_mounts.0.host_path: 'isaac/assets' must be an absolute path"),
    ({"images": {"postgres": "postgres:10.14"}}, "postgres:10.14 is older than PostgreSQL 12"),
    ({"master_host": "http://gpu-a:8080"}, "master_host: 'http://gpu-a:8080' must be a bare host name"),
    ({"master_port": 0}, "master_port: Input should be greater than or equal to 1"),
    ({"scheduler": {"default_priority": 100}}, "scheduler.default_priority"),
    ({"tls": True}, "unknown key 'tls'"),
    ({"users": {"alice": {"uid": 1001}}}, "users.alice.gid: Field required"),
])
def test_bad_cluster_config_is_one_line(lab, data, message):
    write_cluster(lab, data)
    with pytest.raises(ClusterConfigError) as exc:
        load_cluster_settings(load_settings(lab.config, env={}))
    line = str(exc.value)
    assert "\n" not in line and message in line and "cluster.yaml" in line, line


@pytest.mark.parametrize("cmd", [("cluster", "config"), ("cluster", "up", "--dry-run"),
                                 ("cluster", "agent-up", "gpu-a", "--dry-run")])
def test_cli_reports_bad_cluster_config_in_one_line(lab, cmd):
    write_cluster(lab, {"pools": [{"name": "gpu"}, {"name": "gpu"}]})
    if cmd == ("cluster", "config"):  # once through the installed script
        proc = lab.cli(*cmd)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        res = invoke(lab, *cmd)
        code, out, err = res.exit_code, res.stdout, res.stderr
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "cluster.yaml: pools: duplicate pool name 'gpu'" in lines[0]


def test_explicit_cluster_config_path(lab, tmp_path):
    missing = tmp_path / "nope.yaml"
    res = invoke(lab, "cluster", "--cluster-config", str(missing), "config")
    assert res.exit_code == 2 and f"{missing}: no such cluster config file" in res.stderr
    other = tmp_path / "other.yaml"
    other.write_text("master_host: box-7\nmaster_port: 9090\n")
    res = invoke(lab, "cluster", "--cluster-config", str(other), "config", "--agent", "x")
    assert res.exit_code == 0, res.stderr
    assert "master_host: box-7" in res.stdout and "master_port: 9090" in res.stdout


def test_invalid_yaml_names_the_line(lab):
    path = lab.root / ".det-lab" / "cluster.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("pools: [\n")
    res = invoke(lab, "cluster", "config")
    assert res.exit_code == 2 and "invalid YAML" in res.stderr and "cluster.yaml:2:" in res.stderr


# --- the schema itself: every documented rule catches its mistake ----------------------------------

def _valid_master(tmp_path) -> dict:
    lab = load_settings(env={"DET_LAB_DATA_ROOT": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)})
    return render_master(lab, load_cluster_settings(lab))


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update(chekpoint_storage={}), "chekpoint_storage: unknown key"),
    (lambda m: m.pop("db"), "db: required"),
    (lambda m: m["db"].pop("host"), "db.host: required"),
    (lambda m: m["db"].update(port="5432"), "db.port: expected int"),
    (lambda m: m["checkpoint_storage"].update(host_path="data"), "checkpoint_storage.host_path: must be an absolute path"),
    (lambda m: m["checkpoint_storage"].update(storage_path="../elsewhere"), "is not under host_path"),
    (lambda m: m["task_container_defaults"]["bind_mounts"][0].update(container_path="data"),
     "bind_mounts[0].container_path: must be an absolute path"),
    (lambda m: m["task_container_defaults"]["bind_mounts"][0].update(propagation="slaveish"), "propagation: 'slaveish'"),
    (lambda m: m["task_container_defaults"]["bind_mounts"][1].update(
        container_path=m["task_container_defaults"]["bind_mounts"][0]["container_path"]), "is mounted twice"),
    (lambda m: m["resource_pools"].append({"pool_name": "default"}), "resource_pools[1].pool_name: duplicate pool 'default'"),
    (lambda m: m["resource_pools"][0].update(pool_name="gpu"),
     "resource_manager.default_compute_resource_pool: pool 'default' is not defined"),
    (lambda m: m.update(port=8443), "port: det deploy local publishes container port 8080 only"),
    (lambda m: m.update(security={"tls": {"cert": "/c", "key": "/k"}}), "security.tls: det deploy local cannot run a TLS master"),
    (lambda m: m["resource_manager"]["scheduler"].update(type="round_robin"), "scheduler.type: 'round_robin'"),
])
def test_master_schema_rules(tmp_path, mutate, message):
    master = _valid_master(tmp_path)
    assert master_errors(master) == []
    mutate(master)
    errors = master_errors(master)
    assert any(message in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_agent_schema_rules(tmp_path):
    master = _valid_master(tmp_path)
    lab = load_settings(env={"DET_LAB_DATA_ROOT": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)})
    agent = render_agent(load_cluster_settings(lab), "gpu-a")
    assert agent_errors(agent, master) == []
    # the agent decodes with DisallowUnknownFields: a typo stops it from starting
    assert agent_errors({**agent, "fluentd": {}}) == ["fluentd: unknown key"]
    assert agent_errors({k: v for k, v in agent.items() if k != "master_port"}) == ["master_port: required"]
    assert any("the master has no pool 'rtx'" in e for e in agent_errors({**agent, "resource_pool": "rtx"}, master))
    with pytest.raises(ClusterConfigError, match="unknown pool 'rtx'"):
        render_agent(load_cluster_settings(lab), "gpu-a", pool="rtx")


def test_example_cluster_config_renders_cleanly(tmp_path):
    example = Path(__file__).parent.parent / "cluster" / "cluster.yaml.example"
    lab = load_settings(env={"DET_LAB_DATA_ROOT": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)})
    cluster = load_cluster_settings(lab, example)
    master = render_master(lab, cluster)
    assert master_errors(master) == []
    for pool in cluster.pools:
        for agent in pool.agents:
            conf = render_agent(cluster, agent)
            assert conf["resource_pool"] == pool.name and agent_errors(conf, master) == []
    assert master["security"]["default_task"]["user"] == "det-task"
    assert master["notebook_timeout"] == 7200 and cluster.backup.keep_daily == 7
    assert {"host_path": "/opt/isaac-assets", "container_path": "/opt/isaac-assets", "read_only": True,
            "propagation": "rslave"} in master["task_container_defaults"]["bind_mounts"]


def test_task_template_carries_the_volume_and_passes_determined_schema(lab, tmp_path):
    """`det-lab cluster template`: what JupyterLab/commands from the Web UI get via --template."""

    import yaml

    out = tmp_path / "det-lab-template.yaml"
    proc = lab.cli("cluster", "template", "--out", str(out.parent))  # the installed script
    assert proc.returncode == 0, proc.stderr
    tpl = yaml.safe_load(out.read_text())
    mounts = {m["container_path"]: m for m in tpl["bind_mounts"]}
    assert mounts[f"{lab.root}/datasets"]["read_only"] is True
    assert mounts[f"{lab.root}/outputs"]["read_only"] is False
    assert f"DET_LAB_DATA_ROOT={lab.root}" in tpl["environment"]["environment_variables"]
    expconf.assert_valid([out], template=True)  # a template may only hold valid experiment-config keys
    # without a master or an admin password, --apply fails in one line
    proc = invoke(lab, "cluster", "template", "--apply")
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("warning: ")]
    assert proc.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


@pytest.mark.parametrize("tracking, warned", [
    ({}, ["tracking.mlflow_uri is not set"]),  # the default backend, mlflow, with no server
    ({"backend": "mlflow", "mlflow_uri": "sqlite:////mnt/data/mlflow.db"}, ["tracking.mlflow_uri is sqlite:"]),
    ({"backend": "both", "mlflow_uri": "http://gpu-a.lab:5000", "aim_repo": "/mnt/data/aim"},
     ["tracking.aim_repo is /mnt/data/aim"]),
    ({"backend": "mlflow", "mlflow_uri": "http://gpu-a.lab:5000"}, []),
    ({"backend": "none"}, []),
])
def test_tracking_the_tasks_cannot_reach_is_warned_with_the_fix(lab, tracking, warned):
    lab.write_config(tracking=tracking)
    for cmd in (("cluster", "config"), ("cluster", "template")):
        proc = invoke(lab, *cmd)
        assert proc.exit_code == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == len(warned), proc.stderr
        for line, expected in zip(warnings, warned):
            assert expected in line and str(lab.config) in line and "tracking.backend: none" in line
    env = rendered(lab)["master.yaml"]["task_container_defaults"]["environment_variables"]
    uri = tracking.get("mlflow_uri", "")
    assert (f"MLFLOW_TRACKING_URI={uri}" in env) == uri.startswith("http")


@pytest.mark.parametrize("notebooks, seconds, timeout, kind", [
    ({}, 7200, "2h", "kernels_or_terminals"),  # the lab-wide default
    ({"idle_timeout": "1h30m", "idle_type": "activity"}, 5400, "1h30m", "activity"),
    ({"idle_timeout": None}, None, None, "kernels_or_terminals"),  # turned off
])
def test_idle_notebook_default_is_rendered_into_master_and_notebook_template(lab, tmp_path, notebooks, seconds,
                                                                             timeout, kind):
    from determined.cli.ntsc import parse_config

    from det_lab.cluster.schema import notebook_template_errors

    write_cluster(lab, {"notebooks": notebooks} if notebooks else {})
    master = rendered(lab)["master.yaml"]
    assert master.get("notebook_timeout") == seconds and master_errors(master) == []
    out = tmp_path / "det-lab-notebook-template.yaml"
    proc = invoke(lab, "cluster", "template", "--notebook", "--out", str(out.parent))
    assert proc.exit_code == 0, proc.stderr
    tpl = yaml.safe_load(out.read_text())
    assert tpl.get("idle_timeout") == timeout and tpl["notebook_idle_type"] == kind
    assert f"{lab.root}/datasets" in {m["container_path"] for m in tpl["bind_mounts"]}
    assert notebook_template_errors(tpl) == []
    # what the template shares with an experiment config passes Determined's schema
    shared = tmp_path / "shared.yaml"
    shared.write_text(yaml.safe_dump({k: v for k, v in tpl.items() if k not in ("idle_timeout", "notebook_idle_type")}))
    expconf.assert_valid([shared], template=True)
    # the experiment template stays free of notebook-only keys (an experiment config refuses them)
    plain = yaml.safe_load(invoke(lab, "cluster", "template").stdout)
    assert "idle_timeout" not in plain and "notebook_idle_type" not in plain
    # one notebook lengthened: det's CLI sends the value as the notebook's own config, over the template
    own = parse_config(None, None, ["idle_timeout=8h"], [])
    assert own == {"idle_timeout": "8h"} and notebook_template_errors({**tpl, **own}) == []


@pytest.mark.parametrize("notebooks, message", [
    ({"idle_timeout": "2 hours"}, "notebooks.idle_timeout: '2 hours' is not a duration like 2h"),
    ({"idle_timeout": "30s"}, "notebooks.idle_timeout: '30s' is under a minute"),
    ({"idle_type": "idle"}, "notebooks.idle_type:"),
])
def test_bad_idle_setting_is_one_line(lab, notebooks, message):
    write_cluster(lab, {"notebooks": notebooks})
    for cmd in (("cluster", "config"), ("cluster", "template", "--notebook")):
        proc = invoke(lab, *cmd)
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("warning: ")]
        assert proc.exit_code == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_notebook_template_check_catches_what_determined_would_refuse():
    from det_lab.cluster.schema import notebook_template_errors

    assert notebook_template_errors({"idle_timeout": "2h", "notebook_idle_type": "activity"}) == []
    errors = notebook_template_errors({"idle_timeout": "two hours", "notebook_idle_type": "sleepy",
                                       "searcher": {"name": "single"}})
    assert len(errors) == 3 and errors[0].startswith("searcher:") and "idle_timeout" in errors[1]


FORK_IMAGES = {"repo_prefix": "ghcr.io/wu-cvgl", "version": "0.42.0"}


@pytest.mark.parametrize("images, numa_packing, error", [
    (FORK_IMAGES, False, None),
    (FORK_IMAGES, True, None),
    (FORK_IMAGES, None, None),
    ({}, None, None),  # upstream 0.38.1: nothing fork-only is rendered
    ({}, False, "images.version is 0.38.1"),  # a 0.38.1 master would not start with it
    ({**FORK_IMAGES, "version": "0.41.1"}, False, "images.version is 0.41.1"),
])
def test_fork_only_numa_packing_is_rendered_only_for_the_fork(lab, images, numa_packing, error):
    scheduler = {} if numa_packing is None else {"numa_packing": numa_packing}
    write_cluster(lab, {"images": images, "scheduler": scheduler})
    if error:
        proc = invoke(lab, "cluster", "config")
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.exit_code == 2 and len(lines) == 1 and "scheduler.numa_packing" in lines[0] and error in lines[0]
        return
    master = rendered(lab)["master.yaml"]
    sched = master["resource_manager"]["scheduler"]
    assert sched.get("numa_packing") == numa_packing and master_errors(master) == []
    if numa_packing is None:
        assert "numa_packing" not in sched and not any("scheduler" in p for p in master["resource_pools"])
