"""A multi-host test bed on one machine: three "hosts" as network + UTS + mount namespaces on a
bridge, Slurm with slurmdbd across them from det_lab's own rendered slurm.conf, the lab volume at
the same path on every host.

Layout (``<n>`` is this process's id, so two sessions never share a name)::

    host 0  dl<n>h0  10.213.X.1  slurmctld, slurmdbd, MariaDB (the controller machine)
    host 1  dl<n>h1  10.213.X.2  slurmd, node dl<n>a (2 CPUs, 2 fake GPUs)
    host 2  dl<n>h2  10.213.X.3  slurmd, node dl<n>b
    root namespace   10.213.X.254 on bridge dl<n>br: the login node (sbatch, sacct, det-lab, MLflow)

Each host is started as ``nsenter --net=<netns> unshare --uts --mount --propagation private`` (not
``ip netns exec``, which remounts /sys and hides /sys/fs/cgroup from slurmd: shared/notes/multihost.md)
and then gets its own hostname, ``/etc/hosts`` naming every host, a private ``/tmp`` and ``/run``
(tmpfs), and the lab volume at the same path as on the login node: bind-mounted, or (the
``multihost_sshfs`` bed) an sshfs mount of host 0's SFTP server over the bridge, so that a node cut
off loses its volume too, its writes held up in flight until the link heals. The range is
black-holed in the root namespace before anything targets it, and the hosts have no route but
their /24: no packet leaves the machine. One munged in the root namespace serves every host (its
socket is a path). slurm.conf is :func:`det_lab.slurm.render.render_all` with
``nodes_share_disk=True`` (``%n`` in slurmd's spool, pid file and log) plus test-only keys: private
ports and munge socket, ``proctrack/linuxproc`` and ``task/none`` (three slurmd on one cgroup tree),
``SlurmdTimeout`` as small as works. Everything lives in a directory under /var/tmp (the hosts'
/tmp is their own), and teardown goes by the daemons' pids and by the namespaces, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from det_lab.slurm.render import render_all
from det_lab.slurm.render_accounting import render_slurmdbd_conf, write_slurmdbd_conf
from det_lab.slurm.settings import AccountingSettings, NodeSettings, SlurmSettings
from det_lab.tracking.mlflow_server import MlflowServer, free_port
from tests.conftest import Lab, publish_tiny_data
from tests.slurm_cluster import (
    ACCOUNTING_BINARIES,
    BINARIES,
    FAKE_GPU_MAJOR,
    REPO,
    SlurmCluster,
    _binary,
    _start_mariadb,
    missing_binaries,
)

#: slurmctld marks a node DOWN and requeues its jobs once it has not answered for this long
#: (slurm.conf(5) SlurmdTimeout; it pings every SlurmdTimeout/3)
SLURMD_TIMEOUT = 5
#: seconds an RPC may take (slurm.conf(5) MessageTimeout, default 10): a ping round to a cut-off node
#: lasts this long, and the next round waits for it
MESSAGE_TIMEOUT = 4
#: a host's script: its hostname, /etc/hosts, private /tmp and /run, the volume; then the command
#: Software under /tmp (a CI clone and its venv) is bound into the new /tmp at the same path, as a
#: machine's image would have it: the tmpfs is filled on a free mount point, then moved over /tmp.
#: ``server`` (``addr:port``, a node of an sshfs bed) mounts the volume over the bridge instead of
#: binding it; sshfs daemonizes and lives in this process's namespaces (kill_host ends it).
_HOST_SH = """h=$1; hosts=$2; data=$3; spare=$4; keep=$5; server=$6; shift 6
hostname "$h"
mount --bind "$hosts" /etc/hosts
mount -t tmpfs -o size=256m,mode=1777 dltmp "$spare"
for k in $keep; do mkdir -p "$spare/${k#/tmp/}"; mount --bind "$k" "$spare/${k#/tmp/}"; done
mount --move "$spare" /tmp
mount -t tmpfs -o size=16m,mode=755 dlrun /run
if [ -n "$server" ]; then
  sshfs -o "directport=${server##*:},allow_other,reconnect" "${server%:*}:$data" "$data" || exit 1
else
  mount --bind "$data" "$data"
