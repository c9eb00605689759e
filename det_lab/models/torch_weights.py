"""torchvision and torch.hub weights on the volume: ``TORCH_HOME/hub/checkpoints/<file>``, by file name.

torch.hub names a weight file by what it is (``resnet18-f37072fd.pth``: the prefix of its sha256)
and loads it from ``$TORCH_HOME/hub/checkpoints`` before it would download it. A file name
therefore holds one content for good: importing another content under a name already there is
refused rather than changing what earlier runs loaded.
"""

from __future__ import annotations

import filecmp
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from det_lab.models.errors import ModelStoreError
from det_lab.models.layout import ModelStoreLayout

SUFFIXES = (".pth", ".pt", ".ckpt", ".safetensors")


@dataclass(frozen=True)
class WeightFile:
    """One weight file under TORCH_HOME."""

    name: str
    path: Path
    size: int


def is_weight_file(path: Path) -> bool:
    """Whether ``path`` is a file ``det-lab models import`` takes as torch hub weights."""
    return path.is_file() and path.suffix in SUFFIXES


def plan_torch_import(layout: ModelStoreLayout, source: Path) -> tuple[WeightFile, bool]:
    """The file ``source`` would become, and whether it is new; a name taken by another content is an error."""
    target = layout.torch_checkpoints / source.name
    if target.exists():
        if not filecmp.cmp(source, target, shallow=False):
            raise ModelStoreError(f"{target} exists with other content: torch.hub names weights by file, so runs "
                                  "that loaded it would change; give the new file another name")
        return WeightFile(source.name, target, target.stat().st_size), False
    return WeightFile(source.name, target, source.stat().st_size), True


def import_torch_weights(layout: ModelStoreLayout, source: Path) -> tuple[WeightFile, bool]:
    """Copy ``source`` to TORCH_HOME's checkpoints, whole or not at all; the file and whether it was copied."""
    weight, new = plan_torch_import(layout, source)
    if not new:
        return weight, False
    weight.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = weight.path.with_name(f".{weight.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        with open(source, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(4 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o444)
        tmp.replace(weight.path)
    finally:
        tmp.unlink(missing_ok=True)
    return weight, True


def list_torch_weights(layout: ModelStoreLayout) -> list[WeightFile]:
    """The weight files under TORCH_HOME, by name."""
    try:
        entries = sorted(layout.torch_checkpoints.iterdir())
    except FileNotFoundError:
        return []
    return [WeightFile(p.name, p, p.stat().st_size) for p in entries if not p.name.startswith(".") and p.is_file()]
