"""Tags for an ended run's tracker runs, delivered through its journal (``det-lab runs delete``).

An ended run's journal has no writer any more, so a command may append to it: the tags become
one more event, the end marker moves after it (the sender closes the tracker run again with the
status it ended with) and :func:`~det_lab.tracking.sync.sync` delivers it. A tracker that does not
answer leaves the event in the journal; ``det-lab tracking sync`` delivers it later.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from det_lab.tracking.events import Tags
from det_lab.tracking.journal import Journal, JournalError
from det_lab.tracking.mirror import DeliverySummary
from det_lab.tracking.sync import sync


def recorded_targets(journal_dir: Path) -> dict[str, str]:
    """``{backend: target}`` the journal delivers to ({} when it is not a deliverable journal)."""
    if not (journal_dir / "run.json").is_file():
        return {}
    try:
        return Journal(journal_dir).run()[1]
    except JournalError:
        return {}


def unreachable(target: str, timeout: float = 2.0) -> str | None:
    """Why a tracker ``target`` (an MLflow URI, an Aim repo or ``aim://host:port``) does not answer
    now, or None when it does (local stores: when their place exists)."""
    url = urlparse(target)
    if url.scheme in ("http", "https", "aim"):
        port = url.port or {"http": 80, "https": 443, "aim": 53800}[url.scheme]
        try:
            with socket.create_connection((url.hostname or "localhost", port), timeout=timeout):
                return None
        except OSError as exc:
            return f"{url.hostname}:{port} does not answer ({exc.strerror or exc})"
    path = Path(url.path if url.scheme in ("sqlite", "file") else target)
    place = path.parent if url.scheme == "sqlite" else path
    return None if place.exists() else f"{place} does not exist"


def tag_ended_run(journal_dir: Path, tags: Mapping[str, str], timeout: float = 10.0) -> DeliverySummary:
    """Append ``tags`` to an ended run's journal and try to deliver them within ``timeout`` s."""
    journal = Journal(journal_dir)
    journal.run()  # JournalError if the journal records no targets: nothing appended
    end = journal.end()
    journal.append([Tags({k: str(v) for k, v in tags.items()})])
    journal.mark_end(end.status if end else "KILLED")
    journal.close()
    return sync(journal_dir, timeout=timeout)
