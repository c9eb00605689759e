"""``det-lab tracking sync``: deliver what finished runs' senders left in their journals.

Each backend is delivered to the target recorded in the journal when the run started, whatever
the shell running sync is configured for. Sync only reads the journal and moves its cursors: a
failed attempt leaves it exactly as it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.ondisk import NewerFormat
from det_lab.tracking.journal import Journal, JournalError
from det_lab.tracking.mirror import BackendSummary, DeliverySummary
from det_lab.tracking.delivery import Busy, Sender, sender_lock


def backlog(journal_dir: Path) -> tuple[int, str | None]:
    """Events of the journal some backend has not acknowledged (all of them if it names no
    target), and what is wrong with its ``run.json`` when it cannot be delivered (else None)."""
    journal = Journal(journal_dir)
    try:
        _, targets = journal.run()
    except NewerFormat as exc:  # not this det_lab's to read: counted as undelivered, so never removed as done
        return max(journal.last_seq, 1), str(exc)
    except JournalError as exc:
        return journal.last_seq, str(exc)
    return sum(journal.pending(b) for b in targets), None


def pending(journal_dir: Path) -> int:
    """Events of the journal some backend has not acknowledged (all of them if it names no target)."""
    return backlog(journal_dir)[0]


def sync(journal_dir: Path, timeout: float = 60.0) -> DeliverySummary:
    """Replay one journal into its tracker runs, at the targets the journal recorded (the same
    runs, found by their keys), within ``timeout`` s; waits (within it) for a sender still at
    work on the journal. Raises :class:`JournalError` if the journal recorded no targets."""
    journal = Journal(journal_dir)
    _, targets = journal.run()
    summary = DeliverySummary(journal_dir)
    deadline = time.monotonic() + timeout
    for name in targets:
        error, delivered = None, 0
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


def sync_waiting(journal_dirs: Iterable[Path], timeout: float = 60.0) -> tuple[list[DeliverySummary], list[str]]:
    """``det-lab tracking sync`` with no journal named: every journal with undelivered events is
    synced; one this det_lab cannot deliver (damaged, or of a newer det_lab) is left as it is and
    named, not a stop for the journals after it. Returns the summaries and one line per journal left."""
    summaries: list[DeliverySummary] = []
    left: list[str] = []
    for journal_dir in journal_dirs:
        events, problem = backlog(journal_dir)
        if problem:
            left.append(problem if str(journal_dir) in problem else f"{journal_dir}: {problem}")
        elif events:
            summaries.append(sync(journal_dir, timeout))
    return summaries, left


@dataclass(frozen=True)
class JournalBacklog:
    """One journal holding undelivered events, and what is wrong with it when it cannot be delivered."""

    journal: Path
    events: int
    damaged: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """What ``det-lab tracking status --json`` prints for the journal."""
        return {"journal": str(self.journal), "events": self.events, "damaged": self.damaged}


def backlogs(journal_dirs: Iterable[Path]) -> list[JournalBacklog]:
    """The journals of ``journal_dirs`` with undelivered events, and every damaged one (each
    journal's run.json read once: the count and whether it can be delivered)."""
    found = [JournalBacklog(j, *backlog(j)) for j in journal_dirs]
    return [b for b in found if b.events or b.damaged]
