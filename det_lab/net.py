"""Whether a service answers over HTTP: the one probe det_lab uses for masters and trackers."""

from __future__ import annotations

import urllib.request


def http_answers(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    """``(True, "HTTP 200")`` when ``GET url`` answers with 2xx; else ``(False, why)``.

    Refused, timed out, DNS, TLS or an HTTP error: all mean "not usable now"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (configured URL)
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except Exception as exc:  # noqa: BLE001
        return False, str(getattr(exc, "reason", exc))
