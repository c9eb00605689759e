"""The errors of det_lab's dataset readers: one line naming the file and what is wrong with it."""

from __future__ import annotations

import re
from pathlib import Path
from det_lab.errors import UserError


class LeRobotDatasetError(UserError, ValueError):
    """A malformed or unreadable LeRobot dataset; the message is ``<file>: <problem>``."""


class VideoDecoderMissing(LeRobotDatasetError):
    """The dataset stores a camera as video and no working decoder (torchcodec, PyAV) is installed."""


def dataset_error(path: Path, problem: str) -> LeRobotDatasetError:
    return LeRobotDatasetError(f"{path}: {problem}")


def first_line(exc: BaseException) -> str:
    """``<ExceptionType>: <first line of its message>``, for one-line errors."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    # torchcodec prefixes its messages with "<function>, <C++ source file>:<line>, "
    line = re.sub(r"^\w+, \S+\.(?:cpp|h):\d+, ", "", line)
    return f"{type(exc).__name__}: {line}"
