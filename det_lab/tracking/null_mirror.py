"""The mirror of a rank that mirrors nothing: same API as :class:`~det_lab.tracking.mirror.Mirror`.

Only the chief rank of a distributed trial mirrors; the other ranks get a ``NullMirror`` so
that trial code calls ``mirror.log_artifact(...)`` everywhere without checking for ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from det_lab.tracking.backend import RunStatus
from det_lab.tracking.events import RunInfo


class NullMirror:
    """Accepts every call of :class:`~det_lab.tracking.mirror.Mirror` and records nothing."""

    def __init__(self, run: RunInfo | None = None) -> None:
        self.run = run

    def log_metrics(self, group: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Ignored."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Ignored."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Ignored."""

    def log_checkpoint(self, uuid: str, step: int, metadata: Mapping[str, Any] | None = None) -> None:
        """Ignored."""

    def log_artifact(self, path: str | Path, name: str, step: int, media: str = "file") -> None:
        """Ignored."""

    def flush(self, timeout: float = 10.0) -> bool:
        """Nothing to deliver: always True."""
        return True

    def close(self, status: RunStatus = "FINISHED", timeout: float = 10.0) -> None:
        """Nothing to close; returns None (no delivery summary on this rank)."""
        return None
