"""Checkpoints of a project land in one place on the volume, whether the experiment ran on the
cluster or locally: every template config is checked against the master config det-lab renders
and against Determined's own schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from det_lab.cluster.render import render_master
from det_lab.cluster.settings import load_cluster_settings
from det_lab.settings import load_settings
from det_lab.volume import VolumeLayout
from tests import expconf

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "experiment_templates").glob("*/*.yaml")
                 if "det_lab" in (yaml.safe_load(p.read_text()).get("data") or {}))


def cluster_checkpoint_dir(master: dict, exp_conf: dict) -> Path:
    """The host directory Determined writes an experiment's checkpoints under: the experiment's
    checkpoint_storage merged over the master's (same union member: field by field, the
    experiment winning; Determined's schemas.UnionMerge), then host_path/storage_path."""
    storage = dict(master["checkpoint_storage"])
    ours = exp_conf.get("checkpoint_storage") or {}
    if ours.get("type", storage["type"]) != storage["type"]:
        storage = {}
    storage.update(ours)
    sub = Path(storage.get("storage_path") or "")
    return sub if sub.is_absolute() else Path(storage["host_path"]) / sub


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_cluster_and_local_checkpoints_of_a_project_share_one_directory(lab, config):
    settings = load_settings(lab.config, env={})
    master = render_master(settings, load_cluster_settings(settings))
    conf = yaml.safe_load(config.read_text())
    project = conf["data"]["det_lab"]["project"]
    layout = VolumeLayout.from_settings(settings)
    expected = layout.project_checkpoints(project)  # what the project's quota counts
    assert cluster_checkpoint_dir(master, conf) == expected
    assert layout.experiment_checkpoints(project, conf) == expected
    # and trials on the cluster see it at the same host path (det_lab reads checkpoints there)
    mounts = [Path(m["host_path"]) for m in master["task_container_defaults"]["bind_mounts"]]
    assert any(expected.is_relative_to(m) for m in mounts)


def test_template_configs_pass_determineds_schema():
    expconf.assert_valid(CONFIGS)


def test_a_config_without_storage_path_keeps_local_checkpoints_per_project(tmp_path):
    layout = VolumeLayout(tmp_path)
    assert layout.experiment_checkpoints("vla", {"searcher": {}}) == tmp_path / "checkpoints" / "vla"
    other = {"checkpoint_storage": {"type": "shared_fs", "storage_path": "checkpoints/vla-big"}}
    assert layout.experiment_checkpoints("vla", other) == tmp_path / "checkpoints" / "vla-big"
