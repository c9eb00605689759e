"""How this machine's Python environment differs from the one a run recorded."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from det_lab.runs.lineage import installed_distributions, read_environment


def current() -> dict[str, str]:
    """``{name: version}`` of this interpreter's distributions (what a re-run here would use)."""
    return dict(line.split("==", 1) for line in installed_distributions())


def recorded(lineage: dict[str, Any]) -> dict[str, str] | None:
    """The recorded ``{name: version}``; None when the run recorded none or its list is gone."""
    file = (lineage.get("environment") or {}).get("file")
    if not file or not Path(file).is_file():
        return None
    return read_environment(Path(file))


def differences(before: dict[str, str], after: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(name, before, after)`` for each distribution whose version differs ("-" where absent)."""
    names = sorted(set(before) | set(after))
    return [(n, before.get(n, "-"), after.get(n, "-")) for n in names if before.get(n) != after.get(n)]


def against_here(lineage: dict[str, Any]) -> tuple[list[tuple[str, str, str]], str | None]:
    """The differences between the run's environment and this one, and a note when they cannot
    be told (no environment recorded)."""
    before = recorded(lineage)
    rows: list[tuple[str, str, str]] = []
    python = (lineage.get("environment") or {}).get("python") or lineage.get("python")
    if python and python != platform.python_version():
        rows.append(("python", python, platform.python_version()))
    if before is None:
        return rows, "the run recorded no list of installed distributions (or it is gone); versions not compared"
    return rows + differences(before, current()), None
