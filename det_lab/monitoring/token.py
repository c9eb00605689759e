"""``det-lab monitor token``: a Determined session token for Prometheus, in the file it reads.

Determined's metrics endpoints want a bearer token; a session token expires, so a systemd timer
renews it. The new token replaces the file whole (mode 0600); on any failure the old file stays
as it was, so Prometheus keeps scraping with the token it has until that one expires.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from det_lab.errors import UserError
from det_lab.volume import atomic_write_text

LOGIN_PATH = "/api/v1/auth/login"


class TokenError(UserError, RuntimeError):
    """The master did not give a token."""


def login(master_url: str, user: str, password: str, timeout: float = 10.0) -> str:
    """A session token from ``POST /api/v1/auth/login``."""
    body = json.dumps({"username": user, "password": password}).encode()
    req = urllib.request.Request(master_url.rstrip("/") + LOGIN_PATH, data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the configured master)
            token = json.loads(resp.read()).get("token")
    except urllib.error.HTTPError as exc:
        raise TokenError(f"{master_url} refused the login of {user!r} (HTTP {exc.code})") from None
    except (OSError, ValueError) as exc:
        raise TokenError(f"{master_url} did not answer the login: {getattr(exc, 'reason', exc)}") from None
    if not isinstance(token, str) or not token:
        raise TokenError(f"{master_url} answered the login without a token")
    return token


def renew(master_url: str, user: str, password: str, out: Path) -> Path:
    """Log in and write the token to ``out`` (0600), replacing it only once a token is in hand."""
    token = login(master_url, user, password)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, token, 0o600)
    return out
