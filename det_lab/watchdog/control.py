"""What users ask of the watchdog: a snooze for their own job, and what it has done (``status``)."""

from __future__ import annotations

import datetime as dt
import getpass
from typing import Any

from det_lab.errors import UserError
from det_lab.settings import LabSettings
from det_lab.watchdog.journal import WatchdogJournal
from det_lab.watchdog_settings import parse_duration


class WatchdogError(UserError):
    """A snooze the lab config does not allow, or a bad duration."""


def _span(seconds: float) -> str:
    from det_lab.watchdog.service import span

    return span(seconds)


def snooze(settings: LabSettings, target: str, duration: str, user: str | None = None,
           now: dt.datetime | None = None) -> dict[str, Any]:
    """Leave ``target`` (a Slurm job id, run name or Determined task id) alone for ``duration``, at most
    the lab's ``watchdog.snooze_limit``; honoured for a holder of ``user`` (default: the caller) or root."""
    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        raise WatchdogError(f"snooze {target} {duration}: {exc}") from None
    limit = settings.watchdog.snooze_limit
    if seconds > limit:
        raise WatchdogError(f"snooze {target} {duration}: at most {_span(limit)} (watchdog.snooze_limit in "
                            f"{settings.source or 'the lab config'}); ask an admin for an exemption")
    now = now or dt.datetime.now().astimezone()
    until = now + dt.timedelta(seconds=seconds)
    entry = {"holder": f"snooze:{target}", "event": "snoozed", "target": target, "until": until.timestamp(),
             "until_time": until.isoformat(timespec="seconds"), "by": user or getpass.getuser(),
             "message": f"{target} snoozed for {_span(seconds)} by {user or getpass.getuser()}"}
    WatchdogJournal(settings.data_root).append(entry, once=False)
    return entry


def status(settings: LabSettings, now: dt.datetime | None = None) -> dict[str, Any]:
    """The latest event of each holder the journal names, the snoozes in force and the exemptions."""
    now = now or dt.datetime.now()
    latest: dict[str, dict[str, Any]] = {}
    snoozes = []
    journal = WatchdogJournal(settings.data_root)
    for e in journal.entries():
        if e["event"] == "snoozed":
            if float(e.get("until", 0)) > now.timestamp():
                snoozes.append(e)
            continue
        latest[e["holder"]] = e
    exemptions = [{**e.model_dump(mode="json"), "expired": now >= e.until} for e in settings.watchdog.exemptions]
    return {"journal": str(journal.file), "holders": list(latest.values()), "snoozes": snoozes,
            "exemptions": exemptions}
