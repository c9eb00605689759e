"""A real one-node Slurm cluster (munged + slurmctld + slurmd) in a temporary directory; with
accounting, a private MariaDB and slurmdbd started before slurmctld (``slurm_acct_cluster``).

The configuration is det_lab's own rendering (:mod:`det_lab.slurm.render`) of a node with two fake
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

from det_lab.slurm.render_accounting import render_slurmdbd_conf, write_slurmdbd_conf
from det_lab.slurm.render import render_all
from det_lab.slurm.settings import AccountingSettings, NodeSettings, SlurmSettings
from det_lab.tracking.mlflow_server import free_port
from tests.conftest import Lab, publish_tiny_data

REPO = Path(__file__).resolve().parents[1]
#: the tests' tiny PyTorchTrial (linear regression; no shuffling, so resumed losses are exact)
TINY = Path(__file__).parent / "fixtures" / "tiny"

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
ACCOUNTING_BINARIES = ("slurmdbd", "sacctmgr", "sacct", "sshare", "mariadbd", "mariadb-install-db", "mariadb")
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
    node: str = NODE
    #: the processes by daemon name (munged, mariadbd, slurmdbd, slurmctld, slurmd)
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    #: how each daemon was started (argv, log name), so a stopped one can be started again
    argvs: dict[str, tuple[list[str], str]] = field(default_factory=dict)

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
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmdbd.log", "mariadbd.out"):
            path = self.dir / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).stdout.strip()
            if state.split("\n")[0] in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"node {self.node} did not come up (state {state!r})\n{self.log_tail()}")

    @property
    def constrains_devices(self) -> bool:
        return "TaskPlugin=task/cgroup" in self.conf.read_text()

    def stop(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.procs and self.procs[-1].poll() is None:
            if not self.run("squeue", "-h", check=False).stdout.strip():
                break  # no job is running or completing: slurmd can go
            time.sleep(0.3)
        procs = sorted(self.procs, key=lambda p: _STOP_ORDER.get(self._name(p), 0))
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for hierarchy in Path("/sys/fs/cgroup").glob(f"*/slurm_{self.node}"):
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


    def _name(self, proc: subprocess.Popen) -> str:
        return next((n for n, p in self.daemons.items() if p is proc), "")

    def start_daemon(self, name: str) -> subprocess.Popen:
        """Start (or start again) the daemon ``name`` as it was first started."""
        argv, log = self.argvs[name]
        out = open(self.dir / "log" / log, "ab")
        proc = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        self.daemons[name] = proc
        return proc

    def stop_daemon(self, name: str) -> None:
        """SIGTERM one daemon and wait for it (e.g. slurmdbd, to see what slurmctld does without it)."""
        proc = self.daemons[name]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    # --- accounting (slurm_acct_cluster only) -----------------------------------------------------------------

    @property
    def accounting(self) -> AccountingSettings:
        assert self.settings.accounting is not None, "this cluster has no accounting (use slurm_acct_cluster)"
        return self.settings.accounting

    def slurm_yaml(self, path: Path, **accounting) -> Path:
        """Write a slurm.yaml describing this cluster, its accounting section updated with ``accounting``
        (members, defaults, projects, deny_on_limit ...): what ``det-lab slurm accounts`` reads."""
        import yaml

        data = self.settings.model_dump(mode="json", exclude={"source"}, exclude_none=True)
        data["accounting"].update(accounting)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def wait_dbd(self, timeout: float = 30) -> None:
        """Until slurmdbd answers sacctmgr."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.run("sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster", check=False)
            if proc.returncode == 0 and not proc.stderr.strip():
                return
            if time.monotonic() > deadline or self.daemons["slurmdbd"].poll() is not None:
                raise RuntimeError(f"slurmdbd does not answer: {proc.stderr}\n{self.log_tail()}")
            time.sleep(0.3)


_STOP_ORDER = {"slurmd": 0, "slurmctld": 1, "slurmdbd": 2, "mariadbd": 3, "munged": 4}


