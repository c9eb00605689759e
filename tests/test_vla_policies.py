"""The VLA template trains LeRobot's own policies (ACT, Diffusion), checked against LeRobot itself.

LeRobot's own code, offline (``HF_HUB_OFFLINE=1``, ``HF_HOME``/``TORCH_HOME`` in temporary
directories), random-initialised policies at small sizes, on a dataset LeRobot's own writer makes
(``LeRobotDataset.create``/``add_frame``/``save_episode``/``finalize``): det_lab's batches are
LeRobot's items; det_lab's first steps give LeRobot's ``update_policy`` losses and parameters; a
det_lab checkpoint loads with ``from_pretrained`` and acts as the trial's model did; ``det-lab run
vla --local --exp-config act.yaml`` trains, mirrors the policy's scalars and resumes after a
preemption to an uninterrupted run's losses; bad input is one line.

PyPI's torchvision does not import beside the CPU torch of these machines: ``tests/torchvision_shim.py``
declares its op schemas first, in this process and (as the entrypoint's first script) in the trials.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import VENV_BIN, Lab
from tests.lerobot_loop import collate, lerobot_reader, scratch_steps
from tests.lerobot_writer import skip_without_lerobot

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "experiment_templates" / "vla"
SHIM = REPO / "tests" / "torchvision_shim.py"
CAMERA = "observation.images.front"
LENGTHS = (9, 12, 7, 10)  # episodes of different lengths: chunks padded at both ends of each
SEED = 7
#: three batches by dataset index, each touching episode starts and ends
BATCHES = ([0, 8, 9, 20, 21, 27, 30, 37], [1, 2, 10, 15, 22, 28, 33, 36], [3, 5, 11, 19, 23, 29, 31, 35])
#: tight: the same operations in the same order (measured: identical to the last bit)
TOL = dict(rtol=1e-6, atol=1e-7)

SPECS: dict[str, dict[str, Any]] = {
    "act": dict(name="act", pretrained_backbone_weights=None, dim_model=32, n_heads=2, dim_feedforward=64,
                n_encoder_layers=1, n_decoder_layers=1, n_vae_encoder_layers=1, latent_dim=8, chunk_size=5,
                n_action_steps=5, dropout=0.1, optimizer_lr=1e-3, optimizer_lr_backbone=1e-3),
    "diffusion": dict(name="diffusion", pretrained_backbone_weights=None, crop_shape=None, horizon=8, n_action_steps=4,
                      drop_n_last_frames=3, down_dims=[16, 32], kernel_size=3, n_groups=4, diffusion_step_embed_dim=16,
                      spatial_softmax_num_keypoints=8, num_inference_steps=4, scheduler_warmup_steps=2),
}

pytestmark = skip_without_lerobot()


# --- set-up: LeRobot offline, its torchvision importable, a dataset LeRobot wrote ----------------


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> dict[str, str]:
    """HF_HOME/TORCH_HOME in a temporary directory and the hub off, for this process and its children."""
    home = tmp_path_factory.mktemp("hf-home")
    env = {"HF_HOME": str(home / "hf"), "TORCH_HOME": str(home / "torch"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from tests import torchvision_shim

    torchvision_shim.install()
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _write(root: Path, camera: bool) -> Path:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotWriter

    features = {"observation.state": {"dtype": "float32", "shape": (3,), "names": None},
                "action": {"dtype": "float32", "shape": (2,), "names": None}}
    if camera:
        features[CAMERA] = {"dtype": "image", "shape": (24, 32, 3), "names": ["height", "width", "channels"]}
    ds = LeRobotWriter.create("local/policies", fps=10, features=features, root=root, use_videos=False)
    rng = np.random.default_rng(0)
    for ep, length in enumerate(LENGTHS):
        for _ in range(length):
            frame = {"observation.state": rng.normal(size=3).astype(np.float32),
                     "action": rng.normal(size=2).astype(np.float32), "task": f"pick the {('red', 'blue')[ep % 2]} block"}
            if camera:
                frame[CAMERA] = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def written(offline, tmp_path_factory) -> Path:
    """A LeRobot v3.0 dataset written by LeRobot itself: a 24x32 camera, state 3, action 2, two tasks."""
    return _write(tmp_path_factory.mktemp("lerobot") / "dataset", camera=True)


def _ours(root: Path, kind: str, total_steps: int = 10):
    """det_lab's training of ``SPECS[kind]`` on det_lab's reader, seeded as LeRobot's loop is."""
    from lerobot.utils.random_utils import set_seed

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, build_training, dataset_meta, parse_policy

    frames = LeRobotDataset(root)
    set_seed(SEED)
    training = build_training(parse_policy(SPECS[kind]), dataset_meta(frames), total_steps=total_steps)
    return training, PolicyFrames(frames, training.delta_indices)  # every frame: index i is dataset index i


