"""The one interface every tracking backend implements (one small class per tracker)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

from det_lab.tracking.events import Event, RunInfo

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


class TrackerBackend(ABC):
    """A tracker the mirror delivers to.

    Only a sender process (:mod:`det_lab.tracking.delivery`) or ``det-lab tracking sync`` calls
    these, never the training process. Any exception means "not delivered, try again later": the
    events stay in the journal and ``open`` / ``deliver`` are called again with the same events
    once the tracker answers, possibly by another process after a crash. ``deliver`` must
    therefore tolerate a batch that was partly or wholly delivered before.
    """

    name: str  # "mlflow", "aim": also the journal cursor's name

    @abstractmethod
    def open(self, run: RunInfo, resume_id: str | None) -> str:
        """Create or continue the run for ``run.key`` and return the tracker's run id.

        ``resume_id`` is the id returned by a previous ``open`` for the same key (from the
        journal), if any; without it the backend should still find a run tagged with ``run.key``.
        """

    @abstractmethod
    def deliver(self, events: Sequence[Event]) -> None:
        """Send events, in order, to the open run. Raise on any failure."""

    @abstractmethod
    def close(self, status: RunStatus) -> None:
        """Mark the run ended and release connections. Raise on failure."""

    def describe(self) -> str:
        """Where the backend sends to, for log lines and summaries."""
        return self.name
