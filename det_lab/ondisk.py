"""The versions of the files det_lab leaves for another det_lab to read: one registry, one rule.

Runs, journals, leases and caches outlive the det_lab that wrote them: a lab upgrades one
workstation before another, a run made by a newer det_lab is listed, resumed or pruned by an older
one. Each such file belongs to a format of :data:`FORMATS`, whose integer version is raised when a
change would make an older det_lab misread the file (a key it would take for something else, a
meaning changed); a key added that older readers may ignore raises nothing.

- **Writers stamp** each JSON object with ``"format": {"name": ..., "version": N}``
  (:func:`stamped`). A journal of many JSON lines is stamped where the lines have a header file
  beside them (a tracking journal's ``run.json``, a run's ``run.json`` for its ``metrics.jsonl``):
  a header line inside the JSONL would be misread by det_lab 0.1.0's readers, which take every
  line for an event. The GPU lease journal has no such file: each line carries the stamp (a key
  that 0.1.0's reader ignores).
- **Readers accept** their version and every older one: a file without a stamp is version 1 (what
  det_lab 0.1.0 wrote) and reads as it always did. A newer one is refused with
  :class:`NewerFormat`: one line naming the file, its format version, this det_lab's and
  "upgrade det_lab to read it"; never misread.
- **Nothing newer is removed or replaced** by an older det_lab: a newer run record is not saved
  over, a newer journal gets no line, a newer lease is not reaped, prune and retention skip what
  they cannot read and say so. A newer tracking journal only costs a running trial its mirror (one
  warning; training goes on).

Node caches (:mod:`det_lab.runs.cachefile`) carry their version in their header; one of a newer
version is passed over and left in place, and the caller works without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

from det_lab import __version__
from det_lab.errors import UserError

log = logging.getLogger("det_lab")

#: the key of the stamp in a JSON object
FORMAT_KEY: Final = "format"


class Format(NamedTuple):
    """One on-disk format: its name in stamps, the version this det_lab writes and reads up to,
    and which files are of it."""

    name: str
    version: int
    files: str


RUN_RECORD: Final = Format("run-record", 1, "a local or Slurm run's run.json; it also versions the run's "
                                            "metrics.jsonl and tracking-summary.json")
RUN_ATTEMPT: Final = Format("run-attempt", 1, "a run's attempt.json (the fencing epoch of its current job)")
TRACKING_JOURNAL: Final = Format("tracking-journal", 1, "a tracking journal's run.json; it also versions the "
                                                        "journal's segments, cursors, marks, writer.json and end.json")
GPU_LEASE: Final = Format("gpu-lease", 1, "a machine's GPU lease and queue files (leases/*.json, queue/*.json "
                                          "under $DET_LAB_GPU_STATE_DIR)")
GPU_LEASE_JOURNAL: Final = Format("gpu-lease-journal", 1, "each line of the volume's GPU lease journal "
                                                          "(.det-lab/gpus/journal/<host>.<user>.jsonl)")
MODEL_RECORD: Final = Format("model-record", 1, "a base model revision's record in the models store "
                                                "(models/.det-lab/revisions/<name>/<revision>.json)")
RUNS_LISTING_CACHE: Final = Format("runs-listing-cache", 1, "a user's cache of det-lab runs list "
                                                            "($XDG_CACHE_HOME/det-lab/runs-<volume>.json)")
#: the pickled node caches carry their version in their header (:mod:`det_lab.runs.cachefile`)
SPACE_CACHE: Final = Format("space-cache", 1, "a user's cache of checkpoint sizes ($XDG_CACHE_HOME/det-lab/"
                                              "space-<volume>.pickle)")
RUN_FACTS_CACHE: Final = Format("run-facts-cache", 1, "a user's cache of what each run.json says for volume "
                                                      "usage ($XDG_CACHE_HOME/det-lab/run-facts-<volume>.pickle)")
TREES_CACHE: Final = Format("trees-cache", 1, "a user's cache of directory sizes for runs prune "
                                              "($XDG_CACHE_HOME/det-lab/trees-<volume>.pickle)")

#: every versioned format, by name
FORMATS: Final[dict[str, Format]] = {f.name: f for f in (RUN_RECORD, RUN_ATTEMPT, TRACKING_JOURNAL, GPU_LEASE,
                                                         GPU_LEASE_JOURNAL, MODEL_RECORD, RUNS_LISTING_CACHE,
                                                         SPACE_CACHE, RUN_FACTS_CACHE, TREES_CACHE)}


class NewerFormat(UserError, ValueError):
    """A file written in a newer version of its format than this det_lab reads: one line naming the
    file, both versions and the fix (a ValueError: code that passes over unreadable files still does)."""

    def __init__(self, path: Path | str, fmt: Format, found: object) -> None:
        super().__init__(f"{path}: {fmt.name} format version {found}, newer than det_lab {__version__} reads "
                         f"(up to version {fmt.version}); upgrade det_lab to read it")
        self.path = str(path)
        self.format = fmt
        self.found = found


def stamp(fmt: Format) -> dict[str, Any]:
    """The stamp of ``fmt`` as this det_lab writes it."""
    return {"name": fmt.name, "version": fmt.version}


def stamped(data: Mapping[str, Any], fmt: Format) -> dict[str, Any]:
    """``data`` with this det_lab's stamp of ``fmt`` first (replacing an older one it was read with)."""
    return {FORMAT_KEY: stamp(fmt), **{k: v for k, v in data.items() if k != FORMAT_KEY}}


