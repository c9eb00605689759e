"""One trial container as a Determined 0.38.1 agent starts it, with bubblewrap in place of Docker.

``run_allocation`` lays out what the master ships into the container (master/pkg/tasks/task.go:150-191
Archives: the run directory, the helper scripts, the injected user, the harness wheel; task_trial.go:92-103
the trial's directories and entrypoint.sh), composes the environment (tests/standin/task_env.py), and
runs the container's command as the master builds it (task.go:249-258, task_trial.go:112)::

    /run/determined/ship-logs.sh /run/determined/ship_logs.py /run/determined/train/entrypoint.sh

as the linked ``uid:gid`` alone (task.go:408-413), in its own user, PID, IPC, UTS and (``network_mode:
bridge``) network namespaces. From there on everything is Determined's: ship-logs.sh, ship_logs.py,
task-setup.sh and entrypoint.sh re-transcribed (tests/standin/task_scripts.py), then the harness the
master ships, pip-installed into PYTHONUSERBASE: ``determined.exec.prep_container`` downloads the
context from the master (GetTaskContextDirectory) and writes ``/run/determined/info/*.json``, the hooks
are sourced, ``determined.exec.launch`` checks the checkpoint storage and runs the entrypoint.

Reaching the master from the task's own network namespace: the agent's ``container_master_host`` is a
name in the task's /etc/hosts for an address of the namespace's loopback (``RELAY_IP``), where a relay
(``NETFWD_PY``, started before ship-logs.sh) passes connections to a Unix socket bound into the
sandbox; on this side the stand-in passes them to the master stand-in's TCP address. 127.0.0.1 in the
task stays the task's own. A ``container_master_host`` of localhost/127.x is left unreachable, as
under Docker's bridge.

Differences from a Docker agent: no image pull, registry or NVIDIA runtime (GPU slots only choose the
``cuda`` variables); the image is this machine's /usr and /etc (tests/standin/task_image.py) and its
root is read-only; no libnss_determined (the task's /etc/passwd shows its entry instead); the master's
address is on the loopback, not a bridge; the trial's SSH keys and sshd config (task_trial.go:63-90),
ports publishing and capabilities are not set up; ``DET_SHIPPER_EMIT_STDOUT_LOGS=1`` is added unless
``emit_logs=False`` so that the task's output is also in ``TaskExit``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from tests.standin import task_scripts
from tests.standin.model import Allocation, TaskExit
from tests.standin.task_config import RUN_DIR, SHARED_FS_CONTAINER_PATH, WORK_DIR, Image, LinkedUser, pool_defaults
from tests.standin.task_env import agent_env, docker_env, master_env
from tests.standin.task_image import image_root_args, injected_user_files, passwd_view

#: master/version: the harness version the master ships (copy.go:37 globs *<version>*.whl)
DETERMINED_VERSION = "0.38.1"
#: master/pkg/tasks/copy.go:22
WHEELS_DIR = "/opt/determined/wheels"
#: where the stand-in's own files are in the task (not Determined's)
STANDIN_DIR = "/run/det-standin"
#: the task's address for the master: on its own loopback, where the relay listens
RELAY_IP = "127.0.79.1"
#: the agent's container_master_host when the caller names none
MASTER_NAME = "det-master"


@dataclass(frozen=True)
class Machine:
    """Another machine the agent and its containers run on (a host of tests/multihost_agents.py).

    ``name``: its hostname; ``hosts_file``: its /etc/hosts (what a host-networking container sees,
    with its hostname: Docker's ``--network host``); ``argv``: a command as a root process there;
    ``tmp_dir``: where the agent keeps a container's files, at the same path here and there."""

    name: str
    hosts_file: Path
    argv: Callable[[list[str]], list[str]]
    tmp_dir: Path


class _MasterRelay:
    """This side of the relay: a Unix socket whose connections go to the master's TCP address."""

    def __init__(self, path: Path, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=10)
                up.settimeout(None)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def _write(path: Path, text: str, mode: int) -> None:
    path.write_text(text)
    path.chmod(mode)


def _lay_out_run_dir(run: Path, alloc: Allocation, tcd: dict[str, Any], user: LinkedUser) -> None:
    """The container's /run/determined as the master's archives make it (owner, mode)."""
    trial = alloc.task_type == "TRIAL"
    dirs = [("", 0o700), ("info", 0o755), ("pythonuserbase", 0o700), ("workdir", 0o700), ("etc", 0o755)]  # task.go:331-344
    for d, mode in dirs + ([("train", 0o700), ("train/model", 0o700)] if trial else []):  # task_trial.go:92-99
        (run / d).mkdir(exist_ok=True)
        (run / d).chmod(mode)
    _write(run / "task-setup.sh", task_scripts.TASK_SETUP_SH, 0o744)  # task.go:348-353; const.go:15-16
    _write(run / "ship-logs.sh", task_scripts.SHIP_LOGS_SH, 0o755)  # task.go:355-360; const.go:18-19
    _write(run / "ship_logs.py", task_scripts.SHIP_LOGS_PY, 0o755)  # task.go:361-366; const.go:21-22
    if tcd.get("startup_hook"):  # task.go:374-381; const.go:12-13
        _write(run / "dynamic-tcd-startup-hook.sh", tcd["startup_hook"], 0o744)
    if trial:
        _write(run / "train" / "entrypoint.sh", task_scripts.ENTRYPOINT_SH, 0o744)  # task_trial.go:54-61; const.go:4-5
    elif alloc.task_type == "COMMAND":  # api_command.go LaunchCommand's AdditionalFiles (task_command.go:109-111)
        _write(run / "command-entrypoint.sh", task_scripts.COMMAND_ENTRYPOINT_SH, 0o700)
    for p in [run, *run.rglob("*")]:
        os.lchown(p, user.uid, user.gid)  # OwnedArchiveItem: the linked user's
    for name, text in injected_user_files(user).items():  # task.go:389-405: RootItems, root's
        _write(run / "etc" / name, text, 0o600 if name == "shadow" else 0o644)
        os.chown(run / "etc" / name, 0, 0)
    os.chown(run / "etc", 0, 0)


def _mounts(conf: dict[str, Any], work_dir: str = WORK_DIR) -> list[tuple[str, str, bool]]:
    """master/pkg/tasks/task_trial.go:146-159: the experiment's bind mounts (relative container paths
    under the workdir: mounts.go:12-30), then shared_fs checkpoint storage at /determined_shared_fs (a
    command's config has no checkpoint storage: task_command.go:115)."""
    mounts = []
    for m in conf.get("bind_mounts") or []:
        target = m["container_path"]
        mounts.append((m["host_path"], target if os.path.isabs(target) else os.path.join(work_dir, target),
                       bool(m.get("read_only"))))
    storage = conf.get("checkpoint_storage") or {}
    if storage.get("type") == "shared_fs":
        mounts.append((storage["host_path"], SHARED_FS_CONTAINER_PATH, False))
    return mounts


def run_allocation(alloc: Allocation, *, master: dict[str, Any], user: LinkedUser, image: Image, wheel_dir: Path,
                   timeout: float = 600, pool: str = "default", agent: dict[str, Any] | None = None,
                   master_addr: tuple[str, int] | None = None, cluster_id: str = "det-lab-standin",
                   master_id: str = "det-lab-standin-master", emit_logs: bool = True,
                   kill: threading.Event | None = None,
                   services: dict[str, tuple[str, int]] | None = None, machine: Machine | None = None) -> TaskExit:
    """Run ``alloc``'s trial container to its end, as a Determined 0.38.1 agent would.

    ``master``: the master.yaml dict (task-container defaults of ``pool``, unless ``alloc`` carries
    them). ``wheel_dir``: where the master finds its harness wheel (``*0.38.1*.whl``, copy.go:35-79).
    ``agent``: the agent.yaml dict (``master_host``/``master_port``, ``container_master_host``/``_port``,
    ``agent_id``; by default ``det-master`` at ``master_addr``'s port). ``master_addr``: where the master
    stand-in listens on this machine (default: ``alloc.master_url``'s host and port). ``kill``: set it to
    kill the container (SIGKILL, exit 137). Exit code 124 when ``timeout`` passes. ``services``: other
    machines of the lab the task reaches by name (a tracking server): name -> this machine's address,
    relayed as the master is, at the same port. ``machine``: the agent runs on that machine, not this
    one: the container is started there (as root, then ``setpriv`` to the linked user: the uid change
    Docker makes), and with host networking it has that machine's hostname and /etc/hosts.
    """
    if alloc.task_type not in ("TRIAL", "COMMAND"):  # notebook-entrypoint.sh needs jupyterlab in the image
        return TaskExit(alloc.allocation_id, 1, "", f"stand-in agent: a {alloc.task_type} task is not modelled "
                        "(no JupyterLab in the task image); the task was not started\n")
    wheels = sorted(Path(wheel_dir).glob(f"*{DETERMINED_VERSION}*.whl")) if Path(wheel_dir).is_dir() else []
    if not wheels:  # the container is not started: nothing reaches the master or the agent's disk
        return TaskExit(alloc.allocation_id, 1, "", f"stand-in agent: no Determined {DETERMINED_VERSION} harness wheel "
                        f"(*{DETERMINED_VERSION}*.whl) in {wheel_dir}; the task was not started\n")
    tcd = alloc.task_container_defaults or pool_defaults(master, pool)
    if master_addr is None:
        url = urlsplit(alloc.master_url)
        master_addr = (url.hostname or "127.0.0.1", url.port or 8080)
    agent = {"master_host": MASTER_NAME, "master_port": master_addr[1], "agent_id": "det-lab-standin-agent",
             **(agent or {})}
    master_host = agent.get("container_master_host") or agent["master_host"]
    master_port = int(agent.get("container_master_port") or agent["master_port"])
    # task.go:274-277: a container of a multi-agent allocation uses the host's network, whatever the defaults say
    bridge = tcd.get("network_mode", "bridge") != "host" and not alloc.use_host_mode
    hostname = alloc.container_id[:12]  # Docker's default hostname: the container id's first 12 characters
    if machine is not None and not bridge:  # --network host: the host's hostname and /etc/hosts
        hostname = machine.name
    env = docker_env(image.env, master_env(alloc, tcd) + agent_env(alloc, agent, cluster_id=cluster_id,
                                                                   master_id=master_id), hostname)
    if emit_logs:
        env["DET_SHIPPER_EMIT_STDOUT_LOGS"] = "1"
    shm = int((alloc.config.get("resources") or {}).get("shm_size") or tcd["shm_size_bytes"])  # task_trial.go:142-144

    root = Path(tempfile.mkdtemp(prefix="det-task-", dir=machine.tmp_dir if machine else None))
    relays: list[_MasterRelay] = []
    try:
        root.chmod(0o755)
        run, standin, wheels_copy = root / "run", root / "standin", root / "wheels"
        for d in (run, standin, wheels_copy):
            d.mkdir(mode=0o755)
        _lay_out_run_dir(run, alloc, tcd, user)
        for w in wheels:  # copy.go:44-76: the wheel's bytes, owned by the linked user
            shutil.copy2(w, wheels_copy / w.name)
            os.chown(wheels_copy / w.name, user.uid, user.gid)
        passwd, group = passwd_view(user)
        _write(standin / "passwd", passwd, 0o644)
        _write(standin / "group", group, 0o644)
        _write(standin / "netfwd.py", task_scripts.NETFWD_PY, 0o644)
        hosts = f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
        if machine is not None and not bridge:
            hosts = machine.hosts_file.read_text()
        fwd: list[str] = []
        if not bridge:  # network_mode host: the host's network, the master where it listens
            hosts += f"{master_addr[0]}\t{master_host}\n" if not _is_loopback(master_host) else ""
        elif not _is_loopback(master_host):
            if _is_ip(master_host):  # only a name can be pointed at the relay
                raise ValueError(f"stand-in: cannot give the task the address {master_host} (name the master)")
            hosts += f"{RELAY_IP}\t{master_host}\n"
            relays.append(_MasterRelay(standin / "master.sock", master_addr))
            fwd = ["--listen", f"{RELAY_IP}:{master_port}", "--unix", f"{STANDIN_DIR}/master.sock"]
        for i, (name, addr) in enumerate(sorted((services or {}).items())):
            ip = f"127.0.79.{i + 2}"
            hosts += f"{ip}\t{name}\n"
            relays.append(_MasterRelay(standin / f"service-{i}.sock", addr))
            fwd += ["--listen", f"{ip}:{addr[1]}", "--unix", f"{STANDIN_DIR}/service-{i}.sock"]
        _write(standin / "hosts", hosts, 0o644)

        args = ["bwrap", "--die-with-parent", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", hostname, *image_root_args(),
                "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run",
                "--size", str(shm), "--tmpfs", "/dev/shm",
                "--ro-bind", str(standin / "passwd"), "/etc/passwd", "--ro-bind", str(standin / "group"), "/etc/group",
                "--ro-bind", str(standin / "hosts"), "/etc/hosts"]
        if bridge:
            args.append("--unshare-net")
        for own in image.dirs:
            args += ["--ro-bind", str(own), str(own)]
        args += ["--bind", str(run), RUN_DIR, "--ro-bind", str(standin), STANDIN_DIR,
                 "--ro-bind", str(wheels_copy), WHEELS_DIR]
        # Docker mounts a parent before what lies below it (daemon/volumes.go sortMounts)
        work_dir = alloc.work_dir or WORK_DIR
        for host, target, ro in sorted(_mounts(alloc.config, work_dir), key=lambda m: Path(m[1]).parts):
            if not os.path.exists(host):  # Docker's refusal of a missing bind source
                raise FileNotFoundError(f"bind mount source {host} does not exist on this agent")
            args += ["--ro-bind" if ro else "--bind", host, target]
        entrypoint = [f"{RUN_DIR}/train/entrypoint.sh"] if alloc.task_type == "TRIAL" else alloc.entrypoint
        args += ["--remount-ro", "/", "--chdir", work_dir,  # task.go:308 WorkingDir
                 str(image.bin_dir / "python3"), "-I", "-S", f"{STANDIN_DIR}/netfwd.py", *fwd, "--",
                 f"{RUN_DIR}/ship-logs.sh", f"{RUN_DIR}/ship_logs.py", *entrypoint]  # task.go:249-258
        args[0] = shutil.which("bwrap") or "bwrap"
        as_user: dict[str, Any] = {"user": user.uid, "group": user.gid, "extra_groups": []}
        if machine is not None:
            args = machine.argv(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", *args])
            as_user = {}
        proc = subprocess.Popen(args, env=env, umask=0o022, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", **as_user)
        deadline, code, out, err = time.monotonic() + timeout, None, "", ""
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if (kill is not None and kill.is_set()) or time.monotonic() > deadline:
                    code = 137 if kill is not None and kill.is_set() else 124
                    proc.kill()
        code = code if code is not None else (128 - proc.returncode if proc.returncode < 0 else proc.returncode)
        return TaskExit(alloc.allocation_id, code, out, err)
    finally:
        for relay in relays:
            relay.close()
        shutil.rmtree(root, ignore_errors=True)  # AutoRemove (agent/internal/containers/spec.go:35)
