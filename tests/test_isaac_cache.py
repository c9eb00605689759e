"""Where an Isaac trial keeps Kit's shader and kernel caches, on a cluster det_lab did not lay out
with its defaults (the audit's R4: isaac.yaml bind-mounted /var/cache/det-lab/isaac, which exists only
under the default ``tasks.local_cache``; Docker refuses a bind whose source is missing, so every
Isaac trial failed at container creation: ``master/pkg/tasks/mounts.go`` l.19-27, ``task_trial.go`` l.146)."""

from __future__ import annotations

from pathlib import Path

import yaml

from det_lab.cluster.render import prepare_local_cache, render_master
from det_lab.cluster.settings import ClusterSettings
from det_lab.rl.commands import isaac_cache_root
from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.task_standin import experiment_config

ISAAC_YAML = Path(__file__).resolve().parents[1] / "experiment_templates" / "isaac_lab" / "isaac.yaml"


def test_every_mount_of_an_isaac_trial_exists_under_a_custom_task_cache(tmp_path):
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(tmp_path / "data")}))
    lab = load_settings(tmp_path / "lab.yaml", env={})
    init_volume(lab)
    cluster = ClusterSettings(tasks={"local_cache": str(tmp_path / "ssd" / "det-lab-cache")})
    prepare_local_cache(lab, cluster)  # what 'cluster agent-up' makes on the agent
    conf = experiment_config(render_master(lab, cluster), "default", yaml.safe_load(ISAAC_YAML.read_text()))
    missing = [m["host_path"] for m in conf["bind_mounts"] if not Path(m["host_path"]).exists()]
    assert missing == []
    # and the trial finds its cache in what the master mounts
    env = dict(e.split("=", 1) for e in conf["environment"]["environment_variables"])
    assert isaac_cache_root(None, env) == tmp_path / "ssd" / "det-lab-cache" / "isaac"
    assert (tmp_path / "ssd" / "det-lab-cache" / "isaac").is_dir()


def test_a_configured_cache_root_wins_and_a_missing_one_keeps_no_cache(tmp_path):
    assert isaac_cache_root(str(tmp_path), {"DET_LAB_LOCAL_CACHE": "/elsewhere"}) == tmp_path
    assert isaac_cache_root(str(tmp_path / "absent"), {}) is None
