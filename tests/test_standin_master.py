"""The master and agent stand-ins (tests/standin/master*.py, agent.py) driven by Determined 0.38.1's own
client code: the ``det`` CLI as a subprocess and the SDK, with a Core API trial run through Determined's
prep_container, launch and harness against the stand-in (the agent's HostRunner). Each test names the
Determined source (determined-ai/determined v0.38.1, ``path:line``) whose behaviour it checks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import yaml

from tests.standin.agent import Agent, HostRunner
from tests.standin.master import Master
from tests.standin.searcher import make_searcher as SEARCHER  # noqa: N812

REPO = Path(__file__).resolve().parents[1]
DET = Path(sys.executable).parent / "det"

pytestmark = pytest.mark.skipif(not shutil.which("bwrap") or not DET.exists(),
                                reason="needs bubblewrap (Debian's bubblewrap) and Determined's det CLI")

TRAIN = r'''
import json, pathlib, time
import determined as det

def main(core):
    info = det.get_cluster_info()
    hp = info.trial.hparams
    steps, start = int(hp["steps"]), 0
    if info.latest_checkpoint:
        with core.checkpoint.restore_path(info.latest_checkpoint) as path:
            start = json.loads((pathlib.Path(path) / "state.json").read_text())["step"]
    print(f"TRAIN start={start} lr={hp['lr']} run={info.trial._trial_run_id}", flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(float(hp.get("sleep", 0)))
        core.train.report_training_metrics(steps_completed=step, metrics={"loss": 1.0 / step})
        core.train.report_validation_metrics(steps_completed=step,
                                             metrics={"val_loss": float(hp["lr"]) / step, "batches": step})
        core.train.report_progress(step / steps)
        with core.checkpoint.store_path({"steps_completed": step}) as (path, _):
            (path / "state.json").write_text(json.dumps({"step": step}))
        if core.preempt.should_preempt():
            print(f"PREEMPTED step={step}", flush=True)
            return
    print(f"DONE step={steps}", flush=True)

if __name__ == "__main__":
    with det.core.init(tensorboard_mode=det.core.TensorboardMode.MANUAL) as core:
        main(core)
'''


# --- fixtures --------------------------------------------------------------------------------------

class Cluster:
    """A master and an agent stand-in, a context directory, and ``det`` with its own HOME."""

    def __init__(self, base: Path, *, slots: int = 2, stop_preempts: bool = False) -> None:
        self.base = base
        self.storage = base / "checkpoints"
        self.storage.mkdir()
        self.master = Master({"checkpoint_storage": {"type": "shared_fs", "host_path": str(self.storage)}},
                             searcher_factory=SEARCHER, stop_preempts=stop_preempts)
        self.agent = Agent(self.master, HostRunner(timeout=120), slots=slots)
        self.context = base / "context"
        self.context.mkdir()
        (self.context / "train.py").write_text(TRAIN)
        (self.context / "ignored.bin").write_text("not sent")
        (self.context / ".detignore").write_text("*.bin\n")
        home = base / "home"
        home.mkdir()
        self.env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local/share"),
                    "DET_USER": "determined", "DET_PASS": "", "DET_MASTER": self.master.url, "LANG": "C.UTF-8"}

    def det(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(DET), "-m", self.master.url, *args], capture_output=True, text=True,
                              env=self.env, timeout=60)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def create(self, config: dict[str, Any]) -> int:
        path = self.base / f"exp-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(config))
        out = self.det("experiment", "create", str(path), str(self.context)).stdout
        return int(out.split("Created experiment ")[1].split()[0])

    def wait(self, predicate: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.master.state.changed:
            while not predicate():
                assert time.monotonic() < deadline, "timed out"
                self.master.state.changed.wait(0.5)

    def wait_state(self, exp_id: int, *states: str) -> None:
        self.wait(lambda: self.master.state.experiments[exp_id].state in states)

    def session(self) -> Any:
        from determined.common.api import authentication
        return authentication.login(self.master.url, "determined", "", cert=None)

    def close(self) -> None:
        self.agent.close()
        self.master.close()


def config(**over: Any) -> dict[str, Any]:
    base = {"name": "standin", "entrypoint": "python3 train.py", "max_restarts": 0,
            "hyperparameters": {"lr": 0.5, "steps": 3},
            "searcher": {"name": "single", "metric": "val_loss", "max_length": {"batches": 3}}}
    return {**base, **over}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


# --- tests -----------------------------------------------------------------------------------------

def test_det_experiment_create_runs_a_core_api_trial_to_completed(cluster):
    """cli/experiment.py:165-226 submit_experiment (context packed honouring .detignore:
    common/context.py), api_experiment.go:1592-1700 CreateExperiment, the trial's task through
    prep_container and launch (master/static/srv/entrypoint.sh), trial.go:569-709 (exit 0 is a
    user-requested stop: COMPLETED), experiment.go:555-568 (the searcher shuts down, COMPLETED)."""
    exp_id = cluster.create(config())
    cluster.wait_state(exp_id, "COMPLETED", "ERROR", "CANCELED")
    state = cluster.master.state
    exp = state.experiments[exp_id]
    [trial] = [t for t in state.trials.values() if t.experiment is exp]
    assert (exp.state, trial.state) == ("COMPLETED", "COMPLETED"), [e.stderr[-2000:] for e in cluster.agent.exits]
    assert cluster.master.unserved == []

    described = cluster.det("experiment", "describe", str(exp_id)).stdout  # cli/experiment.py:317-470
    assert "COMPLETED" in described and "100.0%" in described
    trials = cluster.det("experiment", "list-trials", str(exp_id)).stdout
    assert f"{trial.id} | COMPLETED" in trials and '"lr": 0.5' in trials
    ckpts = cluster.det("experiment", "list-checkpoints", str(exp_id)).stdout  # cli/checkpoint.py:40-88
    assert ckpts.count("state.json") == 3 and "0.16666" in ckpts  # val_loss at step 3
    logs = cluster.det("trial", "logs", str(trial.id)).stdout  # common/api/logs.py:7-11 (ship_logs.py's lines)
    assert "TRAIN start=0 lr=0.5 run=1" in logs and "DONE step=3" in logs

    from determined.common import api
    from determined.experimental import client
    sdk = client.Determined._from_session(cluster.session())
    sdk_trial = sdk.get_trial(trial.id)
    validations = list(sdk_trial.iter_metrics("validation"))  # common/experimental/trial.py:599 GetMetrics
    assert [(m.steps_completed, m.metrics["val_loss"]) for m in validations] == [(1, 0.5), (2, 0.25), (3, 0.5 / 3)]
    assert [m.steps_completed for m in sdk_trial.iter_metrics("training")] == [1, 2, 3]
    best = sdk.get_experiment(exp_id).list_checkpoints(
        sort_by=client.CheckpointSortBy.BATCH_NUMBER, order_by=client.OrderBy.DESC, max_results=1)[0]
    path = best.download(path=str(cluster.base / "download"))  # checkpoint/_checkpoint.py:196-262 shared_fs
    assert json.loads((Path(path) / "state.json").read_text()) == {"step": 3}
    assert json.loads((Path(path) / "metadata.json").read_text())["steps_completed"] == 3
    tgz = api.bindings.get_GetModelDef(cluster.session(), experimentId=exp_id).b64Tgz  # .detignore honoured
    import base64
    import io
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(tgz))) as tar:
        assert tar.getnames() == ["train.py"]


def test_pause_preempts_and_activate_resumes_from_the_latest_checkpoint(cluster):
    """experiment.go:499-511 PauseExperiment -> trial.go:750-759 TerminateAllocation -> allocation.go:918-965
    (ready, so preempted: the long poll of api_trials.go:1283-1299 returns); the acked exit leaves the
    trial PAUSED (trial.go:700-708); activate reallocates it with DET_LATEST_CHECKPOINT and the steps of
    that checkpoint (task_trial.go:120-126, trial.go:524-555)."""
    exp_id = cluster.create(config(hyperparameters={"lr": 0.5, "steps": 40, "sleep": 0.05}))
    state = cluster.master.state
    cluster.wait(lambda: any(c.trial_id for c in state.checkpoints.values()))
    cluster.det("experiment", "pause", str(exp_id))
    [trial] = [t for t in state.trials.values() if t.experiment.id == exp_id]
    cluster.wait(lambda: trial.alloc is None)
    assert (state.experiments[exp_id].state, trial.state) == ("PAUSED", "PAUSED")
    paused_at = int(state.latest_checkpoint(trial).metadata["steps_completed"])
    assert 0 < paused_at < 40
    cluster.det("experiment", "activate", str(exp_id))
    cluster.wait_state(exp_id, "COMPLETED", "ERROR")
    assert trial.state == "COMPLETED" and trial.run_id == 2
    logs = "".join(log["log"] for log in state.logs[trial.task_id])
    assert f"PREEMPTED step={paused_at}" in logs and f"TRAIN start={paused_at} lr=0.5 run=2" in logs
    live = [(m.group, m.total_batches) for m in state.metrics if m.trial_id == trial.id and not m.archived]
    assert sorted(live) == sorted({(g, s) for g in ("training", "validation") for s in range(1, 41)})


def _asha(c: Cluster) -> tuple[int, list[Any]]:
    hps = {"lr": {"type": "int", "minval": 1, "maxval": 8}, "steps": 4, "sleep": 0.1}
    exp_id = c.create(config(hyperparameters=hps, reproducibility={"experiment_seed": 7}, searcher={
        # larger is better here: with these seeds the first two trials (lr 8) are the best, so the third
        # (lr 1) reaches each rung after them and is outside the top half there (asha_stopping.go)
        "name": "adaptive_asha", "metric": "val_loss", "smaller_is_better": False, "max_trials": 4,
        "max_concurrent_trials": 4,
        "time_metric": "batches", "max_time": 4, "divisor": 2, "mode": "aggressive"}))
    c.wait_state(exp_id, "COMPLETED", "ERROR", "CANCELED")
    trials = sorted((t for t in c.master.state.trials.values() if t.experiment.id == exp_id), key=lambda t: t.id)
    return exp_id, trials


def _last_step(c: Cluster, trial: Any) -> int:
    return max(m.total_batches for m in c.master.state.metrics if m.trial_id == trial.id)


def test_an_asha_search_queues_on_two_slots_and_a_searcher_stop_does_not_preempt_in_0_38_1(cluster):
    """experiment.go:673-676 (Stop: EarlyStoppedBySearcher), trial.go:227-248 (STOPPING_COMPLETED) and
    :760-775: 0.38.1 signals no allocation for STOPPING_COMPLETED (#9605's TerminateAllocation was
    reverted in 332cefca45), so a stopped trial trains to its own end and is COMPLETED (:591-603)."""
    exp_id, trials = _asha(cluster)
    assert cluster.master.state.experiments[exp_id].state == "COMPLETED"
    assert len(trials) == 4 and all(t.state == "COMPLETED" for t in trials)
    # asha_stopping.go stops every trial that reaches the top rung, and the others at a lower one
    early = [t for t in trials if t.stopped_by_searcher and t.stopped_after["batches"] < 4]
    assert early and len(early) < 4
    assert all(_last_step(cluster, t) == 4 for t in trials)  # yet every trial trained to max_time
    starts = sorted(e.allocation_id for e in cluster.agent.exits)
    assert len(starts) == 4  # four allocations, two at a time (the agent's two slots)


def test_with_stop_preempts_the_stopped_trials_exit_early(tmp_path):
    """The same search on a master that preempts what the searcher stops (trial.go as #9605 had it):
    the stopped trials see should_preempt() (core/_preempt.py:54-63) and exit before max_time."""
    c = Cluster(tmp_path, stop_preempts=True)
    try:
        exp_id, trials = _asha(c)
        assert c.master.state.experiments[exp_id].state == "COMPLETED"
        early = [t for t in trials if t.stopped_by_searcher and t.stopped_after["batches"] < 4]
        assert early and all(t.state == "COMPLETED" and _last_step(c, t) < 4 for t in early)
        assert all(_last_step(c, t) == 4 for t in trials if t not in early)
    finally:
        c.close()


def test_a_bad_config_is_the_masters_one_line_error_and_registers_nothing(cluster):
    """core_experiment.go:274-277 (expconf/parse.go:37-41, schemas/schema.go:30-38): a plain error, so
    grpc-gateway answers Internal (grpcutil/errors.go:44-50); cli/cli.py:267-268 prints it on one line."""
    bad = cluster.base / "bad.yaml"
    bad.write_text(yaml.safe_dump(config(searcher={"name": "single", "metric": 3})))
    proc = cluster.det("experiment", "create", str(bad), str(cluster.context), check=False)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]  # (after the CLI's blank-password warning)
    assert [line for line in lines if line.startswith("Failed")] == lines[-1:] and lines[-1].startswith(  # the schema's own wording after the path is the validator's
        "Failed to create experiment: invalid experiment configuration: version 0 experiment config is invalid: "
        "config is invalid: <config>.searcher.metric: "), proc.stderr
    assert cluster.master.state.experiments == {}
    assert "1 |" not in cluster.det("experiment", "list", "--all").stdout  # GetExperiments: none


def test_more_slots_than_the_agents_have_is_refused_at_creation_as_0_38_1_refuses_it(tmp_path):
    """experiment.go:117-128 newExperiment -> agent_resource_manager.go:527-557 ValidateResources:
    ``is_single_node`` and no agent with that many slots is "request unfulfillable"
    (resource_pool.go:568-593); more slots than the connected agents have together is refused while the
    master's ``launch_error`` is on (its default, config.go:149), else created with the CLI's launch
    warning (cli/experiment.py:218-219, common/api/_util.py:24-28) and left queued. One agent, 2 slots."""
    c = Cluster(tmp_path)
    try:
        def create(**resources: Any) -> subprocess.CompletedProcess[str]:
            path = c.base / f"exp-{uuid.uuid4().hex[:6]}.yaml"
            path.write_text(yaml.safe_dump(config(resources=resources)))
            return c.det("experiment", "create", str(path), str(c.context), check=False)

        refused = {
            "failed to create experiment: slots requested exceeds cluster capacity": create(slots_per_trial=3),
            "failed to create experiment: validating resources: request unfulfillable, please try requesting "
            "less slots": create(slots_per_trial=3, is_single_node=True)}
        for message, proc in refused.items():
            assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == f"Failed to create experiment: "\
                f"{message}", proc.stderr
        assert c.master.state.experiments == {}
        assert create(slots_per_trial=2, is_single_node=True).returncode == 0  # the one agent has 2
    finally:
        c.close()
    (tmp_path / "no-launch-error").mkdir()
    c = Cluster(tmp_path / "no-launch-error")
    c.master.config["launch_error"] = False
    try:
        path = c.base / "big.yaml"
        path.write_text(yaml.safe_dump(config(resources={"slots_per_trial": 3})))
        proc = c.det("experiment", "create", str(path), str(c.context))
        assert "Warning: The requested job requires more slots than currently available." in proc.stderr
        (exp,) = c.master.state.experiments.values()
        time.sleep(1)  # the agent looks at the queue every 0.5 s: a trial it could start would have started
        assert [a.state for a in c.master.state.allocs.values()] == ["PENDING"] and exp.state == "ACTIVE"
    finally:
        c.close()


def test_a_fork_with_parent_id_reuses_the_context_and_trains_with_the_changed_hparam(cluster):
    """webui/react/src/services/apiConfig.ts:673-696 createExperiment {activate, config, parentId,
    projectId}; core_experiment.go:382-390: the parent's model definition is reused."""
    from determined.common.api import bindings
    parent = cluster.create(config())
    cluster.wait_state(parent, "COMPLETED")
    sess = cluster.session()
    original = yaml.safe_load(bindings.get_GetExperiment(sess, experimentId=parent).experiment.originalConfig)
    original["hyperparameters"]["lr"] = 0.25
    resp = bindings.post_CreateExperiment(sess, body=bindings.v1CreateExperimentRequest(
        activate=True, config=yaml.safe_dump(original), parentId=parent, projectId=1))
    child = resp.experiment.id
    assert resp.experiment.forkedFrom == parent
    cluster.wait_state(child, "COMPLETED", "ERROR")
    [trial] = [t for t in cluster.master.state.trials.values() if t.experiment.id == child]
    assert trial.state == "COMPLETED" and trial.hparams["lr"] == 0.25
    assert cluster.master.state.experiments[child].model_def == cluster.master.state.experiments[parent].model_def
    assert "TRAIN start=0 lr=0.25 run=1" in cluster.det("trial", "logs", str(trial.id)).stdout


def test_python_m_tests_standin_prints_det_master_and_stops_cleanly_on_sigterm(tmp_path):
    """tests/standin/__main__.py: the DET_MASTER line once /info answers (cli/version.py:16-30), then
    nothing left running after SIGTERM."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.standin", "--root", str(tmp_path / "root")], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("DET_MASTER=http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else line
        import urllib.request
        with urllib.request.urlopen(line.split("=", 1)[1] + "/info", timeout=10) as reply:
            assert json.loads(reply.read())["version"] == "0.38.1"
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_continue_trial_in_a_new_experiment_starts_from_the_source_trials_latest_checkpoint(cluster):
    """ExperimentContinueModal.tsx:205-209 (Continue Trial in New Experiment: createExperiment with
    parentId and utils/experiment.ts:327-350 trialContinueConfig: the trial's hyperparameters, a single
    searcher with source_trial_id); experiment.go:138-143,840-869: the source trial's latest checkpoint
    is the new trial's DET_LATEST_CHECKPOINT (trial.go:530-537), with 0 steps completed. A source trial
    without a checkpoint is the master's one line and registers nothing."""
    from determined.common.api import bindings, errors
    parent = cluster.create(config())
    cluster.wait_state(parent, "COMPLETED")
    [source] = [t for t in cluster.master.state.trials.values() if t.experiment.id == parent]
    sess = cluster.session()
    conf = yaml.safe_load(bindings.get_GetExperiment(sess, experimentId=parent).experiment.originalConfig)
    conf["hyperparameters"] = {"lr": {"type": "const", "val": 0.5}, "steps": {"type": "const", "val": 5}}
    conf["searcher"] = {"name": "single", "metric": "val_loss", "smaller_is_better": True, "source_trial_id": source.id,
                        "max_length": {"batches": 5}}
    child = bindings.post_CreateExperiment(sess, body=bindings.v1CreateExperimentRequest(
        activate=True, config=yaml.safe_dump(conf), parentId=parent)).experiment.id
    cluster.wait_state(child, "COMPLETED", "ERROR")
    [trial] = [t for t in cluster.master.state.trials.values() if t.experiment.id == child]
    logs = cluster.det("trial", "logs", str(trial.id)).stdout
    assert trial.state == "COMPLETED" and "TRAIN start=3 lr=0.5 run=1" in logs and "DONE step=5" in logs, logs

    conf["searcher"]["source_trial_id"] = 999
    with pytest.raises(errors.APIException) as refused:
        bindings.post_CreateExperiment(sess, body=bindings.v1CreateExperimentRequest(
            activate=True, config=yaml.safe_dump(conf), parentId=parent))
    assert refused.value.response_error["error"] == "failed to create experiment: no checkpoint found for source trial 999"
    assert sorted(cluster.master.state.experiments) == [parent, child]
