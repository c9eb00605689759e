"""A reader for LeRobot datasets, layouts v3.0 and v2.1 (v2.0), without the lerobot package.

lerobot needs Python >= 3.12 and pins an older torch, so det_lab reads the format itself
(layouts: LeRobot's ``src/lerobot/datasets/lerobot_dataset.py`` and its v2.1 -> v3.0 converter)::

    ds = LeRobotDataset(path, horizon=10)          # every episode
    train_eps, val_eps = split_episodes(ds.episode_indices, val_episodes=2)
    train, val = ds.select(train_eps), ds.select(val_eps)
    item = train[0]
    item["observation.state"]      # (state_dim,) float32
    item["action"]                 # (horizon, action_dim) float32: actions t .. t+H-1
    item["action_is_pad"]          # (horizon,) bool: True past the episode's last frame
    item["observation.images.front"]  # (3, H, W) float32 in [0, 1]
    item["task"], item["task_index"], item["episode_index"], item["frame_index"], item["index"]

All tabular data (state, action, indices) is loaded into memory once; images are read per
item: files at ``info["image_path"]``, bytes embedded in the parquet frames, or frames decoded
from ``info["video_path"]`` videos by torchcodec or PyAV (:mod:`det_lab.formats.video`: the frame
nearest to the item's timestamp, refused beyond ``tolerance_s``, as LeRobot's reader does).

Every problem with the dataset is a :class:`LeRobotDatasetError` (a ``ValueError``) whose
message is one line naming the file and what is wrong with it: at load time for the metadata
and tables, when an item is read for a corrupt image or video (naming the episode and frame).

Strings may be stored as any Arrow string type (``string``, ``large_string`` as pandas 3
writes them, ``string_view``, dictionary-encoded). Normalisation statistics come from
``meta/stats.json`` or, where it is absent, are aggregated from the per-episode statistics
(``meta/episodes_stats.jsonl`` in v2.1, the ``stats/...`` columns in v3.0) as LeRobot does.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data
from PIL import Image

from det_lab.formats import lerobot_tables as tables
from det_lab.formats import video
from det_lab.formats.errors import LeRobotDatasetError, VideoDecoderMissing, dataset_error, first_line
from det_lab.formats.lerobot_stats import read_stats
from det_lab.formats.lerobot_tables import ACTION, STATE

__all__ = ["Episode", "LeRobotDataset", "LeRobotDatasetError", "VideoDecoderMissing", "split_episodes"]

_CAMERA_DTYPES = ("image", "video")


@dataclass(frozen=True)
class Episode:
    """One episode: its frames are rows ``start .. start + length - 1`` of the reader."""

    index: int
    length: int
    tasks: tuple[str, ...]
    start: int
    video: dict[str, tuple[Path, float]]  # camera -> (video file, timestamp of frame 0 in it)


def split_episodes(episodes: Sequence[int], *, val_episodes: int | None = None,
                   val_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split episode indices into disjoint (train, held-out) lists, deterministically by ``seed``.

    ``val_episodes`` held out if given, else ``round(val_fraction * n)``, at least one; both
    sides keep at least one episode.
    """
    eps = sorted(set(int(e) for e in episodes))
    n = len(eps)
    if n < 2:
        raise ValueError(f"need at least 2 episodes to hold some out, got {n}")
    k = val_episodes if val_episodes is not None else max(1, round(val_fraction * n))
    if not 1 <= k < n:
        raise ValueError(f"cannot hold out {k} of {n} episodes (need 1 <= k < {n})")
    order = np.random.default_rng(seed).permutation(n)
    val = sorted(eps[i] for i in order[:k])
    return [e for e in eps if e not in set(val)], val


