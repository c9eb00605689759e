"""det_lab's templates on the Determined path, end to end: submitted with Determined 0.38.1's own
``det experiment create`` to the master stand-in (tests/standin/master*.py), run by the agent stand-in
through Determined's whole container chain (tests/standin/task_run.py: ship-logs.sh, task-setup.sh
installing the 0.38.1 harness wheel, prep_container, the startup hook, ``determined.exec.launch``,
the ``torch_distributed`` launcher) in a bubblewrap sandbox as a linked non-root user, with the
master config det_lab renders (its task-container defaults, the volume's mounts, shared_fs storage).

What a researcher reads afterwards is what these tests check: the master's record (what the Web UI
shows), the checkpoints on the volume and through the SDK, the run's own metrics. Several slots
(one process per slot under the launcher, the chief alone reporting and saving) are
tests/test_vla_distributed.py's, with LeRobot's ACT on the same cluster chain.
"""

from __future__ import annotations

from collections.abc import Iterator
import functools
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from det_lab.cluster.render import prepare_local_cache, render_master
from det_lab.cluster.settings import ClusterSettings
from tests.standin.agent import Agent
from tests.standin.master import Master
from tests.standin.task_config import Image, LinkedUser
from tests import torchvision_shim
from tests.lerobot_writer import skip_without_lerobot
from tests.standin.task_image import make_image
from tests.task_standin import run_allocation
from tests.test_standin_master import SEARCHER
from tests.test_task_chain import harness_wheels  # noqa: F401  (a fixture: the 0.38.1 harness wheel)
from tests.test_task_standin import TEMPLATES, Lab, lab  # noqa: F401  (lab: a fixture)

REPO = Path(__file__).resolve().parents[1]
DET = Path(sys.executable).parent / "det"


class DetCluster:
    """The lab's cluster as det_lab renders it: a master stand-in with det_lab's master config, an
    agent stand-in with ``slots`` CPU slots running each task through Determined's chain as member A."""

    def __init__(self, lab: Lab, wheels: Path, mlflow_uri: str, slots: int = 2) -> None:
        self.lab = lab
        # the lab's tracking server, on another machine of the lab network as the tasks see it
        port = int(mlflow_uri.rsplit(":", 1)[1].strip("/"))
        self.mlflow_uri, self.task_mlflow_uri = mlflow_uri, f"http://lab-mlflow:{port}"
        cluster = ClusterSettings(tasks={"local_cache": str(lab.base / "agent-cache")})
        prepare_local_cache(lab.settings, cluster)  # what 'cluster agent-up' makes
        self.cluster = cluster
        self.config = render_master(lab.settings, cluster)
        a = lab.a
        self.master = Master(self.config, searcher_factory=SEARCHER, agent_user_group={
            "agentUid": a.uid, "agentGid": lab.gid, "agentUser": a.name, "agentGroup": lab.group})
        # the lab's task image: det_lab in it (this checkout, installed editable in the image's packages)
        base = make_image(lab.base / f"image-{uuid.uuid4().hex[:4]}", probe_uid=a.uid)
        # a lab's image has a torchvision built for its torch; this machine's PyPI pair does not import
        # together (tests/torchvision_shim.py): the image's packages declare its ops at the first import
        (base.dirs[0] / "site-packages" / "zz_torchvision_shim.pth").write_text(torchvision_shim.image_pth_line())
        self.image = Image(base.bin_dir, env=base.env, dirs=[*base.dirs, REPO])
        # 'det-lab cluster link-users' links a member with the lab group as gid (det_lab/cluster/users.py)
        user = LinkedUser(a.name, a.uid, lab.gid, group=lab.group)
        runner = functools.partial(run_allocation, master=self.config, user=user, image=self.image,
                                   wheel_dir=wheels, master_addr=("127.0.0.1", self.master.port),
                                   cluster_id=self.master.cluster_id, master_id=self.master.master_id, timeout=300,
                                   services={"lab-mlflow": ("127.0.0.1", port)})
        self.agent = Agent(self.master, runner, slots=slots)
        home = lab.base / f"det-home-{uuid.uuid4().hex[:4]}"
        home.mkdir()
        self.env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache"), "DET_USER": "determined", "DET_PASS": "",
                    "DET_MASTER": self.master.url, "LANG": "C.UTF-8"}

    def det(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(DET), "-m", self.master.url, *args], capture_output=True, text=True,
                              env=self.env, timeout=120)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def create(self, template: str, conf: dict[str, Any]) -> int:
        """``det experiment create CONFIG DIR`` as a researcher runs it, from the template's directory,
        its metrics mirrored to the lab's MLflow server."""
        conf.setdefault("environment", {}).setdefault("environment_variables", []).extend(
            ["DET_LAB_TRACKING=mlflow", f"MLFLOW_TRACKING_URI={self.task_mlflow_uri}"])
        path = self.lab.base / f"exp-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(conf))
        out = self.det("experiment", "create", str(path), str(TEMPLATES / template)).stdout
        return int(out.split("Created experiment ")[1].split()[0])

    def wait(self, exp_id: int, *states: str, timeout: float = 400) -> str:
        deadline = time.monotonic() + timeout
        state = self.master.state
        with state.changed:
            while state.experiments[exp_id].state not in states:
                assert time.monotonic() < deadline, f"experiment {exp_id}: {state.experiments[exp_id].state}"
                state.changed.wait(0.5)
        return state.experiments[exp_id].state

    def trials(self, exp_id: int) -> list[Any]:
        exp = self.master.state.experiments[exp_id]
        return sorted((t for t in self.master.state.trials.values() if t.experiment is exp), key=lambda t: t.id)

    def task_output(self, exp_id: int | None = None) -> str:
        """The tasks' output (of ``exp_id``'s trials only, when given): for an assertion's message."""
        allocs = None if exp_id is None else {a for t in self.trials(exp_id) for a in t.allocation_ids}
        return "\n".join(e.stdout[-3000:] + e.stderr[-6000:] for e in self.agent.exits
                         if allocs is None or e.allocation_id in allocs)

    def session(self) -> Any:
        from determined.common.api import authentication
        return authentication.login(self.master.url, "determined", "", cert=None)

    def close(self) -> None:
        self.agent.close()
        self.master.close()


