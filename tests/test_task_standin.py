"""The templates as a Determined 0.38.1 agent runs them: in tests/task_standin.py's sandbox, as a
linked non-root user, with the master config det_lab renders and the lab's own projects.

Each test names the Determined source it follows (determined-ai/determined at 0.38.1); the stand-in
itself says which behaviours it reproduces and where it differs.
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from det_lab.cluster.render import prepare_local_cache, publish_task_config, render_master, task_config_path
from det_lab.cluster.settings import ClusterSettings
from det_lab.settings import load_settings
from tests.task_standin import Image, LinkedUser, env_list, experiment_config, pool_defaults, run_trial
from tests.test_shared_volume import _add_user, _venv_for

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "experiment_templates"
HOOK_TEMPLATES = ("vla", "gaussian_splatting", "isaac_lab")

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("useradd"),
    reason="needs root, useradd and bubblewrap (Debian's bubblewrap) for a linked non-root task user")


# --- the startup hook, as entrypoint.sh runs it -----------------------------------------------------

def _entrypoint_sourcing(hook: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """master/static/srv/entrypoint.sh:7-15: `set -e`, then `test -f startup-hook.sh && source
    startup-hook.sh`, then the launch. The launch here prints the shell's options and variables."""
    script = (
        "set -e\n"
        "before=$(declare -p | grep -v -e '^declare -[a-zA-Z-]* \\(BASH\\|_\\|FUNCNAME\\|PIPESTATUS\\)' | sort)\n"
        f'STARTUP_HOOK="{hook}"\n'
        'test -f "${STARTUP_HOOK}" && source "${STARTUP_HOOK}"\n'
        "after=$(declare -p | grep -v -e '^declare -[a-zA-Z-]* \\(BASH\\|_\\|FUNCNAME\\|PIPESTATUS\\|before\\)' | sort)\n"
        'echo "launch: options=$- pipefail=$(set -o | grep -c "pipefail *on") functions=$(declare -F | wc -l)"\n'
        'diff <(echo "$before") <(echo "$after") | grep "^[<>]" | grep -v STARTUP_HOOK || true\n'
    )
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_the_templates_share_one_startup_hook():
    hooks = {t: (TEMPLATES / t / "startup-hook.sh").read_bytes() for t in HOOK_TEMPLATES}
    assert len(set(hooks.values())) == 1, "the templates' startup-hook.sh copies differ"


@pytest.mark.parametrize("template", HOOK_TEMPLATES)
def test_a_sourced_hook_lets_the_trial_start_with_the_shell_unchanged(template):
    """With det_lab in the image (the lab's task image) the hook does nothing: the entrypoint goes on
    to the launch with `set -e` alone (no `-u`, no pipefail) and no variable or function left behind."""
    venv_bin = Path(os.sys.executable).parent
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "DET_LAB_DATA_ROOT": "/nonexistent"}
    proc = _entrypoint_sourcing(TEMPLATES / template / "startup-hook.sh", env)
    assert proc.returncode == 0, proc.stderr
    launch = [line for line in proc.stdout.splitlines() if line.startswith("launch:")]
    assert launch == ["launch: options=ehBc pipefail=0 functions=0"] or (
        launch and "u" not in launch[0].split("options=")[1].split()[0] and "pipefail=0" in launch[0]
        and "functions=0" in launch[0]), proc.stdout
    leaked = [line for line in proc.stdout.splitlines() if line.startswith(("<", ">"))]
    assert leaked == [], leaked


def _fake_python(tmp_path: Path) -> Path:
    """An image without det_lab: its python3 records pip calls; det_lab imports once 'installed'."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f'case "$*" in *"import det_lab"*) [ -f {tmp_path}/installed ] && exit 0; exit 1;; esac\n'
        f'case "$*" in *"pip install"*) touch {tmp_path}/installed;; esac\n')
    (fake / "python3").chmod(0o755)
    return fake


def test_a_hook_with_nothing_to_install_from_says_why_and_leaves_the_shell_to_the_trial(tmp_path):
    """The hook never ends the entrypoint's shell: with det_lab missing and no wheelhouse or pip spec
    it names what it looked for, and the trial's own `import det_lab` fails after that line."""
    fake = _fake_python(tmp_path)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "DET_LAB_DATA_ROOT": str(tmp_path / "root")}
    proc = _entrypoint_sourcing(TEMPLATES / "vla" / "startup-hook.sh", env)
    assert proc.returncode == 0 and "launch: options=" in proc.stdout, proc.stderr
    assert "det_lab is not installed in this image" in proc.stderr and "DET_LAB_PIP_SPEC" in proc.stderr
    assert "pip install" not in (tmp_path / "calls").read_text()


