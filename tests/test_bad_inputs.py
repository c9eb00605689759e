"""Bad input through the real ``det-lab`` CLI: one ``error:`` line naming what is wrong and the
fix, exit code 2, and nothing created or changed on the volume."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from det_lab.settings import ENV_VARS
from tests.conftest import VENV_BIN, Lab


def assert_refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """The command failed with exactly one ``error:`` line holding every needle."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == code, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli(lab: Lab, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``det-lab ARGS`` in this process (typer's runner: no interpreter start), in ``lab``'s
    environment plus ``env``. An exception escaping the CLI fails the test: a user would see a
    traceback."""
    from typer.testing import CliRunner

    from det_lab.cli.app import app

    full = {k: None for k in os.environ if k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    result = CliRunner().invoke(app, list(args), env={**full, **lab.env, **env})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def snapshot_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: equal before and after = nothing written."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in root.rglob("*") if not p.is_dir()} | {
            str(p.relative_to(root)) + "/": (0, 0) for p in root.rglob("*") if p.is_dir()}


# --- the lab configuration and the environment ------------------------------------------------

def test_config_file_that_is_not_utf8(lab):
    lab.config.write_bytes(f"data_root: {lab.root}\n# caf\xe9 in Latin-1\n".encode("latin-1"))
    assert_refused(cli(lab, "init"), str(lab.config), "UTF-8")
    assert not lab.root.exists()


def test_quota_with_two_decimal_points_is_refused(lab):
    lab.write_config(projects={"vla": {"quota": "1.5.5GiB"}})
    assert_refused(cli(lab, "init"), str(lab.config), "projects.vla.quota", "1.5.5GiB")
    assert not lab.root.exists()


@pytest.mark.parametrize("name", sorted(n for n, v in ENV_VARS.items() if v.bad_example is not None))
def test_every_unparseable_environment_variable_is_one_line(lab, name):
    bad = ENV_VARS[name].bad_example
    assert_refused(cli(lab, "init", **{name: bad}), f"{name}={bad}")
    assert not lab.root.exists()


def test_an_unparseable_variable_stops_the_real_command_at_start(lab):
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "init"], env={**lab.env, "DET_LAB_LOCK_LIFETIME": "1m"},
                          cwd=lab.config.parent, capture_output=True, text=True, timeout=120)
    assert_refused(proc, "DET_LAB_LOCK_LIFETIME=1m", "a positive whole number")
    assert not lab.root.exists()


def test_lock_lifetime_is_read_through_the_one_parser(lab):
    env = {**lab.env, "DET_LAB_LOCK_LIFETIME": "soon"}
    proc = subprocess.run([str(VENV_BIN / "python"), "-c", "from det_lab.data.lock import VolumeLock; "
                           "import pathlib, sys; VolumeLock(pathlib.Path(sys.argv[1]))", str(lab.root / "x.lock")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DET_LAB_LOCK_LIFETIME=soon" in proc.stderr
    assert not lab.root.exists()


def test_the_docs_document_every_environment_variable():
    page = (Path(__file__).parents[1] / "docs" / "reference" / "environment.md").read_text()
    missing = [name for name in ENV_VARS if f"`{name}`" not in page]
    assert not missing, f"docs/reference/environment.md lacks {missing}: run python docs/gen_reference.py"


# --- the volume: a damaged registry, a read-only mount ----------------------------------------

@pytest.fixture
def volume(lab):
    assert cli(lab, "init").returncode == 0
    return lab


def publish_tiny(lab, tmp_path: Path, name: str = "tiny") -> None:
    from det_lab.data.publish import publish_directory
    from det_lab.settings import load_settings

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(b"x" * 100)
    (src / "y.bin").write_bytes(b"y" * 50)
    publish_directory(load_settings(lab.config, env={}), "vla", name, src, "tiny")


DAMAGED_REGISTRIES = {
    "invalid YAML": "tiny: {project: vla, repo: /r\n",
    "a list": "- tiny\n- other\n",
    "an entry without its keys": "tiny: {project: vla}\n",
    "an absolute dataset path": "tiny: {project: vla, repo: /r, path: /etc, rev: main}\n",
    "not UTF-8": b"tiny: {project: vla, repo: /r\xe9, path: d, rev: main}\n",
}


@pytest.mark.parametrize("case", sorted(DAMAGED_REGISTRIES))
def test_damaged_dataset_registry(volume, tmp_path, case):
    registry = volume.root / ".det-lab" / "datasets.yaml"
    text = DAMAGED_REGISTRIES[case]
    registry.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = snapshot_tree(volume.root)
    for args in (["data", "pull", "tiny"], ["data", "list"],
                 ["data", "register", "new", "--project", "vla", "--repo", str(tmp_path), "--path", "d"]):
        line = assert_refused(cli(volume, *args), str(registry))
        assert "det-lab data register" in line  # the fix: move it aside and register again
    assert snapshot_tree(volume.root) == before


def _can_mount_read_only() -> bool:
    if os.geteuid() != 0:
        return True  # chmod is enough for a non-root user
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind -o ro / /"], capture_output=True)
    return probe.returncode == 0


needs_ro = pytest.mark.skipif(not _can_mount_read_only(), reason="cannot make a read-only mount here")


def cli_read_only(lab, *args: str) -> subprocess.CompletedProcess:
    """``det-lab ARGS`` with the data root on a read-only mount (a private mount namespace as root)."""
    cmd = [str(VENV_BIN / "det-lab"), *args]
    if os.geteuid() == 0:
        cmd = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(lab.root), *cmd]
        return subprocess.run(cmd, env=lab.env, cwd=lab.config.parent, capture_output=True, text=True, timeout=300)
    dirs = [lab.root, *(p for p in lab.root.rglob("*") if p.is_dir())]
    modes = {d: d.stat().st_mode for d in dirs}
    try:
        for d in dirs:
            os.chmod(d, modes[d] & ~0o222)
        return subprocess.run(cmd, env=lab.env, cwd=lab.config.parent, capture_output=True, text=True, timeout=300)
    finally:
        for d in dirs:
            os.chmod(d, modes[d])


@needs_ro
def test_init_on_a_read_only_volume_fails(volume):
    before = snapshot_tree(volume.root)
    assert_refused(cli_read_only(volume, "init"), str(volume.root), "not writable", "read-write")
    assert snapshot_tree(volume.root) == before


@needs_ro
def test_pull_and_register_on_a_read_only_volume(volume, shared):
    # dataset 'tiny' as published on another volume (its git repo and DVC remote live there)
    from det_lab import data
    from det_lab.settings import load_settings

    repo = shared.root / "datasets" / "vla" / "git" / "tiny.git"
    data.register("tiny", data.DatasetSpec("vla", str(repo), "data/tiny", "main"), load_settings(volume.config, env={}))
    before = snapshot_tree(volume.root)
    assert_refused(cli_read_only(volume, "data", "pull", "tiny"), "not writable", "read-write")
    assert_refused(cli_read_only(volume, "data", "register", "again", "--project", "vla", "--repo", str(repo),
                                 "--path", "data/tiny"), "not writable", "read-write")
    assert snapshot_tree(volume.root) == before
    # once pulled, a read-only mount (how some machines mount the volume) serves the snapshot
    assert cli(volume, "data", "pull", "tiny").returncode == 0
    proc = cli_read_only(volume, "data", "pull", "tiny")
    assert proc.returncode == 0 and "already on the volume" in proc.stdout, proc.stderr


# --- experiment configs: refused before anything is created -----------------------------------

TEMPLATES = Path(__file__).parents[1] / "experiment_templates"
SHIPPED = sorted(TEMPLATES.glob("*/*.yaml"))
VALIDATE_EXPCONF = Path(__file__).parents[2] / "shared" / "tools" / "validate-expconf"  # ../shared beside the checkout


def vla_config(**changes) -> dict:
    import yaml

    conf = yaml.safe_load((TEMPLATES / "vla" / "const.yaml").read_text())
    conf["data"]["det_lab"]["dataset"] = "tiny"
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = conf
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return conf


# configs a Determined 0.38.1 master rejects: (changes, what the error names)
DETERMINED_REJECTS = {
    "negative slots_per_trial": ({"resources__slots_per_trial": -1}, "resources.slots_per_trial"),
    "unknown searcher": ({"searcher__name": "bayesian"}, "searcher.name: 'bayesian' is not a searcher"),
    "unknown top-level key": ({"trainer": {"epochs": 3}}, "trainer: unknown key"),
    "bad hyperparameter type": ({"hyperparameters__lr": {"type": "float", "minval": 0.1, "maxval": 1}},
                                "hyperparameters.lr.type"),
    "missing hyperparameter bound": ({"hyperparameters__lr": {"type": "double", "minval": 0.001}},
                                     "hyperparameters.lr.maxval: is missing"),
    "string hyperparameter bound": ({"hyperparameters__lr": {"type": "log", "base": 10, "minval": "-4", "maxval": -2}},
                                    "hyperparameters.lr.minval"),
    "bounds the wrong way round": ({"hyperparameters__model__d_model": {"type": "int", "minval": 64, "maxval": 32}},
                                   "hyperparameters.model.d_model: minval (64) must be less than maxval (32)"),
    "unknown resources key": ({"resources__gpus": 2}, "resources.gpus: unknown key"),
    "bad validation period": ({"min_validation_period": {"steps": 5}}, "min_validation_period"),
}
# det_lab's own rules on top of Determined's: (changes, what the error names)
LAB_REJECTS = {
    "negative max_time": ({"searcher": {"name": "adaptive_asha", "metric": "val_action_l1", "max_trials": 2,
                                        "time_metric": "batches", "max_time": -100}}, "searcher.max_time"),
    "unknown dataset name": ({"data__det_lab__dataset": "no-such-data"}, "no dataset named 'no-such-data'"),
    "bad dataset repo": ({"data__det_lab__dataset": {"repo": "/no/such/repo", "path": "data/x"}},
                         "git repository /no/such/repo not found"),
    "searcher without metric": ({"searcher": {"name": "single"}}, "searcher.metric: is missing"),
    "no det_lab section": ({"data": {}}, "data.det_lab is missing"),
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Lab:
    """One initialised volume with dataset 'tiny' published, for the tests that write nothing."""
    tmp = tmp_path_factory.mktemp("shared")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    lab = Lab(tmp / "data", tmp / "lab.yaml", {**env, "DET_LAB_CONFIG": str(tmp / "lab.yaml"),
                                                 "XDG_CONFIG_HOME": str(tmp / "xdg"), "COLUMNS": "200"})
    lab.write_config()
    assert cli(lab, "init").returncode == 0
    publish_tiny(lab, tmp)
    return lab


@pytest.fixture
def tiny(shared):
    from det_lab.settings import load_settings

    return load_settings(shared.config, env={})


@pytest.mark.parametrize("case", sorted(DETERMINED_REJECTS) + sorted(LAB_REJECTS))
def test_preflight_refuses_before_anything_is_created(tiny, shared, case):
    from det_lab.runs.validate import PreflightError, preflight

    changes, expected = {**DETERMINED_REJECTS, **LAB_REJECTS}[case]
    before = snapshot_tree(shared.root)
    with pytest.raises(PreflightError) as info:
        preflight(vla_config(**changes), tiny, "const.yaml")
    assert "\n" not in str(info.value) and str(info.value).startswith("const.yaml: ")
    assert expected in str(info.value)
    assert snapshot_tree(shared.root) == before


def test_preflight_refuses_a_dataset_over_quota(shared, tmp_path):
    from det_lab.settings import load_settings
    from det_lab.runs.validate import PreflightError, preflight
    from det_lab.volume import VolumeLayout, project_usage

    used = project_usage(VolumeLayout(shared.root), "vla")
    config = tmp_path / "small-quota.yaml"
    config.write_text(f"data_root: {shared.root}\nprojects: {{vla: {{quota: {used + 64}}}}}\n")
    before = snapshot_tree(shared.root)
    with pytest.raises(PreflightError, match="data.det_lab.dataset: project 'vla' would use .* quota"):
        preflight(vla_config(), load_settings(config, env={}), "const.yaml")
    assert snapshot_tree(shared.root) == before


def test_preflight_accepts_the_shipped_config(tiny):
    from det_lab.runs.validate import preflight

    preflight(vla_config(), tiny, "const.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_passes_determined_rules(path):
    import yaml

    from det_lab.runs.validate import determined_errors

    assert determined_errors(yaml.safe_load(path.read_text())) == []


@pytest.mark.skipif(not VALIDATE_EXPCONF.exists(), reason="the 0.38.1 schema validator is not on this machine")
def test_verdicts_agree_with_determined_schemas(tmp_path):
    """The official 0.38.1 schemas accept every config we ship and reject each config that our
    mirror of their rules rejects."""
    import yaml

    bad = []
    for case, (changes, _) in DETERMINED_REJECTS.items():
        bad.append(tmp_path / f"{case.replace(' ', '-')}.yaml")
        bad[-1].write_text(yaml.safe_dump(vla_config(**changes)))
    proc = subprocess.run([str(VALIDATE_EXPCONF), *map(str, SHIPPED + bad)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": str(VENV_BIN / "python")})
    lines = proc.stdout.splitlines()
    assert [p for p in SHIPPED if f"OK {p}" not in lines] == [], proc.stdout + proc.stderr
    accepted = [p.name for p in bad if not any(line.startswith(f"{p}: ") for line in lines)]
    assert accepted == [], f"the schemas accept {accepted}"


@pytest.mark.parametrize("text,expected", [
    ("searcher: {name: single\n", "invalid YAML"),
    (b"name: caf\xe9\n", "not UTF-8"),
    ("- a list\n", "top level must be a mapping"),
])
def test_unreadable_experiment_config_is_one_line(tmp_path, tiny, text, expected):
    from det_lab.runs.validate import PreflightError, load_and_check

    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PreflightError) as info:
        load_and_check(path, tiny)
    assert "\n" not in str(info.value) and str(path) in str(info.value) and expected in str(info.value)


# --- det-lab run: refused before a run directory appears ---------------------------------------

def write_config(tmp_path: Path, conf: dict | str, name: str = "exp.yaml") -> Path:
    import yaml

    path = tmp_path / name
    path.write_text(conf if isinstance(conf, str) else yaml.safe_dump(conf))
    return path


def runs_dir(lab: Lab) -> Path:
    return lab.root / "outputs" / "vla" / "local-runs"


RUN_REJECTS = {
    "negative slots_per_trial": (vla_config(resources__slots_per_trial=-1), "resources.slots_per_trial"),
    "unknown searcher": (vla_config(searcher__name="bayesian"), "searcher.name"),
    "unknown top-level key": (vla_config(trainer={"epochs": 3}), "trainer: unknown key"),
    "missing bound": (vla_config(hyperparameters__lr={"type": "double", "minval": 0.1}), "hyperparameters.lr.maxval"),
    "negative max_time": (vla_config(**LAB_REJECTS["negative max_time"][0]), "searcher.max_time"),
    "unknown dataset": (vla_config(data__det_lab__dataset="nope"), "no dataset named 'nope'"),
    "unparseable YAML": ("searcher: {name: single\nhyperparameters: [1, 2\n", "invalid YAML"),
}


@pytest.mark.parametrize("case", sorted(RUN_REJECTS))
def test_run_refuses_a_bad_config_before_anything_is_created(shared, tmp_path, case):
    conf, expected = RUN_REJECTS[case]
    path = write_config(tmp_path, conf)
    before = snapshot_tree(shared.root)
    assert_refused(cli(shared, "run", str(TEMPLATES / "vla"), "--local", "--exp-config", str(path)), expected)
    assert snapshot_tree(shared.root) == before


@needs_ro
def test_run_on_a_read_only_volume(shared, tmp_path):
    path = write_config(tmp_path, vla_config())
    before = snapshot_tree(shared.root)
    assert_refused(cli_read_only(shared, "run", str(TEMPLATES / "vla"), "--local", "--exp-config", str(path)),
                   "not writable", "read-write")
    assert snapshot_tree(shared.root) == before


def _existing_run(lab: Lab, text: str | None = None) -> Path:
    """A run directory as an earlier 'det-lab run' leaves it (or with ``text`` as its run.json)."""
    import json

    run = runs_dir(lab) / "vla-20260101-000000-abcd"
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(text if text is not None else json.dumps({
        "kind": "local", "name": run.name, "template": "vla", "latest_checkpoint": "0123", "checkpoints": [],
        "cwd": str(TEMPLATES / "vla"), "command": ["python3", "train.py"], "max_length": 10,
        "max_length_unit": "batches", "status": "stopped"}))
    return run


def test_run_name_without_resume_is_refused(shared, tmp_path):
    run = _existing_run(shared)
    path = write_config(tmp_path, vla_config())
    before = snapshot_tree(shared.root)
    assert_refused(cli(shared, "run", str(TEMPLATES / "vla"), "--local", "--exp-config", str(path), "--run", run.name),
                   f"run {run.name} exists; use --resume to continue it or choose another name")
    assert snapshot_tree(shared.root) == before


def test_damaged_run_record_is_one_line(shared, tmp_path):
    run = _existing_run(shared, '{"name": "vla-2026", "latest_checkp')
    path = write_config(tmp_path, vla_config())
    before = snapshot_tree(shared.root)
    assert_refused(cli(shared, "run", str(TEMPLATES / "vla"), "--local", "--exp-config", str(path), "--resume",
                              "--run", run.name), str(run / "run.json"))
    assert snapshot_tree(shared.root) == before


def test_an_error_line_keeps_the_brackets_of_what_it_quotes(volume):
    """fail() prints its message as text: a name with brackets is not taken for rich markup."""
    assert_refused(cli(volume, "runs", "list", "--project", "vla[bold]x[/]"), "unknown project 'vla[bold]x[/]'")
