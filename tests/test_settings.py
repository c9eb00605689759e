"""The lab configuration: search order, overrides, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from det_lab.settings import BUILTIN_PROJECTS, LabConfigError, find_config_file, load_settings
from tests.test_bad_inputs import cli as cli_in_process


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_without_any_file(tmp_path):
    s = load_settings(env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert s.data_root == Path("/mnt/data")
    assert set(BUILTIN_PROJECTS) <= set(s.projects)
    assert s.tracking.backend == "mlflow" and s.master_url is None


def test_full_file_is_loaded_and_quotas_parsed(tmp_path):
    cfg = write(tmp_path / "lab.yaml", """
data_root: /srv/nfs/lab
group: robots
projects:
  vla: {quota: 2TiB, description: policies}
  grasping: {quota: 100GB}
tracking: {backend: both, mlflow_uri: "http://mlflow.lab:5000", aim_repo: "aim://aim.lab:53800"}
master_url: gpu-box-1:8080
""")
    s = load_settings(cfg, env={})
    assert s.data_root == Path("/srv/nfs/lab") and s.group == "robots"
    assert int(s.projects["vla"].quota) == 2 * 2**40
    assert int(s.projects["grasping"].quota) == 100 * 10**9
    assert {"3dgs", "isaac"} <= set(s.projects)  # built-ins survive a file that lists others
    assert s.tracking.uses_mlflow and s.tracking.uses_aim
    assert s.master_url == "http://gpu-box-1:8080"
    assert s.source == cfg


def test_relative_data_root_is_relative_to_the_file(tmp_path):
    (tmp_path / "conf").mkdir()
    cfg = write(tmp_path / "conf" / "lab.yaml", "data_root: ../shared\n")
    assert load_settings(cfg, env={}).data_root == (tmp_path / "conf" / ".." / "shared").absolute()


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    cfg = write(tmp_path / "lab.yaml", "data_root: /srv/a\ntracking: {backend: aim}\n")
    monkeypatch.chdir(tmp_path)
    s = load_settings(cfg, env={"DET_LAB_DATA_ROOT": "local-root", "DET_LAB_TRACKING": "none",
                                "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    assert s.data_root == tmp_path / "local-root"
    assert s.tracking.backend == "none" and s.tracking.mlflow_uri == "http://127.0.0.1:5000"


def test_search_order(tmp_path):
    xdg = tmp_path / "xdg"
    (xdg / "det-lab").mkdir(parents=True)
    user = write(xdg / "det-lab" / "lab.yaml", "{}")
    cwd = tmp_path / "proj"
    cwd.mkdir()
    assert find_config_file({"XDG_CONFIG_HOME": str(xdg)}, cwd=cwd) == user
    here = write(cwd / "det-lab.yaml", "{}")
    assert find_config_file({"XDG_CONFIG_HOME": str(xdg)}, cwd=cwd) == here
    explicit = write(tmp_path / "x.yaml", "{}")
    assert find_config_file({"DET_LAB_CONFIG": str(explicit), "XDG_CONFIG_HOME": str(xdg)}, cwd=cwd) == explicit


BAD_FILES = {
    "unknown top-level key": ("data_rot: /x\n", "unknown key 'data_rot'"),
    "unknown nested key": ("projects: {vla: {qouta: 1TiB}}\n", "unknown key 'projects.vla.qouta'"),
    "unknown tracking key": ("tracking: {uri: http://x}\n", "unknown key 'tracking.uri'"),
    "negative quota": ("projects: {vla: {quota: -5}}\n", "projects.vla.quota"),
    "zero quota": ("projects: {vla: {quota: 0}}\n", "projects.vla.quota: must be a positive size"),
    "bad quota unit": ("projects: {vla: {quota: 10 potatoes}}\n", "projects.vla.quota"),
    "bad backend": ("tracking: {backend: wandb}\n", "tracking.backend"),
    "bad mlflow uri": ("tracking: {mlflow_uri: 'gopher://x'}\n", "tracking.mlflow_uri"),
    "bad aim repo": ("tracking: {aim_repo: 'relative/repo'}\n", "tracking.aim_repo"),
    "bad master url": ("master_url: 'ftp://host'\n", "master_url"),
    "bad project name": ("projects: {'Bad Name': {}}\n", "project name 'Bad Name'"),
    "projects not a mapping": ("projects: [vla, isaac]\n", "projects"),
    "data_root not a path": ("data_root: [1, 2]\n", "data_root"),
    "top level is a list": ("- a\n- b\n", "top level must be a mapping"),
    "broken yaml": ("data_root: [1\n", "invalid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_one_line_naming_file_and_key(tmp_path, case):
    text, expected = BAD_FILES[case]
    cfg = write(tmp_path / "lab.yaml", text)
    with pytest.raises(LabConfigError) as info:
        load_settings(cfg, env={})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(cfg))
    assert expected in message


@pytest.mark.parametrize("var,value,key", [
    ("DET_LAB_DATA_ROOT", "", None),  # empty means unset, not an error
    ("DET_LAB_TRACKING", "tensorboard", "tracking.backend"),
    ("DET_LAB_MASTER", "ftp://x", "master_url"),
    ("MLFLOW_TRACKING_URI", "nonsense", "tracking.mlflow_uri"),
])
def test_bad_environment_names_the_variable(tmp_path, var, value, key):
    cfg = write(tmp_path / "lab.yaml", "{}\n")
    if key is None:
        load_settings(cfg, env={var: value})
        return
    with pytest.raises(LabConfigError) as info:
        load_settings(cfg, env={var: value})
    assert str(info.value).startswith(f"environment variable {var}=")
    assert key in str(info.value)


def test_missing_explicit_config_is_an_error(tmp_path):
    with pytest.raises(LabConfigError, match="DET_LAB_CONFIG=.*no such file"):
        load_settings(env={"DET_LAB_CONFIG": str(tmp_path / "nope.yaml")})


def test_unreadable_config_is_an_error(tmp_path):
    d = tmp_path / "a-directory.yaml"
    d.mkdir()
    with pytest.raises(LabConfigError, match="cannot read"):
        load_settings(d, env={})


def test_cli_reports_config_error_in_one_line_without_traceback(lab):
    lab.config.write_text("projects: {vla: {quota: lots}}\n")
    for proc in (lab.cli("init"), cli_in_process(lab, "config")):  # the installed script, then in process
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert str(lab.config) in lines[0] and "projects.vla.quota" in lines[0]
        assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_config_shows_effective_values(lab):
    lab.write_config(projects={"vla": {"quota": "3TiB"}})
    proc = cli_in_process(lab, "config")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"source: {lab.config}" in out
    assert "3072GiB" in out and str(lab.root) in out