def test_the_hook_installs_with_the_task_python_from_the_wheelhouse_or_the_pip_spec(tmp_path):
    fake = _fake_python(tmp_path)
    wheels = tmp_path / "root" / ".det-lab" / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "det_lab-0.1.0-py3-none-any.whl").write_bytes(b"")
    # task-setup.sh:16-19: the task's Python is $DET_PYTHON_EXECUTABLE (Isaac Sim's python.sh), not python3
    (fake / "python.sh").symlink_to(fake / "python3")
    env = {"PATH": "/usr/bin:/bin", "DET_LAB_DATA_ROOT": str(tmp_path / "root"),
           "DET_PYTHON_EXECUTABLE": str(fake / "python.sh")}
    proc = _entrypoint_sourcing(TEMPLATES / "isaac_lab" / "startup-hook.sh", env)
    assert proc.returncode == 0 and "launch:" in proc.stdout, proc.stderr
    # --user: into PYTHONUSERBASE, which the task user owns (master/pkg/tasks/task.go:198-200)
    assert f"-m pip install --quiet --user --no-index --find-links {wheels} det_lab" in (tmp_path / "calls").read_text()

    (tmp_path / "installed").unlink()
    shutil.rmtree(wheels)
    env["DET_LAB_PIP_SPEC"] = "/mnt/data/wheels/det_lab-0.1.0-py3-none-any.whl"
    proc = _entrypoint_sourcing(TEMPLATES / "gaussian_splatting" / "startup-hook.sh", env)
    assert proc.returncode == 0 and "launch:" in proc.stdout, proc.stderr
    assert f"install --quiet --user --no-cache-dir {env['DET_LAB_PIP_SPEC']}" in (tmp_path / "calls").read_text()


# --- the master's task-container defaults, merged as Determined merges them ----------------------

def test_a_pool_block_keeps_the_labs_shm_size_and_preemption_timeout():
    """A pool with a GPU kind gets a task_container_defaults block; Determined parses it with its own
    defaults filled in (task_container_defaults.go:80-89), which win in the merge (:183-335)."""
    lab = load_settings(None, env={})
    cluster = ClusterSettings(pools=[{"name": "a100", "gpu_kind": "a100", "agents": ["gpu1"]}],
                              default_compute_pool="a100", default_aux_pool="a100",
                              tasks={"shm_size": "32GiB", "preemption_timeout": 600})
    master = render_master(lab, cluster)
    tcd = pool_defaults(master, "a100")
    assert tcd["shm_size_bytes"] == 32 * 1024**3 and tcd["preemption_timeout"] == 600
    env = dict(e.split("=", 1) for e in env_list(tcd["environment_variables"]))
    assert env["DET_LAB_GPU_KIND"] == "a100" and env["DET_LAB_CONFIG"] == str(task_config_path(lab))
    # and an experiment's own variables win over the defaults' (environment_config.go:160-175)
    conf = experiment_config(master, "a100", {"environment": {"environment_variables": ["DET_LAB_GPU_KIND=x"]}})
    assert env_list(conf["environment"]["environment_variables"], "cuda")[-1] == "DET_LAB_GPU_KIND=x"


def test_the_task_copy_of_the_lab_config_loads_as_the_lab_config(tmp_path):
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({
        "data_root": str(tmp_path / "data"), "group": "robots",
        "projects": {"grasping": {"quota": "2GiB", "description": "grasp"}}, "tracking": {"backend": "none"}}))
    lab = load_settings(tmp_path / "lab.yaml", env={})
    path = publish_task_config(lab)
    seen = load_settings(None, env={"DET_LAB_CONFIG": str(path)})
    assert seen.model_dump(exclude={"source"}) == lab.model_dump(exclude={"source"})
    assert oct(path.stat().st_mode & 0o777) == "0o644"


