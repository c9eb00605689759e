"""Templates by name, copies to edit, and `--set KEY=VALUE` overrides of their configs."""

from __future__ import annotations

import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from det_lab import templates
from det_lab.cli.app import app
from det_lab.settings import load_settings
from det_lab.runs.expconf import lab_section, training_length
from det_lab.volume import init_volume
from tests import expconf

REPO = Path(__file__).resolve().parents[1]


def test_templates_are_known_by_one_set_of_names():
    assert [t.name for t in templates.available()] == ["vla", "3dgs", "isaac"]
    for name, directory in templates.NAMES.items():
        assert templates.resolve(name) == templates.resolve(directory) == REPO / "experiment_templates" / directory
        assert templates.name_of(templates.resolve(directory)) == name
    with pytest.raises(templates.TemplateError) as err:
        templates.resolve("gaussian")
    assert "templates: vla, 3dgs, isaac" in str(err.value) and "det-lab templates list" in str(err.value)


def test_copy_is_whole_and_never_overwrites(tmp_path):
    out = templates.copy("isaac", tmp_path / "mine")
    cmp = filecmp.dircmp(REPO / "experiment_templates/isaac_lab", out, ignore=["__pycache__"])
    assert not (cmp.left_only or cmp.diff_files) and cmp.right_only == [templates.ORIGIN_FILE]
    assert (out / templates.ORIGIN_FILE).read_text() == "isaac_lab\n"
    (out / "const.yaml").write_text("edited")
    with pytest.raises(templates.TemplateError, match="already exists"):
        templates.copy("vla", out)
    assert (out / "const.yaml").read_text() == "edited"
    with pytest.raises(templates.TemplateError, match="does not exist"):
        templates.copy("vla", tmp_path / "no" / "such" / "parent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging left behind


def test_set_overrides_reach_the_experiment_config():
    conf = yaml.safe_load((REPO / "experiment_templates/vla/search.yaml").read_text())
    assert training_length(conf, lab_section(conf)).batches == 2000  # ASHA's max_time
    templates.apply_overrides(conf, ["data.det_lab.max_length.batches=50", "hyperparameters.lr=0.01",
                                     "name=quick check", "labels=[a, b]"])
    lab = lab_section(conf)
    assert training_length(conf, lab).batches == 50 and conf["searcher"]["max_time"] == 50
    assert conf["hyperparameters"]["lr"] == 0.01 and conf["name"] == "quick check" and conf["labels"] == ["a", "b"]


def test_overridden_config_still_passes_determineds_schema(tmp_path):
    conf = yaml.safe_load((REPO / "experiment_templates/vla/const.yaml").read_text())
    templates.apply_overrides(conf, ["data.det_lab.max_length.batches=20", "min_validation_period.batches=10",
                                     "checkpoint_storage.save_trial_latest=2"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf))
    expconf.assert_valid([path])


@pytest.mark.parametrize("assignment, message", [
    ("lr", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("data..det_lab=3", "expected KEY=VALUE"),
    ("name.first=x", "name is a str, not a mapping"),
    ("hyperparameters.lr=[0.1", "not valid YAML"),
])
def test_bad_set_is_one_line_naming_it(assignment, message):
    conf = yaml.safe_load((REPO / "experiment_templates/vla/const.yaml").read_text())
    with pytest.raises(templates.TemplateError) as err:
        templates.apply_overrides(conf, [assignment])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_optional_requirements_are_named_with_their_install_command():
    gsplat = {"backend": "gsplat"}
    missing = templates.missing_requirements(templates.resolve("3dgs"), gsplat)
    if not missing:
        pytest.skip("gsplat is installed here")
    (line,) = missing
    assert line.startswith("template 3dgs needs gsplat") and "pip install gsplat" in line
    assert templates.missing_requirements(templates.resolve("3dgs"), {"backend": "torch"}) == []


def test_isaac_standin_names_rsl_rl_and_its_install_when_it_is_missing(monkeypatch):
    isaac, standin = templates.resolve("isaac"), {"require_isaaclab": False, "isaaclab_path": None}
    monkeypatch.delenv("ISAACLAB_PATH", raising=False)
    assert templates.missing_requirements(isaac, standin) == []  # rsl_rl is installed here
    monkeypatch.setitem(sys.modules, "rsl_rl", None)  # what `import rsl_rl` sees without the package
    (line,) = templates.missing_requirements(isaac, standin)
    assert line.startswith("template isaac needs rsl_rl") and templates.RSL_RL_INSTALL in line
    # on Isaac Lab itself (the cluster config) the stand-in, and with it rsl_rl from PyPI, is not used
    assert templates.missing_requirements(isaac, {**standin, "require_isaaclab": True}) == []


def test_a_copy_of_a_template_is_checked_as_the_template_it_came_from(tmp_path, monkeypatch):
    """The walk-throughs run copies (``det-lab templates copy isaac my-isaac``): their optional
    packages are checked as the original's, also for a copy made before copies named their origin
    (its train.py is the template's); a directory of one's own is not taken for a template."""
    standin = {"require_isaaclab": False, "isaaclab_path": None}
    monkeypatch.delenv("ISAACLAB_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "rsl_rl", None)
    mine = templates.copy("isaac", tmp_path / "my-isaac")
    (line,) = templates.missing_requirements(mine, standin)
    assert line.startswith("template my-isaac needs rsl_rl") and templates.RSL_RL_INSTALL in line
    (mine / templates.ORIGIN_FILE).unlink()  # a copy from an older det_lab
    assert len(templates.missing_requirements(mine, standin)) == 1
    (mine / "train.py").write_text("print('my own trial')\n")
    assert templates.missing_requirements(mine, standin) == []


# --- through det-lab run ------------------------------------------------------------------------

FAILING_TRIAL = {
    "name": "fails", "entrypoint": "python3 train.py",
    "searcher": {"name": "single", "metric": "loss", "smaller_is_better": True},
    "hyperparameters": {}, "max_restarts": 0,
    "data": {"det_lab": {"project": "vla", "max_length": {"batches": 10}, "tracking": "none"}},
}


def invoke(lab, *args: str) -> subprocess.CompletedProcess:
    """det-lab in this process (no interpreter start), for commands that end before training;
    a run that trains goes through the installed script."""
    res = CliRunner().invoke(app, list(args), env=lab.env)
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, res.stderr)


def init(lab) -> None:
    init_volume(load_settings(lab.config, env={}))


def _runs(lab) -> list[Path]:
    runs = lab.root / "outputs" / "vla" / "local-runs"
    return sorted(runs.iterdir()) if runs.is_dir() else []


def test_missing_optional_package_refuses_before_anything_is_made(lab):
    if importlib.util.find_spec("gsplat") is not None:
        pytest.skip("gsplat is installed here")
    init(lab)
    proc = invoke(lab, "run", "3dgs", "--local", "--set", "hyperparameters.backend=gsplat", "--set", "data.det_lab.dataset=null")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: template 3dgs needs gsplat") and "pip install gsplat" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list((lab.root / "outputs" / "3dgs").glob("local-runs/*"))


def test_isaac_without_rsl_rl_refuses_with_its_install_before_anything_is_made(lab, monkeypatch):
    init(lab)
    monkeypatch.delenv("ISAACLAB_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "rsl_rl", None)  # the package hidden from this interpreter
    proc = invoke(lab, "run", "isaac", "--local")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: template isaac needs rsl_rl") and templates.RSL_RL_INSTALL in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list((lab.root / "outputs" / "isaac").glob("local-runs/*"))


def test_bad_set_and_set_on_resume_are_one_line(lab):
    init(lab)
    proc = invoke(lab, "run", "vla", "--local", "--set", "data.det_lab.max_length=")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "max_length" in proc.stderr
    proc = invoke(lab, "run", "vla", "--local", "--set", "name.x=1")
    assert proc.returncode == 2 and proc.stderr == "error: --set name.x: name is a str, not a mapping\n"
    proc = invoke(lab, "run", "vla", "--local", "--resume", "--set", "hyperparameters.lr=1")
    assert proc.returncode == 2 and "--set applies to new runs" in proc.stderr
    assert _runs(lab) == []


def test_a_run_without_checkpoint_offers_no_resume(lab, tmp_path):
    init(lab)
    trial = tmp_path / "fails"
    trial.mkdir()
    (trial / "const.yaml").write_text(yaml.safe_dump(FAILING_TRIAL))
    (trial / "train.py").write_text("raise SystemExit('no GPU here')\n")
    proc = lab.cli("run", str(trial), "--local")
    assert proc.returncode == 1
    assert "no GPU here" in proc.stdout and "resume with" not in proc.stdout
    assert [line.split() for line in proc.stdout.splitlines() if "checkpoints" in line] == [["│", "checkpoints", "│", "none", "│"]]