def missing_binaries(names=BINARIES) -> list[str]:
    return [b for b in names if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _start_mariadb(cluster: SlurmCluster, port: int, password: str) -> None:
    """A private MariaDB under ``cluster.dir / "db"`` on 127.0.0.1:``port``; root through its socket makes
    Slurm's database and user."""
    base = cluster.dir
    sock = base / "mysql.sock"
    made = subprocess.run([_binary("mariadb-install-db"), "--user=root", f"--datadir={base / 'db'}",
                           "--auth-root-authentication-method=socket", "--skip-test-db"],
                          capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        raise RuntimeError(f"mariadb-install-db failed ({made.returncode}): {(made.stdout + made.stderr)[-3000:]}")
    cluster.argvs["mariadbd"] = ([_binary("mariadbd"), "--no-defaults", "--user=root", f"--datadir={base / 'db'}",
                                  f"--socket={sock}", f"--port={port}", "--bind-address=127.0.0.1",
                                  f"--pid-file={base / 'mariadbd.pid'}", "--innodb-buffer-pool-size=64M",
                                  "--innodb-log-file-size=16M", "--innodb-lock-wait-timeout=900",
                                  "--skip-name-resolve"], "mariadbd.out")
    cluster.start_daemon("mariadbd")
    deadline = time.monotonic() + 60
    sql = ("CREATE DATABASE slurm_acct_db; CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '%s'; "
           "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" % password)
    while True:
        proc = subprocess.run([_binary("mariadb"), "--no-defaults", "-S", str(sock), "-u", "root", "-e", sql],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline or cluster.daemons["mariadbd"].poll() is not None:
            raise RuntimeError(f"MariaDB did not start: {proc.stderr}\n{cluster.log_tail()}")
        time.sleep(0.3)


def start_cluster(base: Path, accounting: bool = False, node: str = NODE) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``base``; with ``accounting`` MariaDB and slurmdbd first.
    The caller stops it."""
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
    extra = {
        "SlurmdUser": user,
        "AuthInfo": f"socket={socket_path},cred_expire=5",  # a requeued job may start again after 5 s
        "SlurmctldPidFile": str(base / "slurmctld.pid"),
        "SlurmdPidFile": str(base / "slurmd.pid"),
        "JobAcctGatherType": "jobacct_gather/none",
        **({} if CGROUP_DEVICES.is_dir() else {"ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none"}),
        "SchedulerParameters": "sched_interval=1,bf_interval=1",
        "MinJobAge": "600",
        "KillWait": "30",
    }
    acct = None
    if accounting:
        from det_lab.cluster.secrets import generate_password

        db_port = free_port()
        password = generate_password(32)
        (base / "db-password").write_text(password + "\n")
        (base / "db-password").chmod(0o600)
        acct = AccountingSettings(
            storage_host="127.0.0.1", storage_port=db_port, password_file=base / "db-password",
            dbd_port=free_port(), half_life="0", interactive_time="1",
            dbd_extra={"AuthInfo": f"socket={socket_path}", "PidFile": str(base / "slurmdbd.pid"),
                       "LogFile": str(base / "log" / "slurmdbd.log"), "DebugLevel": "info"})
        extra.update({
            # with a private munge socket slurmctld reaches slurmdbd only when told the socket here too
            "AccountingStoragePass": str(socket_path),
            "JobAcctGatherType": "jobacct_gather/linux",
            # test-only: usage counted every minute, never decayed, priorities from fair-share alone
            "PriorityCalcPeriod": "1", "PriorityWeightAge": "0", "PriorityUsageResetPeriod": "NONE",
            "MinJobAge": "600",
            # 8 CPUs declared on a machine that may have 2, so the GPU limits, not CPUs, decide what waits;
            # the declared cores do not exist, so no CPU binding (the GPU device tests run on slurm_cluster)
            "SlurmdParameters": "config_overrides", "TaskPlugin": "task/none", "ProctrackType": "proctrack/linuxproc",
        })
    settings = SlurmSettings(
        cluster_name="detlabacct" if accounting else "detlabtest", controller=os.uname().nodename.split(".")[0],
        controller_addr="127.0.0.1",
        nodes=[NodeSettings(name=node, addr="127.0.0.1", cpus=max(os.cpu_count() or 2, 8) if accounting else
                            os.cpu_count() or 2, memory="4GiB" if not accounting else "8GiB", gpus=2,
                            gpu_kind="fake", gpu_files=str(base / "dev" / "gpu[0-1]"))],
        slurmctld_port=free_port(), slurmd_port=free_port(), slurm_user=user,
        state_dir=base / "state", spool_dir=base / "spool", log_dir=base / "log",
        signal_seconds=30, extra=extra, accounting=acct,
    )
    conf = base / "etc" / "slurm.conf"
    for name, text in render_all(settings).items():
        (base / "etc" / name).write_text(text)
    cluster = SlurmCluster(base, conf, settings, node=node)

    def start(name: str, argv: list[str], log: str) -> None:
        cluster.argvs[name] = (argv, log)
        cluster.start_daemon(name)

    start("munged", [_binary("munged"), "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                     f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
                     f"--log-file={base / 'log' / 'munged.log'}"], "munged.out")
    deadline = time.monotonic() + 15
    while not socket_path.exists():
        if time.monotonic() > deadline or cluster.procs[0].poll() is not None:
            cluster.stop()
            raise RuntimeError(f"munged did not start\n{cluster.log_tail()}")
        time.sleep(0.1)
    try:
        if acct is not None:
            _start_mariadb(cluster, acct.storage_port, password)
            write_slurmdbd_conf(base / "etc" / "slurmdbd.conf", render_slurmdbd_conf(settings, password), user)
            start("slurmdbd", [_binary("slurmdbd"), "-D"], "slurmdbd.out")
            cluster.wait_dbd(60)  # slurmctld refuses to start without it the first time
        start("slurmctld", [_binary("slurmctld"), "-D", "-i"], "slurmctld.out")
        start("slurmd", [_binary("slurmd"), "-D", "-N", node], "slurmd.out")
        cluster.wait_idle()
    except (RuntimeError, subprocess.SubprocessError):
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A real one-node Slurm cluster for the whole test session."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}): "
                    "apt-get install slurm-wlm munge (tests/setup.sh does)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs (CI runs the tests as root)")
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.run("scancel", "--full", "-u", os.environ.get("USER") or "root", check=False)
    cluster.stop()


@pytest.fixture(scope="session")
def slurm_acct_cluster() -> Iterator[SlurmCluster]:
    """A second one-node Slurm cluster with accounting, for the whole test session.

    Its own munged, a private MariaDB (``<dir>/db``, root through ``<dir>/mysql.sock``), slurmdbd and
    slurmctld (started in that order), slurmd as node ``detlabacct<pid>`` with two fake GPUs
    (partition ``fake``). slurm.conf is det_lab's rendering with an ``accounting:`` section
    (``AccountingStorageEnforce=associations,limits,qos,safe``, multifactor fair-share, GPU billing,
    the interactive-job limit of 1 minute through job_submit.lua) plus test-only keys: usage counted
    every minute (``PriorityCalcPeriod=1``) and never decayed (``PriorityDecayHalfLife=0``), no age factor.

    Interface: ``cluster.env`` (``SLURM_CONF``) for Slurm's commands and det-lab; ``cluster.run(argv)``;
    ``cluster.settings`` (cluster name ``detlabacct``); ``cluster.slurm_yaml(path, members=[...], ...)``
    writes a slurm.yaml for ``det-lab --slurm-config`` / ``det-lab slurm accounts``, which creates the
    accounts and limits (nothing but root exists at start); ``cluster.stop_daemon("slurmdbd")`` /
    ``cluster.start_daemon("slurmdbd")`` + ``cluster.wait_dbd()``. Tests share it: make your own
    accounts and users (distinct names) and cancel your jobs. Note that ``det-lab slurm accounts``
    removes every det-lab-made account and QOS its config does not name (tests/test_slurm_accounting.py
    syncs projects ``vla`` and ``side<pid>``): a module that needs accounts of its own should make them
    with plain ``sacctmgr -i add account ...`` (never touched by the sync) or sync them again itself.

    For a job pending on a limit (what tests/test_slurm_accounting.py does): ``sacctmgr -i add qos q1
    MaxTRESPerUser=gres/gpu=1``, ``sacctmgr -i add account a1``, ``sacctmgr -i add user root account=a1
    qos=q1 defaultqos=q1``; two ``sbatch -A a1 --gres=gpu:1`` jobs: the second pends with
    ``QOSMaxGRESPerUser``. For ``sshare``: usage is counted when a job ends and fair-share recomputed
    every minute. Jobs as another Unix user: ``runuser -u USER -- sbatch -D /tmp -o /dev/null ...``
    (the cluster's directory is world-readable for that)."""
    missing = missing_binaries(BINARIES + ACCOUNTING_BINARIES)
    if missing:
        pytest.skip(f"Slurm accounting needs Debian's slurmdbd and mariadb-server packages (missing "
                    f"{', '.join(missing)}): tests/setup.sh installs them")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs (CI runs the tests as root)")
    import tempfile

    # other Unix users submit here: their sbatch reads slurm.conf and the munge socket under this directory
    base = Path(tempfile.mkdtemp(prefix="detlab-slurm-acct-"))
    base.chmod(0o755)
    try:
        cluster = start_cluster(base, accounting=True, node=f"detlabacct{os.getpid()}")
        yield cluster
        jobs = cluster.run("squeue", "-h", "-o", "%A", check=False).stdout.split()
        if jobs:
            cluster.run("scancel", "--full", *jobs, check=False)
        cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


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


def tiny_config(lab: Lab, name: str, **changes) -> Path:
    """The tiny VLA config (:data:`TINY`) with dotted keys changed, written beside the lab's config."""
    import yaml

    conf = yaml.safe_load((TINY / "const.yaml").read_text())
    for key, value in changes.items():
        node = conf
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = lab.config.parent / name
    path.write_text(yaml.safe_dump(conf))
    return path
