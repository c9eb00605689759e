"""`det-lab doctor` on a missing, read-only, over-quota and healthy data root, and its parsers.

Most checks run det-lab in this process (fast); the table and the read-only mount go through the
installed console script, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from typer.testing import CliRunner

from det_lab.cli.app import app
from det_lab.doctor import gpu_report, run_checks
from det_lab.mounts import mount_of, parse_mounts
from det_lab.settings import load_settings
from tests.conftest import VENV_BIN


def invoke(lab, *args: str):
    """det-lab in this process: its exit code and output, without the interpreter start."""
    result = CliRunner().invoke(app, list(args), env=lab.env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def init(lab) -> None:
    result = invoke(lab, "init")
    assert result.exit_code == 0, result.output


def doctor_json(lab, *prefix: str) -> tuple[int, dict]:
    """`det-lab doctor --json`; with ``prefix`` (a command to wrap it in) the installed script."""
    if not prefix:
        result = invoke(lab, "doctor", "--json")
        return result.exit_code, json.loads(result.stdout)
    proc = subprocess.run([*prefix, str(VENV_BIN / "det-lab"), "doctor", "--json"], env=lab.env,
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_missing_root_fails_with_a_fix(lab):
    rc, report = doctor_json(lab)
    assert rc == 1 and report["ok"] is False
    root = by_name(report)["data root"]
    assert root["status"] == "fail" and "does not exist" in root["detail"]
    assert "DET_LAB_DATA_ROOT" in root["fix"] and "det-lab init" in root["fix"]
    # no per-project lines pretend to know usage of a volume that is not there
    assert not any(name.startswith("quota ") for name in by_name(report))


def _own_filesystem(path: Path, size: str) -> None:
    """A tmpfs of ``size`` at ``path`` (made here): a volume whose free space the test decides,
    whatever the machine's own disk holds (a CI machine with less than 10 % free made this warn)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs of its own as the data root: needs root")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)


@pytest.fixture
def volume(lab):
    """Unmounts what :func:`_own_filesystem` mounted at the lab's root."""
    yield lab.root
    subprocess.run(["umount", "-l", str(lab.root)], check=False, capture_output=True)


def test_healthy_root_passes(lab, volume):
    _own_filesystem(volume, "4g")  # empty: all of it free, above the 1 GiB floor
    init(lab)
    rc, report = doctor_json(lab)
    checks = by_name(report)
    assert rc == 0 and report["ok"] is True, [c for c in report["checks"] if c["status"] == "fail"]
    for name in ("data root", "data root writable", "layout", "group sharing", "free space", "quota vla", "git",
                 "dvc", "determined"):
        assert checks[name]["status"] == "pass", checks[name]
    # on this machine: no Docker, no GPU -> warnings that say local mode still works
    for c in report["checks"]:
        if c["status"] == "warn":
            assert c["fix"], c
    assert len(report["risks"]) == 5 and all(r["detail"] for r in report["risks"])


def test_a_volume_with_less_than_a_gib_free_fails_with_a_fix(lab, volume):
    _own_filesystem(volume, "512m")
    init(lab)
    rc, report = doctor_json(lab)
    free = by_name(report)["free space"]
    assert rc == 1 and report["ok"] is False
    assert free["status"] == "fail" and "free of 512.0 MiB" in free["detail"], free
    assert "delete old checkpoints" in free["fix"], free


def test_human_table_lists_every_check_with_fix(lab):
    lab.cli("init", check=True)  # both through the installed script
    proc = lab.cli("doctor")
    assert proc.returncode == 0
    for text in ("data root writable", "quota isaac", "docker", "pass", "GPU OOM from concurrent jobs"):
        assert text in proc.stdout


def test_uninitialised_root_warns_to_run_init(lab):
    lab.root.mkdir()
    rc, report = doctor_json(lab)
    assert rc == 0
    assert by_name(report)["layout"]["status"] == "warn"
    assert "det-lab init" in by_name(report)["layout"]["fix"]


def test_over_quota_fails_only_that_project(lab):
    lab.write_config(projects={"vla": {"quota": "64KiB"}})
    init(lab)
    (lab.root / "outputs" / "vla" / "big.bin").write_bytes(os.urandom(200_000))
    rc, report = doctor_json(lab)
    checks = by_name(report)
    assert rc == 1
    assert checks["quota vla"]["status"] == "fail" and "over quota" in checks["quota vla"]["detail"]
    assert "projects.vla.quota" in checks["quota vla"]["fix"]
    assert checks["quota 3dgs"]["status"] == "pass"
    risk = {r["name"]: r for r in report["risks"]}["no disk quota"]
    assert risk["status"] == "fail"


def test_nearly_full_quota_warns(lab):
    lab.write_config(projects={"3dgs": {"quota": "100KiB"}})
    init(lab)
    (lab.root / "datasets" / "3dgs" / "blob").write_bytes(os.urandom(94 * 1024))
    _, report = doctor_json(lab)
    assert by_name(report)["quota 3dgs"]["status"] == "warn"