@pytest.fixture(scope="module")
def det_cluster(lab, harness_wheels, shared_mlflow_server):  # noqa: F811
    if not DET.exists():
        pytest.skip("needs Determined's det CLI")
    # the lab's MLflow server as 'det-lab tracking serve' runs it, answering the name tasks use for it;
    # this module's runs are told apart by the master's cluster id (_mlflow_history)
    cluster = DetCluster(lab, harness_wheels, shared_mlflow_server.uri)
    yield cluster
    cluster.close()


def _expconf(template: str, config: str, **lab_section: Any) -> dict[str, Any]:
    conf = yaml.safe_load((TEMPLATES / template / config).read_text())
    conf["data"]["det_lab"].update(project="grasping", **lab_section)
    return conf


def _master_metrics(cluster: DetCluster, trial: Any) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """What the master stored for ``trial``, by group: (steps, the reported averages), in order."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for m in cluster.master.state.metrics:
        if m.trial_id == trial.id and not m.archived:
            values = m.metrics["validation_metrics" if m.group == "validation" else "avg_metrics"]
            out.setdefault(m.group, []).append((m.total_batches, values))
    return out


def _mlflow_history(cluster: DetCluster, trial: Any) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cluster.mlflow_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.tags.get("det.trial_id") == str(trial.id)
            and r.data.tags.get("det.cluster_id") == cluster.master.cluster_id]
    assert len(runs) == 1, [ln for ln in cluster.task_output().splitlines() if "tracking" in ln][-5:]
    run = runs[0]
    return {name: sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics}


def _checkpoint_dirs(cluster: DetCluster, trial: Any, storage: str) -> list[tuple[Any, Path]]:
    ckpts = [c for c in cluster.master.state.checkpoints.values() if c.trial_id == trial.id]
    return [(c, cluster.lab.data / storage / c.uuid) for c in ckpts]


def _vla_conf(**searcher: Any) -> dict[str, Any]:
    conf = _expconf("vla", "const.yaml", dataset="grasp-frames", max_length={"batches": 60}, reporting_batches=10)
    conf["min_validation_period"] = conf["min_checkpoint_period"] = {"batches": 20}
    conf["searcher"].update(searcher)
    # Determined draws the experiment seed from the clock unless the config names one (trial seeds follow it)
    conf["reproducibility"] = {"experiment_seed": 7}
    return conf


@pytest.fixture(scope="module")
def vla_run(det_cluster) -> tuple[int, Any, Any]:
    """One VLA trial trained to its end on the cluster, never interrupted: the reference. Submitted
    as a notebook submits (det_lab.notebook.submit in cluster mode: the SDK's create_experiment,
    common/experimental/determined.py), which waits for the end; every other experiment here goes
    through ``det experiment create``. Yields the experiment, its trial and what submit returned."""
    from det_lab import notebook

    conf = _vla_conf()
    conf["environment"] = {"environment_variables": [
        "DET_LAB_TRACKING=mlflow", f"MLFLOW_TRACKING_URI={det_cluster.task_mlflow_uri}"]}
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"DET_USER": "determined", "DET_PASS": "", "DET_MASTER": det_cluster.master.url,
                           "HOME": det_cluster.env["HOME"]}.items():  # the SDK's token cache goes to HOME
            env.setenv(key, value)
        try:
            result = notebook.submit("vla", conf, settings=det_cluster.lab.settings, mode="cluster", det_template="")
        except notebook.SubmitError as exc:
            pytest.fail(f"{exc}\n{det_cluster.task_output()[-4000:]}")
    (trial,) = det_cluster.trials(result.experiment_id)
    return result.experiment_id, trial, result


def test_a_vla_experiment_trains_to_completed_and_the_master_volume_and_tracker_agree(det_cluster, vla_run):
    """The master's record (api_trials.go ReportTrialMetrics, ReportCheckpoint: what the Web UI shows),
    the volume and the tracker agree on one trial run through Determined's whole chain."""
    exp_id, trial, _ = vla_run
    assert trial.state == "COMPLETED" and det_cluster.master.unserved == []

    metrics = _master_metrics(det_cluster, trial)
    assert [s for s, _ in metrics["training"]] == [10, 20, 30, 40, 50, 60]  # every report once, in order
    assert [s for s, _ in metrics["validation"]] == [20, 40, 60]
    mirrored = _mlflow_history(det_cluster, trial)
    for group in ("training", "validation"):  # the mirror names a metric <group>/<name> (det_lab.tracking)
        for step, values in metrics[group]:
            for name, value in values.items():
                assert dict(mirrored[f"{group}/{name}"])[step] == value, (group, name, step)
    assert all(len(h) == len({s for s, _ in h}) for h in mirrored.values())  # each step once

    ckpts = _checkpoint_dirs(det_cluster, trial, "checkpoints/vla")
    assert sorted(c.metadata["steps_completed"] for c, _ in ckpts) == [20, 40, 60]
    for ckpt, path in ckpts:
        files = sorted(name for name in ckpt.resources if not name.endswith("/"))  # directories end in /
        assert files == sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        assert all((path / name).stat().st_size == int(size) for name, size in ckpt.resources.items()
                   if not name.endswith("/"))
        assert path.stat().st_uid == det_cluster.lab.a.uid  # written as the linked member
    from determined.experimental import client

    sdk = client.Determined._from_session(det_cluster.session())
    latest = max(ckpts, key=lambda cp: cp[0].metadata["steps_completed"])
    got = Path(sdk.get_checkpoint(latest[0].uuid).download(path=str(det_cluster.lab.base / "download-vla")))
    assert (got / "state_dict.pth").read_bytes() == (latest[1] / "state_dict.pth").read_bytes()
    logs = det_cluster.det("trial", "logs", str(trial.id)).stdout  # what ship_logs.py sent (task logs)
    assert "det_lab" in logs


