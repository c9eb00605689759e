"""The ``Check`` type: one line of a health report, which packages produce and ``det-lab doctor``
collects. A leaf module: it imports nothing of det_lab."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str
    fix: str = ""
