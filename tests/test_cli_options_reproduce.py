"""`det-lab reproduce --json` on a real tiny trial (tests/test_reproduce.py's world: a git repository,
a DVC dataset, an MLflow server): one JSON object naming what was re-run and the comparison the
new run's run.json records."""

from __future__ import annotations

import json

from tests.test_reproduce import state, world  # noqa: F401  (fixture)


def test_reproduce_json_is_what_was_rerun_and_the_recorded_comparison(world):  # noqa: F811
    lab = world
    proc = lab.cli("reproduce", "orig", "--run", "orig-json", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)  # the whole of stdout is the one object
    orig, new = state(lab, "orig"), state(lab, "orig-json")
    assert out["original"] == "orig" and out["run"] == "orig-json" and out["exit_code"] == 0
    assert out["comparison"] == new["reproduction"] and out["comparison"]["verdict"] == "reproduced exactly"
    assert out["dataset"]["md5"] == orig["lineage"]["dataset"]["md5"]
    assert out["dataset"]["commit"] == orig["lineage"]["dataset"]["commit"]
    assert out["seed"] == orig["lineage"].get("seed", orig.get("seed")) is not None
    assert out["hparams"] == orig["hparams"] and "/orig-json/" in out["log"]
    assert out["from_step"] in (0, None) and out["from_checkpoint"] is None
    assert isinstance(out["environment"], list)