def _wait_for(cluster: DetCluster, predicate: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with cluster.master.state.changed:
        while not predicate():
            assert time.monotonic() < deadline, cluster.task_output()[-4000:]
            cluster.master.state.changed.wait(0.2)


def test_a_pause_from_the_cli_checkpoints_and_activate_resumes_to_the_uninterrupted_losses(det_cluster, vla_run):
    """experiment.go PauseExperiment -> trial.go:750-759 TerminateAllocation (the preemption long poll
    answers), the trial checkpoints and exits; ActivateExperiment -> a new allocation with
    DET_LATEST_CHECKPOINT (task_trial.go:124-126): the losses after the resume are the reference's."""
    exp_id = det_cluster.create("vla", _vla_conf())
    # Paused once the rendezvous made the allocation ready (before it, a pause kills: allocation.go
    # tryExitOrTerminate), so the trial takes it at a report boundary (_pytorch_trial.py:360, :605-607)
    # with most of its 60 batches to go: paused after step 20's report, a fast trial once ran its last
    # 40 batches while the CLI started.
    _wait_for(det_cluster, lambda: bool(det_cluster.trials(exp_id)) and det_cluster.trials(exp_id)[0].alloc is not None
              and det_cluster.trials(exp_id)[0].alloc.ready)
    det_cluster.det("experiment", "pause", str(exp_id))
    (trial,) = det_cluster.trials(exp_id)
    _wait_for(det_cluster, lambda: trial.state == "PAUSED" and trial.alloc is None or trial.state == "COMPLETED")
    assert trial.state == "PAUSED", "the pause came after the trial ended: nothing was resumed"
    paused_at = max(s for s, _ in _master_metrics(det_cluster, trial)["training"])
    assert paused_at < 60, "the pause came after the trial ended: nothing was resumed"
    saved = max(c.metadata["steps_completed"] for c, _ in _checkpoint_dirs(det_cluster, trial, "checkpoints/vla"))
    assert saved == paused_at  # the pause's own checkpoint, at the boundary where the trial took it
    det_cluster.det("experiment", "activate", str(exp_id))
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "COMPLETED", det_cluster.task_output()
    assert trial.run_id == 2  # one more run: DET_TRIAL_RUN_ID
    second = [m.total_batches for m in det_cluster.master.state.metrics
              if m.trial_id == trial.id and m.trial_run_id == 2 and m.group == "training"]
    assert second and min(second) > saved  # it went on from the checkpoint, not from the first batch
    resumed = dict(_master_metrics(det_cluster, trial)["training"])
    reference = dict(_master_metrics(det_cluster, vla_run[1])["training"])
    assert sorted(resumed) == sorted(reference)
    for step in sorted(reference):
        assert resumed[step]["loss"] == reference[step]["loss"], (step, paused_at)


def test_an_asha_search_of_four_trials_on_two_slots_stops_the_trials_the_searcher_stops(det_cluster):
    """searcher/asha_stopping.go: a trial whose metric at a rung is outside the top 1/divisor is stopped
    (trial.go:227-248 STOPPING_COMPLETED, no signal in 0.38.1: det_lab's chief sees the state and stops,
    det_lab/trials/searcher_stop.py); 2 slots, so the four trials queue (the agent takes what fits)."""
    conf = _vla_conf(name="adaptive_asha", max_trials=4, max_concurrent_trials=2, time_metric="batches",
                     max_time=40, divisor=2, max_rungs=3, mode="aggressive")  # rungs at 10, 20 and 40 batches
    conf["data"]["det_lab"]["max_length"] = {"batches": 40}
    conf["min_validation_period"] = conf["min_checkpoint_period"] = {"batches": 10}
    conf["hyperparameters"]["lr"] = {"type": "categorical", "vals": [0.003, 1e-7]}
    conf["reproducibility"] = {"experiment_seed": 2}  # its first two trials draw lr 0.003 (nprand, as Go's)
    conf["environment"] = {"environment_variables": ["DET_LAB_SEARCHER_POLL=0.5"]}
    exp_id = det_cluster.create("vla", conf)
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED", timeout=600) == "COMPLETED", \
        det_cluster.task_output()
    trials = det_cluster.trials(exp_id)
    assert len(trials) == 4 and {t.state for t in trials} == {"COMPLETED"}
    # asha_stopping.go stops a trial at a rung below the top (and every trial reaching the top one); a
    # stopped trial learns it within a poll and a reporting period (10 batches), checkpoints and exits
    early = [t for t in trials if t.stopped_by_searcher and t.stopped_after["batches"] < 40]
    assert early, "the searcher stopped no trial early: nothing to honour"
    trained = {}
    for trial in trials:
        trained[trial.id] = max(s for s, _ in _master_metrics(det_cluster, trial)["training"])
        saved = max(c.metadata["steps_completed"] for c, _ in _checkpoint_dirs(det_cluster, trial, "checkpoints/vla"))
        assert saved == trained[trial.id], (trial.id, trained[trial.id], saved)  # it checkpointed where it stopped
        if trial in early:
            assert trained[trial.id] - trial.stopped_after["batches"] <= 20, (trial.id, trained, trial.stopped_after)
        else:
            assert trained[trial.id] == 40, (trial.id, trained)
    assert min(trained.values()) < 40, trained  # the search saved training: a stopped trial trained less


def _check_one_trial(cluster: DetCluster, exp_id: int, storage: str) -> Any:
    """The trial ended COMPLETED; its metrics at the master once each and equal to the MLflow run's;
    every checkpoint it lists on the volume with the files it names."""
    assert cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "COMPLETED", cluster.task_output(exp_id)
    (trial,) = cluster.trials(exp_id)
    metrics = _master_metrics(cluster, trial)
    assert all(len(rows) == len({s for s, _ in rows}) for rows in metrics.values())
    mirrored = _mlflow_history(cluster, trial)
    for group, rows in metrics.items():
        for step, values in rows:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    assert dict(mirrored[f"{group}/{name}"])[step] == value, (group, name, step)
    ckpts = _checkpoint_dirs(cluster, trial, storage)
    assert ckpts
    for ckpt, path in ckpts:
        assert all((path / name).is_file() for name in ckpt.resources if not name.endswith("/"))
    return trial


def test_3dgs_submitted_with_det_experiment_create_trains_to_completed(det_cluster):
    conf = _expconf("gaussian_splatting", "const.yaml", dataset="grasp-scene", max_length={"batches": 30},
                    reporting_batches=10)
    conf["hyperparameters"].update(validate_every=15, checkpoint_every=30, densify_until=20)
    trial = _check_one_trial(det_cluster, det_cluster.create("gaussian_splatting", conf), "checkpoints/3dgs")
    assert "psnr" in _master_metrics(det_cluster, trial)["validation"][-1][1]


def test_isaac_submitted_with_det_experiment_create_trains_to_completed(det_cluster):
    conf = _expconf("isaac_lab", "const.yaml", max_length={"batches": 6})
    conf["hyperparameters"]["save_interval"] = 3
    trial = _check_one_trial(det_cluster, det_cluster.create("isaac_lab", conf), "checkpoints/isaac")
    assert _master_metrics(det_cluster, trial)["training"]


@pytest.fixture(scope="module")
def smolvla_experiment(det_cluster, no_backbone) -> Iterator[tuple[int, Any]]:
    """smolvla.yaml (shrunk: tests/smolvla_models.py) through det experiment create, after the tiny
    SmolVLA base and VLM were imported into the lab's model store by its member; submitted after the
    no_backbone experiment (requested here only so that it runs meanwhile: it frees its slot at once).
    Yields the experiment and the child that loads its checkpoints with LeRobot."""
    from det_lab.templates import apply_overrides
    from tests.smolvla_models import RUN_ASSIGNMENTS, ModelsChild

    lab = det_cluster.lab
    with ModelsChild(lab.base / f"tiny-smolvla-{uuid.uuid4().hex[:4]}", lab.data) as tiny:
        for path in tiny.work.rglob("*"):  # readable by the member, as a download would be (safetensors writes 0600)
            path.chmod(path.stat().st_mode | (0o055 if path.is_dir() else 0o044))
        for src, name in tiny.models():
            imported = lab.det_lab(lab.a, "models", "import", str(src), name)
            assert imported.returncode == 0, imported.stdout + imported.stderr
        conf = apply_overrides(_expconf("vla", "smolvla.yaml", dataset="grasp-frames"), list(RUN_ASSIGNMENTS))
        yield det_cluster.create("vla", conf), tiny


@skip_without_lerobot()
@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m in ("transformers", "num2words")),
                    reason="needs transformers and num2words (SmolVLA's VLM): pip install -e '.[test]'")
