"""What det_lab keeps in an Aim run, shared by the writer (:mod:`det_lab.tracking.aim_backend`)
and the reader (:mod:`det_lab.tracking.aim_reader`): the sections of its tags and
hyperparameters, the metric context of a group, the run hash derived from the run key, and
flattened params turned back into nested, typed values."""

from __future__ import annotations

import hashlib
import math
from typing import Any

#: where a run keeps det_lab's tags, run key, status and latest checkpoint
META_SECTION = "det_lab"
#: where a run keeps its hyperparameters (nested, as the user wrote them)
PARAMS_SECTION = "hparams"
#: the sequence-context key holding a metric's group (train, validation ...)
GROUP_CONTEXT = "subset"


RUN_HASH_LENGTH = 24  # what aim.sdk.utils.generate_run_hash produces


def derive_run_hash(key: str) -> str:
    """The Aim run hash for a det_lab run key: 24 hex chars, like Aim's own hashes.

    Part of the on-disk contract: changing it would start new Aim runs for resumed trials.
    """
    return hashlib.sha256(f"det_lab:{key}".encode()).hexdigest()[:RUN_HASH_LENGTH]


def coerce_param(value: str) -> Any:
    """A flattened param string back as int/float/bool/None when that is exactly what it was.

    Only exact round trips convert (``str(result) == value``), so strings such as ``"007"``,
    ``"1e-3"`` or ``"nan"`` stay strings.
    """
    special = {"True": True, "False": False, "None": None}
    if value in special:
        return special[value]
    for cast in (int, float):
        try:
            converted = cast(value)
        except (ValueError, OverflowError):
            continue
        if str(converted) == value and not (isinstance(converted, float) and not math.isfinite(converted)):
            return converted
    return value


def merge_dotted(target: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    """Merge dotted params (``optimizer.lr``) into a nested dict, coercing values.

    A key that cannot nest (a part is empty, or a prefix is already a plain value) is kept flat.
    """
    for key, raw in values.items():
        value = coerce_param(raw)
        parts = key.split(".")
        node = target
        if all(parts):
            for part in parts[:-1]:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    node = None
                    break
                node = child
        else:
            node = None
        if node is None or isinstance(node.get(parts[-1]), dict):
            target[key] = value
        else:
            node[parts[-1]] = value
    return target
