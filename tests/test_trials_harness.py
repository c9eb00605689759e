"""Determined's internals, as det_lab uses them: every private name still there with the signature
det_lab relies on, used from one module only, and the interception working on Determined's own
off-cluster (dummy) Core API contexts. No subprocess, no server: seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import determined as det
import pytest

from det_lab.cluster.deploy import DEPLOY_PRIVATE_NAMES
from det_lab.compat import import_deploy
from det_lab.runs import harness

REPO = Path(__file__).resolve().parents[1]


def test_every_private_name_matches_the_pinned_determined():
    assert det.__version__ == "0.38.1"
    assert harness.check_private_names() == []
    deploy = import_deploy()
    for module, name, _upstream, _why in DEPLOY_PRIVATE_NAMES:
        assert module == deploy.__name__ and hasattr(deploy, name), f"{module}.{name} is gone"


def test_a_changed_signature_is_reported(monkeypatch):
    def renamed(self, group, steps_completed, metrics, per_batch=None):  # upstream renamed a parameter
        return None

    monkeypatch.setattr(det.core.DummyTrainContext, "_report_trial_metrics", renamed)
    monkeypatch.delattr(det.core.CheckpointContext, "_report_checkpoint")
    problems = harness.check_private_names()
    assert any("DummyTrainContext._report_trial_metrics" in p and "per_batch" in p for p in problems)
    assert any("CheckpointContext._report_checkpoint is gone" in p for p in problems)


def _python_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]


def test_private_determined_names_appear_in_one_trial_module_only():
    names = {p.name for p in harness.PRIVATE_NAMES}
    allowed = {REPO / "det_lab/runs/harness.py"}
    offenders = []
    for path in _python_files(REPO / "det_lab") + _python_files(REPO / "experiment_templates"):
        if path in allowed:
            continue
        text = path.read_text()
        for name in names:
            if re.search(rf"\.{name}\b", text):
                offenders.append(f"{path.relative_to(REPO)}: {name}")
        # importing a private module or name of determined
        for m in re.finditer(r"(?:from|import)\s+(determined[\w.]*)(?:\s+import\s+([\w, ]+))?", text):
            module, imported = m.group(1), m.group(2) or ""
            if any(part.startswith("_") for part in module.split(".")) or any(
                    n.strip().startswith("_") for n in imported.split(",")):
                offenders.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    # the cluster deploy code keeps its own, listed in DEPLOY_PRIVATE_NAMES
    deploy_names = {name for _m, name, _u, _w in DEPLOY_PRIVATE_NAMES}
    offenders = [o for o in offenders if not (o.startswith("det_lab/cluster/deploy.py")
                                              and o.split(": ")[1] in deploy_names)]
    assert offenders == []


class Recorder:
    """The Interceptor protocol, recording what it is handed."""

    def __init__(self) -> None:
        self.metrics: list[tuple[str, int, dict]] = []
        self.checkpoints: list[tuple[str, dict]] = []
        self.written: list[str] = []
        self.preempt = False

    def on_metrics(self, group, step, metrics):
        self.metrics.append((group, step, dict(metrics)))

    def checkpoint_metadata(self, metadata):
        return {**metadata, "det_lab": {"run_key": "k"}}

    def checkpoint_written(self, path):
        # the files are there, the metadata.json that makes them a checkpoint not yet (the fence's last check)
        assert path.parent == self.root and any(path.iterdir()) and not (path / "metadata.json").exists()
        self.written.append(path.name)

    def on_checkpoint(self, storage_id, metadata):
        assert (self.root / storage_id / "metadata.json").is_file()  # complete before it is reported
        assert self.written[-1] == storage_id
        self.checkpoints.append((storage_id, dict(metadata)))

    def on_should_preempt(self, answer):
        return answer or self.preempt


def test_intercept_routes_metrics_checkpoints_and_preemption(tmp_path):
    hooks = Recorder()
    hooks.root = tmp_path
    with det.core.init(checkpoint_storage=str(tmp_path)) as core:
        harness.intercept(core, hooks)
        core.train.report_training_metrics(5, {"loss": 0.5})
        core.train.report_validation_metrics(10, {"val_loss": 0.25})
        core.train.report_metrics("custom", 10, {"fps": 30.0})
        with core.checkpoint.store_path({"steps_completed": 10}) as (path, storage_id):
            (path / "w.txt").write_text("1")
            assert hooks.checkpoints == []  # not reported while being written
        assert core.preempt.should_preempt() is False
        hooks.preempt = True
        assert core.preempt.should_preempt() is True
    assert hooks.metrics == [("training", 5, {"loss": 0.5}), ("validation", 10, {"val_loss": 0.25}),
                             ("custom", 10, {"fps": 30.0})]
    assert [c[0] for c in hooks.checkpoints] == [storage_id] and hooks.written == [storage_id]
    meta = json.loads((tmp_path / storage_id / "metadata.json").read_text())
    assert meta["det_lab"] == {"run_key": "k"} and meta["steps_completed"] == 10


def test_harness_shims_are_restored_after_the_trial(tmp_path):
    from determined import core, pytorch, util

    before = (core.init, util.write_user_code, pytorch._PyTorchTrialController)
    with harness.harness_shims(tmp_path, []):
        assert (core.init, util.write_user_code, pytorch._PyTorchTrialController) != before
        with core.init() as ctx:  # off-cluster checkpoints go to the lab's directory
            with ctx.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
                (path / "x").write_text("x")
        assert (tmp_path / storage_id / "x").is_file()
    assert (core.init, util.write_user_code, pytorch._PyTorchTrialController) == before


@pytest.mark.parametrize("steps", [0, 37])
def test_local_resume_uses_the_checkpoints_own_step(tmp_path, steps):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "metadata.json").write_text(json.dumps({"steps_completed": steps}))
    assert harness._steps_completed(tmp_path / "ck") == steps
    assert harness._steps_completed(tmp_path / "missing") == 0