# --- batches: det_lab's reader serves LeRobot's items ----------------------------------------------


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_batches_equal_lerobots_items(written, kind):
    """Action chunks (ACT: t..t+4; Diffusion: t-1..t+6), observation history (Diffusion: t-1, t),
    the padding masks at both episode ends, images, indices and the task string: item for item."""
    import torch

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyFrames, dataset_meta, parse_policy
    from det_lab.policies.training import delta_indices, make_config

    cfg = make_config(parse_policy(SPECS[kind]), "cpu")
    frames = LeRobotDataset(written)
    ours = PolicyFrames(frames, delta_indices(cfg, dataset_meta(frames)))
    theirs = lerobot_reader(written, "local/policies", cfg)
    assert len(ours) == len(theirs) == sum(LENGTHS)
    padded = 0
    for i in range(len(theirs)):
        a, b = ours[i], theirs[i]
        assert sorted(a) == sorted(b), i
        for key, value in b.items():
            if isinstance(value, torch.Tensor):
                assert a[key].dtype == value.dtype and a[key].shape == value.shape, (i, key)
                assert torch.equal(a[key], value), (i, key)
            else:
                assert a[key] == value, (i, key)
        padded += int(b["action_is_pad"].any())
    assert padded >= len(LENGTHS)  # the masks were exercised, not all False
    if kind == "diffusion":
        assert theirs[9]["observation.state_is_pad"].tolist() == [True, False]  # episode 1's first frame
        assert ours[9]["observation.state"].shape == (2, 3) and ours[9][CAMERA].shape == (2, 3, 24, 32)
    # the training items leave out each episode's last frames as LeRobot's EpisodeAwareSampler does
    drop = SPECS[kind].get("drop_n_last_frames", 0)
    assert len(PolicyFrames(frames, None, drop)) == sum(LENGTHS) - drop * len(LENGTHS)


# --- steps: det_lab's step is LeRobot's update_policy ---------------------------------------------


def _lerobot_loop(root: Path, kind: str, total_steps: int = 10) -> tuple[list[float], dict]:
    """LeRobot's own loop, written out from its functions (``lerobot-train``'s order), on
    LeRobot's reader (tests/lerobot_loop.py ``scratch_steps``)."""
    keys = {k: tuple(v) if isinstance(v, list) else v for k, v in SPECS[kind].items() if k != "name"}
    return scratch_steps(root, "local/policies", kind, keys, BATCHES, SEED, total_steps)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_first_steps_give_lerobots_losses_and_parameters(written, kind):
    """Three steps through det_lab (its reader, build and step) against LeRobot's own loop on
    LeRobot's reader, same seed: the same losses and parameters within ``TOL``, while the
    neighbouring step's loss is far outside it (the comparison can tell steps apart)."""
    import torch

    theirs, their_params = _lerobot_loop(written, kind)
    training, items = _ours(written, kind)
    initial = {n: p.detach().clone() for n, p in training.policy.named_parameters()}
    ours, seconds = [], []
    for indices in BATCHES:
        start = time.perf_counter()
        metrics = training.train_step(collate([items[i] for i in indices]))
        seconds.append(time.perf_counter() - start)
        ours.append(float(metrics["loss"]))
        if kind == "act":
            assert {"l1_loss", "kld_loss", "grad_norm", "lr"} <= set(metrics)
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"\n{kind}: losses {ours}, largest difference to LeRobot's {worst:.3g}; "
          f"s/step {', '.join(f'{s:.2f}' for s in seconds)}")
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=TOL["rtol"], abs=TOL["atol"]), step
    for step in range(len(ours) - 1):  # neighbours: what a one-step slip in data, RNG or schedule gives
        assert ours[step] != pytest.approx(theirs[step + 1], rel=TOL["rtol"], abs=TOL["atol"]), step
        assert ours[step + 1] != pytest.approx(theirs[step], rel=TOL["rtol"], abs=TOL["atol"]), step
    mine = training.policy.state_dict()
    assert sorted(mine) == sorted(their_params)
    for name, value in their_params.items():
        torch.testing.assert_close(mine[name], value, **TOL, msg=name)
    moved = sum(not torch.equal(p.detach(), initial[n]) for n, p in training.policy.named_parameters())
    assert moved > 0.5 * len(initial)  # the steps changed the weights


# --- bad input: one line, nothing built -----------------------------------------------------------


