"""Frame identity: every item of a LeRobot-written video dataset is the frame of its own index.

LeRobot itself writes the videos (0.4.x: v3.0, many episodes per file, so episodes start at
``from_timestamp > 0``; 0.3.3: v2.1, one file per episode) at 10, 15 and 30 fps, AV1 and h264.
Every frame *encodes its own identity* in black and white bars (frame index, episode, camera),
so a neighbouring frame can never pass as the right one, whatever a codec does to the pixels.
For every item and every decoder (torchcodec, PyAV) the index decoded from det_lab's image must
equal the item's own frame index, episode and camera, and what LeRobot's reader returns.

Episodes are 23/15/40/7/31 frames long: long enough that float32 timestamps land a hair before
their frame (``float32(0.7) < 0.7``), which a reader asking for "the frame shown at t" turns
into the previous frame. (The LeRobot comparison in test_lerobot_foreign.py could not see that:
its episodes of 5-7 frames at 10 fps end at 0.6 s, and float32 rounds 0.1 .. 0.6 upwards.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from det_lab.formats import LeRobotDataset, LeRobotDatasetError
from det_lab.formats import video as video_mod
from tests.lerobot_writer import finish, import_lerobot_dataset, run_lerobot, skip_without_lerobot, v21_library

pytestmark = skip_without_lerobot()

CAMERAS = ("observation.images.front", "observation.images.wrist")
LENGTHS = (23, 15, 40, 7, 31)
H, W = 48, 64
#: (name, codebase version, fps, codec): LeRobot 0.3.3 always writes AV1
DATASETS = [("v30-10fps-av1", "v3.0", 10, "libsvtav1"), ("v30-15fps-av1", "v3.0", 15, "libsvtav1"),
            ("v30-30fps-h264", "v3.0", 30, "h264"), ("v21-10fps", "v2.1", 10, None), ("v21-30fps", "v2.1", 30, None)]
DECODERS = ("torchcodec", "pyav")


# --- the pattern: 8 bars per band, black or white --------------------------------------------------


def encode(frame: int, episode: int, camera: int) -> np.ndarray:
    """An HxWx3 image whose top band holds ``frame`` in 8 bits, the bottom ``episode*2 + camera``."""
    image = np.zeros((H, W, 3), np.uint8)
    for band, value in enumerate((frame, episode * 2 + camera)):
        for bit in range(8):
            if value >> bit & 1:
                image[band * H // 2:(band + 1) * H // 2, bit * W // 8:(bit + 1) * W // 8] = 255
    return image


def decode(image: np.ndarray) -> tuple[int, int, int]:
    """(frame, episode, camera) from an image in any layout (HWC/CHW, uint8 or [0, 1] floats)."""
    a = np.asarray(image, dtype=np.float64)
    if a.shape[0] == 3:
        a = a.transpose(1, 2, 0)
    if a.max() <= 1.0:
        a = a * 255
    gray = a.mean(axis=2)
    values = []
    for band in range(2):
        value = 0
        for bit in range(8):
            # the middle of each bar: codecs smear the edges
            block = gray[band * H // 2 + 4:(band + 1) * H // 2 - 4, bit * W // 8 + 2:(bit + 1) * W // 8 - 2]
            value |= int(block.mean() > 127) << bit
        values.append(value)
    return values[0], values[1] // 2, values[1] % 2


def test_the_pattern_round_trips() -> None:
    seen = {decode(encode(f, e, c)) for f in range(40) for e in range(5) for c in range(2)}
    assert len(seen) == 400 and (39, 4, 1) in seen


# --- run in a subprocess: LeRobot writes, then reads back -------------------------------------------


def _write(cls: Any, root: Path, fps: int, codec: str | None) -> None:
    import inspect

    features = {"observation.state": {"dtype": "float32", "shape": (2,), "names": None},
                "action": {"dtype": "float32", "shape": (2,), "names": None},
                **{cam: {"dtype": "video", "shape": (H, W, 3), "names": ["height", "width", "channels"]}
                   for cam in CAMERAS}}
    extra = {"vcodec": codec} if codec and "vcodec" in inspect.signature(cls.create).parameters else {}
    ds = cls.create("local/frames", fps=fps, features=features, root=root, use_videos=True, **extra)
    task_argument = "task" in inspect.signature(ds.add_frame).parameters  # 0.3.x: add_frame(frame, task)
    for ep, length in enumerate(LENGTHS):
        for t in range(length):
            frame = {"observation.state": np.array([ep, t], np.float32), "action": np.array([t, ep], np.float32),
                     **{cam: encode(t, ep, c) for c, cam in enumerate(CAMERAS)}}
            if task_argument:
                ds.add_frame(frame, task="count")
            else:
                ds.add_frame({**frame, "task": "count"})
        ds.save_episode()
    if hasattr(ds, "finalize"):
        ds.finalize()


def _read(cls: Any, root: Path) -> list[list[Any]]:
    """Per item: LeRobot's episode, frame index and the identity decoded from each camera."""
    ds = cls("local/frames", root=root)
    out = []
    for i in range(len(ds)):
        item = ds[i]
        out.append([int(item["episode_index"]), int(item["frame_index"]),
                    [list(decode(item[cam].numpy())) for cam in CAMERAS]])
    return out


