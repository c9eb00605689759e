"""The VLA template: the LeRobot reader, the policy, the configs, and `det-lab run vla --local`
end to end (DVC pull, training, checkpoints on the data root, MLflow, preemption and resume)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from det_lab.data import pull
from det_lab.data.demo import IMAGE_KEY, make_vla_demo, make_vla_demo_v21
from det_lab.formats import (
    LeRobotDataset,
    LeRobotDatasetError,
    VideoDecoderMissing,
    split_episodes,
)
from det_lab.settings import load_settings
from tests import expconf
from tests.conftest import VENV_BIN, Lab

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "experiment_templates" / "vla"
CONFIGS = ("const.yaml", "search.yaml", "gpu.yaml", "gpu-large.yaml")
LEROBOT_CONFIGS = ("act.yaml", "act-search.yaml", "smolvla.yaml", "pi05.yaml")  # LeRobot's own policies (tests/test_vla_policies.py, test_vla_smolvla.py, test_vla_scale.py)


# --- the reader --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lerobot")
    kw = dict(episodes=4, frames_per_episode=10, image_size=16)
    return {"v3": make_vla_demo(root / "v3", **kw), "v21": make_vla_demo_v21(root / "v21", **kw)}


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _same_items(a: LeRobotDataset, b: LeRobotDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=f"item {i}, {k}")


def test_v3_and_v21_give_the_same_frames_and_chunks(demos):
    v3, v21 = LeRobotDataset(demos["v3"], horizon=4), LeRobotDataset(demos["v21"], horizon=4)
    assert (v3.version, v21.version) == ("v3.0", "v2.1")
    assert len(v3) == 40 and v3.episode_indices == [0, 1, 2, 3]
    assert (v3.state_dim, v3.action_dim, v3.cameras) == (4, 4, [IMAGE_KEY])
    assert v3.image_shape(IMAGE_KEY) == (3, 16, 16)
    assert v3.tasks == v21.tasks and set(v3.tasks.values()) >= {"pick up the red block"}
    _same_items(v3, v21)

    item = v3[13]  # episode 1, frame 3
    assert (item["episode_index"], item["frame_index"], item["index"]) == (1, 3, 13)
    assert item["observation.state"].shape == (4,) and item["observation.state"].dtype == np.float32
    assert item[IMAGE_KEY].shape == (3, 16, 16) and 0.0 <= item[IMAGE_KEY].min() <= item[IMAGE_KEY].max() <= 1.0
    assert item["task"] == v3.tasks[item["task_index"]]
    frames = pq.read_table(demos["v3"] / "data/chunk-000/file-000.parquet").to_pydict()
    np.testing.assert_array_equal(item["action"], np.asarray(frames["action"][13:17], dtype=np.float32))
    np.testing.assert_array_equal(item["observation.state"], np.asarray(frames["observation.state"][13], dtype=np.float32))
    assert set(v3.norm_stats("action")) == {"mean", "std", "min", "max"}


def test_action_chunks_are_padded_and_masked_at_episode_end(demos):
    ds = LeRobotDataset(demos["v3"], horizon=5)
    actions = pq.read_table(demos["v3"] / "data/chunk-000/file-000.parquet").column("action").to_pylist()
    item = ds[17]  # episode 1, frame 7 of 10: frames 7, 8, 9 are real, two padded
    assert item["action_is_pad"].tolist() == [False, False, False, True, True]
    np.testing.assert_array_equal(item["action"][:3], np.asarray(actions[17:20], dtype=np.float32))
    np.testing.assert_array_equal(item["action"][3], item["action"][2])  # the last action repeated
    np.testing.assert_array_equal(item["action"][4], item["action"][2])
    assert not ds[10]["action_is_pad"].any()  # the first frame of episode 1 never reads episode 0
    assert ds[19]["action_is_pad"].tolist() == [False, True, True, True, True]
    assert not ds[20]["action_is_pad"].any()  # episode 2 starts afresh


def test_held_out_split_is_disjoint_and_deterministic(demos):
    ds = LeRobotDataset(demos["v21"], horizon=2)
    train, val = split_episodes(ds.episode_indices, val_episodes=1, seed=3)
    assert set(train).isdisjoint(val) and sorted(train + val) == [0, 1, 2, 3] and len(val) == 1
    assert split_episodes(ds.episode_indices, val_episodes=1, seed=3) == (train, val)
    tr, va = ds.select(train), ds.select(val)
    assert len(tr) + len(va) == len(ds) and len(va) == 10
    assert {tr[i]["episode_index"] for i in range(len(tr))} == set(train)
    assert {va[i]["episode_index"] for i in range(len(va))} == set(val)
    assert tr.selected_episodes == train and va.selected_episodes == val
    assert LeRobotDataset(demos["v21"], episodes=val).selected_episodes == val
    assert split_episodes(range(10), val_fraction=0.2)[1].__len__() == 2
    with pytest.raises(ValueError):
        split_episodes([0], val_episodes=1)
    with pytest.raises(ValueError):
        split_episodes([0, 1], val_episodes=2)


def _break(root: Path, kind: str) -> Path:
    """Damage a copied dataset; returns the file the error must name."""
    info_file = root / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    v3 = info["codebase_version"] == "v3.0"
    data = root / ("data/chunk-000/file-000.parquet" if v3 else "data/chunk-000/episode_000002.parquet")
    if kind == "no-info":
        info_file.unlink()
        return info_file
    if kind == "unknown-version":
        info_file.write_text(json.dumps({**info, "codebase_version": "v1.6"}))
        return info_file
    if kind == "missing-parquet":
        data.unlink()
        return data
    if kind == "total-frames":
        info_file.write_text(json.dumps({**info, "total_frames": info["total_frames"] + 1}))
        return info_file
    if kind == "episode-rows":  # one frame of episode 2 dropped from the data
        table = pq.read_table(data)
        keep = np.ones(table.num_rows, dtype=bool)
        keep[np.flatnonzero(np.asarray(table.column("episode_index")) == 2)[4]] = False
        pq.write_table(table.filter(pa.array(keep)), data)
        return data
    if kind == "missing-column":
        pq.write_table(pq.read_table(data).drop_columns(["action"]), data)
        return data
    if kind == "missing-image":
        image = root / info["image_path"].format(image_key=IMAGE_KEY, episode_index=3, frame_index=0)
        image.unlink()
        return image
    if kind == "missing-tasks":
        tasks = root / "meta" / ("tasks.parquet" if v3 else "tasks.jsonl")
        tasks.unlink()
        return tasks
    raise AssertionError(kind)


@pytest.mark.parametrize("version", ["v3", "v21"])
@pytest.mark.parametrize("kind", ["no-info", "unknown-version", "missing-parquet", "total-frames",
                                  "episode-rows", "missing-column", "missing-image", "missing-tasks"])
def test_malformed_dataset_is_one_clear_line_naming_the_file(demos, tmp_path, version, kind):
    root = _copy(demos[version], tmp_path)
    bad = _break(root, kind)
    with pytest.raises(LeRobotDatasetError) as err:
        LeRobotDataset(root, horizon=3)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in msg and msg.startswith(f"{bad}: "), msg
    words = {"no-info": "missing", "unknown-version": "'v1.6' is not supported", "missing-parquet": "missing parquet",
             "total-frames": "total_frames", "episode-rows": "episode 2 has 9 frames",
             "missing-column": "'action'", "missing-image": "missing image", "missing-tasks": "missing"}
    assert words[kind] in msg, msg


def test_image_missing_mid_episode_fails_when_read(demos, tmp_path):
    root = _copy(demos["v3"], tmp_path)
    info = json.loads((root / "meta" / "info.json").read_text())
    image = root / info["image_path"].format(image_key=IMAGE_KEY, episode_index=1, frame_index=5)
    image.unlink()
    ds = LeRobotDataset(root)  # only each episode's first and last image are checked up front
    ds[14]
    with pytest.raises(LeRobotDatasetError, match=f"^{image}: missing image"):
        ds[15]


def test_images_embedded_in_parquet_read_like_files(demos, tmp_path):
    """Real v2.1 datasets with image features embed PNG bytes in the frames ({bytes, path})."""
    root = _copy(demos["v21"], tmp_path)
    info_file = root / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        cells = [{"bytes": (root / info["image_path"].format(image_key=IMAGE_KEY, episode_index=e, frame_index=f)).read_bytes(),
                  "path": None}
                 for e, f in zip(table.column("episode_index").to_pylist(), table.column("frame_index").to_pylist())]
        pq.write_table(table.append_column(IMAGE_KEY, pa.array(cells)), path)
    shutil.rmtree(root / "images")
    info_file.write_text(json.dumps({**info, "image_path": None}))
    _same_items(LeRobotDataset(root, horizon=3), LeRobotDataset(demos["v21"], horizon=3))


def test_video_camera_without_a_decoder_is_a_clear_error(demos, tmp_path, monkeypatch):
    """Neither torchcodec nor PyAV importable (as where neither is installed): one line naming both."""
    from det_lab.formats import video

    for module in ("torchcodec", "torchcodec.decoders", "av"):
        monkeypatch.setitem(sys.modules, module, None)  # `import av` now fails as if not installed
    video.decoder_problem.cache_clear()  # probed again now, and again after the test (finally)
    root = _copy(demos["v21"], tmp_path)
    info_file = root / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    info["features"][IMAGE_KEY]["dtype"] = "video"
    info["video_path"] = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    info_file.write_text(json.dumps(info))
    for e in range(4):
        clip = root / info["video_path"].format(episode_chunk=0, video_key=IMAGE_KEY, episode_index=e)
        clip.parent.mkdir(parents=True, exist_ok=True)
        clip.write_bytes(b"not decoded")
    try:
        with pytest.raises(VideoDecoderMissing, match="no video decoder works here: torchcodec not installed") as err:
            LeRobotDataset(root)
    finally:
        video.decoder_problem.cache_clear()
    assert "\n" not in str(err.value) and "pyav not installed (pip install av" in str(err.value)
    assert len(LeRobotDataset(root, cameras=())) == 40  # the tabular part still reads


# --- the template's code and configs -----------------------------------------------------------


def test_every_config_passes_validate_expconf():
    files = sorted(TEMPLATE.glob("*.yaml"))
    assert {f.name for f in files} == set(CONFIGS) | set(LEROBOT_CONFIGS)
    expconf.assert_valid(files)


def test_search_trains_for_max_time_and_is_asha():
    from det_lab.runs.expconf import lab_section, training_length

    conf = yaml.safe_load((TEMPLATE / "search.yaml").read_text())
    searcher = conf["searcher"]
    assert searcher["name"] == "adaptive_asha" and searcher["time_metric"] == "batches"
    assert searcher["max_time"] == conf["data"]["det_lab"]["max_length"]["batches"]
    assert training_length(conf, lab_section(conf)).batches == searcher["max_time"]
    gpu = yaml.safe_load((TEMPLATE / "gpu.yaml").read_text())
    assert gpu["resources"]["slots_per_trial"] >= 2 and gpu["hyperparameters"]["bf16"] is True
    assert "determined.launch.torch_distributed" in gpu["entrypoint"]


def test_the_det_lab_models_bf16_switch_with_a_lerobot_policy_is_refused_by_the_trial(template_modules):
    """hyperparameters.bf16 is read by the det_lab model only: with a LeRobot policy it would train in
    fp32 unasked. The trial's own check (a config from det experiment create had no det-lab preflight),
    the one that ends a cluster trial in one line (tests/test_vla_distributed.py's uneven batch)."""
    from train import _check_scale

    from det_lab.errors import UserError

    hp = {"global_batch_size": 8, "bf16": True}
    with pytest.raises(UserError) as refused:
        _check_scale(hp, True, 2)
    assert str(refused.value) == ("hyperparameters.bf16 is the det_lab model's switch; for a LeRobot policy set "
                                  "hyperparameters.policy.precision: bf16")
    _check_scale(hp, False, 2)  # the det_lab model's own switch
    _check_scale({**hp, "bf16": False}, True, 2)


@pytest.fixture
def template_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(TEMPLATE))
    for name in ("model", "dataset", "train"):
        sys.modules.pop(name, None)
    yield
    for name in ("model", "dataset", "train"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_config_builds_a_policy_that_learns_a_step(demos, config, template_modules):
    import random

    import torch
    from dataset import load_splits
    from model import VLAConfig, VLAPolicy

    from det_lab.runs.local import sample_hparams

    hp = sample_hparams(yaml.safe_load((TEMPLATE / config).read_text())["hyperparameters"], random.Random(0))
    hp["val_episodes"] = 1
    splits = load_splits(demos["v3"], hp)
    full = splits.full
    side = hp.get("resize")
    cfg = VLAConfig.from_hparams(hp["model"], state_dim=4, action_dim=4, horizon=hp["horizon"],
                                 image_shape=(3, side, side) if side else full.image_shape(IMAGE_KEY))
    policy = VLAPolicy(cfg, {k: full.norm_stats(k) for k in ("observation.state", "action", IMAGE_KEY)}, full.cameras)
    n_params = sum(p.numel() for p in policy.parameters())
    if config == "gpu-large.yaml":  # its step (224x224, two cameras) is bench/gpu.py's, on a GPU
        assert 90e6 < n_params < 110e6 and cfg.image_encoder == "patch" and cfg.image_shape == (3, 224, 224)
        return
    n = 4
    batch = torch.utils.data.default_collate([splits.train[i] for i in range(n)])
    out = policy(batch["images"], batch["state"], batch["text_ids"], batch["text_valid"], batch["action"], batch["action_is_pad"])
    assert out["action"].shape == (n, hp["horizon"], 4) and out["loss"].ndim == 0
    out["loss"].backward()
    if config == "gpu.yaml":
        assert n_params > 10_000_000
    elif config == "const.yaml":
        assert n_params < 500_000


# --- speed switches and the frame cache ------------------------------------------------------------


def _policy_pair(full, hp_model: dict, **switches):
    """Two policies with the same weights: the speed switches on (``switches``) and all off."""
    import torch
    from model import VLAConfig, VLAPolicy, apply_speed_switches

    stats = {k: full.norm_stats(k) for k in ("observation.state", "action", IMAGE_KEY)}
    cfg = dict(state_dim=4, action_dim=4, horizon=4, image_shape=full.image_shape(IMAGE_KEY))
    torch.manual_seed(0)
    fast = VLAPolicy(VLAConfig.from_hparams({**hp_model, "attention": "sdpa"}, **cfg), stats, full.cameras)
    plain = VLAPolicy(VLAConfig.from_hparams({**hp_model, "attention": "math"}, **cfg), stats, full.cameras)
    plain.load_state_dict(fast.state_dict())
    return apply_speed_switches(fast, switches), plain


@pytest.mark.parametrize("encoder", ["cnn", "patch"])
def test_speed_switches_train_to_the_same_losses(demos, tmp_path, encoder, template_modules):
    """SDPA vs written-out attention, fused vs per-tensor AdamW, channels-last vs not, uint8
    frames from the cache vs float frames decoded per item: the same losses, step after step."""
    import torch
    from dataset import collate_batch, load_splits

    hp = {"horizon": 4, "val_episodes": 1, "model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "ff_mult": 2,
          "image_encoder": encoder, "patch_size": 4, "vocab_size": 64, "max_text_tokens": 8}}
    decoded, cached = load_splits(demos["v3"], hp), load_splits(demos["v3"], hp, tmp_path / "cache")
    fast, plain = _policy_pair(decoded.full, hp["model"], channels_last=True)
    opt_fast = torch.optim.AdamW(fast.parameters(), lr=3e-3, fused=True)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=3e-3, foreach=False)
    loader_kw = dict(batch_size=8, shuffle=True, generator=None)
    for step in range(4):  # (parameters are not compared: Adam turns rounding noise in gradients that are
        # exactly zero, such as the key bias's, into lr-sized steps; the losses show the training agrees)
        loader_kw["generator"] = torch.Generator().manual_seed(step)
        a = next(iter(torch.utils.data.DataLoader(cached.train, collate_fn=collate_batch, **loader_kw)))
        loader_kw["generator"] = torch.Generator().manual_seed(step)
        b = next(iter(torch.utils.data.DataLoader(decoded.train, **loader_kw)))
        assert a["images"].dtype == torch.uint8 and a["images"].shape[1] == 1
        out_fast = fast(a["images"], a["state"], a["text_ids"], a["text_valid"], a["action"], a["action_is_pad"])
        out_plain = plain(b["images"], b["state"], b["text_ids"], b["text_valid"], b["action"], b["action_is_pad"])
        torch.testing.assert_close(out_fast["loss"], out_plain["loss"], rtol=1e-4, atol=1e-5)
        for opt, out in ((opt_fast, out_fast), (opt_plain, out_plain)):
            opt.zero_grad()
            out["loss"].backward()
            opt.step()


