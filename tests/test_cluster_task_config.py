"""The lab config every Determined task reads (``DET_LAB_CONFIG``, on the volume): who writes it.

The master merges its task-container defaults, ``DET_LAB_CONFIG`` among them, into every task's
environment (``master/pkg/model/task_container_defaults.go`` l.133-155, ``master/pkg/tasks/task.go``
l.272), so the file that variable names is what each task knows of the lab's projects and quotas.
The audit of main 806f3ee (R2, R3) found an agent machine rewriting it with its own config, and a
master deployed from ``cluster config --out`` finding no such file.
"""

from __future__ import annotations

import yaml

from det_lab.cluster import deploy
from det_lab.cluster.render import render_master, task_config_path
from det_lab.cluster.settings import load_cluster_settings
from det_lab.compat import import_deploy
from det_lab.settings import load_settings
from tests.test_cluster_deploy import RecordingDocker, init, invoke, master_info  # noqa: F401


def _task_env(conf: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in conf["task_container_defaults"]["environment_variables"])


def test_a_master_deployed_from_the_rendered_files_gives_tasks_a_lab_config_that_exists(lab, tmp_path):
    """R3: every det_lab call in a task failed with 'unknown project' or 'no such file'."""
    lab.write_config(projects={"grasping": {"quota": "2GiB"}})
    init(lab)
    out = tmp_path / "rendered"
    proc = invoke(lab, "cluster", "config", "--out", str(out))
    assert proc.exit_code == 0, proc.stderr
    master = yaml.safe_load((out / "master.yaml").read_text())
    named = _task_env(master)["DET_LAB_CONFIG"]
    assert named in proc.stdout
    # what a task sees: that variable alone, as the master's defaults give it
    seen = load_settings(None, env={"DET_LAB_CONFIG": named})
    assert seen.project("grasping").quota == load_settings(lab.config, env={}).project("grasping").quota


def test_rendering_where_the_volume_is_not_mounted_makes_nothing_there(lab, tmp_path):
    out = tmp_path / "rendered"
    proc = invoke(lab, "cluster", "config", "--out", str(out))  # the data root was never created
    assert proc.exit_code == 0 and (out / "master.yaml").is_file()
    assert "is not mounted here" in proc.stderr and not lab.root.exists()


def test_an_agent_machine_with_another_lab_config_leaves_the_tasks_copy_alone(lab, tmp_path, monkeypatch, master_info):
    """R2: agent-up rewrote the copy whenever this machine's config differed, so an agent whose config
    lacked the lab's projects took them away from every task on every machine."""
    lab.write_config(projects={"grasping": {"quota": "2GiB"}})
    init(lab)
    master_lab = load_settings(lab.config, env={})
    cluster_yaml = tmp_path / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump({"master_host": "127.0.0.1", "master_port": master_info,
                                            "agent": {"gpu": False},
                                            "tasks": {"local_cache": str(tmp_path / "agent-cache")}}))
    cluster = load_cluster_settings(master_lab, cluster_yaml)
    assert invoke(lab, "cluster", "--cluster-config", str(cluster_yaml), "config", "--out",
                  str(tmp_path / "rendered")).exit_code == 0  # the master machine published it
    copy = task_config_path(master_lab)
    published = copy.read_text()

    # the agent machine: the same volume, a config of its own without the lab's projects
    agent_config = tmp_path / "agent-lab.yaml"
    agent_config.write_text(yaml.safe_dump({"data_root": str(lab.root)}))
    agent_lab = load_settings(agent_config, env={})
    monkeypatch.setattr(import_deploy(), "_docker_client", None)
    deploy.agent_up(agent_lab, cluster, tmp_path / "private", "gpu-b", client=RecordingDocker())
    assert copy.read_text() == published
    assert load_settings(None, env={"DET_LAB_CONFIG": str(copy)}).project("grasping")
    assert _task_env(render_master(agent_lab, cluster))["DET_LAB_CONFIG"] == str(copy)


def test_a_task_without_the_lab_config_says_where_it_comes_from(tmp_path):
    from det_lab.settings import LabConfigError, find_config_file

    missing = tmp_path / ".det-lab" / "lab.yaml"
    try:
        find_config_file({"DET_LAB_CONFIG": str(missing), "DET_TASK_ID": "1.abc"})
    except LabConfigError as exc:
        assert "no such file" in str(exc) and "'det-lab cluster up'" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError("a missing DET_LAB_CONFIG was taken")
