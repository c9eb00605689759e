"""A run's ``metrics.jsonl`` as :meth:`det_lab.runs.record.RunRecord.append_metrics` writes it (one
``{"group", "step", "metrics"}`` JSON object a line), and the progress read back from it: the highest
training step and the last validation metrics, fast for the file as written, line by line otherwise."""

from __future__ import annotations

import json
import re

from det_lab.jsonload import loads

#: how append_metrics starts its lines (json.dumps of {"group", "step", "metrics"}, in that order)
_LINE_HEAD = b'{"group": '
_TRAINING_HEAD = b'{"group": "training", "step": '
_VALIDATION_HEAD = b'{"group": "validation", "step": '
_TRAINING_STEP = re.compile(rb'\n\{"group": "training", "step": (\d+), ')


def parse_progress(data: bytes) -> tuple[int, dict[str, float]]:
    """The highest training step and the last validation metrics in a ``metrics.jsonl``'s bytes
    (a last line without its newline is being written: left for the next read)."""
    complete = data[:data.rfind(b"\n") + 1]
    fast = _progress_as_written(complete)
    if fast is not None:
        return fast
    step, last = 0, None
    for line in complete.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if not isinstance(m, dict):
            continue
        if m.get("group") == "training" and isinstance(m.get("step"), int):
            step = max(step, m["step"])
        elif m.get("group") == "validation" and isinstance(m.get("metrics"), dict):
            last = m
    return step, (last["metrics"] if last else {})


def _progress_as_written(complete: bytes) -> tuple[int, dict[str, float]] | None:
    """:func:`parse_progress` by counting, in C, for a file whose every line is one whole training
    or validation line as append_metrics writes it (runs list reads every run's metrics); None
    for any other file (a torn line followed by the next append has two heads on one line)."""
    lines = complete.count(b"\n")
    framed = b"\n" + complete  # every line, the first included, follows a newline
    steps = _TRAINING_STEP.findall(framed)
    # every line starts with a training or validation head, holds no second one and ends in "}}"
    if not lines or complete.count(_LINE_HEAD) != lines or complete.count(b"}}\n") != lines or \
            len(steps) + framed.count(b"\n" + _VALIDATION_HEAD) != lines:
        return None
    step = max(map(int, steps), default=0)
    at = complete.rfind(_VALIDATION_HEAD)
    if at < 0:
        return step, {}
    if at > 0 and complete[at - 1:at] != b"\n":
        return None
    try:
        metrics = loads(complete[at:complete.index(b"\n", at)])["metrics"]
    except (ValueError, KeyError, TypeError):
        return None
    return (step, metrics) if isinstance(metrics, dict) else None
