"""Checking experiment configs (and config templates) against Determined 0.38.1's rules.

Two judges. det_lab's own validator (:func:`det_lab.runs.validate.determined_errors`, a mirror
of the 0.38.1 expconf schema rules for what det_lab's configs use) runs everywhere, so a plain
clone checks every config. Where Determined's schemas and their validator sit beside the checkout
(``../shared/tools/validate-expconf``: the 0.38.1 ``schemas/expconf/v0``), they judge as well;
test_bad_inputs.py compares the two verdicts there. The pinned ``determined`` wheel ships
neither the schemas nor a validator (removed in 0.21.1), so a clone cannot carry the official one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import yaml

from det_lab.runs.validate import determined_errors

#: Determined's own validator, when ../shared is beside the checkout
OFFICIAL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "validate-expconf"


def problems(paths: Iterable[Path], *, template: bool = False) -> list[str]:
    """Every ``file: problem`` either judge finds in the configs at ``paths`` (empty: all valid);
    ``template``: Determined config templates, which need not be whole configs."""
    paths = [Path(p) for p in paths]
    found = []
    for path in paths:
        conf = yaml.safe_load(path.read_text())
        if not isinstance(conf, dict):
            found.append(f"{path}: not a mapping")
            continue
        found += [f"{path}: {p}" for p in determined_errors(conf, template=template)]
    if OFFICIAL.exists() and paths:
        proc = subprocess.run([str(OFFICIAL), *map(str, paths)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHON": sys.executable})
        if proc.returncode != 0:
            found.append(f"Determined's validator: {proc.stdout}{proc.stderr}")
    return found


def assert_valid(paths: Iterable[Path], *, template: bool = False) -> None:
    paths = list(paths)
    assert paths, "no configs to check"
    found = problems(paths, template=template)
    assert not found, "\n".join(found)
