"""``det-lab run --slurm`` against a real Slurm (munged + slurmctld + slurmd started by the tests):
the VLA template trained to the end with ``--wait``, a job requeued mid-run that resumes with the
losses of an uninterrupted run, an Optuna search over a job array with ASHA pruning, the runs
commands, and Slurm's refusals as one line with nothing left behind."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from tests import torchvision_shim
from tests.conftest import VENV_BIN, Lab
from tests.lerobot_writer import skip_without_lerobot
from tests.slurm_cluster import TINY, SlurmCluster, tiny_config, make_slurm_lab, slurm_cluster, slurm_volume  # noqa: F401 (fixtures)

#: short runs: enough steps for a checkpoint, a validation and a requeue in between
VLA_SETS = ["--set", "data.det_lab.max_length.batches=20", "--set", "min_validation_period.batches=10",
            "--set", "min_checkpoint_period.batches=10", "--set", "data.det_lab.reporting_batches=5"]


@pytest.fixture(scope="module")
def slurm_lab(tmp_path_factory, shared_mlflow_server, slurm_cluster: SlurmCluster, slurm_volume: Path) -> Lab:
    """A lab on the test Slurm and its volume (the VLA demo and the tiny regression data), MLflow tracking."""
    return make_slurm_lab(tmp_path_factory.mktemp("slurm-lab"), shared_mlflow_server.uri, slurm_cluster, slurm_volume)


def runs_dir(lab: Lab) -> Path:
    return lab.root / "outputs" / "vla" / "slurm-runs"


def run_named(lab: Lab, stdout: str) -> Path:
    name = stdout.split()[1].rstrip(":")  # "run <name>: Slurm job <id> ..."
    return runs_dir(lab) / name


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def metrics(run_dir: Path, group: str, key: str) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {m["step"]: m["metrics"][key] for m in lines if m["group"] == group}


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def test_vla_trains_to_the_end_through_slurm_wait(slurm_lab, shared_mlflow_server):
    proc = slurm_lab.cli("run", "vla", "--slurm", "--wait", *VLA_SETS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_named(slurm_lab, proc.stdout)
    st = state(run_dir)
    assert st["kind"] == "slurm" and st["status"] == "finished" and st["latest_checkpoint_step"] == 20
    job_id, (attempt,) = st["slurm"]["job_id"], st["slurm"]["attempts"]
    assert attempt["job_id"] == job_id and attempt["node"].startswith("detlab")
    assert "finished at step 20 of 20" in proc.stdout

    # the job script is a plain sbatch file in the run's directory, asking for the pre-limit signal
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@" in script and "#SBATCH --requeue" in script
    assert f"-m det_lab.slurm.job {run_dir}" in script

    # checkpoints on the volume, with the lineage of the job that wrote them
    for ckpt in st["checkpoints"]:
        meta = json.loads((slurm_lab.root / "checkpoints" / "vla" / ckpt["uuid"] / "metadata.json").read_text())
        assert meta["steps_completed"] == ckpt["step"]
        assert meta["det_lab"]["slurm_job_id"] == job_id and meta["det_lab"]["slurm_node"] == attempt["node"]
        assert meta["det_lab"]["dataset"]["path"]

    # every metric in the real MLflow server, in a run tagged with the job
    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    (backend,) = summary["backends"]
    assert backend["pending"] == 0
    client = MlflowClient(shared_mlflow_server.uri)
    run = client.get_run(backend["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["slurm.job_id"] == job_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "validation/val_action_l1"))
    assert history == sorted((s, pytest.approx(v)) for s, v in metrics(run_dir, "validation", "val_action_l1").items())

    with ThreadPoolExecutor(3) as pool:  # three independent commands, side by side
        listed, shown, tail = pool.map(lambda args: slurm_lab.cli("runs", *args, check=True).stdout, [
            ("list", "--json"), ("show", run_dir.name), ("tail", run_dir.name, "-n", "200")])
    row = next(r for r in map(json.loads, listed.splitlines()) if r["name"] == run_dir.name)
    assert (row["kind"], row["status"], row["step"]) == ("slurm", "finished", 20) and f"job {job_id}" in row["where"]
    assert "slurm job" in shown and str(run_dir / "job.sbatch") in shown
    assert "report_validation_metrics(steps_completed=20" in tail


def _submit_waiting(lab: Lab, *args: str) -> tuple[subprocess.Popen, Path]:
    """``det-lab run <tiny> --slurm --wait`` in the background, once its run has a Slurm job: the process and
    the run's directory."""
    before = set(runs_dir(lab).glob("*"))
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--slurm", *args, "--wait"], env=lab.env,
                            cwd=lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: any((p / "run.json").is_file() and state(p).get("slurm", {}).get("job_id")
                           for p in set(runs_dir(lab).glob("*")) - before), 120, "the submission")
    (run_dir,) = set(runs_dir(lab).glob("*")) - before
    return proc, run_dir


