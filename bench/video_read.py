"""Frames per second through det_lab's LeRobot reader against LeRobot's own, on one LeRobot-written
video dataset, side by side in one run.

LeRobot (0.4.x, installed by tests/setup.sh) writes a v3.0 dataset with one camera (AV1, as
LeRobot writes by default), then both readers serve every item of it through a torch DataLoader:
in order and shuffled, with 1 and 4 loader workers. det_lab is measured with each decoder
(torchcodec, PyAV); LeRobot with its default (torchcodec). Printed: frames/s per case and the
ratio det_lab / LeRobot.

    python bench/video_read.py [--episodes 8 --length 150 --fps 30 --size 96x128 --reps 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.lerobot_writer import import_lerobot_dataset  # noqa: E402

CAMERA = "observation.images.front"


def write(root: Path, episodes: int, length: int, fps: int, h: int, w: int) -> None:
    cls = import_lerobot_dataset()
    features = {"observation.state": {"dtype": "float32", "shape": (4,), "names": None},
                "action": {"dtype": "float32", "shape": (4,), "names": None},
                CAMERA: {"dtype": "video", "shape": (h, w, 3), "names": ["height", "width", "channels"]}}
    ds = cls.create("bench/video", fps=fps, features=features, root=root, use_videos=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:h, 0:w]
    for ep in range(episodes):
        for t in range(length):
            image = np.stack([(xx * 3 + t * 5) % 256, (yy * 4 + ep * 30) % 256, (xx + yy + t) % 256], -1)
            ds.add_frame({"observation.state": rng.normal(size=4).astype(np.float32),
                          "action": rng.normal(size=4).astype(np.float32),
                          CAMERA: image.astype(np.uint8), "task": "bench"})
        ds.save_episode()
    ds.finalize()


class _Images(torch.utils.data.Dataset):
    """Only the camera of each item: what is measured is the video read."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return torch.as_tensor(self.ds[i][CAMERA])


def _reader(kind: str, root: Path):
    if kind == "lerobot":
        return import_lerobot_dataset()("bench/video", root=root)
    from det_lab.formats import LeRobotDataset

    return LeRobotDataset(root, video_decoder=kind.removeprefix("det_lab-"))


def frames_per_second(kind: str, root: Path, shuffle: bool, workers: int, reps: int) -> float:
    best = 0.0
    for rep in range(reps):
        ds = _Images(_reader(kind, root))
        loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=shuffle, num_workers=workers,
                                             generator=torch.Generator().manual_seed(rep),
                                             multiprocessing_context="fork" if workers else None)
        start = time.perf_counter()
        n = sum(len(batch) for batch in loader)
        best = max(best, n / (time.perf_counter() - start))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--length", type=int, default=150)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--size", default="96x128")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workers", default="1,4")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on 2 CPUs: on purpose
    h, w = map(int, args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "dataset"
        # LeRobot writes in a child process: its encoder threads stay out of the measurements
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        writer = subprocess.run([sys.executable, __file__, "--write", str(root), str(args.episodes), str(args.length),
                                 str(args.fps), str(h), str(w)], env=env, capture_output=True, text=True)
        if writer.returncode != 0:
            raise SystemExit(f"LeRobot could not write the dataset:\n{writer.stdout[-2000:]}{writer.stderr[-2000:]}")
        total = args.episodes * args.length
        print(f"v3.0 dataset written by LeRobot: {args.episodes} episodes x {args.length} frames at {args.fps} fps, "
              f"{h}x{w}, AV1; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; best of {args.reps}")
        print(f"{'order':<10}{'workers':>8}{'LeRobot f/s':>13}{'det_lab torchcodec':>20}{'det_lab PyAV':>14}"
              f"{'ratio tc':>10}{'ratio PyAV':>12}")
        for shuffle in (False, True):
            for workers in map(int, args.workers.split(",")):
                fps = {kind: frames_per_second(kind, root, shuffle, workers, args.reps)
                       for kind in ("lerobot", "det_lab-torchcodec", "det_lab-pyav")}
                ref = fps["lerobot"]
                print(f"{'shuffled' if shuffle else 'in order':<10}{workers:>8}{ref:>13.0f}"
                      f"{fps['det_lab-torchcodec']:>20.0f}{fps['det_lab-pyav']:>14.0f}"
                      f"{fps['det_lab-torchcodec'] / ref:>10.2f}{fps['det_lab-pyav'] / ref:>12.2f}", flush=True)
        print(f"({total} frames per pass)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--write":
        _, _, root, episodes, length, fps, h, w = sys.argv
        write(Path(root), int(episodes), int(length), int(fps), int(h), int(w))
    else:
        main()