def test_smolvla_through_det_experiment_create_fine_tunes_offline_from_the_store_and_checkpoints_for_lerobot(
        det_cluster, smolvla_experiment):
    """LeRobot's SmolVLA fine-tuned from the base in the volume's model store through Determined's whole
    chain in the task stand-in, offline (the task's HF_HOME at the store and HF_HUB_OFFLINE=1 from the
    master config det_lab renders; no hub here): COMPLETED, loss each step and the validation at the
    master (equal to MLflow's), and the checkpoint's pretrained_model/ loads with
    SmolVLAPolicy.from_pretrained, offline from the store, to the weights Determined saved."""
    from tests.smolvla_models import assert_loads_as_trained
    from tests.tiny_smolvla import BASE_KEYS

    exp_id, tiny = smolvla_experiment
    trial = _check_one_trial(det_cluster, exp_id, "checkpoints/vla")
    metrics = _master_metrics(det_cluster, trial)
    assert [s for s, _ in metrics["training"]] == [1, 2, 3] and [s for s, _ in metrics["validation"]] == [3]
    assert all({"loss", "grad_norm", "lr"} <= set(values) for _, values in metrics["training"])
    assert "val_action_l1" in metrics["validation"][0][1]
    ((ckpt, path),) = _checkpoint_dirs(det_cluster, trial, "checkpoints/vla")
    assert ckpt.metadata["steps_completed"] == 3
    assert {"pretrained_model/config.json", "pretrained_model/model.safetensors",
            "pretrained_model/policy_preprocessor.json"} <= set(ckpt.resources), sorted(ckpt.resources)
    assert_loads_as_trained(tiny.load([path])[str(path)], BASE_KEYS["chunk_size"])


