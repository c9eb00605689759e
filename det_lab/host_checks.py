"""Checks of this machine that every scheduler needs: the shared volume (mounted, writable, free
space, quotas), the tools (git, DVC, Determined), Docker, the GPUs and the configured services.

``det-lab doctor`` reports them with the rest; ``det-lab cluster up``/``agent-up`` refuse to start on a
``fail`` among them (:func:`det_lab.cluster.deploy.preflight`). Every check returns
:class:`~det_lab.checks.Check` results and never raises.
"""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from det_lab.checks import Check
from det_lab.compat import DETERMINED_VERSION, import_deploy
from det_lab.mounts import NETWORK_FS, mount_of, parse_mounts
from det_lab.net import http_answers
from det_lab.settings import LabSettings
from det_lab.volume import SHARED_DIR_MODE, VolumeLayout, human_bytes, is_initialised, project_usage

MIN_FREE_BYTES = 1 << 30
QUOTA_WARN_FRACTION = 0.8


def config_check(settings: LabSettings) -> Check:
    """Where the lab config came from."""
    return Check("config", "pass", f"loaded from {settings.source}" if settings.source
                 else "built-in defaults (no lab config file found)")


def host_checks(settings: LabSettings, mounts_file: Path = Path("/proc/mounts")) -> list[Check]:
    """The config line, then the volume's, the tools', Docker's, the GPUs' and the services' checks;
    a check that crashes becomes a ``warn`` line and the others still run."""
    return [config_check(settings)] + collect((
        lambda: volume_checks(settings, mounts_file), tool_checks, docker_checks, gpu_checks,
        lambda: service_checks(settings)))


def collect(producers: tuple[Callable[[], Iterator[Check]], ...]) -> list[Check]:
    """Every producer's checks; one that raises becomes a ``warn`` line (a check must never take
    the others down with it)."""
    checks: list[Check] = []
    for produce in producers:
        try:
            checks.extend(produce())
        except Exception as exc:
            checks.append(Check("doctor", "warn", f"a check crashed: {exc!r}", "report this as a det_lab bug"))
    return checks

# --- the shared volume -------------------------------------------------------------------------

def volume_checks(settings: LabSettings, mounts_file: Path) -> Iterator[Check]:
    root = settings.data_root
    if not root.is_dir():
        yield Check(
            "data root", "fail", f"{root} does not exist" if not root.exists() else f"{root} is not a directory",
            f"mount the shared NFS volume at {root} (see docs/admin/volume.md), or for one machine set "
            "DET_LAB_DATA_ROOT to a local directory, then run 'det-lab init'",
        )
        return
    yield Check("data root", "pass", str(root))
    yield _writable(root)
    yield _mount_check(root, mounts_file)
    layout = VolumeLayout.from_settings(settings)
    missing = [d for d in layout.directories(sorted(settings.projects)) if not d.is_dir()]
    if missing or not is_initialised(layout):
        yield Check("layout", "warn",
                    f"{len(missing)} of the volume's directories are missing"
                    + ("" if missing else "; volume marker missing"),
                    "run 'det-lab init' (safe on a populated volume)")
    else:
        yield Check("layout", "pass", "datasets/, dvc-cache/, snapshots/, checkpoints/, outputs/ present")
    yield _group_sharing([d for d in layout.directories(sorted(settings.projects)) if d.is_dir()])
    yield _free_space(root)
    yield from _quota_checks(settings, layout)


def _group_sharing(dirs: list[Path]) -> Check:
    """The volume's directories must be setgid and group-writable, or what one member writes
    (checkpoints, run directories) another cannot resume or delete."""
    unshared = [d for d in dirs if d.stat().st_mode & SHARED_DIR_MODE != SHARED_DIR_MODE]
    if unshared:
        shown = " ".join(str(d) for d in unshared[:3]) + (f" (+{len(unshared) - 3} more)" if len(unshared) > 3 else "")
        return Check("group sharing", "warn", f"not setgid and group-writable: {shown}",
                     f"run 'det-lab init' as their owner, or: chmod g+ws {shown.split(' (+')[0]}")
    return Check("group sharing", "pass", f"{len(dirs)} directories setgid and group-writable; "
                 "det-lab writes group-writable files whatever the umask")


def _writable(root: Path) -> Check:
    user = _user_name(os.geteuid())
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=".det-lab-doctor-"):
            pass
    except OSError as exc:
        return Check(
            "data root writable", "fail", f"{user} cannot write to {root}: {exc.strerror}",
            "remount the volume read-write, or add this user to the volume's group and run 'chmod g+ws' on it",
        )
    return Check("data root writable", "pass", f"writable by {user}")


