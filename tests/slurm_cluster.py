"""A real one-node Slurm cluster (munged + slurmctld + slurmd) in a temporary directory.

The configuration is det_lab's own rendering (:mod:`det_lab.slurm.conf`) of a node with two fake
GPUs (character devices with no driver behind them), with test-only keys on top: private ports,
paths and munge socket, root as the Slurm user, and short scheduler and requeue delays.
Import the fixtures into a test module: ``from tests.slurm_cluster import slurm_cluster, slurm_volume``
(the session's data root for ``make_slurm_lab``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from det_lab.slurm.conf import render_all
from det_lab.slurm.settings import NodeSettings, SlurmSettings
from det_lab.tracking.mlflow_server import free_port
from tests.conftest import Lab, publish_tiny_data

REPO = Path(__file__).resolve().parents[1]
#: the tests' tiny PyTorchTrial (linear regression; no shuffling, so resumed losses are exact)
TINY = Path(__file__).parent / "fixtures" / "tiny"

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
#: unique per test session: Slurm's cgroups live under /sys/fs/cgroup/<controller>/slurm_<node>
NODE = f"detlab{os.getpid()}"
#: the rendered cgroup plugins run where the cgroup v1 devices controller is mounted (this machine)
CGROUP_DEVICES = Path("/sys/fs/cgroup/devices")
#: an unused character-device major: the fake GPUs stat as devices but have no driver
FAKE_GPU_MAJOR = 241


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` selects it for Slurm's commands (``SLURM_CONF``)."""

    dir: Path
    conf: Path
    settings: SlurmSettings
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env}
        proc = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> {proc.returncode}: {proc.stderr}")
        return proc

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.dir / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-n", NODE, "-o", "%T", check=False).stdout.strip()
            if state.split("\n")[0] in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"node {NODE} did not come up (state {state!r})\n{self.log_tail()}")

    @property
    def constrains_devices(self) -> bool:
        return "TaskPlugin=task/cgroup" in self.conf.read_text()

    def stop(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.procs[-1].poll() is None:
            if not self.run("squeue", "-h", check=False).stdout.strip():
                break  # no job is running or completing: slurmd can go
            time.sleep(0.3)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for hierarchy in Path("/sys/fs/cgroup").glob(f"*/slurm_{NODE}"):
            dirs = sorted((p for p in hierarchy.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for d in [*dirs, hierarchy]:
                # processes of this cluster's jobs that outlived their slurmd (its stepds), by pid
                for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else []:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
            for d in [*dirs, hierarchy]:  # rmdir is how an empty cgroup is removed
                with contextlib.suppress(OSError):
                    d.rmdir()


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def start_cluster(base: Path) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``base``; the caller stops it."""
    for sub in ("etc", "state", "spool", "log", "munge", "dev"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    munge = base / "munge"
    munge.chmod(0o711)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket_path = munge / "munge.socket"
    for i in range(2):
        dev = base / "dev" / f"gpu{i}"
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(FAKE_GPU_MAJOR, i))

    user = os.environ.get("USER") or "root"
    settings = SlurmSettings(
        cluster_name="detlabtest", controller=os.uname().nodename.split(".")[0], controller_addr="127.0.0.1",
        nodes=[NodeSettings(name=NODE, addr="127.0.0.1", cpus=os.cpu_count() or 2, memory="4GiB", gpus=2,
                            gpu_kind="fake", gpu_files=str(base / "dev" / "gpu[0-1]"))],
        slurmctld_port=free_port(), slurmd_port=free_port(), slurm_user=user,
        state_dir=base / "state", spool_dir=base / "spool", log_dir=base / "log",
        signal_seconds=30,
        extra={
            "SlurmdUser": user,
            "AuthInfo": f"socket={socket_path},cred_expire=5",  # a requeued job may start again after 5 s
            "SlurmctldPidFile": str(base / "slurmctld.pid"),
            "SlurmdPidFile": str(base / "slurmd.pid"),
            "JobAcctGatherType": "jobacct_gather/none",
            **({} if CGROUP_DEVICES.is_dir() else {"ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none"}),
            "SchedulerParameters": "sched_interval=1,bf_interval=1",
            "MinJobAge": "600",
            "KillWait": "30",
        },
    )
    files = render_all(settings)
    conf = base / "etc" / "slurm.conf"
    conf.write_text(files["slurm.conf"])
    (base / "etc" / "gres.conf").write_text(files["gres.conf"])
    (base / "etc" / "cgroup.conf").write_text(files["cgroup.conf"])
    cluster = SlurmCluster(base, conf, settings)
    env = {**os.environ, **cluster.env}

    def start(argv: list[str], log: str) -> None:
        out = open(base / "log" / log, "ab")
        cluster.procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))

    start([_binary("munged"), "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
           f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
           f"--log-file={base / 'log' / 'munged.log'}"], "munged.out")
    deadline = time.monotonic() + 15
    while not socket_path.exists():
        if time.monotonic() > deadline or cluster.procs[0].poll() is not None:
            cluster.stop()
            raise RuntimeError(f"munged did not start\n{cluster.log_tail()}")
        time.sleep(0.1)
    start([_binary("slurmctld"), "-D", "-i"], "slurmctld.out")
    start([_binary("slurmd"), "-D", "-N", NODE], "slurmd.out")
    try:
        cluster.wait_idle()
    except RuntimeError:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A real one-node Slurm cluster for the whole test session."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}): "
                    "apt-get install slurm-wlm munge (.ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs (CI runs the tests as root)")
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.run("scancel", "--full", "-u", os.environ.get("USER") or "root", check=False)
    cluster.stop()


@pytest.fixture(scope="session")
def slurm_volume(tmp_path_factory) -> Path:
    """One data root for the Slurm test modules, the VLA demo and the tiny regression data published
    on it; the two publishes run side by side (each is mostly DVC starting up)."""
    from concurrent.futures import ThreadPoolExecutor

    from det_lab.data.demo import make_vla_demo
    from det_lab.data.publish import publish_directory
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    tmp = tmp_path_factory.mktemp("slurm-volume")
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env={})
    lab.write_config()
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    with ThreadPoolExecutor(2) as pool:
        vla = pool.submit(lambda: publish_directory(settings, "vla", "vla-demo", make_vla_demo(tmp / "vla-demo"),
                                                    "VLA demo"))
        publish_tiny_data(settings, tmp)
        vla.result()
    return lab.root


def make_slurm_lab(tmp: Path, mlflow_uri: str | None, cluster: SlurmCluster, root: Path) -> Lab:
    """A lab on the data root ``root`` (see ``slurm_volume``) whose commands reach ``cluster``, MLflow at
    ``mlflow_uri`` (None: no tracking)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               DET_LAB_TEMPLATES=str(REPO / "experiment_templates"), **cluster.env)
    lab = Lab(root=root, config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": mlflow_uri} if mlflow_uri else {"backend": "none"})
    return lab
