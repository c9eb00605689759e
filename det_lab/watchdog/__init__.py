"""The idle-GPU watchdog: GPUs held and idle over a sliding window are warned about, then stopped.

Public face: :class:`Watchdog` (the service, ``det-lab watchdog``), :func:`snooze`,
:func:`status`, :func:`idle_gpu_hours` (``det-lab usage``) and :func:`notice_line` (``runs list`` /
``runs show``). A wings package: nothing imports it but the CLI.
"""

from __future__ import annotations

from det_lab.watchdog.control import WatchdogError, snooze, status
from det_lab.watchdog.journal import idle_gpu_hours
from det_lab.watchdog.notify import notice_line
from det_lab.watchdog.service import Watchdog

__all__ = ["Watchdog", "WatchdogError", "idle_gpu_hours", "notice_line", "snooze", "status"]