def _main(out: str, specs: str) -> None:
    cls = import_lerobot_dataset()
    for name, fps, codec in json.loads(specs):
        root = Path(out) / name
        _write(cls, root / "dataset", fps, codec)
        (root / "lerobot.json").write_text(json.dumps(_read(cls, root / "dataset")))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    """{name: directory with dataset/ and lerobot.json}, written and read back by LeRobot."""
    v21_lib = v21_library(request.config)
    out = tmp_path_factory.mktemp("frames")
    by_version = {v: [[n, fps, codec] for n, vv, fps, codec in DATASETS if vv == v] for v in ("v3.0", "v2.1")}

    def write(version: str) -> subprocess.Popen:
        for name, _, _ in by_version[version]:
            shutil.rmtree(out / name, ignore_errors=True)
        return run_lerobot(__file__, [str(out), json.dumps(by_version[version])],
                           v21_lib if version == "v2.1" else None)

    procs = {version: write(version) for version in by_version}  # both at once: two cores
    for version, proc in procs.items():
        finish(proc, lambda version=version: write(version), version)
    for name, version, _, _ in DATASETS:
        info = json.loads((out / name / "dataset/meta/info.json").read_text())
        assert info["codebase_version"] == version
    return {name: out / name for name, *_ in DATASETS}


# --- identity, for every item and every decoder -------------------------------------------------------


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", [d[0] for d in DATASETS])
def test_every_item_is_its_own_frame(written: dict[str, Path], name: str, decoder: str) -> None:
    theirs = json.loads((written[name] / "lerobot.json").read_text())
    ds = LeRobotDataset(written[name] / "dataset", video_decoder=decoder)
    assert ds.video_decoder == decoder and len(ds) == sum(LENGTHS) == len(theirs)
    wrong = []
    for i in range(len(ds)):
        item = ds[i]
        episode, frame = item["episode_index"], item["frame_index"]
        assert [episode, frame] == theirs[i][:2]  # the same item, row for row
        ours = [list(decode(item[cam])) for cam in CAMERAS]
        expected = [[frame, episode, c] for c in range(len(CAMERAS))]
        if ours != expected or theirs[i][2] != expected:
            wrong.append((i, episode, frame, ours, theirs[i][2]))
    assert not wrong, f"{len(wrong)} items are not their own frame (item, episode, frame, det_lab, LeRobot): {wrong[:5]}"


