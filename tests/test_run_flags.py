"""``det-lab run``'s scheduler flags and ``det-lab runs show --json``, through the installed
console script: ``--local --slurm`` is refused (it used to take Slurm silently), and ``runs show
--json`` is the record of a real tiny run, the same facts the table prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Lab, tiny_data_lab

TINY = Path(__file__).parent / "fixtures" / "tiny"


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory) -> Lab:
    """A lab with the tiny regression dataset published, no tracker (a run needs none)."""
    return tiny_data_lab(tmp_path_factory.mktemp("flags-lab"))


def _runs(lab: Lab) -> set[Path]:
    root = lab.root / "outputs" / "vla"
    return {p for d in ("local-runs", "slurm-runs", "slurm-searches") for p in (root / d).glob("*")}


def test_local_and_slurm_together_is_one_line_and_runs_nothing(tiny_lab):
    before = _runs(tiny_lab)
    proc = tiny_lab.cli("run", str(TINY), "--local", "--slurm")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "--local" in line and "--slurm" in line and "not both" in line, line
    assert _runs(tiny_lab) == before and proc.stdout == ""


def test_runs_show_json_is_the_runs_record(tiny_lab):
    proc = tiny_lab.cli("run", str(TINY), "--local", "--run", "shown",
                        "--set", "data.det_lab.max_length.batches=20", "--set", "min_checkpoint_period.batches=10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tiny_lab.root / "outputs" / "vla" / "local-runs" / "shown"
    st = json.loads((run_dir / "run.json").read_text())
    shown = tiny_lab.cli("runs", "show", "shown", "--json", check=True)
    d = json.loads(shown.stdout)  # one JSON document, nothing else on stdout
    assert (d["name"], d["kind"], d["status"], d["directory"]) == ("shown", "local", "finished", str(run_dir))
    assert d["hparams"] == st["hparams"] and d["config"] == st["config"]
    assert d["checkpoints"] == st["checkpoints"] and len(d["checkpoints"]) == 2
    assert (d["latest_checkpoint"], d["latest_checkpoint_step"]) == (st["latest_checkpoint"], 20)
    assert (d["step"], d["max_length"]) == (20, 20)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last_validation = [m["metrics"] for m in metrics if m["group"] == "validation"][-1]
    assert d["validation"] == last_validation
    # the table says the same
    table = tiny_lab.cli("runs", "show", "shown", check=True).stdout
    assert "shown (local): finished" in table and f"latest {st['latest_checkpoint']} (step 20)" in table

    damaged = tiny_lab.root / "outputs" / "vla" / "local-runs" / "torn"
    damaged.mkdir()
    (damaged / "run.json").write_text('{"name": "torn", "status": "runn')
    proc = tiny_lab.cli("runs", "show", "torn", "--json")
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "damaged run record" in line