def test_compile_switch_keeps_checkpoints_loadable(demos, template_modules):
    """torch.compile in place: the same state-dict keys, so checkpoints load with or without it."""
    from dataset import load_splits

    hp = {"horizon": 4, "val_episodes": 1, "model": {"d_model": 32, "n_heads": 4, "n_layers": 1, "patch_size": 4,
                                                      "vocab_size": 64, "max_text_tokens": 8}}
    compiled, plain = _policy_pair(load_splits(demos["v3"], hp).full, hp["model"], compile=True)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(compiled.state_dict())


def test_frame_cache_holds_the_decoded_frames(demos, tmp_path, template_modules):
    import torch
    from frame_cache import open_frames
    from model import Normalize

    ds = LeRobotDataset(demos["v3"], horizon=1)
    frames = open_frames(ds, tmp_path, revision="rev-a")
    assert frames.dtype == np.uint8 and frames.shape == (len(ds), 1, 3, 16, 16)
    for i in (0, 17, len(ds) - 1):  # item i of the full dataset is row i
        np.testing.assert_array_equal(frames[i, 0], np.round(ds[i][IMAGE_KEY] * 255).astype(np.uint8))
    # resized once into the cache: within uint8 rounding of resizing each decoded item
    resized = open_frames(ds, tmp_path, resize=24, revision="rev-a")
    from dataset import PolicyFrames

    item = PolicyFrames(ds, vocab_size=64, max_text_tokens=8, resize=24)[5]["images"][0]
    assert np.abs(resized[5, 0] / 255.0 - item.numpy()).max() <= 0.5 / 255 + 1e-6
    # the model reads uint8 and [0, 1] floats alike
    norm = Normalize(np.full((3, 1, 1), 0.5), np.full((3, 1, 1), 0.25))
    torch.testing.assert_close(norm.images(torch.from_numpy(np.array(frames[:2, 0]))),
                               norm(torch.from_numpy(np.array(frames[:2, 0])).float() / 255))


