"""master.yaml's top-level keys as Determined 0.38.1 decodes them: every key of its ``Config``
struct is accepted, any other is one error line (the master would not start: it decodes the top
level with ``DisallowUnknownFields``, ``master/cmd/determined-master/root.go`` l.177)."""

from __future__ import annotations

import pytest

from det_lab.cluster.render import render_master
from det_lab.cluster.schema import master_errors
from det_lab.cluster.settings import load_cluster_settings
from det_lab.settings import load_settings

#: the json tags of ``Config`` (``master/internal/config/config.go`` l.173-206) and of the embedded
#: ``ResourceConfig`` (``master/internal/config/resource_config.go`` l.28-35)
CONFIG_GO_KEYS = (
    "config_file", "log", "db", "tensorboard_timeout", "notebook_timeout", "security", "checkpoint_storage",
    "task_container_defaults", "port", "root", "telemetry", "enable_cors", "launch_error", "cluster_name",
    "ui_customization", "logging", "retention_policy", "observability", "cache", "webhooks", "feature_switches",
    "reserved_ports", "__internal", "scim", "saml", "oidc", "det_cloud", "integrations",
    "resource_manager", "resource_pools", "additional_resource_managers",
)
#: ``TaskContainerDefaultsConfig``'s (``master/pkg/model/task_container_defaults.go`` l.27-58) that
#: det_lab does not render
TCD_UNRENDERED = ("cpu_pod_spec", "gpu_pod_spec", "checkpoint_gc_pod_spec", "slurm", "pbs", "kubernetes")


def _master(tmp_path) -> dict:
    lab = load_settings(env={"DET_LAB_DATA_ROOT": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)})
    return render_master(lab, load_cluster_settings(lab))


def _sample(key: str, master: dict):
    if key in master:
        return master[key]
    return {"config_file": "/etc/determined/master.yaml", "root": "/usr/share/determined/master",
            "tensorboard_timeout": 300, "enable_cors": False, "launch_error": True,
            "additional_resource_managers": [], "reserved_ports": [9000]}.get(key, {})


@pytest.mark.parametrize("key", CONFIG_GO_KEYS)
def test_every_key_the_master_decodes_is_accepted(tmp_path, key):
    master = _master(tmp_path)
    master[key] = _sample(key, master)
    assert [e for e in master_errors(master) if "unknown key" in e] == []


@pytest.mark.parametrize("key", TCD_UNRENDERED)
def test_task_container_defaults_keys_of_other_resource_managers_are_accepted(tmp_path, key):
    master = _master(tmp_path)
    master["task_container_defaults"][key] = {}
    assert master_errors(master) == []


@pytest.mark.parametrize("key", ["tls", "checkpoint_storge", "resource_pool", "scheduling"])
def test_a_key_outside_config_go_is_one_error_line(tmp_path, key):
    master = _master(tmp_path)
    master[key] = {}
    assert master_errors(master) == [f"{key}: unknown key"]


def test_the_pre_0_13_scheduler_beside_resource_manager_is_refused(tmp_path):
    """root.go shimOldRMConfig l.211-219: the old ``scheduler``/``provisioner`` keys with
    ``resource_manager``/``resource_pools`` stop the master."""
    master = _master(tmp_path)
    master["scheduler"] = {"type": "priority"}
    errors = master_errors(master)
    assert len(errors) == 1 and errors[0].startswith("scheduler: the pre-0.13 form cannot be used with resource_manager")
