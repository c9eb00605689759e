"""``DET_LAB_CLUSTER_CONFIG`` is read by every reader of the cluster config, not only by
``det-lab cluster``: ``monitor config``, ``monitor token``, doctor's backup check and the
notebooks' config template. Each test keeps the default ``<data_root>/.det-lab/cluster.yaml``
absent and puts the cluster config elsewhere, named by the variable only."""

from __future__ import annotations

import yaml

from tests.det_template_master import TemplateMaster


def _cluster_file(lab, tmp_path, data: dict):
    path = tmp_path / "elsewhere" / "cluster.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    lab.env["DET_LAB_CLUSTER_CONFIG"] = str(path)
    assert not (lab.root / ".det-lab" / "cluster.yaml").exists()
    return path


def test_monitor_config_scrapes_the_agents_of_the_named_cluster_config(lab, tmp_path):
    _cluster_file(lab, tmp_path, {"master_host": "det-master", "master_port": 8090,
                                  "pools": [{"name": "default", "agents": ["gpu-q"]}]})
    out = tmp_path / "out"
    lab.cli("monitor", "config", "--out", str(out), check=True)
    conf = yaml.safe_load((out / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in conf["scrape_configs"]}
    assert targets["node"] == ["gpu-q:9100"] and targets["determined-master"] == ["det-master:8090"]


def test_monitor_token_logs_in_to_the_master_of_the_named_cluster_config(lab, tmp_path):
    master = TemplateMaster("prom-secret")
    try:
        port = int(master.url.rsplit(":", 1)[1])
        _cluster_file(lab, tmp_path, {"master_host": "127.0.0.1", "master_port": port})
        lab.env.update(DET_USER="prometheus", DET_PASS="prom-secret")
        token = tmp_path / "det-master.token"
        proc = lab.cli("monitor", "token", "--out", str(token.parent))
        assert proc.returncode == 0, proc.stderr
        assert token.read_text() == "standin-token"
    finally:
        master.close()


def test_doctor_backup_check_looks_where_the_named_cluster_config_keeps_backups(lab, tmp_path, monkeypatch):
    from det_lab.cluster.backup import backup_check
    from det_lab.settings import load_settings

    backups = tmp_path / "backups"
    backups.mkdir()
    _cluster_file(lab, tmp_path, {"backup": {"dir": str(backups)}})
    monkeypatch.setenv("DET_LAB_CLUSTER_CONFIG", lab.env["DET_LAB_CLUSTER_CONFIG"])
    status, detail, _ = backup_check(load_settings(lab.config))
    assert status == "warn" and detail == f"no backup of the master's database in {backups}"
    proc = lab.cli("doctor")
    assert f"no backup of the master's database in {backups}" in proc.stdout


def test_the_notebooks_config_template_carries_the_named_cluster_configs_mounts(lab, tmp_path, monkeypatch):
    from det_lab import notebook as nb
    from det_lab.settings import load_settings

    _cluster_file(lab, tmp_path, {"bind_mounts": [{"host_path": "/opt/isaac-assets"}]})
    monkeypatch.setenv("DET_LAB_CLUSTER_CONFIG", lab.env["DET_LAB_CLUSTER_CONFIG"])
    template = nb.det_template(load_settings(lab.config))
    assert "/opt/isaac-assets" in [m["host_path"] for m in template["bind_mounts"]]


def test_a_named_cluster_config_that_does_not_exist_is_one_error_line(lab, tmp_path):
    lab.env["DET_LAB_CLUSTER_CONFIG"] = str(tmp_path / "missing.yaml")
    lab.env.update(DET_USER="prometheus", DET_PASS="x")
    proc = lab.cli("monitor", "token", "--out", str(tmp_path / "token"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "missing.yaml: no such cluster config file" in lines[0]