fi
exec "$@"
"""
#: what the hosts run: this Python's venv and the checkout (det_lab installed editable from it)
_SOFTWARE = sorted({Path(sys.prefix), Path(__file__).resolve().parents[1]})


def in_host(host: Host, hosts_file: Path, data: Path, spare: Path, argv: list[str], volume_server: str = "") -> list[str]:
    """``argv`` as a root process of ``host`` (``_HOST_SH``): its hostname and ``hosts_file``, a private
    /tmp (``spare`` its mount point) keeping the software under /tmp, a private /run, ``data`` at the
    same path (bind-mounted, or with sshfs from ``volume_server``, ``addr:port``)."""
    keep = " ".join(str(p) for p in _SOFTWARE if str(p).startswith("/tmp/"))
    return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation",
            "private", "--", "sh", "-c", _HOST_SH, "sh", host.name, str(hosts_file), str(data), str(spare),
            keep, volume_server, *argv]


@dataclass(frozen=True)
class Host:
    """One namespace "machine": its netns, hostname (its Slurm node name), address, bridge port."""

    index: int
    netns: str
    name: str
    addr: str
    veth: str  # its link's end on the bridge, in the root namespace: down = cut off


@dataclass
class MultiHostCluster(SlurmCluster):
    """A :class:`SlurmCluster` whose daemons run in hosts: ``placement`` maps a daemon to its host."""

    hosts: list[Host] = field(default_factory=list)
    placement: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""
    subnet: str = ""
    data_root: Path = Path()
    timings: dict[str, float] = field(default_factory=dict)
    #: ``addr:port`` of the volume's SFTP server on host 0 when the nodes mount it with sshfs
    volume_server: str = ""

    @property
    def nodes(self) -> list[Host]:
        return self.hosts[1:]

    def host_argv(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` as a process of ``host``."""
        return in_host(host, self.dir / "etc" / "hosts", self.data_root, self.dir / "host-tmp", argv,
                       self.volume_server if host.index > 0 else "")

    def start_daemon(self, name: str) -> subprocess.Popen:
        argv, log = self.argvs[name]
        host = self.placement.get(name)
        if host is not None and argv[0] != "nsenter":
            self.argvs[name] = (self.host_argv(host, argv), log)
        return super().start_daemon(name)

    def on_host(self, host: Host, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a shell command as ``host`` (its namespaces and mounts) and wait for it."""
        return subprocess.run(self.host_argv(host, ["sh", "-c", command]), capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **self.env})

    def node_state(self, host: Host) -> str:
        out = self.run("sinfo", "-h", "-n", host.name, "-o", "%T", check=False).stdout.strip()
        return out.splitlines()[0] if out else ""

    def wait_nodes(self, states: tuple[str, ...] = ("idle", "mixed", "allocated"), timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            now = {h.name: self.node_state(h) for h in self.nodes}
            if all(s.rstrip("*") in states for s in now.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not {states}: {now}\n{self.log_tail()}")
            time.sleep(0.3)

    def pids(self, host: Host) -> list[int]:
        """Every process in ``host``'s network namespace (its daemons, their jobs, the trials)."""
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: Host) -> int:
        """SIGKILL every process of ``host``, as a machine that loses power; how many there were."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def restart_slurmd(self, host: Host) -> None:
        """The node boots again: its slurmd starts as it first did."""
        self.start_daemon(f"slurmd-{host.name}")

    def link(self, host: Host, up: bool) -> None:
        """Cut ``host`` off the bridge (its processes run on) or connect it again."""
        subprocess.run(["ip", "link", "set", host.veth, "up" if up else "down"], check=True)

    def log_tail(self, lines: int = 30) -> str:
        out = [super().log_tail(lines)]
        for path in sorted((self.dir / "log").glob("slurmd-*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _net_up(cluster: MultiHostCluster, base: Path) -> None:
    """The bridge and one veth per host; the range black-holed first (notes: before anything targets it)."""
    if not Path("/run/netns").exists():
        (base / ".made-run-netns").touch()
    _ip("route", "add", "blackhole", cluster.subnet, "metric", "4242")
    _ip("link", "add", cluster.bridge, "type", "bridge")
    _ip("link", "set", cluster.bridge, "up")
    _ip("addr", "add", f"{cluster.subnet.rsplit('.', 1)[0]}.254/24", "dev", cluster.bridge)
    for h in cluster.hosts:
        _ip("netns", "add", h.netns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _ip("link", "set", h.veth, "master", cluster.bridge, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")


def _net_down(cluster: MultiHostCluster, base: Path) -> None:
    for h in cluster.hosts:
        _ip("netns", "del", h.netns, check=False)  # its veth pair goes with it
        _ip("link", "del", h.veth, check=False)
    _ip("link", "del", cluster.bridge, check=False)
    _ip("route", "del", "blackhole", cluster.subnet, "metric", "4242", check=False)
    if (base / ".made-run-netns").exists() and not _ip("netns", "list", check=False).stdout.strip():
        subprocess.run(["umount", "/run/netns"], capture_output=True)
        with contextlib.suppress(OSError):
            Path("/run/netns").rmdir()


def namespaces_refused() -> str | None:
    """Why this kernel (or container) refuses what the test bed needs; None when it allows it."""
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c",
                            "hostname probe && mount -t tmpfs probe /mnt && ip link add probe0 type bridge"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the kernel refuses network/UTS/mount namespaces or bridges here: {probe.stderr.strip()}"
    return None


#: Debian's SFTP server (openssh-sftp-server), what the sshfs bed's file server runs per connection
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
#: the longest a host's TCP waits between retransmissions (ms; net.ipv4.tcp_rto_max_ms, Linux 6.15+;
#: default 120 s): a healed node's sshfs resends what the partition held up within a second or two
TCP_RTO_MAX_MS = 1000


def sshfs_refused() -> str | None:
    """Why the sshfs volume cannot be built here (see :func:`start_bed`); None when it can."""
    missing = [name for name, path in (("sshfs", shutil.which("sshfs")), ("socat", shutil.which("socat")),
                                       ("sftp-server", SFTP_SERVER if Path(SFTP_SERVER).exists() else None))
               if path is None]
    if missing:
        return (f"the sshfs test bed needs {', '.join(missing)} (apt: sshfs fuse3 openssh-sftp-server socat; "
                "tests/setup.sh installs them)")
    if not Path("/dev/fuse").exists():
        return "the sshfs test bed needs FUSE: this kernel (or container) has no /dev/fuse"
    return None


def _start_volume_server(cluster: MultiHostCluster, ctl: Host) -> None:
    """The volume's file server on host 0: socat hands each connection to an sftp-server on the
    volume; the nodes mount it with sshfs (``_HOST_SH``), so a node cut off loses its volume too."""
    for h in cluster.hosts:  # before any socket exists (a socket takes the value it is made with)
        knob = "/proc/sys/net/ipv4/tcp_rto_max_ms"
        subprocess.run(["nsenter", f"--net=/run/netns/{h.netns}", "sh", "-c",
                        f"[ ! -w {knob} ] || echo {TCP_RTO_MAX_MS} > {knob}"], check=True)
    port = free_port()
    cluster.argvs["sftp"] = (["socat", f"TCP-LISTEN:{port},bind={ctl.addr},reuseaddr,fork",
                              f"EXEC:{SFTP_SERVER}"], "sftp.out")
    cluster.placement["sftp"] = ctl
    cluster.start_daemon("sftp")

    def listening() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((ctl.addr, port), timeout=1):
            return True
        return False

    _wait(listening, 15, "the volume's SFTP server")
    cluster.volume_server = f"{ctl.addr}:{port}"


def start_bed(base: Path, volume: str = "bind") -> MultiHostCluster:
    """Bring the test bed up under ``base`` (see the module docstring); the caller tears it down.
    ``volume="sshfs"``: the nodes mount the volume from host 0 over the bridge (FUSE)."""
    t0 = time.monotonic()
    n = os.getpid()
    net = f"10.213.{n % 250}"
    names = [f"dl{n}h0", f"dl{n}a", f"dl{n}b"]
    hosts = [Host(i, f"dl{n}h{i}", names[i], f"{net}.{i + 1}", f"dl{n}v{i}") for i in range(3)]
    for sub in ("etc", "state", "spool", "log", "munge", "dev", "data", "host-tmp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for h in hosts[1:]:
        (base / "spool" / h.name).mkdir()  # slurmd does not create its spool directory
        for g in range(2):
            os.mknod(base / "dev" / f"{h.name}-gpu{g}", 0o666 | 0o020000, os.makedev(FAKE_GPU_MAJOR, 10 * h.index + g))
    (base / "etc" / "hosts").write_text("127.0.0.1 localhost\n" + f"{net}.254 dl{n}login\n" +
                                        "".join(f"{h.addr} {h.name}\n" for h in hosts))
    munge = base / "munge"
    munge.chmod(0o711)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = munge / "munge.socket"
    ctl = hosts[0]
    password = "pw" + os.urandom(12).hex()
    (base / "db-password").write_text(password + "\n")
    (base / "db-password").chmod(0o600)
    db_port = free_port()
    acct = AccountingSettings(
        storage_host="127.0.0.1", storage_port=db_port, password_file=base / "db-password", dbd_port=free_port(),
        dbd_extra={"AuthInfo": f"socket={sock}", "PidFile": str(base / "slurmdbd.pid"),
                   "LogFile": str(base / "log" / "slurmdbd.log"), "DebugLevel": "info"})
    extra = {
        "SlurmdUser": "root",
        "AuthInfo": f"socket={sock},cred_expire=5",  # a requeued job may start again after 5 s
        "AccountingStoragePass": str(sock),
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",  # three slurmd, one cgroup tree
        "JobAcctGatherType": "jobacct_gather/none",
        "SchedulerParameters": "sched_interval=1,bf_interval=1",
        # a node is DOWN once it has not answered for SlurmdTimeout; each ping round waits up to
        # MessageTimeout for a node cut off (its packets dropped): both small, so a lost node is seen fast
        "SlurmdTimeout": str(SLURMD_TIMEOUT), "MessageTimeout": str(MESSAGE_TIMEOUT),
        "KillWait": "5", "MinJobAge": "600",
        "PriorityWeightAge": "0",
    }
    settings = SlurmSettings(
        cluster_name=f"dl{n}", controller=ctl.name, controller_addr=ctl.addr,
        nodes=[NodeSettings(name=h.name, addr=h.addr, cpus=2, memory="2GiB", gpus=2, gpu_kind="fake",
                            gpu_files=str(base / "dev" / f"{h.name}-gpu[0-1]")) for h in hosts[1:]],
        slurmctld_port=free_port(), slurmd_port=free_port(), slurm_user="root",
        state_dir=base / "state", spool_dir=base / "spool", log_dir=base / "log",
        signal_seconds=30, extra=extra, accounting=acct)
    for name, text in render_all(settings, nodes_share_disk=True).items():
        (base / "etc" / name).write_text(text)
    write_slurmdbd_conf(base / "etc" / "slurmdbd.conf", render_slurmdbd_conf(settings, password), "root")
    conf = base / "etc" / "slurm.conf"
    cluster = MultiHostCluster(base, conf, settings, node=hosts[1].name, hosts=hosts, bridge=f"dl{n}br",
                               subnet=f"{net}.0/24", data_root=base / "data")
    cluster.placement = {"mariadbd": ctl, "slurmdbd": ctl, "slurmctld": ctl,
                         **{f"slurmd-{h.name}": h for h in hosts[1:]}}
    try:
        _net_up(cluster, base)
        cluster.argvs["munged"] = ([_binary("munged"), "--foreground", "--force", f"--socket={sock}",
                                    f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                                    f"--seed-file={munge / 'seed'}", f"--log-file={base / 'log' / 'munged.log'}"],
                                   "munged.out")
        cluster.start_daemon("munged")
        _wait(lambda: sock.exists(), 15, "munged")
        _start_mariadb(cluster, db_port, password)  # on host 0 (placement), through its socket here
        cluster.argvs["slurmdbd"] = ([_binary("slurmdbd"), "-D"], "slurmdbd.out")
        cluster.start_daemon("slurmdbd")
        cluster.wait_dbd(60)  # slurmctld refuses to start without it the first time
        if volume == "sshfs":
            _start_volume_server(cluster, ctl)
        cluster.argvs["slurmctld"] = ([_binary("slurmctld"), "-D", "-i"], "slurmctld.out")
        cluster.start_daemon("slurmctld")
        for h in hosts[1:]:
            cluster.argvs[f"slurmd-{h.name}"] = ([_binary("slurmd"), "-D", "-N", h.name], f"slurmd-{h.name}.out")
            cluster.start_daemon(f"slurmd-{h.name}")
        cluster.wait_nodes(("idle",))
    except BaseException:
        stop_bed(cluster)
        raise
    cluster.timings["up_s"] = round(time.monotonic() - t0, 2)
    return cluster


def stop_bed(cluster: MultiHostCluster) -> None:
    """Tear down by pid and namespace: the daemons (SIGTERM, then SIGKILL), whatever is left in the
    hosts' network namespaces, the namespaces, the bridge, the black hole, the directory."""
    t0 = time.monotonic()
    with contextlib.suppress(Exception):
        jobs = cluster.run("squeue", "-h", "-o", "%A", check=False).stdout.split()
        if jobs:
            cluster.run("scancel", "--full", *jobs, check=False)
    for h in cluster.hosts:  # the nodes' jobs and trials first: slurmd need not wait for them
        if Path(f"/run/netns/{h.netns}").exists() and h.index > 0:
            cluster.kill_host(h)
    for proc in cluster.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in cluster.procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for h in cluster.hosts:
        if Path(f"/run/netns/{h.netns}").exists():
            cluster.kill_host(h)
    _net_down(cluster, cluster.dir)
    cluster.timings["down_s"] = round(time.monotonic() - t0, 2)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def record_timing(cluster: MultiHostCluster, name: str, seconds: float) -> None:
    """Keep a measured figure (``$DET_LAB_MULTIHOST_TIMINGS``: also appended there as JSON)."""
    cluster.timings[name] = round(seconds, 2)
    out = os.environ.get("DET_LAB_MULTIHOST_TIMINGS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({name: round(seconds, 2)}) + "\n")


@dataclass
class Bed:
    """What a test module gets: the cluster, a lab on its volume (MLflow on the bridge), the MLflow server."""

    cluster: MultiHostCluster
    lab: Lab
    mlflow: MlflowServer


@pytest.fixture(scope="module")
def multihost() -> Iterator[Bed]:
    """The test bed for one test module (see the module docstring), with a lab on its volume (the
    tiny regression data published) whose det-lab commands reach its Slurm, tracking to an MLflow
    server on the bridge's address (the hosts reach it there)."""
    yield from _bed("bind")


@pytest.fixture(scope="module")
def multihost_sshfs() -> Iterator[Bed]:
    """:func:`multihost` with the nodes' volume an sshfs mount served from host 0 over the bridge."""
    refused = sshfs_refused()
    if refused:
        pytest.skip(refused)
    yield from _bed("sshfs")


def _bed(volume: str) -> Iterator[Bed]:
    missing = missing_binaries(BINARIES + ACCOUNTING_BINARIES)
    if missing:
        pytest.skip(f"the multi-host test bed needs Slurm, slurmdbd and MariaDB (missing {', '.join(missing)}): "
                    "tests/setup.sh installs them")
    if os.geteuid() != 0:
        pytest.skip("the multi-host test bed makes network namespaces and runs slurmd: root only")
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    base = Path(tempfile.mkdtemp(prefix="det-lab-multihost-", dir="/var/tmp"))  # the hosts' /tmp is private
    base.chmod(0o755)
    mlflow = None
    cluster = None
    try:
        with ThreadPoolExecutor(2) as pool:
            made = pool.submit(lab_volume, base)
            cluster = start_bed(base, volume)
            mlflow_port = free_port()
            lab = made.result()
        mlflow = MlflowServer(base / "mlflow", mlflow_port, host=cluster.subnet.rsplit(".", 1)[0] + ".254")
        (base / "mlflow").mkdir()
        mlflow.start()
        lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": mlflow.uri})
        lab.env.update(cluster.env)
        yield Bed(cluster, lab, mlflow)
    finally:
        if mlflow is not None:
            mlflow.stop()
        if cluster is not None:
            stop_bed(cluster)
            print(f"\nmulti-host test bed: {json.dumps(cluster.timings)}")
        if not os.environ.get("DET_LAB_MULTIHOST_KEEP"):  # set: keep the logs and the volume to look at
            shutil.rmtree(base, ignore_errors=True)


def lab_volume(base: Path) -> Lab:
    """The lab on ``base/data``: a config outside /tmp (the jobs read it on the hosts), the tiny data."""
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(base / "lab.yaml"), XDG_CONFIG_HOME=str(base / "xdg-config"), COLUMNS="200",
               DET_LAB_TEMPLATES=str(REPO / "experiment_templates"))
    lab = Lab(root=base / "data", config=base / "lab.yaml", env=env)
    lab.write_config()
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    (base / "work").mkdir()
    publish_tiny_data(settings, base / "work")
    return lab


def shell(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