@pytest.fixture(scope="module")
def no_backbone(det_cluster) -> int:
    """act.yaml (shrunk) naming ImageNet backbone weights that the volume lacks. LeRobot's ACT training
    through this chain, its scalars and its checkpoints' pretrained_model/ are tests/test_vla_distributed.py's."""
    conf = _expconf("vla", "act.yaml", dataset="grasp-frames", max_length={"batches": 6}, reporting_batches=3)
    conf["hyperparameters"].update(val_episodes=1, torch_threads=1)
    conf["hyperparameters"]["policy"].update(dim_model=32, dim_feedforward=64, n_encoder_layers=1,
                                             pretrained_backbone_weights="ResNet18_Weights.IMAGENET1K_V1")
    return det_cluster.create("vla", conf)


def test_a_backbone_missing_from_the_volumes_model_store_ends_the_trial_in_one_line_before_it_trains(
        det_cluster, no_backbone):
    """A config through det experiment create had no det-lab preflight: the trial's start checks the
    base models it loads (det_lab/runs/base_models.py) before the pull, and ends in the line naming
    the import, with no metric and no checkpoint (LeRobot is not even imported)."""
    exp_id = no_backbone
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "ERROR", det_cluster.task_output(exp_id)
    (trial,) = det_cluster.trials(exp_id)
    logs = det_cluster.det("trial", "logs", str(trial.id)).stdout
    (line,) = [ln for ln in logs.splitlines() if "error: " in ln]
    assert "hyperparameters.policy.pretrained_backbone_weights: torch hub weights resnet18-f37072fd.pth are not on " \
           "the volume" in line and "det-lab models import ~/.cache/torch/hub/checkpoints/resnet18-f37072fd.pth" in line
    # the trial's own output has no traceback (the torch_distributed launcher prints one after the
    # line for any rank that exits non-zero: Determined's own)
    assert "Traceback" not in logs.split(line)[0], logs[-3000:]
    assert not _master_metrics(det_cluster, trial) and not _checkpoint_dirs(det_cluster, trial, "checkpoints/vla")


