"""The reference pages (docs/reference/) say what the code does: regenerated here, any difference fails.

Also the tables they come from are whole: every config key has a description, every ``DET_LAB_``
variable the code reads is declared in ``det_lab.settings.ENV_VARS``, and every series the exporter's
sources export is declared (with its labels) in ``det_lab.monitoring.series``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_reference_pages_are_generated_from_the_current_code(tmp_path):
    gen.generate(tmp_path)
    stale = [rel for rel in gen.PAGES
             if not (REPO / "docs" / rel).is_file()
             or (REPO / "docs" / rel).read_text(encoding="utf-8") != (tmp_path / rel).read_text(encoding="utf-8")]
    assert not stale, f"stale reference pages {stale}: run {gen.REGENERATE} and commit them"


def test_a_changed_field_description_makes_its_page_stale(tmp_path, monkeypatch):
    from det_lab.settings import TrackingSettings
    field = TrackingSettings.model_fields["backend"]
    monkeypatch.setattr(field, "description", field.description + " (changed)")
    assert gen.stale(REPO / "docs") == ["reference/lab-config.md"]


@pytest.mark.parametrize("model", ["det_lab.settings:LabSettings", "det_lab.cluster.settings:ClusterSettings",
                                   "det_lab.slurm.settings:SlurmSettings"])
def test_every_config_key_has_a_description(model):
    module, name = model.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert gen.missing_descriptions(cls) == []


def test_the_config_reference_lists_nested_keys_with_type_and_default():
    page = (REPO / "docs" / "reference" / "slurm-config.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `accounting.members[].gpu_limit` |"))
    assert "integer or null" in row and "GPUs they may hold at once" in row
    page = (REPO / "docs" / "reference" / "lab-config.md").read_text()
    assert "| `projects.<name>.quota` | size (500GiB, 1.5TiB) | 500GiB |" in page


# --- one table of environment variables ----------------------------------------------------

_VAR = re.compile(r"\bDET_LAB_[A-Z0-9_]*[A-Z0-9]\b")


def _files_that_run():
    """Code that runs in det_lab's processes or its tasks: the package, templates, notebooks, cluster files."""
    for pattern in ("det_lab/**/*.py", "experiment_templates/**/*.py", "experiment_templates/**/*.sh",
                    "experiment_templates/**/*.yaml", "notebooks/*.ipynb", "cluster/*.yaml"):
        yield from REPO.glob(pattern)


def undeclared_variables(declared) -> dict[str, list[str]]:
    """Each ``DET_LAB_`` name the code mentions that ``declared`` lacks, with the files naming it."""
    found: dict[str, list[str]] = {}
    for path in _files_that_run():
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(cell.get("source", "")) for cell in json.loads(text)["cells"])
        for name in set(_VAR.findall(text)) - set(declared):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def test_every_det_lab_variable_the_code_reads_is_declared_in_one_table():
    from det_lab.settings import ENV_VARS
    missing = undeclared_variables(ENV_VARS)
    assert not missing, f"declare these in det_lab.settings.ENV_VARS: {missing}"


def test_an_undeclared_variable_is_found():
    from det_lab.settings import ENV_VARS
    declared = {name for name in ENV_VARS if name != "DET_LAB_WHEELS"}
    assert "experiment_templates/vla/startup-hook.sh" in undeclared_variables(declared)["DET_LAB_WHEELS"]


def test_the_environment_reference_has_every_declared_variable_once():
    from det_lab.settings import ENV_VARS
    page = (REPO / "docs" / "reference" / "environment.md").read_text()
    rows = [line.split("|")[1].strip(" `") for line in page.splitlines() if line.startswith("| `")]
    assert rows == list(ENV_VARS)


# --- exported series -----------------------------------------------------------------------

def _exported_in_code():
    """(file, line, name, labels or None) of each ``.add("name", doc, labels...)`` / ``.gauge(...)`` call."""
    for path in sorted((REPO / "det_lab" / "monitoring").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("add", "gauge") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and len(node.args) >= 2):
                continue
            labels = None
            if len(node.args) >= 3:
                arg = node.args[2]
                if isinstance(arg, ast.Dict) and all(isinstance(k, ast.Constant) for k in arg.keys):
                    labels = tuple(k.value for k in arg.keys)
                elif isinstance(arg, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in arg.elts):
                    labels = tuple(e.value for e in arg.elts)
            yield path.name, node.lineno, node.args[0].value, labels


def test_every_series_a_source_exports_is_declared_with_its_labels():
    from det_lab.monitoring.series import BY_NAME
    calls = list(_exported_in_code())
    assert len({name for _, _, name, _ in calls}) >= 20  # the scan sees the sources
    wrong = [f"{f}:{line} {name}" for f, line, name, labels in calls
             if name not in BY_NAME or (labels is not None and labels != BY_NAME[name].labels)]
    assert not wrong, f"declare these in det_lab/monitoring/series.py (name and labels): {wrong}"


def test_describe_declares_what_the_volume_sources_export(lab):
    """The sources that run here, on a real volume with a run and a journal: each family they
    export is declared by the collector's describe() with the same labels."""
    from det_lab.monitoring.collector import LabCollector
    from det_lab.monitoring.source_runs import RunsSource
    from det_lab.monitoring.source_trackers import TrackersSource
    from det_lab.monitoring.source_volume import VolumeSource
    from det_lab.settings import load_settings
    from det_lab.volume import VolumeLayout

    assert lab.cli("init").returncode == 0
    settings = load_settings(lab.config)
    run = VolumeLayout.from_settings(settings).outputs("vla") / "local-runs" / "r1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "completed", "template": "vla", "user": "alice"}))
    collector = LabCollector([VolumeSource(settings), RunsSource(settings), TrackersSource(settings)])
    declared = {f.name: f for f in collector.describe()}
    exported = [f for f in collector.collect() if f.samples]
    assert {"det_lab_volume_project_bytes", "det_lab_runs", "det_lab_scrape_error"} <= {f.name for f in exported}
    for family in exported:
        assert family.name in declared, family.name
        for sample in family.samples:
            assert tuple(sample.labels) == tuple(declared[family.name]._labelnames), (family.name, sample.labels)
        assert family.documentation == declared[family.name].documentation