# --- the three templates, trained in the stand-in -------------------------------------------------

class Lab:
    """A volume of one Unix group, the lab's own project ``grasping``, demo data, a rendered master."""

    def __init__(self, base: Path, group: str, gid: int, a, b, bin_dir: Path) -> None:
        self.base, self.group, self.gid, self.a, self.b, self.bin = base, group, gid, a, b, bin_dir
        self.data = base / "data"
        self.config = base / "lab.yaml"

    def det_lab(self, user, *args: str) -> subprocess.CompletedProcess:
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(user.home), "USER": user.name,
               "DET_LAB_CONFIG": str(self.config), "COLUMNS": "200"}
        return subprocess.run([str(self.bin / "det-lab"), *args], user=user.uid, group=user.gid,
                              extra_groups=[self.gid], umask=0o022, env=env, cwd=user.home,
                              capture_output=True, text=True, timeout=600)

    @property
    def settings(self):
        return load_settings(self.config, env={})

    def master(self, **cluster) -> dict:
        """The master config det_lab renders, with this agent's task cache under the lab's temporary
        directory (made as 'cluster agent-up' makes it), never the host's /var/cache/det-lab."""
        tasks = {"local_cache": str(self.base / "agent-cache"), **cluster.pop("tasks", {})}
        settings = ClusterSettings(tasks=tasks, **cluster)
        prepare_local_cache(self.settings, settings)
        return render_master(self.settings, settings)

    def linked(self, user) -> LinkedUser:
        return LinkedUser(user.name, user.uid, user.gid, [self.gid])

    def image(self) -> Image:
        # the image's Python: the members' venv, the test venv its .pth names and this checkout
        # (det_lab installed editable), wherever they lie (a CI clone under /tmp too)
        return Image(self.bin, dirs=[self.bin.parent, Path(sys.prefix).resolve(), REPO])