def _mount_check(root: Path, mounts_file: Path) -> Check:
    try:
        mount = mount_of(root, parse_mounts(mounts_file.read_text()))
    except OSError as exc:
        return Check("shared mount", "warn", f"cannot read {mounts_file}: {exc.strerror}")
    if mount is None:
        return Check("shared mount", "warn", f"no mount found for {root} in {mounts_file}")
    opts = set(mount.options)
    desc = f"{mount.fstype} {mount.device} on {mount.mountpoint} ({','.join(mount.options)})"
    if "ro" in opts:
        return Check("shared mount", "fail", f"read-only: {desc}", "remount it read-write (drop 'ro' from its fstab options)")
    if mount.fstype in NETWORK_FS:
        if "soft" in opts:
            return Check("shared mount", "warn", f"soft NFS mount: {desc}",
                         "mount with 'hard' so a server hiccup stalls I/O instead of corrupting checkpoints")
        return Check("shared mount", "pass", desc)
    if mount.fstype == "autofs":
        return Check("shared mount", "warn", f"autofs trigger, not yet mounted: {desc}",
                     "access the path once or check the automounter map")
    return Check("shared mount", "warn", f"not NFS: {desc}",
                 "fine for a single machine; for a team, mount the same NFS export here on every machine")


def _free_space(root: Path) -> Check:
    st = os.statvfs(root)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    detail = f"{human_bytes(free)} free of {human_bytes(total)}"
    if free < MIN_FREE_BYTES:
        return Check("free space", "fail", detail, "delete old checkpoints/outputs or grow the volume")
    if total and free / total < 0.1:
        return Check("free space", "warn", detail, "less than 10% left: clean up before the next large pull")
    return Check("free space", "pass", detail)


def _quota_checks(settings: LabSettings, layout: VolumeLayout) -> Iterator[Check]:
    for name, project in sorted(settings.projects.items()):
        used, quota = project_usage(layout, name), int(project.quota)
        detail = f"{human_bytes(used)} of {human_bytes(quota)} ({used / quota:.0%})"
        if used >= QUOTA_WARN_FRACTION * quota:
            detail += f"; largest: {_largest(settings, name)}"
        if used > quota:
            yield Check(f"quota {name}", "fail", f"over quota: {detail}",
                        f"delete data under {layout.outputs(name)} / {layout.project_checkpoints(name)} "
                        f"or raise projects.{name}.quota in the lab config; see 'det-lab volume usage --by run'")
        elif used >= QUOTA_WARN_FRACTION * quota:
            yield Check(f"quota {name}", "warn", detail, "nearly full: clean up before the next pull "
                        "('det-lab runs prune', 'det-lab data gc'; 'det-lab volume usage --by run' shows who uses it)")
        else:
            yield Check(f"quota {name}", "pass", detail)


def _largest(settings: LabSettings, project: str) -> str:
    """The project's largest runs and kinds, in words (``run-3 12.0 GiB, checkpoints 40.1 GiB``)."""
    from det_lab.lifecycle.space import largest_consumers

    return ", ".join(f"{name} {human_bytes(n)}" for name, n in largest_consumers(settings, project)) or "nothing"


# --- tools ------------------------------------------------------------------------------------

def tool_checks() -> Iterator[Check]:
    git = shutil.which("git")
    if git:
        yield Check("git", "pass", _first_line([git, "--version"]))
    else:
        yield Check("git", "fail", "git not found", "install git (apt-get install git); DVC datasets need it")
    try:
        dvc_version = importlib.metadata.version("dvc")
    except importlib.metadata.PackageNotFoundError:
        yield Check("dvc", "fail", "dvc is not installed", "pip install det-lab (it depends on dvc)")
    else:
        yield Check("dvc", "pass", f"dvc {dvc_version}")
    try:
        version = importlib.metadata.version("determined")
    except importlib.metadata.PackageNotFoundError:
        yield Check("determined", "fail", "determined is not installed", f"pip install determined=={DETERMINED_VERSION}")
        return
    try:
        import_deploy()
    except Exception as exc:
        yield Check("determined", "fail", f"determined {version}: 'det deploy' is broken ({exc})",
                    "reinstall det-lab so its setuptools pin applies: pip install --force-reinstall det-lab")
        return
    if version != DETERMINED_VERSION:
        yield Check("determined", "warn", f"determined {version}; det_lab is tested with {DETERMINED_VERSION}",
                    f"pip install determined=={DETERMINED_VERSION}")
    else:
        yield Check("determined", "pass", f"determined {version}, 'det deploy' importable")


# --- Docker and GPUs --------------------------------------------------------------------------

def docker_checks() -> Iterator[Check]:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
        info = client.info()
    except Exception as exc:
        yield Check("docker", "warn", f"no Docker daemon reachable ({type(exc).__name__})",
                    "local mode works without it; for the cluster install Docker and add your user to group 'docker'")
        yield Check("nvidia runtime", "warn", "not checked (no Docker)",
                    "install nvidia-container-toolkit once Docker is running")
        return
    yield Check("docker", "pass", f"Docker {info.get('ServerVersion', '?')}")
    runtimes = set((info.get("Runtimes") or {}).keys())
    if "nvidia" in runtimes or info.get("CDISpecDirs"):
        yield Check("nvidia runtime", "pass", f"runtimes: {', '.join(sorted(runtimes))}")
    else:
        yield Check("nvidia runtime", "warn", "no nvidia runtime registered with Docker",
                    "install nvidia-container-toolkit and run 'nvidia-ctk runtime configure --runtime=docker'")