def test_unknown_policy_type_and_missing_feature_are_one_line(written, tmp_path):
    from det_lab.errors import UserError
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyError, build_training, dataset_meta, parse_policy

    meta = dataset_meta(LeRobotDataset(written))
    with pytest.raises(PolicyError) as err:
        build_training(parse_policy({"name": "actt"}), meta, total_steps=1)
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    assert "unknown policy type 'actt'" in str(err.value) and "act, " in str(err.value)
    with pytest.raises(PolicyError, match=r"ACTConfig has no keys \['dim_modle'\]"):
        build_training(parse_policy({"name": "act", "dim_modle": 64}), meta, total_steps=1)
    with pytest.raises(PolicyError, match="is not a local directory nor a hub id"):
        parse_policy({"name": "act", "pretrained": str(tmp_path / "no-such-model")})
    assert parse_policy({"name": "act", "pretrained": "lerobot/act_aloha_sim"}).pretrained == "lerobot/act_aloha_sim"

    no_camera = _write(tmp_path / "no-camera", camera=False)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(PolicyError) as err:
        build_training(parse_policy(SPECS["act"]), dataset_meta(LeRobotDataset(no_camera)), total_steps=1)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{no_camera}: policy act cannot train on this dataset")
    assert "at least one image" in msg and "observation.state" in msg, msg
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_default_policy_does_not_import_lerobot():
    """The quick start's start-up: the template's own policy never imports LeRobot."""
    code = (f"import sys; sys.path.insert(0, {str(TEMPLATE)!r}); import train; "
            "from det_lab.policies import parse_policy; assert not parse_policy(None).is_lerobot; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lerobot', 'torchvision')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# --- det-lab run vla --local --exp-config act.yaml -------------------------------------------------

RUN_SETS = ("--set", f"entrypoint=python3 -m determined.launch.torch_distributed python3 {SHIM} train.py",
            "--set", "data.det_lab.max_length.batches=10", "--set", "min_checkpoint_period.batches=4",
            "--set", "min_validation_period.batches=10",
            "--set", "hyperparameters.val_episodes=1", "--set", "data.det_lab.reporting_batches=1",
            "--set", "hyperparameters.torch_threads=1", "--set", "hyperparameters.policy.dim_model=32",
            "--set", "hyperparameters.policy.dim_feedforward=64", "--set", "hyperparameters.policy.n_encoder_layers=1")


def _start(lab: Lab, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(VENV_BIN / "det-lab"), "run", "vla", "--local", *args], env={**lab.env, **env},
                            cwd=lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _series(run_dir: Path, group: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["group"] == group:
            out.setdefault(record["step"], {}).update(record["metrics"])
    return out


class ActRuns(threading.Thread):
    """Three act.yaml runs (``--set`` shrinks them), driven from a thread so that they train while
    this module's in-process tests run: one straight, one Ctrl-C'd after its first checkpoint and
    resumed, one with an unknown policy type. :meth:`result` waits for all of them."""

    def __init__(self, lab: Lab, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.lab, self.env = lab, env
        self.runs = lab.root / "outputs" / "vla" / "local-runs"
        self.procs: dict[str, subprocess.Popen] = {}
        self.outs: dict[str, str] = {}
        self.error: BaseException | None = None
        self.stopped_at = 0

    def run(self) -> None:
        try:
            self._drive()
        except BaseException as exc:  # noqa: BLE001 (handed to the test that asks for the result)
            self.error = exc

    def _drive(self) -> None:
        config = str(TEMPLATE / "act.yaml")
        for name in ("straight", "stopped"):
            self.procs[name] = _start(self.lab, self.env, "--exp-config", config, "--run", f"act-{name}", *RUN_SETS)
        self.procs["bad"] = _start(self.lab, self.env, "--exp-config", config, "--run", "act-bad", *RUN_SETS,
                                   "--set", "hyperparameters.policy.name=actt")
        stopped, deadline = self.runs / "act-stopped", time.monotonic() + 300
        while not ((stopped / "run.json").exists() and (_state(stopped).get("latest_checkpoint_step") or 0) > 0):
            assert self.procs["stopped"].poll() is None, self.procs["stopped"].communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            # a short poll: the tiny policy trains its last 6 batches in a few tenths of a second,
            # and a Ctrl-C that comes after them stops nothing (it once came after step 10)
            time.sleep(0.01)
        self.procs["stopped"].send_signal(signal.SIGINT)  # Ctrl-C: checkpoint and stop
        self.outs["stopped"] = _finish(self.procs["stopped"])
        self.stopped_at = _state(stopped)["latest_checkpoint_step"]
        self.procs["resumed"] = _start(self.lab, self.env, "--resume", "--run", "act-stopped")
        for name in ("bad", "resumed", "straight"):
            self.outs[name] = _finish(self.procs[name])

    def result(self) -> dict[str, Any]:
        self.join(timeout=600)
        if self.error is not None:
            raise self.error
        assert not self.is_alive(), "the act.yaml runs did not finish within 600 s"
        return {"dirs": {n: self.runs / f"act-{n}" for n in ("straight", "stopped", "bad")}, "outs": self.outs,
                "codes": {n: p.returncode for n, p in self.procs.items()}, "stopped_at": self.stopped_at,
                "checkpoints": self.lab.root / "checkpoints" / "vla"}

    def kill(self) -> None:
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module", autouse=True)
def _act_runs_started(offline, demo_lab) -> ActRuns:
    """Starts the runs when the module starts (autouse), stops whatever is left when it ends."""
    runs = ActRuns(demo_lab, offline)
    runs.start()
    yield runs
    runs.kill()


@pytest.fixture(scope="module")
def act_runs(_act_runs_started) -> dict[str, Any]:
    return _act_runs_started.result()


def test_act_yaml_trains_reports_the_policys_scalars_and_resumes_exactly(act_runs, shared_mlflow_server):
    from mlflow.tracking import MlflowClient

    dirs, outs, codes = act_runs["dirs"], act_runs["outs"], act_runs["codes"]
    assert codes["straight"] == 0 and codes["resumed"] == 0, outs
    assert 0 < act_runs["stopped_at"] < 10 and _state(dirs["stopped"])["resumed"] == 1
    straight, resumed = _series(dirs["straight"], "training"), _series(dirs["stopped"], "training")
    assert sorted(straight) == sorted(resumed) == list(range(1, 11))
    assert {"loss", "l1_loss", "kld_loss", "grad_norm", "lr"} <= set(straight[1])
    for step in straight:  # Ctrl-C and --resume: the losses of the uninterrupted run, step for step
        for key in ("loss", "l1_loss", "kld_loss"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-6, abs=1e-9), (step, key)
    val_a, val_b = _series(dirs["straight"], "validation"), _series(dirs["stopped"], "validation")
    assert sorted(val_a) == sorted(val_b) == [10]
    for step in val_a:
        for key in ("val_loss", "val_action_l1", "val_action_l1_first"):
            assert val_b[step][key] == pytest.approx(val_a[step][key], rel=1e-6), (step, key)
    assert straight[10]["loss"] < straight[1]["loss"]  # it learns

    summary = json.loads((dirs["straight"] / "tracking-summary.json").read_text())
    (backend,) = summary["backends"]
    client = MlflowClient(shared_mlflow_server.uri)
    for key in ("l1_loss", "kld_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(backend["run_id"], f"training/{key}"))
        assert history == [(s, pytest.approx(straight[s][key])) for s in sorted(straight)], key
    assert client.get_run(backend["run_id"]).data.params["policy.name"] == "act"


def test_checkpoint_loads_with_lerobots_from_pretrained_and_acts_as_the_trial_did(act_runs, demo_lab):
    """The checkpoint's pretrained_model/ through ACTPolicy.from_pretrained and LeRobot's processor
    loader gives the action chunk of the trial's own weights (Determined's state_dict.pth) run
    through det_lab on the same observation."""
    import torch
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors

    from det_lab.data import pull
    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PRETRAINED_DIR, PolicyFrames, build_training, dataset_meta, parse_policy
    from det_lab.settings import load_settings

    state = _state(act_runs["dirs"]["straight"])
    ckpt = act_runs["checkpoints"] / state["latest_checkpoint"]
    pretrained = ckpt / PRETRAINED_DIR
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json"} <= \
        {p.name for p in pretrained.iterdir()}
    policy = ACTPolicy.from_pretrained(pretrained)
    preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=str(pretrained))

    frames = LeRobotDataset(pull("vla-demo", load_settings(demo_lab.config, env={}), progress=False).path)
    training = build_training(parse_policy(state["hparams"]["policy"]), dataset_meta(frames), total_steps=1)
    weights = torch.load(ckpt / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
    training.policy.load_state_dict(weights)
    batch = collate([PolicyFrames(frames, training.delta_indices)[i] for i in (0, 45, 77)])
    observation = {k: v for k, v in batch.items() if k.startswith("observation.") or k == "task"}

    training.policy.eval()
    with torch.no_grad():
        trial = training.postprocessor(training.predict_chunk(training.preprocessor(dict(observation))))
        loaded = postprocessor(policy.predict_action_chunk(preprocessor(dict(observation))))
    assert loaded.shape == (3, 10, 4)
    torch.testing.assert_close(loaded, trial, rtol=0, atol=0)
    assert json.loads((pretrained / "config.json").read_text())["type"] == "act"


def test_unknown_policy_type_in_a_run_is_one_error_line_and_no_checkpoint(act_runs):
    run_dir = act_runs["dirs"]["bad"]
    assert act_runs["codes"]["bad"] not in (0, None)
    log = (run_dir / "train.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown policy type 'actt'" in errors[0], log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    state = _state(run_dir)
    assert state["status"] == "failed" and not state.get("checkpoints") and not state.get("latest_checkpoint")
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    assert "unknown policy type 'actt'" in act_runs["outs"]["bad"]  # det-lab run's summary shows the line
