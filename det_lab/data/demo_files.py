"""Deterministic file writers for the demo datasets: the same data always gives the same bytes
(no timestamps, sorted JSON keys, fixed PNG and Parquet writer settings, no pandas metadata)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def prepare_dest(dest: Path) -> Path:
    """Create ``dest``; refuse one that holds anything, so a dataset is never mixed with another."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise ValueError(f"dataset destination {dest} exists and is not a directory")
        if any(dest.iterdir()):
            raise ValueError(f"dataset destination {dest} is not empty; pick a new or empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def write_png(path: Path, pixels: np.ndarray) -> None:
    """``pixels`` (HxWx3 uint8) as a PNG, its parent directories made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Pillow writes no tIME chunk; fixing the compression settings fixes the bytes.
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(
        path, format="PNG", compress_level=6, optimize=False
    )


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON with sorted keys (NaN refused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")


def write_jsonl(path: Path, rows: Sequence[Any]) -> None:
    """One JSON object per line, keys sorted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row, sort_keys=True, allow_nan=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_parquet(path: Path, table: pa.Table) -> None:
    """``table`` as Parquet with every writer setting that shapes the bytes fixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table,
        path,
        version="2.6",
        compression="snappy",
        use_dictionary=False,
        write_statistics=True,
        row_group_size=1 << 20,
        data_page_version="1.0",
        store_schema=True,
    )
