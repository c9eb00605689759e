"""rsl_rl output as Isaac Lab lays it out, read from the outside.

    logs/rsl_rl/<experiment>/<YYYY-mm-dd_HH-MM-SS>[_<run name>]/
        model_<iter>.pt ...          torch.save of the runner (a zip; ``iter`` inside)
        params/{env,agent}.yaml      the configs Isaac Lab dumps
        events.out.tfevents.*        TensorBoard scalars (Loss/*, Train/*, Perf/*, Episode/*)
        det_lab_metrics.jsonl        only when det_lab's LogWriter is plugged in

Metric sources are incremental (``poll()`` returns what is new) so a supervisor can tail a run
that is still writing.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from det_lab.rl.tfevents import EventsTail, Scalar, read_scalars

RUN_DIR_RE = re.compile(r"^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(_.+)?$")
MODEL_RE = re.compile(r"^model_(\d+)\.pt$")
JSONL_NAME = "det_lab_metrics.jsonl"


def run_dirs(logs_root: Path) -> list[Path]:
    """Run directories under ``logs/rsl_rl`` (``<experiment>/<timestamp>[_name]``), oldest first."""
    root = Path(logs_root)
    if not root.is_dir():
        return []
    found = [d for exp in root.iterdir() if exp.is_dir() for d in exp.iterdir()
             if d.is_dir() and RUN_DIR_RE.match(d.name)]
    return sorted(found, key=lambda d: (d.name[:19], d.stat().st_mtime))


def latest_run(logs_root: Path, experiment: str | None = None) -> Path | None:
    """The newest run directory (of ``experiment``, if given)."""
    runs = [d for d in run_dirs(logs_root) if experiment is None or d.parent.name == experiment]
    return runs[-1] if runs else None


def models(run_dir: Path) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of each ``model_<iter>.pt``, by iteration (not by name: 10 > 9)."""
    out = []
    for p in Path(run_dir).glob("model_*.pt"):
        m = MODEL_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_model(run_dir: Path) -> tuple[int, Path] | None:
    """The highest-iteration model in a run directory, or None."""
    found = models(run_dir)
    return found[-1] if found else None


def model_complete(path: Path) -> bool:
    """True once ``torch.save`` has finished: its zip's end-of-central-directory record is last."""
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def scalars(run_dir: Path) -> list[Scalar]:
    """Every scalar in a run directory's events files (``/time`` axes included), in file order."""
    files = sorted(Path(run_dir).glob("events.out.tfevents.*"))
    return [s for f in files for s in read_scalars(f)]


def last_values(points: list[Scalar]) -> dict[str, tuple[int, float]]:
    """``tag -> (step, value)`` of the highest step per tag."""
    out: dict[str, tuple[int, float]] = {}
    for s in points:
        if s.tag not in out or s.step >= out[s.tag][0]:
            out[s.tag] = (s.step, s.value)
    return out


class TfEventsSource:
    """New scalars from all events files of a run directory (files may appear later)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.tails: dict[Path, EventsTail] = {}

    def poll(self) -> tuple[list[Scalar], list[int]]:
        for f in sorted(self.run_dir.glob("events.out.tfevents.*")):
            self.tails.setdefault(f, EventsTail(f))
        return [s for t in self.tails.values() for s in t.poll()], []

    @property
    def problems(self) -> list[str]:
        return [t.broken for t in self.tails.values() if t.broken]


class JsonlSource:
    """New scalars and saved-model events from det_lab's LogWriter file (``det_lab_metrics.jsonl``)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / JSONL_NAME
        self.offset = 0
        self.problems: list[str] = []

    def poll(self) -> tuple[list[Scalar], list[int]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return [], []
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is still being written
        self.offset += end
        points, saved = [], []
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
                if rec.get("kind") == "model":
                    saved.append(int(rec["iter"]))
                else:
                    points.append(Scalar(int(rec["step"]), str(rec["tag"]), float(rec["value"]),
                                         float(rec.get("wall_time", 0.0))))
            except (ValueError, KeyError, TypeError):
                self.problems.append(f"{self.path}: unreadable line {line[:80]!r}")
        return points, saved


def metric_source(run_dir: Path, kind: str) -> TfEventsSource | JsonlSource:
    """``jsonl`` (det_lab's LogWriter) or ``tfevents`` (rsl_rl's default TensorBoard writer)."""
    if kind == "jsonl":
        return JsonlSource(run_dir)
    if kind == "tfevents":
        return TfEventsSource(run_dir)
    raise ValueError(f"metrics source must be 'jsonl' or 'tfevents', not {kind!r}")


def checkpoint_path(log_path: Path, run_dir: str = ".*", checkpoint: str = ".*") -> Path:
    """Isaac Lab's ``get_checkpoint_path``: the last run matching ``run_dir`` (a regex, by name) and
    in it the last ``model_*.pt`` matching ``checkpoint`` (by iteration)."""
    log_path = Path(log_path)
    runs = sorted(d.name for d in log_path.iterdir() if d.is_dir() and re.match(run_dir, d.name)) \
        if log_path.is_dir() else []
    if not runs:
        raise FileNotFoundError(f"no run directory in {log_path} matches {run_dir!r}")
    run = log_path / runs[-1]
    found = [p for _, p in models(run) if re.match(checkpoint, p.name)]
    if not found:
        raise FileNotFoundError(f"no checkpoint in {run} matches {checkpoint!r}")
    return found[-1]
