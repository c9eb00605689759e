"""Where a notebook's figures go: each plot and the data drawn in it, under :func:`output_dir`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

OUT_ENV = "DET_LAB_NOTEBOOK_OUT"
DEFAULT_OUT = "notebook-out"


def output_dir(*parts: str) -> Path:
    """``$DET_LAB_NOTEBOOK_OUT/<parts>`` (default ``./notebook-out``), created."""
    path = Path(os.environ.get(OUT_ENV) or DEFAULT_OUT).expanduser().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path



def save_figure(fig: Any, name: str, data: dict[str, Any]) -> Path:
    """Save ``fig`` as ``<output_dir>/<name>.png`` and the data drawn in it as ``<name>.json``."""
    out = output_dir()
    png = out / f"{name}.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"saved {png} (+ {name}.json)")
    return png
