"""The notebooks in notebooks/, executed headless top to bottom (nbclient) with no Determined
master, against real local services: an MLflow server, a local Aim repo and a scratch lab whose
demo datasets are real DVC datasets. Each notebook must say it fell back to local mode; its plots
must exist and the data drawn in them (the JSON saved beside each PNG) must be what the runs
reported. Also: the notebooks in the repo carry no outputs."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import nbclient
import nbformat
import pytest
import yaml
from nbclient.exceptions import CellExecutionError
from typer.testing import CliRunner

from det_lab import notebook as nb
from det_lab.cli.app import app
from det_lab.tracking.mlflow_server import free_port
from tests.conftest import VENV_BIN

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
TEMPLATE = REPO / "experiment_templates" / "vla"
BATCHES = 40


@dataclass
class NotebookLab:
    root: Path  # data root
    tmp: Path
    env: dict[str, str]
    mlflow_uri: str
    aim_repo: Path

    def short_config(self, name: str, **hparams: float) -> Path:
        """const.yaml trained for BATCHES batches of 8, validated every 10 and checkpointed every 20:
        four validations, two checkpoints, eight training points, in as few batches as that takes."""
        conf = yaml.safe_load((TEMPLATE / "const.yaml").read_text())
        conf["data"]["det_lab"].update(max_length={"batches": BATCHES}, reporting_batches=5)
        conf["min_validation_period"] = {"batches": 10}
        conf["min_checkpoint_period"] = {"batches": 20}
        conf["hyperparameters"].update(global_batch_size=8, **hparams)
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(conf))
        return path

    def execute(self, notebook: str, **env: str) -> tuple[str, Path]:
        """Run ``notebook`` in a fresh kernel; its printed text and its output directory."""
        out = self.tmp / "out" / Path(notebook).stem / env.get(nb.TRACKER_ENV, "")
        book = nbformat.read(REPO / "notebooks" / notebook, as_version=4)
        client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                         resources={"metadata": {"path": str(self.tmp)}})
        try:
            client.execute(env={**self.env, nb.OUT_ENV: str(out), **env})
        except CellExecutionError as exc:
            pytest.fail(f"{notebook} failed:\n{exc}")
        return _text(book), out


def _text(book) -> str:
    parts = []
    for cell in book.cells:
        for o in cell.get("outputs", []):
            parts.append(o.get("text", "") if o["output_type"] == "stream"
                         else (o.get("data") or {}).get("text/plain", ""))
    return "\n".join(parts)


def _figure(out: Path, name: str) -> dict:
    png = out / f"{name}.png"
    assert png.is_file() and png.stat().st_size > 5000, f"{png} missing or empty"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / f"{name}.json").read_text())


def _runs(lab: NotebookLab) -> list[Path]:
    return sorted((lab.root / "outputs" / "vla" / "local-runs").glob("vla-*"), key=lambda p: p.stat().st_mtime)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, mlflow_server) -> NotebookLab:
    """A lab with the demo datasets published, tracking to MLflow and Aim, and no master."""
    tmp = tmp_path_factory.mktemp("nb-lab")
    config = tmp / "lab.yaml"
    aim_repo = tmp / "aim"
    config.write_text(yaml.safe_dump({"data_root": str(tmp / "data"), "tracking": {
        "backend": "both", "mlflow_uri": mlflow_server.uri, "aim_repo": str(aim_repo)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER", "DET_USER"))}
    env.update(DET_LAB_CONFIG=str(config), XDG_CONFIG_HOME=str(tmp / "xdg-config"),
               XDG_DATA_HOME=str(tmp / "xdg-data"), MPLBACKEND="Agg", COLUMNS="200",
               DET_LAB_TEMPLATES=str(REPO / "experiment_templates"))
    proc = CliRunner().invoke(app, ["init", "--demo"], env=env)  # in this process: no interpreter start
    assert proc.exit_code == 0, proc.output
    return NotebookLab(tmp / "data", tmp, env, mlflow_server.uri, aim_repo)


@pytest.fixture(scope="module")
def submitted(lab: NotebookLab) -> tuple[str, Path]:
    """01 run once: its text and output dir (the run it trains is used by 03 as well)."""
    return lab.execute("01_submit_and_watch.ipynb", DET_LAB_NOTEBOOK_CONFIG=str(lab.short_config("short")))


@pytest.fixture(scope="module")
def two_runs(lab: NotebookLab, submitted) -> list[Path]:
    """A second short run with another learning rate, started as a user would."""
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "run", "vla", "--local", "--exp-config",
                           str(lab.short_config("short-lr", lr=0.006))],
                          env=lab.env, cwd=lab.tmp, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = _runs(lab)
    assert len(runs) == 2
    return runs


def test_notebooks_in_the_repo_have_no_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"01_submit_and_watch.ipynb", "02_datasets.ipynb", "03_compare_runs.ipynb"}
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        nbformat.validate(book)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear its outputs"


def test_submit_notebook_trains_locally_and_fetches_the_best_checkpoint(lab, submitted):
    text, out = submitted
    assert "No Determined master reachable" in text and "LOCAL MODE" in text
    (run_dir,) = _runs(lab)
    state = json.loads((run_dir / "run.json").read_text())
    assert f"local run {state['name']}: COMPLETED" in text and str(run_dir) in text

    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in metrics if m["group"] == "validation"]
    curves = _figure(out, "01_training_curves")
    assert curves["mode"] == "local" and curves["location"] == str(run_dir)
    assert curves["validation/val_action_l1"]["steps"] == [m["step"] for m in val] == [10, 20, 30, 40]
    assert curves["validation/val_action_l1"]["values"] == pytest.approx([m["metrics"]["val_action_l1"] for m in val])
    assert curves["training/loss"]["steps"][-1] == BATCHES and len(curves["training/loss"]["values"]) == 8

    result = json.loads((out / "01_result.json").read_text())
    best = result["best_checkpoint"]
    assert [c["uuid"] for c in state["checkpoints"]] == result["checkpoints"]
    assert len(state["checkpoints"]) + len(state.get("checkpoints_deleted", [])) == 2  # kept, or deleted by retention
    by_step = {m["step"]: m["metrics"]["val_action_l1"] for m in val}
    best_step = min((c["step"] for c in state["checkpoints"]), key=by_step.__getitem__)
    assert best["step"] == best_step and best["metrics"]["val_action_l1"] == pytest.approx(by_step[best_step])
    assert Path(best["path"]) == lab.root / "checkpoints" / "vla" / best["uuid"]
    assert (Path(best["path"]) / "vla_policy.json").is_file()


def test_datasets_notebook_lists_the_demo_datasets_with_sizes(lab):
    text, out = lab.execute("02_datasets.ipynb")
    assert "LOCAL MODE" in text
    for name in ("vla-demo", "3dgs-demo"):
        assert name in text
    sizes = _figure(out, "02_sizes_per_project")
    assert sizes["projects"] == ["3dgs", "isaac", "vla"]
    remote = dict(zip(sizes["projects"], sizes["remote_bytes"]))
    assert remote["vla"] > 0 and remote["3dgs"] > 0 and remote["isaac"] == 0
    datasets = sizes["datasets"]
    assert set(datasets) == {"vla-demo", "3dgs-demo"}
    for name, d in datasets.items():
        assert d["size_bytes"] > 0 and d["files"] > 0 and d["revisions"] >= 1 and len(d["commit"]) == 40
        assert f"{name}: commit {d['commit'][:12]} md5 {d['md5']}" in text
    assert datasets["vla-demo"]["project"] == "vla" and datasets["3dgs-demo"]["project"] == "3dgs"


@pytest.mark.parametrize("tracker", ["mlflow", "aim"])
def test_compare_notebook_plots_every_run_linked_to_its_run_dir(lab, two_runs, tracker):
    text, out = lab.execute("03_compare_runs.ipynb", DET_LAB_NOTEBOOK_TRACKER=tracker)
    assert "LOCAL MODE" in text and f"2 run(s) of project vla in {tracker}" in text
    states = {json.loads((d / "run.json").read_text())["name"]: d for d in two_runs}

    curves = _figure(out, "03_loss_curves")
    assert curves["tracker"] == tracker and set(curves["runs"]) == set(states)
    for name, run_dir in states.items():
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        val = [m for m in lines if m["group"] == "validation"]
        train = [m for m in lines if m["group"] == "training"]
        drawn = curves["runs"][name]
        assert drawn["validation/val_action_l1"]["steps"] == [m["step"] for m in val]
        assert drawn["validation/val_action_l1"]["values"] == pytest.approx(
            [m["metrics"]["val_action_l1"] for m in val])
        assert drawn["training/loss"]["steps"] == [m["step"] for m in train]
        assert f"{name}: local run {run_dir}" in text

    scatter = _figure(out, "03_metric_vs_hparam")
    assert scatter["hparam"] == "lr" and len(scatter["runs"]) == 2
    assert sorted(r["x"] for r in scatter["runs"]) == pytest.approx([0.002, 0.006])
    for r in scatter["runs"]:
        run_dir = states[r["name"]]
        assert r["link_kind"] == "local run" and r["link"] == str(run_dir)
        val = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if m["group"] == "validation"]
        assert r["y"] == pytest.approx(val[-1]["metrics"]["val_action_l1"])


def test_master_reachable_only_when_info_answers(tmp_path, monkeypatch):
    from det_lab.settings import LabSettings

    monkeypatch.delenv("DET_MASTER", raising=False)
    assert nb.master_reachable(LabSettings(data_root=tmp_path)) is False  # none configured
    closed = LabSettings(data_root=tmp_path, master_url=f"http://127.0.0.1:{free_port()}")
    assert nb.master_reachable(closed, timeout=1) is False
    assert nb.choose_mode(closed, timeout=1) == "local"

    class Info(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/info" else 404)
            self.end_headers()
            self.wfile.write(b'{"version": "0.38.1"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = LabSettings(data_root=tmp_path, master_url=f"http://127.0.0.1:{server.server_port}")
        assert nb.master_reachable(settings) is True
        assert nb.choose_mode(settings) == "cluster"
    finally:
        server.shutdown()


def test_det_template_matches_the_task_defaults_and_the_shipped_copy():
    from det_lab.cluster.render import render_master
    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings, TrackingSettings

    lab = LabSettings(data_root="/mnt/data", tracking=TrackingSettings(mlflow_uri="http://gpu-box-1:5000"))
    cluster = ClusterSettings(master_host="gpu-box-1")
    template = nb.det_template(lab, cluster)
    tcd = render_master(lab, cluster)["task_container_defaults"]
    assert template["bind_mounts"] == tcd["bind_mounts"]
    assert template["environment"]["environment_variables"] == tcd["environment_variables"]
    assert set(template) <= {"bind_mounts", "environment"}  # experiment-config keys only
    assert yaml.safe_load((REPO / "cluster" / "notebook-template.yaml").read_text()) == template


def test_cluster_submit_goes_through_the_sdk_with_the_det_lab_template(tmp_path, monkeypatch):
    """The SDK path's wiring, with determined.experimental.client stubbed (no master here)."""
    from types import SimpleNamespace

    from determined.experimental import client

    from det_lab.settings import LabSettings

    calls: dict = {}
    ckpt = SimpleNamespace(uuid="c-1", metadata={"steps_completed": 80},
                           training=SimpleNamespace(trial_id=7, validation_metrics={
                               "avgMetrics": {"val_action_l1": 0.1}}))

    def download(path):
        Path(path).mkdir(parents=True)
        (Path(path) / "metadata.json").write_text("{}")
        return path

    ckpt.download = download
    trial = SimpleNamespace(id=7, hparams={"lr": 0.002}, iter_metrics=lambda group: [
        SimpleNamespace(steps_completed=80, metrics={"loss" if group == "training" else "val_action_l1": 0.1})])
    exp = SimpleNamespace(id=3, wait=lambda interval: SimpleNamespace(name="COMPLETED"),
                          top_checkpoint=lambda: ckpt, list_trials=lambda: [trial])

    def create_experiment(config, model_dir=None, template=None, **kw):
        calls.update(config=config, model_dir=model_dir, template=template)
        return exp

    monkeypatch.setattr(client, "login", lambda master=None, **kw: calls.setdefault("master", master))
    monkeypatch.setattr(client, "create_experiment", create_experiment)
    monkeypatch.setenv(nb.OUT_ENV, str(tmp_path / "out"))
    monkeypatch.delenv(nb.DET_TEMPLATE_ENV, raising=False)
    settings = LabSettings(data_root=tmp_path, master_url="http://master:8080")
    from det_lab.runs.validate import PreflightError

    bad = {**yaml.safe_load((TEMPLATE / "const.yaml").read_text()), "trainer": {"epochs": 3}}
    with pytest.raises(PreflightError, match="trainer: unknown key"):  # refused before the master is asked
        nb.submit("vla", bad, settings=settings, mode="cluster")
    assert calls == {}
    # a config of the user's own, without a storage_path: checkpoints/<project>, as a local run of it
    own = {k: v for k, v in yaml.safe_load((TEMPLATE / "const.yaml").read_text()).items() if k != "checkpoint_storage"}
    result = nb.submit("vla", own, settings=settings, mode="cluster")
    assert calls["master"] == "http://master:8080" and calls["template"] == "det-lab"
    assert Path(calls["model_dir"]) == TEMPLATE and calls["config"]["name"] == "vla-tiny"
    assert calls["config"]["checkpoint_storage"] == {"type": "shared_fs", "storage_path": "checkpoints/vla"}
    assert result.location == "http://master:8080/det/experiments/3/trials/7" and result.status == "COMPLETED"
    best = nb.best_checkpoint(result)
    assert best.uuid == "c-1" and best.step == 80 and best.metrics == {"val_action_l1": 0.1}
    assert best.path == tmp_path / "out" / "checkpoints" / "c-1"
    assert result.history("val_action_l1") == [(80, 0.1)] and result.hparams == {"lr": 0.002}
