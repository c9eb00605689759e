"""The experiment config is `--exp-config` on `run` and `slurm ci` (`--config` is the lab config,
before the command); the old spelling still works for one release, said on stderr. `slurm ci --out`
is a directory, as every `--out`."""

from __future__ import annotations

import yaml

from tests.test_bad_inputs import cli

TEMPLATE = "experiment_templates/vla"


def test_old_config_spelling_still_names_the_experiment_config_and_says_it_is_deprecated(lab, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hyperparameters: [\n")  # not YAML: refused naming the file it was given
    new = cli(lab, "run", TEMPLATE, "--local", "--exp-config", str(bad))
    old = cli(lab, "run", TEMPLATE, "--local", "--config", str(bad))
    assert new.returncode == old.returncode == 2 and str(bad) in new.stderr
    assert old.stderr.splitlines()[-1] == new.stderr.splitlines()[-1]  # the same refusal of the same file
    assert old.stderr.splitlines()[0] == ("deprecated: --config is now --exp-config; the old spelling goes in "
                                          "det_lab 0.3.0") and "deprecated" not in new.stderr
    assert "--exp-config" in cli(lab, "run", "--help").stdout and "--config" not in cli(lab, "run", "--help").stdout


def test_slurm_ci_writes_gitlab_ci_yml_into_out_with_the_named_experiment_config(lab, tmp_path):
    proc = cli(lab, "slurm", "ci", "--out", str(tmp_path), "--exp-config", "gpu.yaml")
    assert proc.returncode == 0, proc.stderr
    pipeline = yaml.safe_load((tmp_path / ".gitlab-ci.yml").read_text())
    assert pipeline["variables"]["CONFIG"] in ("gpu.yaml", {"value": "gpu.yaml"}) or "gpu.yaml" in str(pipeline["variables"])
    assert any("--exp-config \"$CONFIG\"" in line for job in pipeline.values() if isinstance(job, dict)
               for line in job.get("script", []))
    old = cli(lab, "slurm", "ci", "--config", "old.yaml")
    assert old.returncode == 0 and "old.yaml" in old.stdout and old.stderr.startswith("deprecated: --config")
    taken = tmp_path / "file"
    taken.write_text("keep\n")
    refused = cli(lab, "slurm", "ci", "--out", str(taken))
    assert refused.returncode == 2 and "is a file: --out names a directory" in refused.stderr
    assert taken.read_text() == "keep\n"
