"""Frames of a video file by timestamp, the same frame whichever decoder reads it.

A timestamp maps to the frame whose presentation time is nearest to it, and a timestamp farther
than the dataset's tolerance from every frame is refused: LeRobot's rule (its readers take the
frame nearest to ``from_timestamp + timestamp`` and refuse one ``tolerance_s`` away, 1e-4 s by
default). Nearest matters: LeRobot stores timestamps as float32, and ``float32(0.7)`` is
0.69999999, a hair *before* frame 7 of a 10 fps video, so "the frame shown at t" is frame 6.

Two decoders, probed once per process, in this order:

- ``torchcodec`` (LeRobot's default), which needs FFmpeg's shared libraries on the system;
- ``pyav`` (the ``av`` package), which ships its own FFmpeg.

A decoder that is installed but cannot load (torchcodec without FFmpeg's libraries) is skipped
for the next one; when none works the error says what is missing and how to install it.
torchvision's video reader is not used: torchvision removed it in 0.26, and the torchvision that
matches det_lab's torch has none.

Open files are kept per process (a small LRU): PyAV decodes forward from where the last frame
was read when the next timestamp is just ahead, so sequential reads decode each frame once.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from det_lab.formats.errors import LeRobotDatasetError, VideoDecoderMissing, dataset_error, first_line

__all__ = ["DECODERS", "DEFAULT_TOLERANCE_S", "FrameReader", "decoder_problem", "nearest", "reader", "working_decoder"]

DECODERS = ("torchcodec", "pyav")
#: LeRobot's default ``tolerance_s``
DEFAULT_TOLERANCE_S = 1e-4
#: seconds ahead of the last decoded frame beyond which a PyAV read seeks instead of decoding on
_FORWARD_WINDOW_S = 1.0
_OPEN_FILES = 8

_INSTALL = {
    "torchcodec": "pip install torchcodec, with FFmpeg's shared libraries (apt-get install ffmpeg)",
    "pyav": "pip install av (it ships its own FFmpeg)",
}


class FrameReader(Protocol):
    """Reads the frame nearest to a timestamp of a video file, as HWC uint8 RGB."""

    name: str

    def frame(self, path: Path, ts: float, tolerance_s: float) -> np.ndarray: ...


# --- choosing a decoder --------------------------------------------------------------------------


@functools.cache
def decoder_problem(name: str) -> str | None:
    """Why the decoder ``name`` cannot be used in this process, or None when it works (probed once)."""
    if name not in DECODERS:
        return f"unknown decoder (known: {', '.join(DECODERS)})"
    try:
        if name == "torchcodec":
            import torchcodec.decoders  # noqa: F401  (loads libtorchcodec and FFmpeg's libraries)
        else:
            import av  # noqa: F401
    except ModuleNotFoundError:
        return "not installed"
    except Exception as exc:  # noqa: BLE001 (a native library that does not load raises anything)
        if name == "torchcodec":
            return "installed but cannot load its FFmpeg libraries (libavutil, libavcodec...)"
        return f"installed but cannot load: {first_line(exc)}"
    return None


def working_decoder(where: Path, prefer: str | None = None) -> str:
    """The name of the first decoder that works here (``prefer`` alone when given).

    Raises:
        VideoDecoderMissing: none works; one line naming each decoder's problem and its install.
    """
    names: Sequence[str] = (prefer,) if prefer else DECODERS
    problems = []
    for name in names:
        problem = decoder_problem(name)
        if problem is None:
            return name
        problems.append(f"{name} {problem}" + (f" ({_INSTALL[name]})" if name in _INSTALL else ""))
    raise VideoDecoderMissing(f"{where}: cameras are stored as video and no video decoder works here: "
                              f"{'; '.join(problems)}; or convert the videos to image files")


def reader(name: str) -> FrameReader:
    """This process's reader for the decoder ``name`` (see :func:`working_decoder`)."""
    return _readers()[name]


@functools.cache
def _readers() -> dict[str, FrameReader]:
    return {"torchcodec": _TorchcodecReader(), "pyav": _PyAVReader()}


def _forget_open_files() -> None:
    # a forked DataLoader worker must not share its parent's open decoders: forget them (clear,
    # not close: closing would act on the parent's handles)
    if _readers.cache_info().currsize:
        for r in _readers().values():
            r.open.clear()


os.register_at_fork(after_in_child=_forget_open_files)


# --- the mapping, one for every decoder ----------------------------------------------------------


def nearest(ts: float, times: Sequence[float]) -> int:
    """Position in ``times`` of the time nearest to ``ts`` (the earlier one on a tie)."""
    return min(range(len(times)), key=lambda k: (abs(times[k] - ts), k))


def _sure(tolerance_s: float, interval: float) -> float:
    """How far a timestamp may be from a frame for that frame to be surely the nearest, without
    looking at its neighbours: within the tolerance, and within half a frame (``interval``: the
    seconds between frames; 0.0 when unknown) for a tolerance looser than that."""
    return min(tolerance_s, interval / 2)


