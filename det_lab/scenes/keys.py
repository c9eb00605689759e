"""Names for per-image outputs (render files, tracker artifact keys) from COLMAP image names.

COLMAP image names are paths relative to the image folder, and rigs keep one subfolder per
camera (``cam0/0001.png``, ``cam1/0001.png``): the file name alone is not unique.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["render_key", "render_keys"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def render_key(image_name: str) -> str:
    """A relative key for an image's outputs: ``cam0/0001.png`` -> ``cam0/0001``.

    Subfolders are kept and the extension dropped; each part keeps only ``A-Z a-z 0-9 . _ -``
    (others become ``_``), and empty, ``.`` and ``..`` parts are dropped or defused, so the key is
    a safe relative path under an output folder and a valid MLflow/Aim artifact name.
    """
    parts = [p for p in image_name.replace("\\", "/").split("/") if p not in ("", ".")]
    if parts:
        stem, dot, ext = parts[-1].rpartition(".")
        parts[-1] = stem if dot and stem else parts[-1]
    safe = [_UNSAFE.sub("_", p) for p in parts]
    return "/".join("__" if p == ".." else p for p in safe) or "_"


def render_keys(image_names: Sequence[str]) -> list[str]:
    """:func:`render_key` of each name, made unique in order (a later duplicate gets ``-2``, ...).

    Names that differ only in extension or in replaced characters (``a b.png``, ``a_b.jpg``)
    would otherwise share a key.
    """
    seen: set[str] = set()
    out = []
    for name in image_names:
        key = base = render_key(name)
        n = 1
        while key in seen:
            n += 1
            key = f"{base}-{n}"
        seen.add(key)
        out.append(key)
    return out
