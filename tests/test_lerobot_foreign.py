"""det_lab's LeRobot reader on datasets that LeRobot itself wrote, and on damaged ones.

LeRobot writes the datasets (``LeRobotDataset.create``/``add_frame``/``save_episode``/
``finalize``): 0.4.x (installed with ``--no-deps``, see README) writes v3.0; 0.3.3, installed by
this module into pytest's cache (with datasets 3.6) beside it, writes v2.1 (``meta/episodes_stats.jsonl``, no
``meta/stats.json``). LeRobot's own reader then reads the same files, and det_lab's reader must
return the same frames, tasks, images and normalisation statistics. LeRobot runs in
subprocesses (this file is also their script), images and video both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from det_lab.formats import LeRobotDataset, LeRobotDatasetError
from tests.lerobot_writer import finish, import_lerobot_dataset, run_lerobot, skip_without_lerobot, v21_library

CAMERA = "observation.images.front"
KINDS = ("image", "video")
LENGTHS = (5, 6, 7)

pytestmark = skip_without_lerobot()


# --- run in a subprocess: LeRobot writes, then reads back ------------------------------------------


def _write_with_lerobot(cls: Any, root: Path, kind: str) -> None:
    import inspect

    features = {
        "observation.state": {"dtype": "float32", "shape": (3,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        CAMERA: {"dtype": kind, "shape": (24, 32, 3), "names": ["height", "width", "channels"]},
    }
    ds = cls.create("local/foreign", fps=10, features=features, root=root, use_videos=kind == "video")
    task_argument = "task" in inspect.signature(ds.add_frame).parameters  # 0.3.x: add_frame(frame, task)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:24, 0:32]
    for ep, length in enumerate(LENGTHS):
        for t in range(length):
            # smooth images, so that a lossy codec keeps them recognisable
            image = np.stack([(xx * 8 + t * 20) % 256, (yy * 10 + ep * 60) % 256, np.full_like(xx, 40 * t)], -1)
            frame = {"observation.state": rng.normal(size=3).astype(np.float32),
                     "action": rng.normal(size=2).astype(np.float32), CAMERA: image.astype(np.uint8)}
            task = f"task {ep % 2}: pick the {'red' if ep % 2 else 'blue'} block"
            if task_argument:
                ds.add_frame(frame, task=task)
            else:
                ds.add_frame({**frame, "task": task})
        ds.save_episode()
    if hasattr(ds, "finalize"):
        ds.finalize()


def _read_with_lerobot(cls: Any, root: Path, out: Path) -> None:
    ds = cls("local/foreign", root=root)
    items = [ds[i] for i in range(len(ds))]
    arrays = {key: np.stack([np.asarray(item[key]) for item in items])
              for key in ("observation.state", "action", CAMERA, "episode_index", "frame_index")}
    np.savez(out / "lerobot_items.npz", **arrays)
    stats = {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in ds.meta.stats.items()}
    (out / "lerobot_meta.json").write_text(json.dumps({"tasks": [item["task"] for item in items], "stats": stats}))


def _main(out: str) -> None:
    cls = import_lerobot_dataset()
    for kind in KINDS:
        root = Path(out) / kind
        _write_with_lerobot(cls, root / "dataset", kind)
        _read_with_lerobot(cls, root / "dataset", root)


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    """{"v3.0": dir, "v2.1": dir}, each with image/ and video/ written and read back by LeRobot."""
    v21_lib = v21_library(request.config)
    outs = {"v3.0": tmp_path_factory.mktemp("lerobot_v30"), "v2.1": tmp_path_factory.mktemp("lerobot_v21")}

    def write(version: str) -> subprocess.Popen:
        shutil.rmtree(outs[version], ignore_errors=True)
        outs[version].mkdir()
        return run_lerobot(__file__, [str(outs[version])], v21_lib if version == "v2.1" else None)

    procs = {version: write(version) for version in outs}  # both at once: two cores
    for version, proc in procs.items():
        finish(proc, lambda version=version: write(version), version)
    for version, out in outs.items():
        info = json.loads((out / "image" / "dataset" / "meta" / "info.json").read_text())
        assert info["codebase_version"] == version
    return outs


# --- det_lab reads what LeRobot wrote --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_reader_matches_lerobot_on_lerobot_written_dataset(written: dict[str, Path], version: str, kind: str) -> None:
    out = written[version] / kind
    theirs = np.load(out / "lerobot_items.npz")
    meta = json.loads((out / "lerobot_meta.json").read_text())
    ds = LeRobotDataset(out / "dataset", horizon=1)

    assert len(ds) == sum(LENGTHS) == len(theirs["action"])
    assert ds.episode_indices == [0, 1, 2]
    ours = [ds[i] for i in range(len(ds))]
    np.testing.assert_array_equal(np.stack([o["observation.state"] for o in ours]), theirs["observation.state"])
    np.testing.assert_array_equal(np.stack([o["action"][0] for o in ours]), theirs["action"])
    np.testing.assert_array_equal([o["episode_index"] for o in ours], theirs["episode_index"].ravel())
    np.testing.assert_array_equal([o["frame_index"] for o in ours], theirs["frame_index"].ravel())
    assert [o["task"] for o in ours] == meta["tasks"]
    assert ours[0]["task"] == "task 0: pick the blue block"
    images = np.stack([o[CAMERA] for o in ours])
    assert images.shape == theirs[CAMERA].shape == (sum(LENGTHS), 3, 24, 32)
    # PNG round trip: identical; video: the same frame decoded, up to colour conversion rounding
    np.testing.assert_allclose(images, theirs[CAMERA], atol=0 if kind == "image" else 2 / 255)
    assert not np.allclose(images[0], images[1])  # frames differ: not the same frame served twice

    if version == "v2.1":
        assert not (out / "dataset" / "meta" / "stats.json").exists()
        assert (out / "dataset" / "meta" / "episodes_stats.jsonl").is_file()
    for key in ("observation.state", "action", CAMERA):
        stats = ds.norm_stats(key)
        for stat in ("mean", "std", "min", "max"):
            np.testing.assert_allclose(stats[stat], np.asarray(meta["stats"][key][stat], dtype=np.float32),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{key} {stat}")


def test_v21_stats_aggregate_the_episodes_like_lerobot(written: dict[str, Path]) -> None:
    """Without stats.json the statistics are those of all frames, not of one episode."""
    ds = LeRobotDataset(written["v2.1"] / "image" / "dataset")
    actions = np.stack([ds[i]["action"][0] for i in range(len(ds))]).astype(np.float64)
    stats = ds.norm_stats("action")
    np.testing.assert_allclose(stats["mean"], actions.mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats["std"], actions.std(0), rtol=1e-4)
    np.testing.assert_array_equal(stats["min"], actions.min(0).astype(np.float32))
    np.testing.assert_array_equal(stats["max"], actions.max(0).astype(np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_vla_template_builds_its_policy_on_lerobot_v21(written: dict[str, Path], kind: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The user outcome behind the aggregated statistics: the VLA template trains on these files."""
    import torch
    import yaml

    template = Path(__file__).resolve().parents[1] / "experiment_templates" / "vla"
    monkeypatch.syspath_prepend(str(template))
    for name in ("model", "dataset"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from dataset import load_splits
    from model import VLAConfig, VLAPolicy

    hp = yaml.safe_load((template / "const.yaml").read_text())["hyperparameters"]  # constants only
    hp.update(val_episodes=1, resize=None)
    splits = load_splits(written["v2.1"] / kind / "dataset", hp)
    full = splits.full
    cfg = VLAConfig.from_hparams(hp["model"], state_dim=3, action_dim=2, horizon=hp["horizon"],
                                 image_shape=full.image_shape(CAMERA))
    policy = VLAPolicy(cfg, {k: full.norm_stats(k) for k in ("observation.state", "action", CAMERA)}, full.cameras)
    batch = torch.utils.data.default_collate([splits.train[i] for i in range(4)])
    out = policy(batch["images"], batch["state"], batch["text_ids"], batch["text_valid"], batch["action"],
                 batch["action_is_pad"])
    assert out["action"].shape == (4, hp["horizon"], 2) and torch.isfinite(out["loss"])
    out["loss"].backward()


# --- Arrow string types ------------------------------------------------------------------------------


def _recast_strings(path: Path, to: pa.DataType | str) -> None:
    """Rewrite a parquet file with every string (and list-of-string) column as another string type."""
    table = pq.read_table(path)
    for i, field in enumerate(table.schema):
        t = field.type
        inner = t.value_type if pa.types.is_list(t) else t
        if not (pa.types.is_string(inner) or pa.types.is_large_string(inner)):
            continue
        column = table.column(i)
        if to == "dictionary":
            if pa.types.is_list(t):
                continue  # parquet cannot store a list of dictionaries; the flat columns are the test
            new = column.dictionary_encode()
        else:
            new = column.cast(pa.list_(to) if pa.types.is_list(t) else to)
        table = table.set_column(i, field.name, new)
    pq.write_table(table, path)


@pytest.mark.parametrize("string_type", ["string", "large_string", "string_view", "dictionary"])
def test_v30_strings_of_every_arrow_type(written: dict[str, Path], tmp_path: Path, string_type: str) -> None:
    src = written["v3.0"] / "image" / "dataset"
    root = shutil.copytree(src, tmp_path / "ds")
    if int(pd.__version__.split(".")[0]) >= 3:  # the case of the bug report, as LeRobot writes it today
        assert pq.read_schema(src / "meta/tasks.parquet").field("__index_level_0__").type == pa.large_string()
    to = {"string": pa.string(), "large_string": pa.large_string(), "string_view": pa.string_view(),
          "dictionary": "dictionary"}[string_type]
    for path in [root / "meta/tasks.parquet", *sorted((root / "meta/episodes").rglob("*.parquet"))]:
        _recast_strings(path, to)
    written_type = pq.read_schema(root / "meta/tasks.parquet").field("__index_level_0__").type
    assert string_type in str(written_type)
    ds = LeRobotDataset(root)
    assert ds.tasks == {0: "task 0: pick the blue block", 1: "task 1: pick the red block"}
    assert ds.episodes[1].tasks == ("task 1: pick the red block",)
    assert ds[len(ds) - 1]["task"] == "task 0: pick the blue block"


def test_v30_stats_aggregate_from_episode_metadata_without_stats_json(written: dict[str, Path], tmp_path: Path) -> None:
    root = shutil.copytree(written["v3.0"] / "image" / "dataset", tmp_path / "ds")
    full = LeRobotDataset(root).norm_stats("observation.state")
    (root / "meta/stats.json").unlink()
    aggregated = LeRobotDataset(root).norm_stats("observation.state")
    for stat in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(aggregated[stat], full[stat], rtol=1e-5, atol=1e-6)


# --- damaged data: one line naming the file and episode ------------------------------------------------


def _one_line_error(ds: LeRobotDataset, index: int) -> str:
    with pytest.raises(LeRobotDatasetError) as info:
        ds[index]
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_corrupt_image_bytes_inside_parquet(written: dict[str, Path], tmp_path: Path) -> None:
    root = shutil.copytree(written["v3.0"] / "image" / "dataset", tmp_path / "ds")
    data = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    cells = table.column(CAMERA).to_pylist()
    cells[7] = {"bytes": cells[7]["bytes"][:40] + b"\x00garbage" * 4, "path": cells[7]["path"]}
    table = table.set_column(table.schema.get_field_index(CAMERA), CAMERA,
                             pa.array(cells, type=table.schema.field(CAMERA).type))
    pq.write_table(table, data)
    ds = LeRobotDataset(root)
    message = _one_line_error(ds, 7)
    assert str(data) in message and "episode 1, frame 2" in message and "corrupt image" in message
    ds[6]  # the other frames still read


def test_corrupt_and_missing_image_files(tmp_path: Path) -> None:
    from det_lab.data.demo import make_vla_demo_v21

    root = make_vla_demo_v21(tmp_path / "ds")
    ds = LeRobotDataset(root)
    row = ds.episodes[1].start + 3
    image = ds._image_file(CAMERA, row)
    image.write_bytes(image.read_bytes()[:60])  # truncated PNG
    message = _one_line_error(ds, row)
    assert message.startswith(f"{image}: corrupt image") and "episode 1, frame 3" in message
    image.write_text("not an image at all")
    assert "corrupt image" in _one_line_error(ds, row)
    image.unlink()
    assert "missing image" in _one_line_error(ds, row)


@pytest.mark.parametrize("decoder", ["torchcodec", "pyav"])
def test_truncated_and_non_video_mp4(written: dict[str, Path], tmp_path: Path, decoder: str) -> None:
    root = shutil.copytree(written["v3.0"] / "video" / "dataset", tmp_path / "ds")
    video = root / "videos" / CAMERA / "chunk-000/file-000.mp4"
    blob = video.read_bytes()
    video.write_bytes(blob[: len(blob) // 3])
    ds = LeRobotDataset(root, video_decoder=decoder)
    message = _one_line_error(ds, len(ds) - 1)
    assert message.startswith(f"{video}: ") and "episode 2, frame 6" in message

    video.write_text("this is a text file, not a video\n")
    ds = LeRobotDataset(root, video_decoder=decoder)
    message = _one_line_error(ds, 0)
    assert message.startswith(f"{video}: ") and "episode 0, frame 0" in message


def test_pyav_fallback_decodes_the_same_frames(written: dict[str, Path]) -> None:
    out = written["v3.0"] / "video"
    theirs = np.load(out / "lerobot_items.npz")[CAMERA]
    ds = LeRobotDataset(out / "dataset", video_decoder="pyav")
    rows = [0, 4, 5, len(ds) - 1]  # first and last frame of an episode, the next episode's first
    np.testing.assert_allclose(np.stack([ds[i][CAMERA] for i in rows]), theirs[rows], atol=2 / 255)


@pytest.mark.parametrize("decoder", ["torchcodec", "pyav"])
def test_video_shorter_than_its_metadata(written: dict[str, Path], tmp_path: Path, decoder: str) -> None:
    """v2.1 keeps one video per episode: give episode 2 (7 frames) the video of episode 0 (5)."""
    root = shutil.copytree(written["v2.1"] / "video" / "dataset", tmp_path / "ds")
    videos = root / "videos/chunk-000" / CAMERA
    shutil.copy(videos / "episode_000000.mp4", videos / "episode_000002.mp4")
    ds = LeRobotDataset(root, video_decoder=decoder)
    start = ds.episodes[2].start
    ds[start + 4]  # within the short video
    message = _one_line_error(ds, start + 6)
    assert message.startswith(f"{videos / 'episode_000002.mp4'}: ")
    assert "episode 2, frame 6" in message and "shorter than the dataset's metadata" in message


if __name__ == "__main__":
    _main(sys.argv[1])
