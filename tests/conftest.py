"""Shared fixtures: an isolated lab (config file + local data root) and a way to run det-lab."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# One intra-op thread per torch process (what OMP_NUM_THREADS sets at torch's start), in this
# process and every process it starts: 3 workers on 2 cores run many trainings at once, and each
# torch's OpenMP threads spin while they wait for the others, which burned ~18 % of a LeRobot
# module's CPU. Comparisons stay like with like: a test's reference and det_lab's run both see it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.aim_fixtures import aim_server  # noqa: F401  (a fixture: a real `aim server` per module)

VENV_BIN = Path(sys.executable).parent

# Tests stop runs with Ctrl-C (SIGINT). A shell without job control starts background commands
# with SIGINT ignored, and an ignored signal stays ignored across exec: every det-lab the tests
# start would then sleep through its Ctrl-C. A handler of our own is reset to the default in
# children, so they get Ctrl-C as a user's terminal gives it.
signal.signal(signal.SIGINT, signal.default_int_handler)

# A local run without a tracking URI writes MLflow's SQLite store under XDG_DATA_HOME. Keep the
# suite's store out of the user's home, and give each test process its own: pytest-xdist's
# workers run at once, and two of them creating one SQLite store race in its schema migration.
_DATA_HOME = tempfile.mkdtemp(prefix="det-lab-tests-data-")
os.environ["XDG_DATA_HOME"] = _DATA_HOME
# The same for this user's caches (runs prune, volume usage, data gc) and state: never the host's
# ~/.cache/det-lab, which a test must not read (a plan cached by an earlier run) nor leave behind.
for _xdg in ("XDG_CACHE_HOME", "XDG_STATE_HOME"):
    os.environ[_xdg] = os.path.join(_DATA_HOME, _xdg.lower())

#: the host paths det_lab writes by default (its settings' defaults and this user's XDG places): a
#: test that writes one depends on, or leaves behind, what another run sees (how README command 2
#: once failed on a fresh machine: a later test made /var/cache/det-lab, which four tests needed).
HOST_PATHS = [Path(p) for p in ("/var/cache/det-lab", "/var/lib/det-lab", "/etc/det-lab", "/mnt/data",
                                 "/tmp/det-lab-gpus")] + [
    Path.home() / d / "det-lab" for d in (".cache", ".config", ".local/share", ".local/state")]


def _host_state() -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for path in HOST_PATHS:
        try:
            out[str(path)] = path.stat().st_mtime
        except OSError:
            out[str(path)] = None
    return out


_HOST_STATE = _host_state()

# Test files that must not run beside each other: each Slurm module talks to a one-node cluster of
# its own, and two slurmd on one machine share its cgroup tree.
_SERIAL_FILES = {"test_slurm_config.py": "slurm", "test_slurm_jobs.py": "slurm", "test_slurm_run.py": "slurm",
                 "test_monitoring.py": "slurm", "test_slurm_accounting.py": "slurm",
                 "test_reproduce_slurm.py": "slurm", "test_watchdog.py": "slurm"}
# Slurm files that may run beside those: the multi-host test bed's slurmd track processes without
# cgroups (proctrack/linuxproc, task/none: tests/multihost.py), in namespaces of their own
_SLURM_FILES = {*_SERIAL_FILES, "test_multinode_slurm.py", "test_multinode_sshfs.py", "test_multinode_lab_view.py"}


# The suite by cost (``python -m pytest -m unit`` runs the fast part alone; docs/verified.md has its time):
# unit: no daemon, no training, no Slurm — settings, renderers, parsers, one-line errors of the CLI;
# slurm: the files that start a Slurm cluster (slurmctld, slurmd, slurmdbd + MariaDB);
# integration: everything else (real MLflow/Aim servers, DVC, trainings, PostgreSQL, Prometheus).
# A file not named here is integration.
UNIT_FILES = {
    "test_bad_inputs.py", "test_cli_options_cluster.py", "test_cli_options_contract.py", "test_cli_options_out.py",
    "test_cli_options_read.py", "test_cli_options_renamed.py", "test_cluster_checkpoints.py", "test_cluster_config.py", "test_cluster_schema_keys.py",
    "test_cluster_secrets.py", "test_colmap_foreign.py", "test_data_git.py", "test_demo_data.py",
    "test_docs_reference.py", "test_gpu_queue.py", "test_install_cli_help.py", "test_monitor_token.py",
    "test_monitoring_nvml.py", "test_monitoring_report_axes.py", "test_notebook_checkpoint.py", "test_settings.py",
    "test_slurm_units.py", "test_tracking_journal.py", "test_trials_concerns.py", "test_trials_harness.py",
    "test_user_errors.py", "test_volume_init.py", "test_watchdog_rule.py",
}


def pytest_configure(config) -> None:
    for name, what in (("unit", "fast: no daemon, no training (-m unit runs these alone)"),
                       ("integration", "real servers, DVC, trainings, databases"),
                       ("slurm", "starts a Slurm cluster (the one-node ones share one xdist worker)")):
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        kind = "slurm" if name in _SLURM_FILES else "unit" if name in UNIT_FILES else "integration"
        item.add_marker(kind)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the Slurm files as one unit: each test file stays on one
    pytest-xdist worker, so its module-scoped labs, servers and trained runs are built once.

    (pytest-xdist 3.8's ``loadgroup`` no longer groups under pytest 9: it renames ``item._nodeid``,
    which pytest 9 does not read back.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return _SERIAL_FILES.get(Path(file).name, file)

    return FileScheduling(config, log)


@pytest.fixture(autouse=True)
def _no_host_paths_written():
    """Fails the test that made or changed one of :data:`HOST_PATHS` (see there)."""
    yield
    now = _host_state()
    changed = [p for p, mtime in now.items() if mtime != _HOST_STATE[p]]
    if changed:
        _HOST_STATE.update(now)  # name this test only, not every later one
        pytest.fail(f"this test wrote host paths outside its temporary directories: {', '.join(changed)}")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_DATA_HOME, ignore_errors=True)


@dataclass
class Lab:
    """A lab config file and data root under tmp_path, and the environment that selects them."""

    root: Path
    config: Path
    env: dict[str, str]

    def write_config(self, **data) -> None:
        data.setdefault("data_root", str(self.root))
        self.config.write_text(yaml.safe_dump(data))

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """Run the installed ``det-lab`` console script, as a user would."""
        proc = subprocess.run(
            [str(VENV_BIN / "det-lab"), *args], env=self.env, cwd=self.config.parent,
            capture_output=True, text=True, timeout=300,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"det-lab {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 (SQLite on local disk), one per test module."""
    yield from _serve_mlflow(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory):
    """One real ``mlflow server`` for the modules that only read their own runs back from it (by run
    id, or by a tag only their runs carry): starting one costs ~11 s of CPU. It also answers to
    ``lab-mlflow``, the name the Determined stand-in's tasks reach it by (tests/test_determined_templates.py)."""
    yield from _serve_mlflow(tmp_path_factory.mktemp("mlflow-shared"), allowed_hosts=["lab-mlflow"])