def test_a_fork_from_the_web_ui_trains_with_the_changed_hyperparameter(det_cluster, vla_run):
    """webui/react/src/services/apiConfig.ts createExperiment: the Fork dialog posts the edited config
    with parentId and no model definition; api_experiment.go:1592-1700 reuses the parent's context."""
    from determined.common.api import bindings

    parent_id, parent, _ = vla_run
    config = yaml.safe_load(det_cluster.master.state.experiments[parent_id].original_config)
    config["hyperparameters"]["lr"] = config["hyperparameters"]["lr"] * 2
    config["name"] = "vla-forked"
    created = bindings.post_CreateExperiment(det_cluster.session(), body=bindings.v1CreateExperimentRequest(
        config=yaml.safe_dump(config), parentId=parent_id, activate=True))
    exp_id = created.experiment.id
    trial = _check_one_trial(det_cluster, exp_id, "checkpoints/vla")
    assert trial.hparams["lr"] == 2 * parent.hparams["lr"]
    # the reported learning rate is twice the parent's at the same step (the same warm-up, twice the peak)
    forked, original = (dict(_master_metrics(det_cluster, t)["training"]) for t in (trial, parent))
    assert forked[10]["lr"] == pytest.approx(2 * original[10]["lr"], rel=1e-9)


def test_a_config_the_master_refuses_is_one_line_and_registers_nothing(det_cluster):
    """core_experiment.go:269-379 parseCreateExperiment: the config is checked before anything is stored."""
    conf = _vla_conf()
    del conf["searcher"]["metric"]
    before = set(det_cluster.master.state.experiments)
    path = det_cluster.lab.base / "bad.yaml"
    path.write_text(yaml.safe_dump(conf))
    proc = det_cluster.det("experiment", "create", str(path), str(TEMPLATES / "vla"), check=False)
    assert proc.returncode != 0
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("Failed to create experiment")]
    assert "searcher" in line and "metric" in line
    assert set(det_cluster.master.state.experiments) == before


def test_an_unknown_project_ends_the_trial_in_one_line_before_it_trains(det_cluster):
    conf = _vla_conf()
    conf["data"]["det_lab"]["project"] = "no-such-project"
    exp_id = det_cluster.create("vla", conf)
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "ERROR", det_cluster.task_output(exp_id)
    (trial,) = det_cluster.trials(exp_id)
    logs = det_cluster.det("trial", "logs", str(trial.id)).stdout
    assert "unknown project 'no-such-project'" in logs
    assert not _master_metrics(det_cluster, trial) and not _checkpoint_dirs(det_cluster, trial, "checkpoints/vla")