@pytest.fixture(scope="module")
def lab():
    if os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("useradd"):
        pytest.skip("needs root, useradd and bubblewrap (Debian's bubblewrap) for a linked non-root task user")
    tag = uuid.uuid4().hex[:6]
    group, names = f"dltask{tag}", (f"dlta{tag}", f"dltb{tag}")
    base = Path(tempfile.mkdtemp(prefix="det-lab-task-"))
    base.chmod(0o755)
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    users = []
    try:
        users = [_add_user(n, group, base) for n in names]
        gid = grp.getgrnam(group).gr_gid
        (base / "data").mkdir()
        os.chown(base / "data", 0, gid)
        (base / "data").chmod(0o2775)
        (base / "lab.yaml").write_text(yaml.safe_dump({
            "data_root": str(base / "data"), "group": group, "tracking": {"backend": "none"},
            "projects": {"grasping": {"quota": "2GiB", "description": "the lab's own project"}}}))
        lab = Lab(base, group, gid, *users, bin_dir=_venv_for(users[0], base))
        init = lab.det_lab(lab.a, "init", "--demo")
        assert init.returncode == 0, init.stdout + init.stderr
        registry = yaml.safe_load((lab.data / ".det-lab" / "datasets.yaml").read_text())
        for demo, name in (("vla-demo", "grasp-frames"), ("3dgs-demo", "grasp-scene")):
            entry = registry[demo]  # the demo data, registered again under the lab's own project
            reg = lab.det_lab(lab.a, "data", "register", name, "--project", "grasping", "--repo", entry["repo"],
                              "--path", entry["path"], "--rev", entry["rev"])
            assert reg.returncode == 0, reg.stdout + reg.stderr
        # what 'det-lab cluster up' writes beside the master config
        publish_task_config(lab.settings)
        yield lab
    finally:
        for u in users:
            subprocess.run(["userdel", u.name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _expconf(template: str, config: str, **lab_section) -> dict:
    conf = yaml.safe_load((TEMPLATES / template / config).read_text())
    conf["data"]["det_lab"].update(project="grasping", **lab_section)
    return conf


def _run(lab: Lab, template: str, conf: dict, user=None, master: dict | None = None, **kw):
    result = run_trial(master or lab.master(), conf, TEMPLATES / template, user=lab.linked(user or lab.a),
                       image=lab.image(), **kw)
    # entrypoint.sh went on past the sourced hook (the VLA and Isaac hooks used to `exit 0` there)
    assert "stand-in: startup hooks done" in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _runs(lab: Lab) -> dict[str, dict]:
    out = {}
    for f in (lab.data / "outputs" / "grasping" / "local-runs").glob("*/run.json"):
        import json
        out[f.parent.name] = json.loads(f.read_text())
    return out


def _new_run(lab: Lab, before: dict) -> dict:
    (name,) = set(_runs(lab)) - set(before)
    return _runs(lab)[name]


@needs_sandbox
def test_the_lab_config_reaches_the_task(lab):
    """A task's environment is Determined's and the defaults' alone (task.go:194-260): the lab's
    project and its quota are known inside it only through DET_LAB_CONFIG."""
    result = run_trial(lab.master(), {"environment": {}}, TEMPLATES / "vla", user=lab.linked(lab.a),
                       image=lab.image(), command=[str(lab.bin / "det-lab"), "data", "list"])
    assert result.returncode == 0, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if "grasping" in line]
    assert "2.0 GiB" in row and "grasp-frames" in row, result.stdout
    assert "DET_LAB_CONFIG" not in os.environ or result.env["DET_LAB_CONFIG"] != os.environ["DET_LAB_CONFIG"]


def _checkpoints(lab: Lab, run: dict, storage: str) -> list[Path]:
    return [lab.data / storage / c["uuid"] for c in run["checkpoints"]]


@needs_sandbox
def test_vla_trains_in_the_task_as_the_linked_user(lab):
    conf = _expconf("vla", "const.yaml", dataset="grasp-frames", max_length={"batches": 40}, reporting_batches=10)
    conf["min_validation_period"] = conf["min_checkpoint_period"] = {"batches": 20}
    before = _runs(lab)
    _run(lab, "vla", conf)
    run = _new_run(lab, before)
    assert run["status"] == "finished", run
    ckpts = _checkpoints(lab, run, "checkpoints/vla")
    assert ckpts and all((c / "state_dict.pth").is_file() for c in ckpts)
    assert {c.stat().st_uid for c in ckpts} == {lab.a.uid}
    # a second trial, another member, a fresh sandbox: only what is mounted is still there. Its
    # frame cache in shm does not fit the container's /dev/shm (task_trial.go:141-143: the
    # experiment's resources.shm_size), so it goes to the volume instead of a SIGBUS
    conf["hyperparameters"]["frame_cache"] = "shm"
    conf["resources"]["shm_size"] = 256 * 1024
    before = _runs(lab)
    _run(lab, "vla", conf, user=lab.b, trial_id=2)
    run = _new_run(lab, before)
    assert run["status"] == "finished"
    log = (lab.data / "outputs" / "grasping" / "local-runs" / run["name"] / "train.log").read_text()
    assert "the frame cache needs" in log and "resources.shm_size" in log
    assert list((lab.data / "outputs" / "grasping" / "frame-cache").glob("frames-*.npy"))


@needs_sandbox
def test_gsplats_build_outlives_the_container(lab):
    """Containers are removed after each trial (agent/internal/containers/spec.go:35 AutoRemove):
    a cache lasts only on a mounted host path, here the agent's task cache the master mounts."""
    cluster = {"tasks": {"local_cache": str(lab.base / "agent-cache")}}
    master = lab.master(**cluster)  # (training 3DGS on the cluster: tests/test_determined_templates.py)

    # gsplat's JIT build directory as gpu.yaml's trial resolves it, in one container and the next
    gpu = yaml.safe_load((TEMPLATES / "gaussian_splatting" / "gpu.yaml").read_text())
    # (as in a trial: its session has made what it writes the group's: det_lab.trials.session)
    probe = ("import os, rasterizer; from det_lab.volume import share_with_group; share_with_group(); "
             "d = rasterizer.gsplat_extensions_dir() / 'gsplat_cuda'; d.mkdir(exist_ok=True); "
             "mine = d / ('built-by-' + os.environ['DET_USER']); mine.write_text('so'); "
             "print('BUILD', sorted(p.name for p in d.iterdir()))")
    builds = []
    for user in (lab.a, lab.b):
        result = run_trial(master, gpu, TEMPLATES / "gaussian_splatting", user=lab.linked(user), image=lab.image(),
                           command=[str(lab.bin / "python"), "-c", probe])
        assert result.returncode == 0, result.stderr[-2000:]
        builds.append(next(line for line in result.stdout.splitlines() if line.startswith("BUILD")))
    assert builds[1] == f"BUILD {sorted(['built-by-' + lab.a.name, 'built-by-' + lab.b.name])}", builds


def _configs() -> list[Path]:
    return sorted(p for p in TEMPLATES.glob("*/*.yaml") if "entrypoint" in (yaml.safe_load(p.read_text()) or {}))


@pytest.mark.parametrize("config", _configs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_hook_installs_det_lab_into_the_python_the_entrypoint_runs(config):
    """task-setup.sh:16-19: Determined's wrapper runs $DET_PYTHON_EXECUTABLE (python3 unless set), and
    so does the hook; an entrypoint on another interpreter would not see what the hook installed."""
    conf = yaml.safe_load(config.read_text())
    env = dict(e.split("=", 1) for e in env_list((conf.get("environment") or {}).get("environment_variables")))
    python = env.get("DET_PYTHON_EXECUTABLE", "python3")
    argv = conf["entrypoint"].split() if isinstance(conf["entrypoint"], str) else list(conf["entrypoint"])
    if "-m" in argv[1:2] and argv[2].startswith("determined.launch."):  # the launcher's own python, then the trial's
        assert argv[0] == python
        argv = argv[3:]
    assert argv[0] == python, f"{config.name}: entrypoint runs {argv[0]}, the hook installs into {python}"


def test_doctor_says_when_tasks_would_read_an_old_lab_config(tmp_path, monkeypatch):
    from det_lab.doctor import run_checks
    from det_lab.volume import init_volume

    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(tmp_path / "data"),
                                                       "projects": {"grasping": {"quota": "2GiB"}}}))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"master_host": "localhost"}))
    monkeypatch.setenv("DET_LAB_CLUSTER_CONFIG", str(tmp_path / "cluster.yaml"))
    lab = load_settings(tmp_path / "lab.yaml", env={})
    init_volume(lab)

    def task_config() -> list[tuple[str, str]]:
        return [(c.status, c.detail) for c in run_checks(load_settings(tmp_path / "lab.yaml", env={}))
                if c.name == "task lab config"]

    [(status, detail)] = task_config()
    assert status == "warn" and "missing" in detail
    publish_task_config(lab)
    assert [s for s, _ in task_config()] == ["pass"]
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(tmp_path / "data"),
                                                       "projects": {"grasping": {"quota": "5GiB"}}}))
    [(status, detail)] = task_config()
    assert status == "warn" and "old settings" in detail


@needs_sandbox
def test_a_tracking_server_on_localhost_is_named_before_tasks_lose_their_metrics(lab):
    """network_mode: bridge (det_lab renders it; task_container_defaults.go:80-84 defaults to it)
    gives each container its own network namespace: 127.0.0.1 there is not the master machine."""
    from det_lab.cluster.render import tracking_problems

    settings = lab.settings.model_copy(update={"tracking": lab.settings.tracking.model_copy(
        update={"backend": "mlflow", "mlflow_uri": "http://127.0.0.1:5000"})})
    (problem,) = tracking_problems(settings)
    assert "127.0.0.1 is the task's own container" in problem
    probe = ("import urllib.request, sys\ntry:\n urllib.request.urlopen('http://127.0.0.1:%d', timeout=2)\n"
             "except Exception as e:\n print('UNREACHABLE', type(e).__name__)\nelse:\n print('REACHED')")
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = run_trial(lab.master(), {"environment": {}}, TEMPLATES / "vla", user=lab.linked(lab.a),
                           image=lab.image(), command=[str(lab.bin / "python"), "-c", probe % server.server_port])
    finally:
        server.shutdown()
    assert "UNREACHABLE" in result.stdout, result.stdout + result.stderr