@pytest.mark.parametrize("tolerance_s", [video_mod.DEFAULT_TOLERANCE_S, 0.1])
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("name", ["v30-15fps-av1", "v21-30fps"])
def test_items_read_backwards_and_shuffled_are_their_own_frames(written: dict[str, Path], name: str,
                                                               decoder: str, tolerance_s: float) -> None:
    """A training loader reads in random order: a step back (PyAV keeps the last two frames), a
    jump back or far ahead (a seek), and on v2.1 ten video files for eight open places. A loose
    tolerance (0.1 s: 1.5 and 3 frames) still gives the nearest frame, not one within tolerance."""
    ds = LeRobotDataset(written[name] / "dataset", video_decoder=decoder, tolerance_s=tolerance_s)
    order = [*range(len(ds) - 1, -1, -1), *np.random.default_rng(0).permutation(len(ds)).tolist()]
    wrong = []
    for i in order:
        item = ds[i]
        expected = [[item["frame_index"], item["episode_index"], c] for c in range(len(CAMERAS))]
        ours = [list(decode(item[cam])) for cam in CAMERAS]
        if ours != expected:
            wrong.append((i, ours, expected))
    assert not wrong, f"{len(wrong)} of {len(order)} reads are not their own frame (item, det_lab, expected): {wrong[:5]}"


def test_the_datasets_have_the_cases_that_broke(written: dict[str, Path]) -> None:
    """Episodes that start inside a file, and float32 timestamps a hair before their frame: with
    them, asking torchcodec for the frame *played at* the timestamp (the old reader) gets the
    previous frame for some items, on every dataset."""
    from torchcodec.decoders import VideoDecoder

    for name, version, fps, _ in DATASETS:
        ds = LeRobotDataset(written[name] / "dataset", cameras=CAMERAS[:1])
        if version == "v3.0":
            offsets = sorted({e.video[CAMERAS[0]][1] for e in ds.episodes.values()})
            assert len(offsets) == len(LENGTHS) and offsets[0] == 0 and offsets[1] > 0
        played_at = []
        for i in range(len(ds)):
            row = int(ds._items[i])
            path, offset = ds.episodes[int(ds.episode_index[row])].video[CAMERAS[0]]
            frames = VideoDecoder(str(path)).get_frames_played_at(seconds=[offset + float(ds.timestamp[row])])
            played_at.append(decode(frames.data[0].numpy())[0] != int(ds.frame_index[row]))
        assert any(played_at), f"{name}: no item where 'played at' picks another frame"
        if fps == 10:  # the report's case: about a third of the items
            assert sum(played_at) / len(played_at) > 0.25, f"{name}: {sum(played_at)} of {len(played_at)}"


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_timestamp_between_frames_is_refused(written: dict[str, Path], tmp_path: Path, decoder: str) -> None:
    root = shutil.copytree(written["v30-15fps-av1"] / "dataset", tmp_path / "ds")
    data = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    ts = table.column("timestamp").to_numpy().copy()
    ts[30] += 0.4 / 15  # 0.4 of a frame late: nearer its own frame than the next, but out of tolerance
    table = table.set_column(table.schema.get_field_index("timestamp"), "timestamp",
                             pa.array(ts, type=table.schema.field("timestamp").type))
    pq.write_table(table, data)
    ds = LeRobotDataset(root, video_decoder=decoder)
    with pytest.raises(LeRobotDatasetError) as info:
        ds[30]
    message = str(info.value)
    assert "\n" not in message and "episode 1, frame 7" in message and "no frame within 0.0001 s" in message
    assert decode(ds[29][CAMERAS[0]]) == (6, 1, 0) and decode(ds[31][CAMERAS[0]]) == (8, 1, 0)
    # a dataset that says its timestamps are looser is read, to the nearest frame
    assert decode(LeRobotDataset(root, video_decoder=decoder, tolerance_s=0.5 / 15)[30][CAMERAS[0]]) == (7, 1, 0)


