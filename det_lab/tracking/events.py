"""What the mirror carries: a run's identity and the events recorded for it.

Events are plain, JSON-serialisable dataclasses so that the journal can store them and replay
them in order after an outage or a restart.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union


@dataclass(frozen=True)
class RunInfo:
    """Identity of a tracker run.

    ``key`` is stable across restarts of the same trial (for example
    ``det-<cluster>-e12-t34``): a resumed trial continues the tracker run with that key.
    """

    key: str
    name: str
    experiment: str = "det_lab"  # MLflow experiment / Aim experiment the run belongs to
    tags: dict[str, str] = field(default_factory=dict)  # experiment/trial ids, URL, lineage, versions


@dataclass(frozen=True)
class Metrics:
    kind: ClassVar[str] = "metrics"
    group: str  # Determined's group: "training", "validation" or a custom one
    step: int
    values: dict[str, float]
    timestamp: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Params:
    kind: ClassVar[str] = "params"
    values: dict[str, str]


@dataclass(frozen=True)
class Tags:
    kind: ClassVar[str] = "tags"
    values: dict[str, str]


@dataclass(frozen=True)
class Checkpoint:
    kind: ClassVar[str] = "checkpoint"
    uuid: str
    step: int
    metadata: dict[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Artifact:
    """A file to attach to the run (a rendered image, a plot). The file must stay in place
    until delivered, so write it under the run's outputs, not a temp dir."""

    kind: ClassVar[str] = "artifact"
    path: str
    name: str  # MLflow artifact directory / Aim sequence name
    step: int
    media: str = "file"  # "image": shown as an image in Aim (and MLflow's artifact view)


Event = Union[Metrics, Params, Tags, Checkpoint, Artifact]
_KINDS: dict[str, type] = {cls.kind: cls for cls in (Metrics, Params, Tags, Checkpoint, Artifact)}


def to_record(seq: int, event: Event) -> dict[str, Any]:
    # a shallow copy: dataclasses.asdict deep-copies, and this runs for every journaled event
    return {"seq": seq, "kind": event.kind, **vars(event)}


def from_record(record: dict[str, Any]) -> tuple[int, Event]:
    record = dict(record)
    seq = record.pop("seq")
    cls = _KINDS[record.pop("kind")]
    if "f64t" in record:  # metrics as the mirror writes them: keys; values then the time, as doubles in hex
        *values, record["timestamp"] = array("d", bytes.fromhex(record.pop("f64t")))
        record["values"] = {k: v for k, v in zip(record.pop("keys"), values) if v == v}  # NaN: not a point
    return seq, cls(**record)


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The values of ``metrics`` that are numbers (numpy/torch scalars included), as floats."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v)
        except Exception:  # not a number (a string, a multi-element tensor): not a metric
            continue
    return out


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested hyperparameters as dotted string params (``optimizer.lr`` -> ``"0.001"``)."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(v)
    return out