def _checked(path: Path, ts: float, found: float | None, end: float | None, tolerance_s: float) -> None:
    """Refuse ``ts`` unless the frame ``found`` (its time; None: no frame) is within tolerance;
    ``end``: where the video ends, when known."""
    if found is not None and abs(found - ts) < tolerance_s:
        return
    if found is None:
        raise dataset_error(path, f"no frame at {ts:.3f} s: the video has no frames")
    if end is not None and ts >= end - tolerance_s:
        raise dataset_error(path, f"no frame at {ts:.3f} s: the video ends at {end:.3f} s, "
                                  "shorter than the dataset's metadata says")
    raise dataset_error(path, f"no frame within {tolerance_s:g} s of {ts:.6f} s (nearest at {found:.6f} s): "
                              "the timestamps do not match the video's frames")


class _Open(OrderedDict):
    """A small LRU of open files; ``close()`` is called on what falls out."""

    def get_or_open(self, path: Path, opener: Any) -> Any:
        if path in self:
            self.move_to_end(path)
            return self[path]
        handle = self[path] = opener(path)
        while len(self) > _OPEN_FILES:
            _, old = self.popitem(last=False)
            old.close()
        return handle

    def drop(self, path: Path) -> None:
        handle = self.pop(path, None)
        if handle is not None:
            handle.close()


# --- torchcodec -----------------------------------------------------------------------------------


class _TorchcodecFile:
    def __init__(self, path: Path) -> None:
        from torchcodec.decoders import VideoDecoder

        self.decoder = VideoDecoder(str(path))  # exact seek mode: indexes every frame once
        meta = self.decoder.metadata
        self.count = int(meta.num_frames or 0)
        self.fps = float(meta.average_fps or 0.0)
        self.begin = float(meta.begin_stream_seconds or 0.0)
        self.end = meta.end_stream_seconds

    def close(self) -> None:
        self.decoder = None


class _TorchcodecReader:
    name = "torchcodec"

    def __init__(self) -> None:
        self.open = _Open()

    def frame(self, path: Path, ts: float, tolerance_s: float) -> np.ndarray:
        f = self.open.get_or_open(path, _TorchcodecFile)
        if not f.count or not f.fps:
            _checked(path, ts, None, None, tolerance_s)  # raises: no frames
        end = float(f.end) if f.end is not None else None
        i = min(max(round((ts - f.begin) * f.fps), 0), f.count - 1)
        frames = {i: f.decoder.get_frame_at(i)}
        # frames not evenly spaced, or a timestamp rounding to the wrong side: unless frame i is
        # surely the nearest, look at the neighbour on ts's side, so the nearest wins as in PyAV
        step = 1 if ts > float(frames[i].pts_seconds) else -1
        if 0 <= i + step < f.count and abs(float(frames[i].pts_seconds) - ts) >= _sure(tolerance_s, 1.0 / f.fps):
            frames[i + step] = f.decoder.get_frame_at(i + step)
        keys = sorted(frames)
        best = keys[nearest(ts, [float(frames[k].pts_seconds) for k in keys])]
        _checked(path, ts, float(frames[best].pts_seconds), end, tolerance_s)
        return frames[best].data.permute(1, 2, 0).numpy()


# --- PyAV -------------------------------------------------------------------------------------------


class _PyAVFile:
    """An open container and where its decoding stands: the last two frames decoded."""

    def __init__(self, path: Path) -> None:
        import av

        self.container = av.open(str(path))
        if not self.container.streams.video:
            self.container.close()
            raise LeRobotDatasetError("no video stream")
        self.stream = self.container.streams.video[0]
        rate = float(self.stream.average_rate or self.stream.guessed_rate or 0)
        #: seconds between frames (0.0: unknown)
        self.interval = 1.0 / rate if rate else 0.0
        self.frames: Any = None
        self.prev: Any = None
        self.cur: Any = None
        self.done = False

    def close(self) -> None:
        self.container.close()

    def _seek(self, ts: float) -> None:
        self.container.seek(max(0, int(ts / self.stream.time_base)), stream=self.stream, backward=True)
        self.frames = self.container.decode(self.stream)
        self.prev = self.cur = None
        self.done = False

    def around(self, ts: float, tolerance_s: float) -> list[Any]:
        """The decoded frames on either side of ``ts`` (one at the ends of the video)."""
        oldest = self.prev if self.prev is not None else self.cur
        # a step back within _sure() of the oldest frame kept is still that frame; farther back,
        # an earlier frame (not kept) may be nearer: seek
        if (self.frames is None or oldest is None or ts < oldest.time - _sure(tolerance_s, self.interval)
                or ts > self.cur.time + _FORWARD_WINDOW_S):
            self._seek(ts)
        while not self.done and (self.cur is None or self.cur.time < ts):
            frame = next(self.frames, None)
            if frame is None:
                self.done = True
            elif frame.time is not None:
                self.prev, self.cur = self.cur, frame
        return [f for f in (self.prev, self.cur) if f is not None]


class _PyAVReader:
    name = "pyav"

    def __init__(self) -> None:
        self.open = _Open()

    def frame(self, path: Path, ts: float, tolerance_s: float) -> np.ndarray:
        f = self.open.get_or_open(path, _PyAVFile)
        try:
            frames = f.around(ts, tolerance_s)
        except Exception:
            self.open.drop(path)  # a failed decode leaves the container where no one knows
            raise
        if not frames:
            _checked(path, ts, None, None, tolerance_s)
        best = frames[nearest(ts, [fr.time for fr in frames])]
        end = frames[-1].time + f.interval if f.done else None
        _checked(path, ts, best.time, end, tolerance_s)
        return best.to_ndarray(format="rgb24")