def _write_with_pyav(path: Path, frames: int, first: int, fps: int = 30) -> None:
    """An MPEG-4 video written by PyAV, not LeRobot, whose frame k (``encode(k, 0, 0)``) is
    presented at ``(first + k) / fps``: its first frame is not at 0 s."""
    import fractions

    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, fps)
        stream.options = {"qscale": "2"}
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(encode(k, 0, 0), format="rgb24")
            frame.pts, frame.time_base = first + k, fractions.Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_video_that_does_not_start_at_zero(tmp_path: Path, decoder: str) -> None:
    """Each decoder reads the frame nearest each timestamp of a video whose first frame is at 0.1 s,
    at LeRobot's tolerance and at one as wide as that offset (three frames)."""
    path = tmp_path / "late.mp4"
    _write_with_pyav(path, frames=20, first=3)
    order = [0, 1, 2, 19, 18, 10, 4, 9, 3, 15, 14, 13, 5]
    for tolerance_s in (video_mod.DEFAULT_TOLERANCE_S, 0.1):
        read = video_mod.reader(decoder)
        got = [decode(read.frame(path, float(np.float32((3 + k) / 30)), tolerance_s))[0] for k in order]
        assert got == order, f"tolerance {tolerance_s}: frames {got} for timestamps of frames {order}"


# --- a decoder that is installed but cannot load --------------------------------------------------------

_NO_FFMPEG = """
import sys
from det_lab.formats import LeRobotDataset, LeRobotDatasetError
from tests.test_video_frames import decode
if sys.argv[2] == "no-av":
    sys.modules["av"] = None  # PyAV not installed either
try:
    ds = LeRobotDataset(sys.argv[1])
    item = ds[30]
    print(ds.video_decoder, item["frame_index"], item["episode_index"], *decode(item["observation.images.wrist"]))
except LeRobotDatasetError as exc:
    print("error:", exc)
"""


def _without_system_ffmpeg(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` where the system's FFmpeg libraries cannot be loaded (hidden in a private mount
    namespace), as on a machine where pip installed torchcodec and nobody installed FFmpeg."""
    libs = [Path(p) for p in subprocess.run(["sh", "-c", "ldconfig -p | grep -o '/.*libav[a-z]*\\.so\\.[0-9]*$'"],
                                            capture_output=True, text=True).stdout.split()]
    if not libs:
        pytest.skip("FFmpeg's libraries are not installed here (tests/setup.sh installs libavcodec59 ...)")
    hide = " && ".join(f"mount --bind /dev/null {lib}" for lib in libs)
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f'{hide} && exec "$0" "$@"', sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0 and "unshare" in proc.stderr and "ermission" in proc.stderr:
        pytest.skip(f"cannot make a private mount namespace here: {proc.stderr.strip()}")
    return proc


def test_torchcodec_without_ffmpeg_falls_back_to_pyav(written: dict[str, Path]) -> None:
    root = written["v30-10fps-av1"] / "dataset"
    probe = _without_system_ffmpeg("import torchcodec.decoders")
    assert probe.returncode != 0 and "Could not load libtorchcodec" in probe.stderr  # the state of the report
    proc = _without_system_ffmpeg(_NO_FFMPEG, str(root), "with-av")
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoder, *identity = proc.stdout.split()
    assert (decoder, *map(int, identity)) == ("pyav", 7, 1, 7, 1, 1)  # item 30: episode 1's frame 7, camera 1

    proc = _without_system_ffmpeg(_NO_FFMPEG, str(root), "no-av")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr[-2000:]
    assert lines[0].startswith(f"error: {root / 'meta/info.json'}: cameras are stored as video and no video decoder works")
    assert "torchcodec installed but cannot load its FFmpeg libraries" in lines[0]
    assert "pyav not installed (pip install av" in lines[0]
    assert "truncated" not in lines[0]


def test_the_probe_names_an_unknown_decoder(written: dict[str, Path]) -> None:
    with pytest.raises(LeRobotDatasetError, match="no video decoder works here: vlc unknown decoder"):
        LeRobotDataset(written["v21-10fps"] / "dataset", video_decoder="vlc")
    assert video_mod.decoder_problem("pyav") is None and video_mod.decoder_problem("torchcodec") is None


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