def test_two_slots_train_one_run_as_two_ranks(slurm_lab, shared_mlflow_server):
    """resources.slots_per_trial: 2 is one job holding both GPUs, its trial under torchrun as two
    ranks (gloo on this CPU-only node): one run record and one tracker run, every step once."""
    proc, run_dir = _submit_waiting(slurm_lab, "--set", "resources.slots_per_trial=2")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert "#SBATCH --gres=gpu:2" in (run_dir / "job.sbatch").read_text()
    st = state(run_dir)
    assert st["status"] == "finished" and [c["step"] for c in st["checkpoints"]] == [40, 80]
    # each rank reads its half of the 400 training rows (16 a batch): 13 batches an epoch, not 25
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in records if r["group"] == "training"]
    assert [r["step"] for r in training] == list(range(10, 81, 10))  # the chief alone reports, once
    assert training[-1]["metrics"]["epochs"] == 80 // 13
    (backend,) = json.loads((run_dir / "tracking-summary.json").read_text())["backends"]
    history = MlflowClient(shared_mlflow_server.uri).get_metric_history(backend["run_id"], "training/loss")
    assert sorted(m.step for m in history) == list(range(10, 81, 10))


def test_requeued_job_resumes_with_the_losses_of_an_uninterrupted_run(slurm_lab, slurm_cluster, shared_mlflow_server):
    config = tiny_config(slurm_lab, "tiny-slow.yaml", **{"hyperparameters.sleep_per_batch": 0.05})
    # the uninterrupted run trains beside the one that is requeued (the node has two GPUs)
    straight, straight_dir = _submit_waiting(slurm_lab, "--exp-config", str(config))
    waiting, run_dir = _submit_waiting(slurm_lab, "--exp-config", str(config))
    job_id = state(run_dir)["slurm"]["job_id"]

    def past_first_checkpoint() -> bool:
        st = state(run_dir)
        steps = metrics(run_dir, "training", "loss") if (run_dir / "metrics.jsonl").exists() else {}
        return bool(st.get("latest_checkpoint")) and max(steps, default=0) > st["latest_checkpoint_step"]

    wait_until(past_first_checkpoint, 120, "the first checkpoint")
    # what Slurm sends --signal seconds before the time limit: the job checkpoints and requeues itself
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    out, _ = waiting.communicate(timeout=300)  # --wait follows the job through its requeue
    assert waiting.returncode == 0, out
    straight_out, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0 and "finished at step 80 of 80" in straight_out, straight_out
    assert f"job {job_id}: PENDING" in out and "(restart 1)" in out and "finished at step 80 of 80" in out

    st = state(run_dir)
    first, second = st["slurm"]["attempts"]
    assert (first["restart"], second["restart"]) == (0, 1) and first["job_id"] == second["job_id"] == job_id
    assert st["resumed"] == 1 and 40 <= st["checkpoints"][1]["step"] < 80 and st["latest_checkpoint_step"] == 80
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "requeueing job" in out and "resuming" in out

    for group, key in (("training", "loss"), ("validation", "val_loss")):
        expected, got = metrics(straight_dir, group, key), metrics(run_dir, group, key)
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)

    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    client = MlflowClient(shared_mlflow_server.uri)
    (backend,) = summary["backends"]
    steps = [m.step for m in client.get_metric_history(backend["run_id"], "training/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 80  # one tracker run, each step once
    assert client.get_run(backend["run_id"]).info.status == "FINISHED"


def test_search_over_a_job_array_prunes_and_reports_the_best(slurm_lab):
    # seed 8: the per-task samplers draw lr 0.05, 0.05, 0.0005, 0.0005, so tasks 2 and 3 reach the
    # first rung (40 batches) after two good trials and ASHA stops them there
    config = tiny_config(slurm_lab, "tiny-search.yaml", **{
        "hyperparameters.lr": {"type": "categorical", "vals": [0.0005, 0.05]},
        # paced so that a prune decision reaches the trial well before its next validation
        "hyperparameters.sleep_per_batch": 0.05,
        "searcher": {"name": "adaptive_asha", "metric": "val_loss", "smaller_is_better": True,
                     "time_metric": "batches", "max_time": 80, "max_trials": 4, "max_concurrent_trials": 2,
                     "divisor": 2, "max_rungs": 2},
        "reproducibility.experiment_seed": 8})
    proc = slurm_lab.cli("run", str(TINY), "--slurm", "--exp-config", str(config), "--wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = proc.stdout.split()[1].rstrip(":")
    search_dir = slurm_lab.root / "outputs" / "vla" / "slurm-searches" / name
    assert "#SBATCH --array=0-3%2" in (search_dir / "job.sbatch").read_text()
    assert (search_dir / "optuna.journal").is_file() and not list(search_dir.glob("*.db"))

    shown = json.loads(slurm_lab.cli("slurm", "search", name, "--json", check=True).stdout)
    trials = shown["trials"]
    assert len(trials) == 4 and {t["array_task"] for t in trials} == {"0", "1", "2", "3"}
    pruned = [t for t in trials if t["state"] == "pruned"]
    done = [t for t in trials if t["state"] == "complete"]
    assert pruned and done and len(pruned) + len(done) == 4
    best = shown["best"]
    assert best["value"] == min(t["value"] for t in done) and best["params"] == {"lr": 0.05}
    # ASHA stopped at least one trial at the first rung (which rung a pruned trial reaches depends on
    # which others finished first, so on a loaded machine a second one may run on); all are worse
    assert any(t["step"] == 40 for t in pruned), pruned
    for t in pruned:
        assert t["step"] <= 80 and t["value"] > best["value"]
        run = state(runs_dir(slurm_lab) / t["run"])
        assert run["status"] == "pruned"
        assert t["step"] > 40 or run["latest_checkpoint_step"] <= 50
    assert f"best: trial {best['number']}" in proc.stdout and "optuna-dashboard" in proc.stdout


def _nothing_created(lab: Lab, before: set[Path]) -> None:
    root = lab.root / "outputs" / "vla"
    now = {p for d in ("slurm-runs", "slurm-searches") for p in (root / d).glob("*")}
    assert now == before, now - before


def _existing(lab: Lab) -> set[Path]:
    root = lab.root / "outputs" / "vla"
    return {p for d in ("slurm-runs", "slurm-searches") for p in (root / d).glob("*")}


@pytest.mark.parametrize("args, message", [
    (["--partition", "h100"], "--partition h100: no such Slurm partition (partitions: fake)"),
    (["--set", "resources.slots_per_trial=4"], "resources.slots_per_trial=4: partition fake has 1 node(s) with at most 2 GPUs"),
    (["--time", "soon"], "--time 'soon' is not a Slurm time"),
    (["--set", "searcher.name=grid"], "searcher.name 'grid' does not run on Slurm"),
    # a search is checked like a single run before its array is created
    (["--set", "searcher.name=random", "--set", "searcher.max_trials=2", "--set", "trainer.epochs=3"],
     "trainer: unknown key"),
    (["--set", "searcher.name=random", "--set", "searcher.max_trials=2", "--set", "data.det_lab.dataset=no-such-data"],
     "no dataset named 'no-such-data'"),
    # base models come from the volume's model store: checked on the login node, before sbatch
    (["--set", "data.det_lab.base_model=lab/absent-vlm"],
     "data.det_lab.base_model: base model lab/absent-vlm is not on the volume"),
    (["--set", "hyperparameters.policy.name=act", "--set", "hyperparameters.policy.pretrained=lab/act-absent"],
     "det-lab models import DIR lab/act-absent"),
])
def test_refusals_are_one_line_and_leave_nothing(slurm_lab, args, message):
    before = _existing(slurm_lab)
    proc = slurm_lab.cli("run", str(TINY), "--slurm", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line, line
    _nothing_created(slurm_lab, before)


def test_gpu_requests_are_planned_against_the_partitions_nodes(slurm_cluster: SlurmCluster, monkeypatch):
    from det_lab.slurm.submit import plan_resources

    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    assert plan_resources("fake", 0) == ("fake", 1, 0)  # slots_per_trial: 0 trains on CPUs: no gres
    assert plan_resources(None, 1) == ("fake", 1, 1)  # the default partition
    assert plan_resources("fake", 2) == ("fake", 1, 2)


def test_without_sbatch_the_error_says_how_to_get_it(slurm_lab):
    before = _existing(slurm_lab)
    env = {**slurm_lab.env, "PATH": str(VENV_BIN)}
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "run", str(TINY), "--slurm"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "sbatch not found on PATH" in line and "slurm-client" in line and "SLURM_CONF" in line
    _nothing_created(slurm_lab, before)


@pytest.fixture(scope="module")
def crashing_run(slurm_lab) -> Iterator[subprocess.Popen]:
    """``det-lab run <tiny> --slurm --wait`` in the background, its trial dying while it writes its first
    checkpoint; started by the cancel test, so that the two jobs share the node."""
    env = {**slurm_lab.env, "TINY_CRASH_ON_CHECKPOINT": "1"}
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", str(TINY), "--slurm", "--wait"], env=env,
                            cwd=slurm_lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_cancel_stops_the_job_after_a_checkpoint(slurm_lab, crashing_run):
    config = tiny_config(slurm_lab, "tiny-slower.yaml", **{"hyperparameters.sleep_per_batch": 0.2})
    proc = slurm_lab.cli("run", str(TINY), "--slurm", "--exp-config", str(config), check=True)
    run_dir = run_named(slurm_lab, proc.stdout)
    wait_until(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the trial to report")
    out = slurm_lab.cli("runs", "cancel", run_dir.name, check=True).stdout
    assert "cancelled Slurm job" in out
    wait_until(lambda: state(run_dir).get("status") in ("stopped", "failed"), 120, "the run to stop")
    st = state(run_dir)
    assert st["status"] == "stopped" and st["latest_checkpoint_step"] < 80  # checkpointed on the way out
    again = slurm_lab.cli("runs", "cancel", run_dir.name)
    assert again.returncode == 2 and "already ended (stopped)" in again.stderr


def test_wait_exits_with_the_trials_failure(slurm_lab, crashing_run):
    out, _ = crashing_run.communicate(timeout=300)
    assert crashing_run.returncode == 3, out  # the trial's own exit code
    run_dir = run_named(slurm_lab, out)
    st = state(run_dir)
    assert st["status"] == "failed" and st["exit_code"] == 3 and not st.get("latest_checkpoint")
    assert "failed at step 40 of 80" in out and "determined.core" in out  # the log's last lines


def test_a_slurm_run_keeps_checkpoints_by_determineds_keys_and_is_not_deleted_while_its_job_lives(slurm_lab):
    """Retention runs inside the job, as for a local run (tests/test_retention.py): a checkpoint
    every 20 batches, save_trial_best 1 and save_trial_latest 1 leave the best and latest (80,
    the loss falls); det-lab runs delete refuses the run while its job is queued or training."""
    proc, run_dir = _submit_waiting(slurm_lab, "--set", "min_checkpoint_period.batches=20",
                                    "--set", "checkpoint_storage.save_trial_latest=1",
                                    "--set", "hyperparameters.sleep_per_batch=0.1")
    refused = slurm_lab.cli("runs", "delete", run_dir.name, "--yes")
    assert refused.returncode == 2 and refused.stderr.startswith(f"error: run {run_dir.name} cannot be deleted: ")
    assert any(words in refused.stderr for words in ("its Slurm job", "it is training as pid")), refused.stderr
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    st = state(run_dir)
    assert st["status"] == "finished" and [c["step"] for c in st["checkpoints"]] == [80]
    assert [d["step"] for d in st["checkpoints_deleted"]] == [20, 40, 60]
    ckpts = slurm_lab.root / "checkpoints" / "vla"
    assert (ckpts / st["latest_checkpoint"] / "metadata.json").is_file()
    assert not any((ckpts / d["uuid"]).exists() for d in st["checkpoints_deleted"])
    slurm_lab.cli("runs", "delete", run_dir.name, "--yes", check=True)  # the job ended: it may go now
    assert not run_dir.exists() and not (ckpts / st["latest_checkpoint"]).exists()


def test_run_names_a_new_slurm_run_and_a_taken_name_is_refused(slurm_lab):
    """``--run NAME`` without ``--resume`` names the new run, as for --local (it used to be refused
    as a resume); the same name again is one line naming the run's job script, and creates nothing."""
    short = ["--set", "data.det_lab.max_length.batches=10", "--set", "min_checkpoint_period.batches=10"]
    proc = slurm_lab.cli("run", str(TINY), "--slurm", "--run", "named-on-slurm", "--wait", *short)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("run named-on-slurm: Slurm job ")
    run_dir = runs_dir(slurm_lab) / "named-on-slurm"
    st = state(run_dir)
    assert (st["name"], st["kind"], st["status"], st["latest_checkpoint_step"]) == ("named-on-slurm", "slurm", "finished", 10)
    assert f"-m det_lab.slurm.job {run_dir}" in (run_dir / "job.sbatch").read_text()

    before = _existing(slurm_lab)
    again = slurm_lab.cli("run", str(TINY), "--slurm", "--run", "named-on-slurm", *short)
    assert again.returncode == 2, again.stdout + again.stderr
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith("error: run named-on-slurm exists") and f"sbatch {run_dir / 'job.sbatch'}" in line, line
    resumed = slurm_lab.cli("run", str(TINY), "--slurm", "--resume", "--run", "named-on-slurm")
    assert resumed.returncode == 2 and "resumes by resubmitting its job script" in resumed.stderr
    _nothing_created(slurm_lab, before)


def _has_smolvla_packages() -> bool:
    return all(__import__("importlib").util.find_spec(m) for m in ("transformers", "num2words"))


#: SmolVLA's VLM trained too, on two ranks: its last layer's queries and MLP never reach the loss, which
#: DDP refuses at the second step unless it looks for unused parameters, as lerobot-train's accelerate does
SMOLVLA_TWO_RANKS = ("--set", "resources.slots_per_trial=2", "--set", "hyperparameters.policy.train_expert_only=false")


@pytest.fixture(scope="module")
def lerobot_jobs(slurm_lab, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """act.yaml and smolvla.yaml (both shrunk) through det-lab run --slurm --wait side by side (the
    node takes both): SmolVLA's tiny base and VLM are written and imported into the volume's model
    store while ACT's job trains. Yields each finished ``det-lab run`` and the child that loads
    SmolVLA's checkpoints with LeRobot (no SmolVLA without transformers and num2words)."""
    from tests.smolvla_models import SMOLVLA_YAML, ModelsChild, run_sets

    tmp = tmp_path_factory.mktemp("lerobot-jobs")
    # the node's Python: a lab's has a torchvision built for its torch; here a sitecustomize declares
    # its ops at the first import (tests/torchvision_shim.py), as the task image of the Determined tests does
    node_site = tmp / "node-site"
    node_site.mkdir()
    (node_site / "sitecustomize.py").write_text(torchvision_shim.image_pth_line())
    sets = ["--set", "data.det_lab.max_length.batches=6", "--set", "min_checkpoint_period.batches=3",
            "--set", "min_validation_period.batches=6", "--set", "data.det_lab.reporting_batches=3",
            "--set", "hyperparameters.val_episodes=1", "--set", "hyperparameters.torch_threads=1",
            "--set", "hyperparameters.policy.dim_model=32", "--set", "hyperparameters.policy.dim_feedforward=64",
            "--set", "hyperparameters.policy.n_encoder_layers=1", "--set", "checkpoint_storage.save_trial_latest=2"]
    act_yaml = Path(__file__).resolve().parents[1] / "experiment_templates" / "vla" / "act.yaml"

    def submit(config: Path, *args: str) -> subprocess.Popen:
        return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", "vla", "--slurm", "--wait", "--exp-config",
                                 str(config), *args], env={**slurm_lab.env, "PYTHONPATH": str(node_site)},
                                cwd=slurm_lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
        out, err = proc.communicate(timeout=500)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    act, smolvla, tiny, failed = submit(act_yaml, *sets), None, None, ""
    with contextlib.ExitStack() as stack:
        try:
            if _has_smolvla_packages():
                try:  # a SmolVLA failure is its test's, not ACT's
                    tiny = stack.enter_context(ModelsChild(tmp / "tiny", slurm_lab.root))
                    for src, name in tiny.models():
                        slurm_lab.cli("models", "import", str(src), name, check=True)
                    smolvla = submit(SMOLVLA_YAML, *run_sets(), *SMOLVLA_TWO_RANKS)
                except AssertionError as exc:
                    failed = str(exc)
            yield {"act": finished(act), "smolvla": finished(smolvla) if smolvla else failed, "tiny": tiny}
        finally:
            for proc in (act, smolvla):
                if proc is not None and proc.poll() is None:
                    proc.kill()


@skip_without_lerobot()
def test_lerobots_act_trains_through_slurm_and_each_checkpoint_holds_its_pretrained_model(slurm_lab, lerobot_jobs):
    """act.yaml (shrunk) through det-lab run --slurm --wait: the job trains LeRobot's ACT, reports its
    scalars, and each checkpoint on the volume holds LeRobot's pretrained_model/, which
    ACTPolicy.from_pretrained loads to exactly the weights saved at that step."""
    import torch

    proc = lerobot_jobs["act"]
    run_dir = run_named(slurm_lab, proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (run_dir / "train.log").read_text()[-3000:]
    st = state(run_dir)
    assert st["status"] == "finished" and [c["step"] for c in st["checkpoints"]] == [3, 6]
    for key in ("loss", "l1_loss", "kld_loss"):
        assert sorted(metrics(run_dir, "training", key)) == [3, 6], key

    torchvision_shim.install()  # this process loads LeRobot's ACT too
    from lerobot.policies.act.modeling_act import ACTPolicy

    weights = []
    for ckpt in st["checkpoints"]:
        path = slurm_lab.root / "checkpoints" / "vla" / ckpt["uuid"]
        loaded = ACTPolicy.from_pretrained(path / "pretrained_model").state_dict()
        saved = torch.load(path / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
        assert sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved), path
        weights.append(loaded)
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # step 3's and 6's differ


@skip_without_lerobot()
@pytest.mark.skipif(not _has_smolvla_packages(),
                    reason="needs transformers and num2words (SmolVLA's VLM): pip install -e '.[test]'")
def test_smolvla_fine_tunes_from_the_volumes_model_store_as_a_slurm_job(slurm_lab, lerobot_jobs):
    """smolvla.yaml (shrunk: tests/smolvla_models.py) through det-lab run --slurm --wait on two ranks, its
    VLM trained too (:data:`SMOLVLA_TWO_RANKS`): the job fine-tunes the tiny SmolVLA base and VLM
    imported into the volume's model store, offline (the job's HF_HOME at the store, HF_HUB_OFFLINE=1;
    this machine has no hub), its lineage naming both; its checkpoint's pretrained_model/ loads with
    SmolVLAPolicy.from_pretrained, offline from the store, to the trial's own weights."""
    from tests.smolvla_models import assert_loads_as_trained
    from tests.tiny_smolvla import BASE_ID, BASE_KEYS, VLM_ID

    proc = lerobot_jobs["smolvla"]
    assert not isinstance(proc, str), proc  # the models were not written or imported
    log = run_named(slurm_lab, proc.stdout) / "train.log" if proc.stdout.startswith("run ") else None
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text()[-3000:] if log else "")
    run_dir = run_named(slurm_lab, proc.stdout)
    st = state(run_dir)
    assert st["status"] == "finished" and [c["step"] for c in st["checkpoints"]] == [3]
    assert sorted(metrics(run_dir, "training", "loss")) == [1, 2, 3]  # each step once: the chief's
    assert sorted(metrics(run_dir, "validation", "val_action_l1")) == [3]
    assert {m["name"] for m in st["lineage"]["models"]} == {BASE_ID, VLM_ID}
    assert "#SBATCH --gres=gpu:2" in (run_dir / "job.sbatch").read_text()  # one job, its trial as two ranks
    checkpoint = slurm_lab.root / "checkpoints" / "vla" / st["checkpoints"][0]["uuid"]
    seen = lerobot_jobs["tiny"].load([checkpoint])[str(checkpoint)]
    assert_loads_as_trained(seen, BASE_KEYS["chunk_size"])
    assert any(".text_model.layers.0." in k for k in seen["moved"]), seen["moved"]  # the VLM trained too
