"""What a dataset pull gives back: the dataset's identity (its lineage) and where it can be read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetIdentity:
    """Lineage of a pulled dataset: enough to reproduce it bit for bit."""

    project: str
    repo: str
    rev: str
    commit: str
    path: str
    md5: str  # DVC's hash of the output; for a directory, the hash of its ``.dir`` manifest
    size: int
    nfiles: int

    def as_tags(self, prefix: str = "dataset.") -> dict[str, str]:
        return {f"{prefix}{k}": str(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PulledDataset:
    """A dataset ready to read: ``path`` is read-only and complete."""

    path: Path
    identity: DatasetIdentity
    fetched: bool  # True when this call did the fetch, False when it reused a snapshot
    repaired: tuple[str, ...] = ()  # snapshot files found damaged on reuse and restored
