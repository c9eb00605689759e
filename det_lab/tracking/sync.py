"""Deliver what finished runs left in their journals while a tracker was down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from det_lab.settings import LabSettings
from det_lab.tracking.journal import Journal
from det_lab.tracking.mirror import DeliverySummary, Mirror
from det_lab.trials import record
from det_lab.volume import VolumeLayout


def find_journals(settings: LabSettings) -> Iterator[Path]:
    """Every tracking journal on the volume (cluster trials and local-style runs: their run records')."""
    yield from record.find_journals(VolumeLayout.from_settings(settings), list(settings.projects))


def pending(journal_dir: Path) -> int:
    journal = Journal(journal_dir)
    _, backends = journal.run()
    return sum(journal.pending(b) for b in backends)


def sync(settings: LabSettings, journal_dir: Path, timeout: float = 60.0) -> DeliverySummary:
    """Replay one journal into its tracker runs (the same runs, found by their keys)."""
    from det_lab.tracking import backends_for

    run, names = Journal(journal_dir).run()
    backends = backends_for(settings, "both" if len(names) > 1 else (names[0] if names else "none"))
    return Mirror(run, backends, journal_dir).close(timeout=timeout)
