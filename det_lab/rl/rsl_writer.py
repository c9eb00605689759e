"""det_lab's rsl_rl LogWriter: scalars and saved models as JSON lines a supervisor can tail.

Plug it in through rsl_rl's logger hook::

    train_cfg["logger"] = {"class_name": "det_lab.rl.rsl_writer:DetLabLogWriter"}

It writes ``<log_dir>/det_lab_metrics.jsonl`` (one ``{"kind": "scalar", "tag", "value", "step"}``
per ``add_scalar``, one ``{"kind": "model", "iter", "path"}`` after each ``torch.save``) and, with
``tensorboard=True`` (default), the same scalars to a TensorBoard events file, so the run directory
looks as it would with rsl_rl's default writer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from det_lab.rl.log_parsers import JSONL_NAME
from det_lab.rl.tbshim import ensure_torch_tensorboard

try:
    ensure_torch_tensorboard()  # rsl_rl.utils imports torch.utils.tensorboard
    from rsl_rl.utils.log_writer import LogWriter as _Base
except ImportError:  # rsl_rl not installed: the same duck-typed interface
    _Base = object  # type: ignore[assignment,misc]


class DetLabLogWriter(_Base):  # type: ignore[misc,valid-type]
    """rsl_rl ``LogWriter`` appending to ``det_lab_metrics.jsonl`` (and a TensorBoard file)."""

    def __init__(self, log_dir: str, tensorboard: bool = True, **_: Any) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._f = open(self.log_dir / JSONL_NAME, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def _line(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        value = float(scalar_value.item() if hasattr(scalar_value, "item") else scalar_value)
        self._line({"kind": "scalar", "tag": tag, "value": value, "step": int(global_step), "wall_time": time.time()})
        if self._tb is not None:
            self._tb.add_scalar(tag, value, global_step)

    def store_config(self, env_cfg: Any, train_cfg: dict) -> None:
        (self.log_dir / "det_lab_train_cfg.json").write_text(json.dumps(train_cfg, indent=2, default=str))

    def save_model(self, model_path: str, it: int) -> None:
        self._line({"kind": "model", "iter": int(it), "path": str(model_path), "wall_time": time.time()})

    def save_file(self, path: str) -> None:
        pass

    def save_video(self, video: Path, it: int) -> None:
        pass

    def stop(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._f.close()
