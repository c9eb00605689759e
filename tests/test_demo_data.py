"""The demo dataset generators: determinism, LeRobot v3.0/v2.1 layouts, learnability, COLMAP."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from det_lab.data.demo import make_3dgs_demo, make_vla_demo, make_vla_demo_v21

IMAGE_KEY = "observation.images.front"
COLORS = ("red", "green", "blue")


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _image_file(root: Path, info: dict[str, Any], episode_index: int, frame_index: int) -> Path:
    rel = info["image_path"].format(
        image_key=IMAGE_KEY, episode_index=episode_index, frame_index=frame_index
    )
    return root / rel


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vla_demo(tmp_path_factory.mktemp("v3") / "ds")


@pytest.fixture(scope="module")
def v21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vla_demo_v21(tmp_path_factory.mktemp("v21") / "ds")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        fmt: make_3dgs_demo(tmp_path_factory.mktemp(fmt) / "scene", fmt=fmt)  # type: ignore[arg-type]
        for fmt in ("text", "binary")
    }


# --- determinism ---------------------------------------------------------------------------

MAKERS: dict[str, Callable[..., Path]] = {
    "vla_v3": lambda dest, **kw: make_vla_demo(dest, episodes=4, frames_per_episode=12, **kw),
    "vla_v21": lambda dest, **kw: make_vla_demo_v21(dest, episodes=4, frames_per_episode=12, **kw),
    "3dgs_text": lambda dest, **kw: make_3dgs_demo(dest, n_views=4, fmt="text", **kw),
    "3dgs_binary": lambda dest, **kw: make_3dgs_demo(dest, n_views=4, fmt="binary", **kw),
}


@pytest.mark.parametrize("kind", MAKERS)
def test_same_seed_same_bytes_other_seed_other_bytes(kind: str, tmp_path: Path) -> None:
    make = MAKERS[kind]
    first = _hashes(make(tmp_path / "a", seed=3))
    assert first == _hashes(make(tmp_path / "b", seed=3))
    other = _hashes(make(tmp_path / "c", seed=4))
    assert other.keys() == first.keys()
    changed = [rel for rel in first if first[rel] != other[rel]]
    assert any(rel.endswith(".png") for rel in changed)
    assert any(rel.endswith((".parquet", ".txt", ".bin")) for rel in changed)


@pytest.mark.parametrize("kind", MAKERS)
def test_refuses_a_non_empty_destination(kind: str, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        MAKERS[kind](tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        MAKERS[kind](tmp_path / "file")

    (tmp_path / "empty").mkdir()
    assert MAKERS[kind](tmp_path / "empty") == tmp_path / "empty"


# --- LeRobot v3.0 --------------------------------------------------------------------------


def test_v3_layout(v3: Path) -> None:
    info = json.loads((v3 / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] is None
    assert info["chunks_size"] == 1000 and info["fps"] == 10
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (12, 480, 3)
    assert info["splits"] == {"train": "0:12"}
    features = info["features"]
    assert features[IMAGE_KEY] == {
        "dtype": "image",
        "shape": [32, 32, 3],
        "names": ["height", "width", "channels"],
    }
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index", "next.done"):
        assert features[key]["shape"] == [1]

    tasks = _rows(v3 / "meta" / "tasks.parquet")
    assert [t["task_index"] for t in tasks] == [0, 1, 2]
    assert all(any(c in t["task"] for c in COLORS) for t in tasks)

    table = pq.read_table(v3 / info["data_path"].format(chunk_index=0, file_index=0))
    assert table.num_rows == info["total_frames"]
    assert table.schema.metadata is None or b"pandas" not in table.schema.metadata
    assert table.schema.field("timestamp").type == pa.float32()
    assert table.schema.field("observation.state").type == pa.list_(pa.float32())
    assert table.schema.field("next.done").type == pa.bool_()
    frames = table.to_pydict()
    assert frames["index"] == list(range(480))
    for key in ("observation.state", "action"):
        assert {len(v) for v in frames[key]} == {features[key]["shape"][0]}

    episodes = _rows(v3 / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert [e["episode_index"] for e in episodes] == list(range(12))
    task_of = {t["task_index"]: t["task"] for t in tasks}
    end = 0
    for ep in episodes:
        assert (ep["data/chunk_index"], ep["data/file_index"]) == (0, 0)
        assert ep["dataset_from_index"] == end
        end = ep["dataset_to_index"]
        rows = range(ep["dataset_from_index"], end)
        assert len(rows) == ep["length"] == 40
        assert {frames["episode_index"][i] for i in rows} == {ep["episode_index"]}
        assert [frames["frame_index"][i] for i in rows] == list(range(40))
        assert [frames["next.done"][i] for i in rows] == [False] * 39 + [True]
        assert ep["tasks"] == [task_of[frames["task_index"][rows[0]]]]
    assert end == info["total_frames"]
    np.testing.assert_allclose(
        frames["timestamp"], np.asarray(frames["frame_index"]) / 10, rtol=0, atol=1e-6
    )

    for e, f in zip(frames["episode_index"], frames["frame_index"]):
        with Image.open(_image_file(v3, info, e, f)) as image:
            assert (image.format, image.mode, image.size) == ("PNG", "RGB", (32, 32))
    assert len(list((v3 / "images").rglob("*.png"))) == info["total_frames"]

    stats = json.loads((v3 / "meta" / "stats.json").read_text())
    assert set(stats) == set(features)
    for key, ft in features.items():
        assert {"mean", "std", "min", "max"} <= set(stats[key])
        if ft["dtype"] == "image":
            assert np.asarray(stats[key]["mean"]).shape == (3, 1, 1)
        else:
            assert len(stats[key]["mean"]) == ft["shape"][0]
    state = np.asarray(frames["observation.state"])
    np.testing.assert_allclose(stats["observation.state"]["mean"], state.mean(0), atol=1e-6)


def test_v3_respects_sizes(tmp_path: Path) -> None:
    root = make_vla_demo(tmp_path / "ds", episodes=2, frames_per_episode=7, image_size=24)
    info = json.loads((root / "meta" / "info.json").read_text())
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (2, 14, 2)
    assert info["features"][IMAGE_KEY]["shape"] == [24, 24, 3]
    assert len(_rows(root / "meta" / "tasks.parquet")) == 2
    with Image.open(_image_file(root, info, 1, 6)) as image:
        assert image.size == (24, 24)


# --- LeRobot v2.1 --------------------------------------------------------------------------


def test_v21_layout_matches_v3_content(v21: Path, v3: Path) -> None:
    info = json.loads((v21 / "meta" / "info.json").read_text())
    info3 = json.loads((v3 / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.1"
    assert info["data_path"] == "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    assert info["features"] == info3["features"]
    assert info["image_path"] == info3["image_path"]

    tasks = _read_jsonl(v21 / "meta" / "tasks.jsonl")
    assert tasks == _rows(v3 / "meta" / "tasks.parquet")
    episodes = _read_jsonl(v21 / "meta" / "episodes.jsonl")
    assert [e["episode_index"] for e in episodes] == list(range(info["total_episodes"]))
    episodes_stats = _read_jsonl(v21 / "meta" / "episodes_stats.jsonl")
    assert [e["episode_index"] for e in episodes_stats] == list(range(info["total_episodes"]))

    files = sorted((v21 / "data").rglob("*.parquet"))
    assert len(files) == info["total_episodes"]
    tables = []
    for ep in episodes:
        path = v21 / info["data_path"].format(episode_chunk=0, episode_index=ep["episode_index"])
        table = pq.read_table(path)
        assert table.num_rows == ep["length"]
        assert set(table.column("episode_index").to_pylist()) == {ep["episode_index"]}
        tables.append(table)
    v3_frames = pq.read_table(v3 / "data" / "chunk-000" / "file-000.parquet")
    assert pa.concat_tables(tables).equals(v3_frames)

    images = {k: h for k, h in _hashes(v21).items() if k.startswith("images/")}
    assert images == {k: h for k, h in _hashes(v3).items() if k.startswith("images/")}
    assert (v21 / "meta" / "stats.json").read_bytes() == (v3 / "meta" / "stats.json").read_bytes()


# --- learnability --------------------------------------------------------------------------


def _block_centre(image: np.ndarray, color: str) -> tuple[float, float]:
    """Table coordinates of the block of ``color``, found by thresholding the image."""
    r, g, b = (image[..., i].astype(int) for i in range(3))
    masks = {
        "red": (r > 150) & (g < 120) & (b < 120),
        "green": (g > 150) & (r < 120) & (b < 120),
        "blue": (b > 150) & (r < 120) & (g < 150),
    }
    rows, cols = np.nonzero(masks[color])
    size = image.shape[0]
    return (cols.mean() + 0.5) / size * 2 - 1, 1 - (rows.mean() + 0.5) / size * 2


def _r2(features: np.ndarray, targets: np.ndarray) -> float:
    x = np.c_[features, np.ones(len(features))]
    weights, *_ = np.linalg.lstsq(x, targets, rcond=None)
    return float(1 - (targets - x @ weights).var(0).sum() / targets.var(0).sum())


def test_actions_are_predictable_from_image_state_and_instruction(v3: Path) -> None:
    info = json.loads((v3 / "meta" / "info.json").read_text())
    frames = pq.read_table(v3 / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    task_color = {
        t["task_index"]: next(c for c in COLORS if c in t["task"])
        for t in _rows(v3 / "meta" / "tasks.parquet")
    }
    state = np.asarray(frames["observation.state"])
    action = np.asarray(frames["action"])
    # The reaching phase: gripper open and staying open.
    reach = np.flatnonzero((state[:, 3] == 0) & (action[:, 3] == 0))
    assert len(reach) > 100
    targets = []
    for i in reach:
        path = _image_file(v3, info, frames["episode_index"][i], frames["frame_index"][i])
        with Image.open(path) as image:
            targets.append(_block_centre(np.asarray(image), task_color[frames["task_index"][i]]))
    to_target = np.asarray(targets) - state[reach, :2]
    velocity = action[reach, :2]

    with_vision = _r2(to_target, velocity)
    one_hot = np.eye(3)[np.asarray(frames["task_index"])[reach]]
    blind = _r2(np.c_[state[reach], one_hot], velocity)
    assert with_vision > 0.7
    assert with_vision - blind > 0.3  # the image carries the goal; state + task alone do not

    done = np.flatnonzero(np.asarray(frames["next.done"]))
    assert np.mean(state[done, 3] == 1) > 0.9  # nearly every episode ends with a grasp


# --- 3DGS / COLMAP -------------------------------------------------------------------------


def _data_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().split("\n")[:-1] if not line.startswith("#")]


def _read_text_model(sparse: Path) -> dict[str, Any]:
    (camera,) = [line.split() for line in _data_lines(sparse / "cameras.txt")]
    camera_id, model, width, height, *params = camera
    cameras = {int(camera_id): (model, int(width), int(height), [float(p) for p in params])}
    lines = _data_lines(sparse / "images.txt")
    images = {}
    for header, obs in zip(lines[::2], lines[1::2]):
        f = header.split()
        o = np.asarray(obs.split(), dtype=float).reshape(-1, 3)
        images[int(f[0])] = {
            "qvec": [float(v) for v in f[1:5]],
            "tvec": [float(v) for v in f[5:8]],
            "camera_id": int(f[8]),
            "name": f[9],
            "xys": o[:, :2],
            "point3d_ids": o[:, 2].astype(np.int64),
        }
    points = {}
    for line in _data_lines(sparse / "points3D.txt"):
        f = line.split()
        points[int(f[0])] = {
            "xyz": [float(v) for v in f[1:4]],
            "rgb": [int(v) for v in f[4:7]],
            "error": float(f[7]),
            "track": [(int(a), int(b)) for a, b in zip(f[8::2], f[9::2])],
        }
    return {"cameras": cameras, "images": images, "points": points}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def name(self) -> str:
        end = self.data.index(b"\x00", self.pos)
        name, self.pos = self.data[self.pos : end].decode(), end + 1
        return name


def _read_binary_model(sparse: Path) -> dict[str, Any]:
    r = _Reader((sparse / "cameras.bin").read_bytes())
    cameras = {}
    for _ in range(r.take("Q")[0]):
        camera_id, model_id, width, height = r.take("iiQQ")
        assert model_id == 1  # PINHOLE
        cameras[camera_id] = ("PINHOLE", width, height, list(r.take("4d")))
    assert r.pos == len(r.data)

    r = _Reader((sparse / "images.bin").read_bytes())
    images = {}
    for _ in range(r.take("Q")[0]):
        image_id, *pose, camera_id = r.take("i7di")
        name = r.name()
        (n,) = r.take("Q")
        obs = [r.take("ddq") for _ in range(n)]
        images[image_id] = {
            "qvec": pose[:4],
            "tvec": pose[4:],
            "camera_id": camera_id,
            "name": name,
            "xys": np.asarray([o[:2] for o in obs], dtype=float).reshape(-1, 2),
            "point3d_ids": np.asarray([o[2] for o in obs], dtype=np.int64),
        }
    assert r.pos == len(r.data)

    r = _Reader((sparse / "points3D.bin").read_bytes())
    points = {}
    for _ in range(r.take("Q")[0]):
        point_id, x, y, z, red, green, blue, error, n = r.take("Q3d3BdQ")
        track = [r.take("ii") for _ in range(n)]
        points[point_id] = {"xyz": [x, y, z], "rgb": [red, green, blue], "error": error, "track": track}
    assert r.pos == len(r.data)
    return {"cameras": cameras, "images": images, "points": points}


def _qvec_to_rotmat(q: list[float]) -> np.ndarray:
    w, x, y, z = q
    return np.array([
        [1 - 2 * y * y - 2 * z * z, 2 * x * y - 2 * w * z, 2 * x * z + 2 * w * y],
        [2 * x * y + 2 * w * z, 1 - 2 * x * x - 2 * z * z, 2 * y * z - 2 * w * x],
        [2 * x * z - 2 * w * y, 2 * y * z + 2 * w * x, 1 - 2 * x * x - 2 * y * y],
    ])


def test_3dgs_layout_and_text_binary_agree(scenes: dict[str, Path]) -> None:
    text_dir, binary_dir = scenes["text"] / "sparse" / "0", scenes["binary"] / "sparse" / "0"
    assert sorted(p.name for p in text_dir.iterdir()) == ["cameras.txt", "images.txt", "points3D.txt"]
    assert sorted(p.name for p in binary_dir.iterdir()) == ["cameras.bin", "images.bin", "points3D.bin"]
    for scene in scenes.values():
        names = sorted(p.name for p in (scene / "images").iterdir())
        assert names == [f"view_{i:03d}.png" for i in range(16)]
        with Image.open(scene / "images" / names[0]) as image:
            assert (image.mode, image.size) == ("RGB", (64, 64))
            assert np.asarray(image).max() > 100  # the blobs are in view
    text, binary = _read_text_model(text_dir), _read_binary_model(binary_dir)

    assert text["cameras"] == binary["cameras"] == {1: ("PINHOLE", 64, 64, [64.0, 64.0, 32.0, 32.0])}
    assert text["images"].keys() == binary["images"].keys() == set(range(1, 17))
    for image_id, t in text["images"].items():
        b = binary["images"][image_id]
        assert (t["name"], t["camera_id"]) == (b["name"], b["camera_id"])
        assert t["qvec"] == list(b["qvec"]) and t["tvec"] == list(b["tvec"])
        np.testing.assert_array_equal(t["xys"], b["xys"])
        np.testing.assert_array_equal(t["point3d_ids"], b["point3d_ids"])
    assert len(text["points"]) == len(binary["points"]) == 200
    for point_id, t in text["points"].items():
        b = binary["points"][point_id]
        assert (t["xyz"], t["rgb"], t["error"]) == (b["xyz"], b["rgb"], b["error"])
        assert t["track"] == [tuple(o) for o in b["track"]]
        for image_id, idx in t["track"]:  # tracks and POINTS2D reference each other
            assert text["images"][image_id]["point3d_ids"][idx] == point_id


def test_3dgs_points_project_into_the_images(scenes: dict[str, Path]) -> None:
    model = _read_text_model(scenes["text"] / "sparse" / "0")
    (_, width, height, (fx, fy, cx, cy)), = model["cameras"].values()
    ids = sorted(model["points"])
    xyz = np.asarray([model["points"][i]["xyz"] for i in ids])
    inside = []
    for image in model["images"].values():
        rot = _qvec_to_rotmat(image["qvec"])
        np.testing.assert_allclose(rot @ rot.T, np.eye(3), atol=1e-9)
        cam = xyz @ rot.T + np.asarray(image["tvec"])
        assert (cam[:, 2] > 0).all()  # the scene is in front of every camera
        uv = np.c_[fx * cam[:, 0] / cam[:, 2] + cx, fy * cam[:, 1] / cam[:, 2] + cy]
        inside.append((uv[:, 0] >= 0) & (uv[:, 0] < width) & (uv[:, 1] >= 0) & (uv[:, 1] < height))
        # Observed keypoints sit (up to SfM-like noise) where their 3D points project.
        rows = np.searchsorted(ids, image["point3d_ids"])
        assert np.abs(image["xys"] - uv[rows]).max() < 2.0
    assert np.mean(inside) > 0.9

    # The scene's centre (the origin) projects to the principal point of every view.
    for image in model["images"].values():
        cam = np.asarray(image["tvec"])
        np.testing.assert_allclose([fx * cam[0] / cam[2] + cx, fy * cam[1] / cam[2] + cy], [cx, cy])
