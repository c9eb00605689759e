"""``det-lab tracking sync``: deliver what a run's senders left in its journal.

Each backend is delivered to the target recorded in the journal when the run started, whatever
the shell running sync is configured for. Sync only reads the journal and moves its cursors: a
failed attempt leaves it exactly as it was.
"""

from __future__ import annotations

import time
from pathlib import Path

from det_lab.tracking.journal import Journal
from det_lab.tracking.mirror import BackendSummary, DeliverySummary
from det_lab.tracking.sender import Busy, Sender, sender_lock


def deliver_journal(journal_dir: Path, timeout: float = 60.0) -> DeliverySummary:
    """Deliver one journal to its recorded targets within ``timeout`` s; waits (within it) for a
    sender still at work on the journal. Raises :class:`~det_lab.tracking.journal.JournalError`
    if the journal does not say where its events go."""
    journal = Journal(journal_dir)
    _, targets = journal.run()
    summary = DeliverySummary(journal_dir)
    deadline = time.monotonic() + timeout
    for name in targets:
        cursor, error, delivered = journal.cursor(name), None, 0
        if journal.pending(name):
            try:
                with sender_lock(journal_dir, name, timeout=max(0.0, deadline - time.monotonic())):
                    sender = Sender(journal_dir, name)
                    sender.drain(max(1.0, deadline - time.monotonic()))
                    delivered = sender.delivered
                    error = sender.cursor.error if sender.down else None
            except Busy as exc:
                error = str(exc)
            cursor = journal.cursor(name)
        summary.backends.append(BackendSummary(name, delivered, Journal(journal_dir).last_seq - cursor.seq,
                                               cursor.run_id, error))
    return summary