class LeRobotDataset(torch.utils.data.Dataset):
    """Frames of a local LeRobot dataset with action chunks of ``horizon`` steps (see module doc).

    Args:
        root: The dataset directory (holding ``meta/info.json``).
        horizon: Actions per item: frame t gets actions t .. t+horizon-1 of its episode, the
            last action repeated past the episode's end and flagged in ``action_is_pad``.
        episodes: Episode indices to serve (default: all).
        cameras: Camera features to load (default: every ``image``/``video`` feature); ``()``
            loads no images.
        tolerance_s: How far (seconds) a video frame may be from an item's timestamp (LeRobot's
            ``tolerance_s``); a timestamp farther from every frame is refused when read.
        video_decoder: ``"torchcodec"`` or ``"pyav"``; default: the first that works here.

    Raises:
        LeRobotDatasetError: missing ``meta/info.json``, unsupported ``codebase_version``, missing
            metadata or parquet file, missing column, frame counts that disagree with the
            metadata, a missing image, or a video camera without a working decoder.
    """

    def __init__(self, root: str | Path, *, horizon: int = 1, episodes: Sequence[int] | None = None,
                 cameras: Sequence[str] | None = None, tolerance_s: float = video.DEFAULT_TOLERANCE_S,
                 video_decoder: str | None = None) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.root = Path(root)
        self.horizon = horizon
        self.tolerance_s = float(tolerance_s)
        self.video_decoder: str | None = None
        self.info = tables.read_info(self.root)
        self.version: str = self.info["codebase_version"]
        self.fps = float(self.info.get("fps") or 0)
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        for key in (STATE, ACTION):
            if key not in self.features:
                raise dataset_error(self.root / "meta/info.json", f"features has no {key!r}")
        all_cameras = [k for k, f in self.features.items() if f.get("dtype") in _CAMERA_DTYPES]
        self.cameras: list[str] = list(all_cameras if cameras is None else cameras)
        for key in self.cameras:
            if key not in all_cameras:
                raise dataset_error(self.root / "meta/info.json", f"no image or video feature {key!r} (has {all_cameras})")
        v3 = self.version == "v3.0"
        self.tasks: dict[int, str] = tables.read_tasks_v3(self.root) if v3 else tables.read_tasks_v2(self.root)
        meta = tables.read_episodes_v3(self.root) if v3 else tables.read_episodes_v2(self.root)
        self.stats: dict[str, Any] = read_stats(self.root, meta)
        embedded = [k for k in self.cameras if self._camera_source(k) == "embedded"]
        files = tables.data_files_v3(self.root, self.info, meta) if v3 else tables.data_files_v2(self.root, self.info, meta)
        frames = tables.read_frames(files, embedded)
        self._load(frames, meta, embedded)
        if any(self._camera_source(k) == "video" for k in self.cameras):
            self.video_decoder = video.working_decoder(self.root / "meta/info.json", video_decoder)
        self._items = np.concatenate([np.arange(e.start, e.start + e.length) for e in self.episodes.values()]) \
            if self.episodes else np.zeros(0, dtype=np.int64)
        if episodes is not None:
            self._items = self.select(episodes)._items
        self._check_images()

    # --- public ----------------------------------------------------------------------------------

    @property
    def episode_indices(self) -> list[int]:
        """Every episode of the dataset (not only the selected ones)."""
        return sorted(self.episodes)

    @property
    def selected_episodes(self) -> list[int]:
        return sorted({int(e) for e in self.episode_index[self._items]})

    @property
    def state_dim(self) -> int:
        return int(self.state.shape[1])

    @property
    def action_dim(self) -> int:
        return int(self.action.shape[1])

    def image_shape(self, camera: str) -> tuple[int, int, int]:
        """(channels, height, width) of a camera, from ``info.json``."""
        ft = self.features[camera]
        dims = dict(zip(ft.get("names") or ["height", "width", "channels"], ft["shape"]))
        return int(dims.get("channels", 3)), int(dims["height"]), int(dims["width"])

    def select(self, episodes: Sequence[int]) -> LeRobotDataset:
        """The same reader serving only ``episodes`` (shares all loaded arrays)."""
        missing = sorted(set(int(e) for e in episodes) - set(self.episodes))
        if missing:
            raise ValueError(f"{self.root}: no episodes {missing} (has {len(self.episodes)})")
        view = copy.copy(self)
        chosen = [self.episodes[int(e)] for e in sorted(set(int(e) for e in episodes))]
        view._items = np.concatenate([np.arange(e.start, e.start + e.length) for e in chosen]) \
            if chosen else np.zeros(0, dtype=np.int64)
        return view

    def norm_stats(self, key: str) -> dict[str, np.ndarray]:
        """``mean``/``std``/``min``/``max`` of a feature (float32 arrays), from ``meta/stats.json``
        or aggregated from the per-episode statistics where that file is absent."""
        if key not in self.stats:
            source = "meta/stats.json" if (self.root / "meta/stats.json").is_file() else \
                ("meta/episodes" if self.version == "v3.0" else "meta/episodes_stats.jsonl")
            raise dataset_error(self.root / source, f"no statistics for {key!r}")
        return {k: np.asarray(v, dtype=np.float32) for k, v in self.stats[key].items()
                if k in ("mean", "std", "min", "max")}

    @property
    def rows(self) -> np.ndarray:
        """The reader rows of the served items, in item order (``self[i]`` reads row ``rows[i]``).

        Rows index the tabular arrays (``state``, ``action``, ``episode_index``, ``timestamp``, ...);
        an episode's frames are rows ``Episode.start .. Episode.start + length - 1``."""
        return self._items.copy()

    def image(self, camera: str, row: int) -> np.ndarray:
        """The ``(C, H, W)`` float32 image in [0, 1] of ``camera`` at reader row ``row``."""
        if camera not in self.cameras:
            raise ValueError(f"{self.root}: camera {camera!r} is not loaded (loaded: {self.cameras})")
        return self._image(camera, int(row))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = int(self._items[i])
        rows = row + np.arange(self.horizon)
        end = self._episode_end[row]
        pad = rows >= end
        item: dict[str, Any] = {
            STATE: self.state[row],
            ACTION: self.action[np.minimum(rows, end - 1)],
            "action_is_pad": pad,
            "task_index": int(self.task_index[row]),
            "task": self.tasks.get(int(self.task_index[row]), ""),
            "episode_index": int(self.episode_index[row]),
            "frame_index": int(self.frame_index[row]),
            "index": int(self.index[row]),
        }
        for key in self.cameras:
            item[key] = self._image(key, row)
        return item

    # --- loading ---------------------------------------------------------------------------------

    def _load(self, frames: dict[str, Any], meta: list[dict[str, Any]], embedded: list[str]) -> None:
        order = np.lexsort((frames["frame_index"], frames["episode_index"]))
        for name in list(frames):
            frames[name] = frames[name][order] if isinstance(frames[name], np.ndarray) else [frames[name][j] for j in order]
        self.state, self.action = frames[STATE], frames[ACTION]
        self.episode_index, self.frame_index = frames["episode_index"], frames["frame_index"]
        self.task_index, self.timestamp, self.index = frames["task_index"], frames["timestamp"], frames["index"]
        self._embedded = {k: frames[k] for k in embedded}

        self.episodes: dict[int, Episode] = {}
        self._data_files: dict[int, Path] = {}
        self._episode_end = np.zeros(len(self.state), dtype=np.int64)
        for ep in meta:
            idx = int(ep["episode_index"])
            start = int(np.searchsorted(self.episode_index, idx, side="left"))
            stop = int(np.searchsorted(self.episode_index, idx, side="right"))
            where = ep["_data"]
            if stop - start != int(ep["length"]):
                raise dataset_error(where, f"episode {idx} has {stop - start} frames, its metadata says {ep['length']}")
            if not np.array_equal(self.frame_index[start:stop], np.arange(stop - start)):
                raise dataset_error(where, f"episode {idx}: frame_index is not 0..{stop - start - 1}")
            self.episodes[idx] = Episode(idx, stop - start, tuple(ep.get("tasks") or ()), start,
                                         self._video_files(ep))
            self._data_files[idx] = where
            self._episode_end[start:stop] = stop
        listed = set(self.episodes)
        extra = sorted(set(np.unique(self.episode_index).tolist()) - listed)
        if extra:
            raise dataset_error(self.root / "data", f"frames of episodes {extra[:5]} are not in the episode metadata")
        total = self.info.get("total_frames")
        if total is not None and int(total) != len(self.state):
            raise dataset_error(self.root / "meta/info.json",
                         f"total_frames is {total} but the data files hold {len(self.state)} frames")

    def _camera_source(self, key: str) -> str:
        if self.features[key].get("dtype") == "video":
            if not self.info.get("video_path"):
                raise dataset_error(self.root / "meta/info.json", f"{key!r} is a video feature but video_path is null")
            return "video"
        return "file" if self.info.get("image_path") else "embedded"

    def _video_files(self, ep: dict[str, Any]) -> dict[str, tuple[Path, float]]:
        out = {}
        template = self.info.get("video_path")
        for key in self.cameras:
            if self._camera_source(key) != "video":
                continue
            idx = int(ep["episode_index"])
            if self.version == "v3.0":
                rel = template.format(video_key=key, chunk_index=int(ep[f"videos/{key}/chunk_index"]),
                                      file_index=int(ep[f"videos/{key}/file_index"]))
                offset = float(ep.get(f"videos/{key}/from_timestamp") or 0.0)
            else:
                chunk = idx // int(self.info.get("chunks_size") or 1000)
                rel = template.format(video_key=key, episode_chunk=chunk, episode_index=idx)
                offset = 0.0
            path = self.root / rel
            if not path.is_file():
                raise dataset_error(path, f"missing video of {key!r} (episode {idx})")
            out[key] = (path, offset)
        return out

    def _image_file(self, key: str, row: int) -> Path:
        return self.root / self.info["image_path"].format(
            image_key=key, episode_index=int(self.episode_index[row]), frame_index=int(self.frame_index[row]))

    def _check_images(self) -> None:
        """Cheap early check: the first and last image file of every episode exist."""
        for key in self.cameras:
            if self._camera_source(key) != "file":
                continue
            for ep in self.episodes.values():
                for row in (ep.start, ep.start + ep.length - 1):
                    path = self._image_file(key, row)
                    if not path.is_file():
                        raise dataset_error(path, f"missing image of {key!r} (episode {ep.index}, frame {self.frame_index[row]})")

    def _image(self, key: str, row: int) -> np.ndarray:
        source = self._camera_source(key)
        episode, frame = int(self.episode_index[row]), int(self.frame_index[row])
        where = f"{key!r} of episode {episode}, frame {frame}"
        if source == "file":
            path = self._image_file(key, row)
            if not path.is_file():
                raise dataset_error(path, f"missing image of {where}")
            pixels = _decode_image(path, path, where)
        elif source == "embedded":
            cell = self._embedded[key][row]
            blob = cell.get("bytes") if isinstance(cell, dict) else cell
            data_file = self._data_files[episode]
            if not blob:
                raise dataset_error(data_file, f"{where} has no image bytes")
            pixels = _decode_image(io.BytesIO(blob), data_file, where)
        else:
            path, offset = self.episodes[episode].video[key]
            ts = offset + float(self.timestamp[row])
            try:
                pixels = video.reader(self.video_decoder).frame(path, ts, self.tolerance_s)
            except LeRobotDatasetError as exc:
                raise dataset_error(path, f"{where}: {str(exc).removeprefix(f'{path}: ')}") from None
            except Exception as exc:  # noqa: BLE001 (decoders raise anything for a broken file)
                raise dataset_error(path, f"cannot decode {where} at {ts:.3f} s (truncated or not a video?): "
                                   f"{first_line(exc)}") from None
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32) / 255.0


def _decode_image(source: Path | io.BytesIO, where_file: Path, what: str) -> np.ndarray:
    """HWC uint8 pixels of an image file or bytes; a damaged image is one error naming the file."""
    try:
        with Image.open(source) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as exc:  # PIL raises SyntaxError for some broken PNGs
        raise dataset_error(where_file, f"corrupt image for {what}: {first_line(exc)}") from None