def test_frame_cache_follows_the_dataset_revision(demos, tmp_path, template_modules):
    from frame_cache import open_frames
    from PIL import Image

    root = _copy(demos["v3"], tmp_path)
    cache = tmp_path / "cache"
    before = np.array(open_frames(LeRobotDataset(root), cache))
    png = root / "images" / IMAGE_KEY / "episode_000001" / "frame_000002.png"
    Image.fromarray(np.full((16, 16, 3), 7, dtype=np.uint8)).save(png)  # a new revision of one frame
    after = np.array(open_frames(LeRobotDataset(root), cache))
    assert (after[12] == 7).all() and not (before[12] == 7).all()
    np.testing.assert_array_equal(np.delete(after, 12, 0), np.delete(before, 12, 0))
    assert len(list(cache.glob("frames-*.npy"))) == 2
    # a pulled snapshot names its revision (the DVC md5): same files, other revision, other cache
    open_frames(LeRobotDataset(root), cache, revision="md5-of-another-revision")
    assert len(list(cache.glob("frames-*.npy"))) == 3


def test_killed_cache_builder_leaves_nothing_a_reader_takes(demos, tmp_path):
    """kill -9 mid-build: no cache file appears; the next reader builds a whole one and removes
    the dead builder's temporary file."""
    cache = tmp_path / "cache"
    script = f"""
import sys, time
sys.path.insert(0, {str(TEMPLATE)!r})
import frame_cache
from det_lab.formats import LeRobotDataset
frame_cache._BUILD_CHUNK = 4
slow = frame_cache.to_uint8
def to_uint8(images, resize):
    print("chunk", flush=True)
    time.sleep(0.5)
    return slow(images, resize)
frame_cache.to_uint8 = to_uint8
frame_cache.open_frames(LeRobotDataset({str(demos["v3"])!r}), {str(cache)!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "chunk\n"
        assert proc.stdout.readline() == "chunk\n"  # the temporary file is being written
        assert len(list(cache.glob(".frames-*.tmp"))) == 1
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not list(cache.glob("frames-*.npy"))
    sys.path.insert(0, str(TEMPLATE))
    try:
        from frame_cache import open_frames

        ds = LeRobotDataset(demos["v3"])
        frames = open_frames(ds, cache)
    finally:
        sys.path.remove(str(TEMPLATE))
        sys.modules.pop("frame_cache", None)
    np.testing.assert_array_equal(frames[-1, 0], np.round(ds[len(ds) - 1][IMAGE_KEY] * 255).astype(np.uint8))
    assert not list(cache.glob(".frames-*.tmp"))


# the startup hook, sourced as Determined's entrypoint.sh does: tests/test_task_standin.py


# --- det-lab run vla --local, end to end -------------------------------------------------------


def _runs(lab: Lab) -> list[Path]:
    runs = (p for p in (lab.root / "outputs" / "vla" / "local-runs").glob("vla-*") if (p / "run.json").is_file())
    return sorted(runs, key=lambda p: p.stat().st_mtime)


def _metrics(run_dir: Path, group: str) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if m["group"] == group]


def _mlflow_run_id(run_dir: Path) -> str:
    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    (backend,) = summary["backends"]
    assert backend["backend"] == "mlflow" and backend["pending"] == 0, summary
    return backend["run_id"]


def _check_checkpoints(lab: Lab, state: dict) -> None:
    settings = load_settings(lab.config, env={})
    identity = pull("vla-demo", settings, progress=False).identity
    assert state["checkpoints"]
    for ckpt in state["checkpoints"]:
        path = lab.root / "checkpoints" / "vla" / ckpt["uuid"]
        meta = json.loads((path / "metadata.json").read_text())
        assert meta["steps_completed"] == ckpt["step"]
        ds = meta["det_lab"]["dataset"]
        assert (ds["project"], ds["md5"], ds["commit"], ds["path"]) == (
            "vla", identity.md5, identity.commit, identity.path)
        assert (path / "state_dict.pth").is_file()
        policy = json.loads((path / "vla_policy.json").read_text())
        assert set(policy["train_episodes"]).isdisjoint(policy["val_episodes"])
        code = {p.name for p in (path / "code").iterdir()}
        assert {"train.py", "model.py", "dataset.py"} <= code and "__pycache__" not in code


def test_default_config_trains_and_a_preempted_run_resumes_in_the_same_mlflow_run(demo_lab, shared_mlflow_server):
    """const.yaml as shipped but for its length, checkpoint period and reporting interval (``--set``;
    README's quick start, timed by bench/quickstart.py, runs it unmodified): Ctrl-C after a checkpoint, then ``--resume``
    trains to the end in the same run directory and MLflow run, and the held-out error falls."""
    total, sets = 240, ("--set", "data.det_lab.max_length.batches=240", "--set", "min_checkpoint_period.batches=40",
                        "--set", "data.det_lab.reporting_batches=20")
    const = yaml.safe_load((TEMPLATE / "const.yaml").read_text())
    before = set(_runs(demo_lab))
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", "vla", "--local", *sets],
                            env=demo_lab.env, cwd=demo_lab.config.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        run_dir = None
        while time.monotonic() < deadline and proc.poll() is None:
            new = set(_runs(demo_lab)) - before
            if new:
                run_dir = new.pop()
                state = json.loads((run_dir / "run.json").read_text())
                trained = [m["step"] for m in _metrics(run_dir, "training")] if (run_dir / "metrics.jsonl").exists() else []
                if state.get("latest_checkpoint") and trained and trained[-1] > state["latest_checkpoint_step"]:
                    break  # past the first checkpoint
            time.sleep(0.2)
        assert proc.poll() is None, "the run finished before it could be preempted: " + proc.communicate()[0]
        proc.send_signal(signal.SIGINT)  # Ctrl-C: det-lab asks the trial to checkpoint and stop
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run_dir is not None
    state = json.loads((run_dir / "run.json").read_text())
    stopped = state["latest_checkpoint_step"]
    assert 0 < stopped < total, out
    assert max(m["step"] for m in _metrics(run_dir, "training")) <= stopped
    first_run_id = _mlflow_run_id(run_dir)
    n_lines = len((run_dir / "metrics.jsonl").read_text().splitlines())

    resumed = demo_lab.cli("run", "vla", "--local", "--resume", check=True)
    assert f"resuming {run_dir.name} from checkpoint {state['latest_checkpoint']}" in resumed.stdout.replace("\n", " ")
    assert "finished" in resumed.stdout and f"{total} of {total} batches" in resumed.stdout
    after = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()[n_lines:]]
    assert after and min(m["step"] for m in after) > stopped  # continued, not restarted
    assert max(m["step"] for m in after) == total
    state = json.loads((run_dir / "run.json").read_text())
    assert state["latest_checkpoint_step"] == total and state["resumed"] == 1
    _check_checkpoints(demo_lab, state)

    # the default hyperparameters learn: the held-out action error falls across the two processes
    val = _metrics(run_dir, "validation")
    assert [m["step"] for m in val][-1] == total and len(val) >= 4
    first, last = val[0]["metrics"]["val_action_l1"], val[-1]["metrics"]["val_action_l1"]
    assert last < 0.7 * first, [m["metrics"]["val_action_l1"] for m in val]
    assert _metrics(run_dir, "training")[-1]["step"] == total

    assert _mlflow_run_id(run_dir) == first_run_id
    client = MlflowClient(shared_mlflow_server.uri)
    run = client.get_run(first_run_id)
    assert run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(first_run_id, "validation/val_action_l1"))
    assert history == [(m["step"], pytest.approx(m["metrics"]["val_action_l1"])) for m in val]
    assert min(s for s, _ in history) <= stopped and max(s for s, _ in history) == total
    assert len(client.get_metric_history(first_run_id, "training/loss")) == len(_metrics(run_dir, "training"))
    assert run.data.params["model.d_model"] == str(const["hyperparameters"]["model"]["d_model"])
    print(f"\nconst.yaml ({total} batches): val_action_l1 {first:.4f} -> {last:.4f}")