def test_a_notebook_submits_through_the_sdk_and_reads_the_best_checkpoint_in_place(det_cluster, vla_run):
    """det_lab.notebook.submit in cluster mode (the reference run, vla_run) waited for the experiment;
    its best checkpoint is the SDK's top one (api_experiment.go:1256-1343: by the searcher metric, the
    better first), read in place on the volume, not downloaded; its history is the master's. (A stand-in
    that listed checkpoints as reported gave the first, step 20, not the best.)"""
    from det_lab import notebook

    _, trial, result = vla_run
    metric = result.searcher_metric  # const.yaml's searcher.metric, smaller is better
    assert metric == "val_action_l1" and result.smaller_is_better
    validations = _master_metrics(det_cluster, trial)["validation"]
    want = min(validations, key=lambda sv: (sv[1][metric], -sv[0]))
    best = notebook.best_checkpoint(result)
    assert result.status == "COMPLETED" and result.history(metric) == [(s, v[metric]) for s, v in validations]
    assert best is not None and best.step == want[0] and best.metrics[metric] == want[1][metric]
    assert best.path is not None and (best.path / "state_dict.pth").is_file()
    assert str(best.path).startswith(str(det_cluster.lab.data))  # in place on the volume, not downloaded


def test_the_web_uis_resume_current_trial_continues_a_completed_trial_to_the_longer_runs_losses(det_cluster, vla_run):
    """ExperimentContinueModal.tsx:201-232,256-270 (Resume Current Trial: the experiment's config, edited,
    without project and workspace) -> apiConfig.ts:698-707 continueExperiment -> api_experiment.go:1441-1590
    ContinueExperiment: the COMPLETED trial goes on under its own id from its latest checkpoint
    (experiment.go:724-745, trial.go:340-367) with the new length; the added steps are the uninterrupted
    longer run's. A changed searcher is refused in one line (:1398-1401) and changes nothing."""
    from determined.common.api import bindings, errors

    conf = _vla_conf()
    conf["data"]["det_lab"]["max_length"] = {"batches": 40}
    conf["hyperparameters"]["lr_schedule_batches"] = 60  # the schedule of the reference (vla_run: 60 batches)
    exp_id = det_cluster.create("vla", conf)
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "COMPLETED", det_cluster.task_output(exp_id)
    (trial,) = det_cluster.trials(exp_id)
    sess = det_cluster.session()
    edited = {k: v for k, v in bindings.get_GetExperiment(sess, experimentId=exp_id).config.items()
              if k not in ("project", "workspace")}
    edited["data"]["det_lab"]["max_length"] = {"batches": 60}

    search = {**edited, "searcher": {**edited["searcher"], "name": "random", "max_trials": 2}}
    with pytest.raises(errors.APIException) as refused:
        bindings.post_ContinueExperiment(sess, body=bindings.v1ContinueExperimentRequest(
            id=exp_id, overrideConfig=yaml.safe_dump(search)))
    assert refused.value.response_error["error"] == "override config must have single searcher type got 'random' instead"
    exp = det_cluster.master.state.experiments[exp_id]
    assert exp.state == "COMPLETED" and exp.config["data"]["det_lab"]["max_length"] == {"batches": 40}

    bindings.post_ContinueExperiment(sess, body=bindings.v1ContinueExperimentRequest(
        id=exp_id, overrideConfig=yaml.safe_dump(edited)))
    assert det_cluster.wait(exp_id, "COMPLETED", "ERROR", "CANCELED") == "COMPLETED", det_cluster.task_output(exp_id)
    assert det_cluster.trials(exp_id) == [trial] and trial.run_id == 2  # the same trial, one more run
    second = [m.total_batches for m in det_cluster.master.state.metrics
              if m.trial_id == trial.id and m.trial_run_id == 2 and m.group == "training"]
    assert second == [50, 60]  # from its checkpoint at 40, not from the first batch
    for group in ("training", "validation"):
        continued = dict(_master_metrics(det_cluster, trial)[group])
        reference = dict(_master_metrics(det_cluster, vla_run[1])[group])
        assert sorted(continued) == sorted(reference)
        key = "loss" if group == "training" else "val_loss"
        for step in sorted(reference):
            assert continued[step][key] == reference[step][key], (group, step)
    mirrored = _mlflow_history(det_cluster, trial)  # the trial's one MLflow run, the added steps in it
    assert mirrored["training/loss"] == [(s, v["loss"]) for s, v in _master_metrics(det_cluster, trial)["training"]]