def test_read_only_root_fails(lab):
    init(lab)
    if os.geteuid() == 0:
        if not shutil.which("unshare"):
            pytest.skip("root without unshare(1): cannot make a read-only mount")
        # a real read-only bind mount in a private mount namespace (root ignores mode bits)
        script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
        rc, report = doctor_json(lab, "unshare", "-m", "sh", "-c", script, str(lab.root))
        assert by_name(report)["shared mount"]["status"] == "fail"
    else:
        os.chmod(lab.root, 0o555)
        try:
            rc, report = doctor_json(lab)
        finally:
            os.chmod(lab.root, 0o2775)
    writable = by_name(report)["data root writable"]
    assert rc == 1 and writable["status"] == "fail" and "cannot write" in writable["detail"]


def test_nfs_mount_is_recognised_and_soft_mounts_warned(lab, tmp_path):
    init(lab)
    settings = load_settings(lab.config, env={})
    real = open("/proc/mounts").read()
    for opts, status in (("rw,relatime,vers=4.2,hard,proto=tcp", "pass"), ("rw,vers=3,soft", "warn")):
        mounts = tmp_path / "mounts"
        mounts.write_text(real + f"nas:/export/lab {lab.root} nfs4 {opts} 0 0\n")
        check = {c.name: c for c in run_checks(settings, mounts_file=mounts)}["shared mount"]
        assert check.status == status and "nas:/export/lab" in check.detail


def test_parse_mounts_picks_the_deepest_mount_and_unescapes():
    table = parse_mounts(
        "/dev/sda1 / ext4 rw 0 0\n"
        "nas:/vol /mnt/data nfs4 rw,hard 0 0\n"
        "nas:/vol/scratch /mnt/data/my\\040scratch nfs rw,soft 0 0\n"
    )
    from pathlib import Path
    assert mount_of(Path("/mnt/data/datasets/vla"), table).device == "nas:/vol"
    assert mount_of(Path("/mnt/data/my scratch/x"), table).fstype == "nfs"
    assert mount_of(Path("/home"), table).mountpoint == Path("/")


NVIDIA_SMI_HEADER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
+-----------------------------------------------------------------------------------------+
"""


def test_gpu_report_names_who_holds_each_gpu_and_flags_sharing():
    me = os.getpid()
    gpus = ("0, GPU-aaa, NVIDIA RTX 6000 Ada Generation, 30000, 49140, 550.54.15\n"
            "1, GPU-bbb, NVIDIA RTX 6000 Ada Generation, 0, 49140, 550.54.15\n")
    apps = f"GPU-aaa, {me}, 20000\nGPU-aaa, 999999999, 10000\n"
    gpu, cuda = list(gpu_report(gpus, apps, NVIDIA_SMI_HEADER))
    user = __import__("pwd").getpwuid(os.geteuid()).pw_name
    assert gpu.status == "warn" and "GPU0" in gpu.detail and f"{user} (pid {me}" in gpu.detail
    assert "GPU1 NVIDIA RTX 6000 Ada Generation 0/49140 MiB free" in gpu.detail
    assert "Determined" in gpu.fix
    assert cuda.status == "pass" and "CUDA <= 12.4" in cuda.detail and "550.54.15" in cuda.detail

    gpu, _ = list(gpu_report(gpus, f"GPU-aaa, {me}, 20000\n", NVIDIA_SMI_HEADER))
    assert gpu.status == "pass"


def test_master_check(lab):
    init(lab)
    from det_lab.tracking.mlflow_server import free_port

    port = free_port()
    lab.write_config(master_url=f"http://127.0.0.1:{port}")
    rc, report = doctor_json(lab)
    assert rc == 1 and by_name(report)["master"]["status"] == "fail"
    assert "det-lab cluster up" in by_name(report)["master"]["fix"]

    class Info(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"version": "0.38.1", "clusterName": "lab"}).encode()
            self.send_response(200 if self.path == "/info" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", port), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, report = doctor_json(lab)
    finally:
        server.shutdown()
    assert rc == 0 and by_name(report)["master"]["status"] == "pass"


def test_directories_another_member_cannot_write_in_are_warned(lab):
    init(lab)
    made_by_hand = lab.root / "checkpoints" / "vla"
    made_by_hand.chmod(0o755)  # as mkdir makes it under umask 022
    rc, report = doctor_json(lab)
    check = by_name(report)["group sharing"]
    assert rc == 0 and check["status"] == "warn" and str(made_by_hand) in check["detail"]
    assert f"chmod g+ws {made_by_hand}" in check["fix"]
    init(lab)  # widens what this user owns
    assert by_name(doctor_json(lab)[1])["group sharing"]["status"] == "pass"
