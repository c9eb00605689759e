"""``det-lab slurm config``: the rendered files as Slurm itself reads them.

slurm.conf is loaded by a real slurmctld (the partitions, nodes and GPUs it reports are what the
lab config says; a job asking for more GPUs than a node has is refused by Slurm); gres.conf and
cgroup.conf run in the session's test cluster, where a job given one of two GPUs can open only
that one.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from det_lab.settings import LabSettings
from det_lab.slurm.settings import SlurmConfigError, load_slurm_settings
from tests.conftest import Lab
from tests.slurm_cluster import SlurmCluster, _binary, slurm_cluster  # noqa: F401 (fixture)
from det_lab.tracking.mlflow_server import free_port

LAB_SLURM = {
    "nodes": [
        {"name": "gpu-box-1", "addr": "127.0.0.1", "cpus": 16, "memory": "64GiB", "gpus": 2, "gpu_kind": "rtx4090"},
        {"name": "gpu-box-2", "addr": "127.0.0.1", "cpus": 32, "memory": "128GiB", "gpus": 4, "gpu_kind": "a100"},
        {"name": "cpu-box", "addr": "127.0.0.1", "cpus": 8, "memory": "32GiB"},
    ],
    "default_time": "04:00:00",
}


def _render(lab: Lab, slurm: dict, out: Path) -> subprocess.CompletedProcess:
    (lab.root / ".det-lab").mkdir(parents=True, exist_ok=True)
    (lab.root / ".det-lab" / "slurm.yaml").write_text(yaml.safe_dump(slurm))
    return lab.cli("slurm", "config", "--out", str(out))


def test_rendered_slurm_conf_is_what_slurmctld_reads(lab, slurm_cluster: SlurmCluster, tmp_path):
    base = tmp_path / "ctld"
    for sub in ("state", "log"):
        (base / sub).mkdir(parents=True)
    slurm = {**LAB_SLURM, "controller": os.uname().nodename.split(".")[0], "controller_addr": "127.0.0.1",
             "slurmctld_port": free_port(), "slurmd_port": free_port(), "slurm_user": "root",
             "state_dir": str(base / "state"), "log_dir": str(base / "log"),
             # the test cluster's munged; the machines' own keys are the only other difference
             "extra": {"AuthInfo": f"socket={slurm_cluster.munge_socket}",
                       "SlurmctldPidFile": str(base / "slurmctld.pid")}}
    out = tmp_path / "etc"
    proc = _render(lab, slurm, out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cgroup.conf", "gres.conf", "slurm.conf"]
    assert "munge.key" in proc.stderr and str(lab.root) in proc.stderr  # the munge and volume notes

    env = {**os.environ, "SLURM_CONF": str(out / "slurm.conf")}
    ctld = subprocess.Popen([_binary("slurmctld"), "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def scontrol(*args: str) -> str:
            deadline = time.monotonic() + 30
            while True:
                p = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=30)
                if p.returncode == 0 or time.monotonic() > deadline:
                    return p.stdout + p.stderr
                time.sleep(0.3)

        partitions = {dict(kv.split("=", 1) for kv in line.split() if "=" in kv)["PartitionName"]: line
                      for line in scontrol("show", "partition", "-o").splitlines()}
        assert sorted(partitions) == ["a100", "cpu", "rtx4090"]
        assert "Nodes=gpu-box-1 " in partitions["rtx4090"] and "Default=YES" in partitions["rtx4090"]
        assert "DefaultTime=04:00:00" in partitions["a100"] and "Nodes=gpu-box-2 " in partitions["a100"]
        node = scontrol("show", "node", "gpu-box-2", "-o")
        assert "Gres=gpu:a100:4" in node and "CPUTot=32" in node and "RealMemory=131072" in node
        config = scontrol("show", "config")
        assert "task/cgroup" in config and "gres/gpu" in config.replace("GresTypes               = gpu", "gres/gpu")

        def submit(*args: str) -> subprocess.CompletedProcess:
            # held: the nodes are not running; only whether slurmctld accepts the request matters
            return subprocess.run(["sbatch", "--hold", *args, "--wrap", "true"], env=env, capture_output=True,
                                  text=True, timeout=30)
        assert submit("-p", "a100", "--gres=gpu:4").returncode == 0
        assert submit("-p", "rtx4090", "--gres=gpu:2", "--time=8-00:00:00").returncode != 0  # over MaxTime
        assert "invalid partition" in submit("-p", "h100").stderr.lower()
    finally:
        ctld.terminate()
        ctld.wait(timeout=30)


def test_a_job_can_open_only_the_gpus_it_was_given(slurm_cluster: SlurmCluster, tmp_path):
    if not slurm_cluster.constrains_devices:
        pytest.skip("no cgroup v1 devices controller here: the test cluster runs without task/cgroup")
    devices = slurm_cluster.settings.nodes[0].gpu_files.replace("[0-1]", "")
    script = tmp_path / "open.sh"
    script.write_text("#!/bin/bash\n"
                      "echo \"CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES\"\n"
                      f"for i in 0 1; do python3 -c \"import os,sys\ntry: os.open('{devices}'+sys.argv[1], os.O_RDWR)\n"
                      "except OSError as e: print(sys.argv[1], e.strerror)\" $i; done\n")
    out = tmp_path / "out.txt"
    slurm_cluster.run("sbatch", "--wait", "--gres=gpu:1", "-o", str(out), str(script))
    lines = out.read_text().splitlines()
    assert lines[0] == "CUDA_VISIBLE_DEVICES=0"
    # the allocated GPU reaches the (absent) driver; the other is refused by the devices cgroup
    assert lines[1:] == ["0 No such device or address", "1 Operation not permitted"]


@pytest.mark.parametrize("slurm, message", [
    ({"nodes": [{"name": "box", "gpus": 2}]}, "gpu_kind is needed with gpus"),
    ({"nodes": [{"name": "box"}], "default_time": "soon"}, "default_time: 'soon' is not a Slurm time"),
    ({"nodes": [{"name": "box"}], "partitions": []}, "unknown key 'partitions'"),
    ({"nodes": [{"name": "box"}], "default_partition": "a100"}, "'a100' is not a partition (partitions: cpu)"),
    ({"nodes": [{"name": "a"}, {"name": "a"}]}, "'a' is listed twice"),
])
def test_bad_slurm_config_is_one_line_naming_file_and_key(tmp_path, slurm, message):
    file = tmp_path / "slurm.yaml"
    file.write_text(yaml.safe_dump(slurm))
    lab = LabSettings(data_root=tmp_path)
    with pytest.raises(SlurmConfigError) as err:
        load_slurm_settings(lab, file)
    assert str(err.value).startswith(f"{file}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_det_lab_slurm_config_refuses_a_bad_file_with_one_line(lab, tmp_path):
    out = tmp_path / "etc"
    proc = _render(lab, {"nodes": [{"name": "box", "gpus": 2}]}, out)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "slurm.yaml: nodes.0: " in line and "gpu_kind" in line, line
    assert not out.exists()


LAB_ACCOUNTING = {
    "members": [{"user": "alice", "projects": ["vla"], "gpu_limit": 2, "fairshare": 2},
                {"user": "bob", "projects": ["vla", "3dgs"]}],
    "defaults": {"gpu_limit": 1}, "projects": {"3dgs": {"gpu_limit": 2}}, "interactive_time": "02:00:00",
}


def test_accounting_renders_slurmdbd_conf_private_with_a_password_made_once(lab, tmp_path):
    """With an accounting section: slurmdbd.conf 0600 and the Slurm user's, its password generated once into
    a 0600 file; slurm.conf's accounting half; job_submit.lua's interactive limit; the database notes.
    (slurmdbd and slurmctld reading these files is shown by tests/test_slurm_accounting.py.)"""
    import pwd
    import stat

    lab.env["DET_LAB_CLUSTER_DIR"] = str(tmp_path / "private")
    out = tmp_path / "etc"
    proc = _render(lab, {**LAB_SLURM, "accounting": LAB_ACCOUNTING}, out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cgroup.conf", "gres.conf", "job_submit.lua", "slurm.conf",
                                                     "slurmdbd.conf"]
    secret = tmp_path / "private" / "slurm-db-password"
    password = secret.read_text().strip()
    dbd = out / "slurmdbd.conf"
    assert stat.S_IMODE(dbd.stat().st_mode) == 0o600 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    try:  # Debian's slurm packages make the user
        assert dbd.stat().st_uid == pwd.getpwnam("slurm").pw_uid  # slurmdbd refuses a file SlurmUser does not own
    except KeyError:
        assert "user slurm does not exist here: chown slurm" in proc.stderr
    keys = dict(line.split("=", 1) for line in dbd.read_text().splitlines() if "=" in line and line[0] != "#")
    assert keys["StoragePass"] == password and len(password) == 32
    assert (keys["StorageType"], keys["StorageLoc"], keys["SlurmUser"]) == ("accounting_storage/mysql", "slurm_acct_db",
                                                                             "slurm")
    conf = (out / "slurm.conf").read_text()
    for line in ("AccountingStorageType=accounting_storage/slurmdbd",
                 "AccountingStorageEnforce=associations,limits,qos,safe",
                 "AccountingStorageTRES=gres/gpu,gres/gpu:a100,gres/gpu:rtx4090", "PriorityType=priority/multifactor",
                 "PriorityWeightFairshare=10000", "PriorityDecayHalfLife=7-0", "JobSubmitPlugins=lua",
                 "JobAcctGatherType=jobacct_gather/cgroup"):
        assert f"\n{line}\n" in conf, line
    partitions = [x for x in conf.splitlines() if x.startswith("PartitionName=")]
    assert len(partitions) == 3 and all("TRESBillingWeights=CPU=1.0,Mem=0.25G,GRES/gpu=4 " in p for p in partitions)
    assert "local INTERACTIVE_MINUTES = 120" in (out / "job_submit.lua").read_text()
    notes = proc.stderr.replace("\n", " ")
    assert "CREATE DATABASE IF NOT EXISTS slurm_acct_db;" in notes and "innodb_lock_wait_timeout=900" in notes
    assert "start order: MariaDB, then slurmdbd" in notes and str(secret) in notes

    # rendered again: the same password; printed to the terminal: no password at all
    assert _render(lab, {**LAB_SLURM, "accounting": LAB_ACCOUNTING}, out).returncode == 0
    assert secret.read_text().strip() == password and f"StoragePass={password}\n" in dbd.read_text()
    shown = lab.cli("slurm", "config")
    assert shown.returncode == 0 and password not in shown.stdout + shown.stderr
    assert "# --- job_submit.lua ---" in shown.stdout and "written only with --out" in shown.stderr


def test_a_bad_member_value_is_one_line_naming_the_member(lab, tmp_path):
    out = tmp_path / "etc"
    bad = {**LAB_ACCOUNTING, "members": [{"user": "alice", "projects": ["vla"], "fairshare": "lots"}]}
    proc = _render(lab, {**LAB_SLURM, "accounting": bad}, out)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "slurm.yaml: accounting.members[alice].fairshare: Input should be a valid integer" in line, line
    assert not out.exists()