def gpu_checks(run: Callable[[list[str]], str] | None = None) -> Iterator[Check]:
    run = run or _run
    smi = shutil.which("nvidia-smi")
    if not smi:
        yield Check("gpus", "warn", "no NVIDIA GPU visible (nvidia-smi not found)",
                    "CPU-only local mode works; on a GPU machine install the NVIDIA driver")
        yield Check("cuda", "warn", "no NVIDIA driver, so no CUDA",
                    "on GPU machines install one driver version everywhere; task images carry CUDA")
        return
    try:
        gpus = run([smi, "--query-gpu=index,uuid,name,memory.used,memory.total,driver_version",
                    "--format=csv,noheader,nounits"])
        apps = run([smi, "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"])
        header = run([smi])
    except (OSError, subprocess.SubprocessError) as exc:
        yield Check("gpus", "fail", f"nvidia-smi failed: {exc}", "check the NVIDIA driver (a reboot after an upgrade?)")
        return
    yield from gpu_report(gpus, apps, header)


def gpu_report(gpus_csv: str, apps_csv: str, smi_header: str) -> Iterator[Check]:
    """Turn nvidia-smi's CSV output into the 'gpus' and 'cuda' lines (who holds which GPU)."""
    rows = [[c.strip() for c in line.split(",")] for line in gpus_csv.strip().splitlines() if line.strip()]
    holders: dict[str, list[str]] = {}
    for line in apps_csv.strip().splitlines():
        parts = [c.strip() for c in line.split(",")]
        if len(parts) >= 3 and parts[1].isdigit():
            holders.setdefault(parts[0], []).append(f"{_pid_owner(int(parts[1]))} (pid {parts[1]}, {parts[2]} MiB)")
    if not rows:
        yield Check("gpus", "warn", "nvidia-smi lists no GPUs", "check the driver and that the GPU is seated")
        return
    shared = []
    described = []
    for index, uuid, name, used, total, _driver in (r[:6] for r in rows if len(r) >= 6):
        who = holders.get(uuid, [])
        described.append(f"GPU{index} {name} {used}/{total} MiB" + (f" held by {', '.join(who)}" if who else " free"))
        if len(who) > 1:
            shared.append(f"GPU{index}")
    detail = "; ".join(described)
    if shared:
        yield Check("gpus", "warn", f"several processes share {', '.join(shared)}: {detail}",
                    "submit work through Determined, Slurm or det-lab run --local (a GPU lease) so each GPU has "
                    "one job (concurrent jobs OOM)")
    else:
        yield Check("gpus", "pass", detail)
    driver = rows[0][5] if len(rows[0]) >= 6 else "?"
    cuda = next((ln.split("CUDA Version:")[1].split()[0] for ln in smi_header.splitlines() if "CUDA Version:" in ln), "?")
    yield Check("cuda", "pass",
                f"driver {driver} supports CUDA <= {cuda}; handled by the cluster: each task brings CUDA in its image",
                f"build task images for CUDA <= {cuda}")


# --- services ---------------------------------------------------------------------------------

def service_checks(settings: LabSettings) -> Iterator[Check]:
    if settings.master_url:
        ok, detail = http_answers(f"{settings.master_url}/info")
        if ok:
            yield Check("master", "pass", f"{settings.master_url} answers: {detail}")
        else:
            yield Check("master", "fail", f"{settings.master_url} unreachable: {detail}",
                        "start it with 'det-lab cluster up' or fix master_url in the lab config")
    else:
        yield Check("master", "pass", "none configured: local mode ('det-lab run ... --local')")
    t = settings.tracking
    if t.backend == "none":
        yield Check("audit trail", "warn", "tracking backend 'none': runs are recorded only by Determined",
                    "set tracking.backend to mlflow or aim in the lab config")
        return
    if t.uses_mlflow and t.mlflow_uri and t.mlflow_uri.startswith("http"):
        ok, detail = http_answers(f"{t.mlflow_uri.rstrip('/')}/health")
        yield Check("audit trail mlflow", "pass" if ok else "warn",
                    f"{t.mlflow_uri} {'answers' if ok else 'unreachable: ' + detail}",
                    "" if ok else "start the MLflow server; until then training journals metrics locally")
    elif t.uses_mlflow:
        yield Check("audit trail mlflow", "pass", f"MLflow {t.mlflow_uri or 'local SQLite store'}")
    if t.uses_aim:
        yield Check("audit trail aim", "pass", f"Aim {t.aim_repo or 'local repository'}")


# --- helpers ----------------------------------------------------------------------------------

def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=True).stdout


def _first_line(cmd: list[str]) -> str:
    try:
        return _run(cmd).strip().splitlines()[0]
    except Exception as exc:
        return f"{cmd[0]} ({exc})"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _pid_owner(pid: int) -> str:
    try:
        return _user_name(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "a process in another container"