def _apply_template(cluster: DetCluster, name: str, conf: dict[str, Any]) -> None:
    """``det-lab cluster template --apply``'s registration (det_lab/cluster/config_template.py, through
    Determined's ``det template create/set-value``)."""
    from det_lab.cluster.config_template import apply_template

    path = cluster.lab.base / f"template-{name}-{uuid.uuid4().hex[:4]}.yaml"
    path.write_text(yaml.safe_dump(conf))
    apply_template(str(DET), cluster.master.url, name, path, cluster.env)


def test_the_web_uis_jupyterlab_preview_is_the_lab_template_merged_as_the_master_merges_it(det_cluster):
    """utils/jupyter.ts:46-64 previewJupyterLab (apiConfig.ts:2099-2107: POST /api/v1/notebooks with
    the dialog's name, pool and slots, ``preview``, ``templateName``) -> api_notebook.go:236-282
    LaunchNotebook, api_command.go:60-179 getCommandLaunchParams: model.DefaultConfig from the
    task-container defaults (command_config.go:23-40), the template unmarshalled over it (its variables
    appended after the defaults': environment_config.go:121-148; its bind mounts first:
    experiment_config.go:175-196), the dialog's fields, the pool's default priority, the template's
    idle timeout as Go prints a duration; nothing is launched."""
    from determined.common.api import bindings

    from det_lab.cluster.render import bind_mounts, environment_variables, render_notebook_template

    settings, cluster = det_cluster.lab.settings, det_cluster.cluster
    _apply_template(det_cluster, "det-lab-notebook", render_notebook_template(settings, cluster))
    resp = bindings.post_LaunchNotebook(det_cluster.session(), body=bindings.v1LaunchNotebookRequest(
        config={"description": "grasping", "resources": {"slots": 0}}, preview=True, templateName="det-lab-notebook"))
    env = environment_variables(settings, cluster)
    assert cluster.notebooks.idle_timeout == "2h" and cluster.images.task is None
    assert resp.config == {
        "description": "grasping", "bind_mounts": bind_mounts(settings, cluster),
        "environment": {
            "image": {"cpu": "determinedai/pytorch-ngc-dev:0736b6d", "cuda": "determinedai/pytorch-ngc-dev:0736b6d",
                      "rocm": "determinedai/environments:rocm-5.6-pytorch-1.3-tf-2.10-rocm-mpich-0736b6d"},
            "environment_variables": {device: env + env for device in ("cpu", "cuda", "rocm")},
            "proxy_ports": None, "ports": None, "force_pull_image": False, "pod_spec": None,
            "add_capabilities": None, "drop_capabilities": None},
        "resources": {"slots": 0, "weight": 1, "resource_pool": "default", "priority": 42, "is_single_node": None,
                      "devices": None},
        "entrypoint": None, "idle_timeout": "2h0m0s", "notebook_idle_type": "kernels_or_terminals",
        "work_dir": None, "debug": False, "pbs": {}, "slurm": {}}
    assert any(e.startswith("DET_LAB_CONFIG=") for e in env) and not det_cluster.master.state.commands


def test_det_cmd_run_with_the_lab_template_runs_as_the_linked_member_and_knows_the_lab(det_cluster):
    """cli/command.py:13-45 run_command (api_command.go LaunchCommand, then the task's logs followed to
    its end); the task through command-entrypoint.sh (prep_container --proxy --download_context_directory,
    the hooks, ``sh -c`` of one argument) in the task stand-in, as the linked uid:gid, with the merged
    config's mounts and variables: det_lab inside it finds the lab's project and dataset."""
    from det_lab.cluster.render import render_task_template, task_config_path

    lab = det_cluster.lab
    _apply_template(det_cluster, "det-lab", render_task_template(lab.settings, det_cluster.cluster))
    script = "id -u; echo LAB=$DET_LAB_CONFIG; python3 -c 'from det_lab.cli.app import main; main()' data list"
    proc = det_cluster.det("cmd", "run", "--template", "det-lab", script)
    (cmd,) = det_cluster.master.state.commands.values()
    assert cmd.exit_status == "command exited successfully", proc.stdout + det_cluster.task_output()[-3000:]
    # the task's output, as det cmd run prints its log lines: "[time] container || LEVEL: message"
    lines = [ln.split(" || ", 1)[1].split(": ", 1)[1] for ln in proc.stdout.splitlines() if " || " in ln]
    assert str(lab.a.uid) in lines and f"LAB={task_config_path(lab.settings)}" in lines, proc.stdout
    (row,) = [line for line in lines if "grasping" in line]
    assert "2.0 GiB" in row and "grasp-frames" in row, proc.stdout