def _serve_mlflow(root: Path, allowed_hosts: list[str] | None = None):
    from det_lab.tracking.mlflow_server import MlflowServer, free_port

    server = MlflowServer(root, free_port(), allowed_hosts=allowed_hosts or []).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_lab(tmp_path_factory, shared_mlflow_server) -> Lab:
    """One lab after ``det-lab init --demo`` (vla-demo and 3dgs-demo published), tracking to
    ``shared_mlflow_server``; shared by the template modules, whose runs each find by project."""
    tmp = tmp_path_factory.mktemp("demo-lab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               DET_LAB_TEMPLATES=str(Path(__file__).resolve().parents[1] / "experiment_templates"))
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "mlflow", "mlflow_uri": shared_mlflow_server.uri})
    lab.cli("init", "--demo", check=True)
    return lab


@pytest.fixture
def lab(tmp_path: Path) -> Lab:
    root = tmp_path / "data"
    config = tmp_path / "lab.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(
        DET_LAB_CONFIG=str(config),
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        COLUMNS="200",  # rich wraps tables to the terminal width; keep lines whole for asserts
    )
    lab = Lab(root=root, config=config, env=env)
    lab.write_config()
    return lab


def new_lab(tmp: Path, tracking: dict | None = None, **env_extra: str) -> Lab:
    """A lab config under ``tmp`` (data root ``tmp/data``, home ``tmp/home``), its volume not yet
    initialised; no tracker unless ``tracking`` names one; ``env_extra`` added to its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"), COLUMNS="200",
               HOME=str(tmp / "home"), **env_extra)
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking=tracking or {"backend": "none"})
    return lab


def tiny_data_lab(tmp: Path, tracking: dict | None = None) -> Lab:
    """A lab under ``tmp`` (:func:`new_lab`) with an initialised volume and the tiny regression
    dataset published (:func:`publish_tiny_data`)."""
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    lab = new_lab(tmp, tracking)
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    return lab


def publish_tiny_data(settings, workdir: Path) -> None:
    """Publish the tiny regression dataset (``tests/fixtures/tiny`` trains on it) as ``vla/tiny-data``."""
    import numpy as np

    from det_lab.data.publish import publish_directory

    src = workdir / "tiny-src"
    src.mkdir()
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (512, 1))
    xy = np.hstack([x, 3 * x + 0.5 + rng.normal(0, 0.05, (512, 1))])
    np.savetxt(src / "train.csv", xy[:400], delimiter=",")
    np.savetxt(src / "val.csv", xy[400:], delimiter=",")
    publish_directory(settings, "vla", "tiny-data", src, "tiny regression data")