def version_of(data: object, fmt: Format, path: Path | str) -> int:
    """The version of ``fmt`` the parsed file ``data`` (at ``path``) is written in: 1 when it has no
    stamp (det_lab 0.1.0); :class:`NewerFormat` when newer than this det_lab reads, or when its
    stamp is not one this det_lab can read (a later det_lab's, whatever it holds)."""
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        return 1
    mark = data[FORMAT_KEY]
    version = mark.get("version") if isinstance(mark, dict) else None
    if type(version) is not int or version < 1 or mark.get("name") != fmt.name:
        raise NewerFormat(path, fmt, json.dumps(mark, sort_keys=True))
    if version > fmt.version:
        raise NewerFormat(path, fmt, version)
    return version


def check(data: Any, fmt: Format, path: Path | str) -> Any:
    """``data`` itself, once :func:`version_of` found its version readable."""
    version_of(data, fmt, path)
    return data


def newer_file(path: Path, fmt: Format) -> NewerFormat | None:
    """The refusal of the JSON file at ``path`` when it is written in a newer version of ``fmt``;
    None when it is readable, missing, or not JSON (damage is the reader's to report)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    try:
        version_of(data, fmt, path)
    except NewerFormat as exc:
        return exc
    return None


def refuse_overwrite(path: Path, fmt: Format) -> None:
    """Raise :class:`NewerFormat` rather than replace a file of a newer version of ``fmt``."""
    refusal = newer_file(path, fmt)
    if refusal is not None:
        raise refusal


def strings_in(path: Path) -> set[str]:
    """Every string anywhere in the JSON file at ``path`` (none when it cannot be read): what a
    newer file may name, for a caller that must keep whatever that is (a checkpoint it lists)
    without reading the file's meaning."""
    try:
        stack: list[Any] = [json.loads(path.read_bytes())]
    except (OSError, ValueError):
        return set()
    out: set[str] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.add(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


_warned: set[str] = set()


def warn_once(refusal: NewerFormat, consequence: str) -> None:
    """Log ``refusal`` and what it costs once per file and process (a side file a trial cannot
    write: the trial goes on without it)."""
    if refusal.path not in _warned:
        _warned.add(refusal.path)
        log.warning("%s; %s", refusal, consequence)
