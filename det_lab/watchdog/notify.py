"""Where a warning goes besides the journal: an incoming webhook, mail through sendmail, the run's notice.

Webhook shapes: Slack's incoming webhook and Mattermost's take ``{"text": ...}`` (Mattermost also
``username``); Matrix has no incoming webhook of its own: matrix-hookshot's generic webhook takes
``{"text": ..., "username": ...}``. A delivery that fails is logged and passed over: a webhook down
never stops the watchdog, and the journal holds every message either way.
"""

from __future__ import annotations

import json
import logging
import subprocess
import urllib.error
import urllib.request
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from det_lab.volume import atomic_write_text
from det_lab.watchdog_settings import MailSettings, WebhookSettings

log = logging.getLogger("det_lab.watchdog")
NOTICE_FILE = "watchdog.json"
USERNAME = "det-lab watchdog"


def webhook_body(hook: WebhookSettings, text: str) -> dict[str, Any]:
    """The JSON a ``hook`` of its kind takes."""
    if hook.kind == "slack":
        return {"text": text}
    return {"text": text, "username": USERNAME}


def post_webhook(hook: WebhookSettings, text: str, timeout: float = 10.0) -> bool:
    """POST ``text`` to the webhook; False (logged) when it did not take it."""
    req = urllib.request.Request(hook.url, data=json.dumps(webhook_body(hook, text)).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout):  # the configured webhook
            return True
    except (OSError, urllib.error.HTTPError) as exc:
        log.warning("watchdog: webhook %s did not take the message: %s", hook.url, exc)
        return False


def send_mail(mail: MailSettings, user: str, subject: str, text: str) -> bool:
    """Mail ``text`` to ``user`` through sendmail (``-t``: the recipients come from the headers)."""
    if not user:
        return False
    msg = EmailMessage()
    msg["From"] = mail.sender if "@" in mail.sender else f"{mail.sender}@{mail.domain}"
    msg["To"] = f"{user}@{mail.domain}"
    if mail.cc:
        msg["Cc"] = ", ".join(mail.cc)
    msg["Subject"] = subject
    msg.set_content(text)
    try:
        proc = subprocess.run([str(mail.sendmail), "-t", "-oi"], input=msg.as_bytes(), capture_output=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("watchdog: %s could not mail %s: %s", mail.sendmail, user, exc)
        return False
    if proc.returncode != 0:
        log.warning("watchdog: %s exited %d mailing %s: %s", mail.sendmail, proc.returncode, user,
                    proc.stderr.decode(errors="replace").strip())
        return False
    return True


def write_notice(run_dir: Path, entry: dict[str, Any]) -> None:
    """The latest watchdog event of a det_lab run, in its run directory (``runs list`` / ``runs show``)."""
    try:
        atomic_write_text(run_dir / NOTICE_FILE, json.dumps(entry, default=str) + "\n", 0o664)
    except OSError as exc:  # a run directory gone or unwritable: the journal still has it
        log.warning("watchdog: cannot write %s: %s", run_dir / NOTICE_FILE, exc)


def read_notice(run_dir: Path) -> dict[str, Any] | None:
    """A run's latest watchdog event, or None."""
    try:
        data = json.loads((run_dir / NOTICE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def notice_line(run_dir: Path) -> str | None:
    """A run's watchdog event as one short line: ``idle GPU: warned 14:05, stops at 14:35``."""
    n = read_notice(run_dir)
    if not n:
        return None
    if n.get("event") == "warned":
        return f"idle GPU: warned {str(n.get('time', ''))[11:16]}, stops at {str(n.get('deadline_time', ''))[11:16]}"
    if n.get("event") == "acted":
        return f"idle GPU: stopped by the watchdog {str(n.get('time', ''))[:16].replace('T', ' ')}, resumable"
    return None  # cleared: it uses its GPU again
