"""`--json` on `tracking status`, `templates list` and `config`: the same data the text shows,
checked against what the journals, the template directories and the lab config file hold."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from det_lab.settings import load_settings
from det_lab.tracking.events import Metrics
from det_lab.tracking.journal import Cursor, Journal
from tests.test_bad_inputs import cli
from tests.test_tracking_sender import run_info


def _json(lab, *args: str, code: int = 0) -> dict:
    proc = cli(lab, *args, "--json")
    assert proc.returncode == code, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _journal(lab, name: str, events: int) -> Journal:
    journal = Journal(lab.root / "outputs" / "vla" / "tracking-journal" / name)
    journal.describe_run(run_info(name), {"mlflow": "http://127.0.0.1:9"})  # a tracker that is down
    journal.append([Metrics("training", s, {"loss": float(s)}) for s in range(1, events + 1)])
    journal.close()
    return journal


def test_tracking_status_json_counts_each_journals_undelivered_events(lab):
    assert _json(lab, "tracking", "status") == {"journals": []}
    waiting, damaged, delivered = _journal(lab, "waiting", 7), _journal(lab, "damaged", 3), _journal(lab, "done", 2)
    (damaged.directory / "run.json").write_text('{"run": {"key": "damaged", "na')  # torn
    delivered.advance("mlflow", Cursor(delivered.last_seq))  # every event acknowledged: nothing waits
    out = {j["journal"]: j for j in _json(lab, "tracking", "status", code=1)["journals"]}
    assert set(out) == {str(waiting.directory), str(damaged.directory)}
    assert out[str(waiting.directory)] == {"journal": str(waiting.directory), "events": Journal(waiting.directory).pending("mlflow"),
                                     "damaged": None} and out[str(waiting.directory)]["events"] == 7
    assert out[str(damaged.directory)]["events"] == 3 and str(damaged.directory / "run.json") in out[str(damaged.directory)]["damaged"]
    text = cli(lab, "tracking", "status").stdout
    assert f"       7 events waiting  {waiting.directory}" in text and "1 journal(s) with undelivered events, 1 damaged" in text


def test_templates_list_json_names_directories_that_hold_each_template(lab):
    from det_lab import templates

    out = _json(lab, "templates", "list")
    by_name = {t["name"]: t for t in out["templates"]}
    assert set(templates.NAMES) <= set(by_name)
    for name, directory in templates.NAMES.items():
        path = by_name[name]["path"]
        assert path.endswith(f"/{directory}") and yaml.safe_load(open(f"{path}/const.yaml"))["name"]
    assert out["notebooks"]["name"] == templates.NOTEBOOKS
    assert any(p.suffix == ".ipynb" for p in Path(out["notebooks"]["path"]).iterdir())
    text = cli(lab, "templates", "list").stdout
    assert all(t["path"] in text for t in out["templates"])


def test_config_json_is_the_lab_config_file_with_quotas_in_bytes(lab):
    lab.write_config(projects={"vla": {"quota": "3GiB", "description": "policies"}})
    out = _json(lab, "config")
    assert out["source"] == str(lab.config)
    assert out["config"]["data_root"] == str(lab.root)
    assert out["config"]["projects"]["vla"] == {"quota": 3 * 2**30, "description": "policies"}
    assert out["config"] == load_settings(lab.config, env={}).model_dump(mode="json")
    assert out["environment_overrides"]["DET_LAB_DATA_ROOT"] == "data_root"
    # an environment override shows in the JSON as in the text
    moved = json.loads(cli(lab, "config", "--json", DET_LAB_DATA_ROOT=str(lab.root / "elsewhere")).stdout)
    assert moved["config"]["data_root"] == str(lab.root / "elsewhere")
