"""Running LeRobot itself in subprocesses, to write datasets and read them back as the reference.

LeRobot 0.4.x (installed with ``--no-deps`` by tests/setup.sh) writes v3.0; 0.3.3, installed on
first use into pytest's cache (with datasets 3.6), writes v2.1. A test module that uses these
runs itself as the subprocess's script (its ``__main__`` calls what it needs).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the last release that writes v2.1, with the `datasets` release its reader needs
LEROBOT_V21 = ("lerobot==0.3.3", "datasets==3.6.0")


def skip_without_lerobot() -> pytest.MarkDecorator:
    missing = [m for m in ("lerobot", "torchcodec", "av") if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: tests/setup.sh installs them")


@functools.cache
def import_lerobot_dataset() -> Any:
    """LeRobot's ``LeRobotDataset`` class, importable beside the CPU torch."""
    import torch

    # The PyPI torchvision wheel is a CUDA build whose C++ ops library cannot load beside the CPU
    # torch, and importing torchvision registers fake kernels for two of those ops. LeRobot's
    # dataset code uses only torchvision's pure-Python transforms, so where the library does not
    # load, declaring the two op schemas lets the real torchvision package import.
    spec = importlib.util.find_spec("torchvision")
    try:
        ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "_C.so"))
    except OSError:
        for op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    from lerobot.datasets import lerobot_dataset

    return lerobot_dataset.LeRobotDataset


def v21_library(config: pytest.Config) -> Path:
    """A directory holding LeRobot 0.3.3 and its ``datasets``, installed once into pytest's cache or,
    where that is off (``-p no:cacheprovider``, a read-only checkout), the user's cache directory."""
    name = "-".join(LEROBOT_V21).replace("==", "-")
    cache = getattr(config, "cache", None)
    if cache is not None:
        lib = Path(cache.mkdir(name))
    else:
        lib = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "det-lab-tests" / name
        lib.mkdir(parents=True, exist_ok=True)
    if not (lib / "datasets").is_dir():
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(lib),
                              *LEROBOT_V21], capture_output=True, text=True, timeout=300)
        if pip.returncode != 0:
            pytest.skip(f"cannot install {LEROBOT_V21} (for v2.1 datasets): {pip.stderr.strip()[-300:]}")
    return lib


def run_lerobot(script: str, args: list[str], extra_path: Path | None = None) -> subprocess.Popen:
    """Start ``python script *args`` with LeRobot offline (and ``extra_path`` first on sys.path)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    # the test module runs as a script: its `tests.` imports need the repository on the path
    paths = [*([str(extra_path)] if extra_path is not None else []), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def finish(proc: subprocess.Popen, restart: Callable[[], subprocess.Popen], what: str, timeout: float = 600) -> None:
    """Wait for ``proc``; run ``restart()`` once more if LeRobot's encoder aborted it."""
    log, _ = proc.communicate(timeout=timeout)
    if proc.returncode < 0:
        # LeRobot's writer (its video encoder, in C++) now and then aborts ("terminate called
        # without an active exception") on a loaded machine: that is LeRobot's, not what is tested
        proc = restart()
        log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"LeRobot ({what}) failed:\n{log[-3000:]}"
