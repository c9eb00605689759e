"""The exporter's collector: every scrape builds its metrics afresh from each source.

A source is slow (``squeue``, a walk of the volume) or fast (NVML); each says how long its figures
may be reused (``ttl``). ``det-lab exporter`` reads every source once before it listens
(:meth:`LabCollector.prime`); after that, a scrape that finds an answer
older than ``ttl`` answers with it and starts a refresh in the background, so a scrape never waits
for a walk of a large volume or a ``squeue`` that hangs (the answer it gives is at most ``ttl``
plus one refresh old). A source never read is read in the scrape; one whose first read is still
under way is that scrape's error. A ``ttl`` of 0 reads the source in every scrape. A source that
fails exports no series of its own and sets ``det_lab_scrape_error{source}`` to 1: a broken
``squeue`` must never read as an idle cluster. A label set that is gone from a source (a finished
job) is gone from the next scrape, because nothing is kept between scrapes except each source's
last whole answer, for its ``ttl``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from det_lab.monitoring.series import BY_NAME, series_of
from det_lab.volume import VolumeLayout

if TYPE_CHECKING:
    from det_lab.settings import LabSettings

PREFIX = "det_lab_"


class Source(Protocol):
    """One thing the exporter watches."""

    name: str
    ttl: float  # seconds its answer may be reused

    def collect(self) -> Iterable[Metric]:
        """Every metric family of this source, now; raises when the source cannot be read."""


class VolumeReader:
    """Base of the sources that read the lab's shared volume (its runs, journals, bytes)."""

    name: str

    def __init__(self, settings: LabSettings, ttl: float = 15.0) -> None:
        self.settings = settings
        self.ttl = ttl
        self.layout = VolumeLayout.from_settings(settings)

    def mounted_root(self) -> Path:
        """The data root; ``FileNotFoundError`` (this source's scrape error) when it is not mounted."""
        root = self.settings.data_root
        if not root.is_dir():
            raise FileNotFoundError(f"data root {root} is not mounted")
        return root


class Families:
    """Builds gauge families by name, adding samples as they come (one family per name)."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily] = {}

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
        full = PREFIX + name
        if full not in self._families:
            declared = BY_NAME.get(name)  # the help text is declared once, in series.py
            self._families[full] = GaugeMetricFamily(full, declared.help if declared else doc, labels=list(labels))
        return self._families[full]

    def add(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        self.gauge(name, doc, list(labels)).add_metric([str(v) for v in labels.values()], float(value))

    def __iter__(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families.values())


@dataclass
class _Cached:
    at: float = float("-inf")
    metrics: list[Metric] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    refreshing: bool = False


class LabCollector(Collector):
    """Registered once in a registry; ``collect`` runs on every scrape."""

    def __init__(self, sources: Sequence[Source], clock=time.monotonic) -> None:
        self.sources = list(sources)
        self._clock = clock
        self._cache = {s.name: _Cached() for s in self.sources}
        self._lock = threading.Lock()  # two scrapes at once read each slow source once

    def _read(self, source: Source) -> _Cached:
        cached = self._cache[source.name]
        now = self._clock()
        if cached.at == float("-inf") and cached.refreshing:  # its first answer is not there yet
            return _Cached(now, [], "not read yet: its first read is still under way")
        if now - cached.at < source.ttl or cached.refreshing:
            return cached
        if cached.at == float("-inf") or source.ttl <= 0:
            return self._refresh(source)
        cached.refreshing = True
        threading.Thread(target=self._refresh, args=(source,), name=f"refresh-{source.name}", daemon=True).start()
        return cached

    def _refresh(self, source: Source) -> _Cached:
        start = time.perf_counter()
        try:
            metrics, error = list(source.collect()), None
        except Exception as exc:  # any failure of a source is its scrape error, never the exporter's
            metrics, error = [], f"{type(exc).__name__}: {exc}"
        fresh = _Cached(self._clock(), metrics, error, time.perf_counter() - start)
        self._cache[source.name] = fresh  # one assignment: a scrape sees the old answer or the new one
        return fresh

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            answers = {s.name: self._read(s) for s in self.sources}
        error = GaugeMetricFamily(PREFIX + "scrape_error",
                                  "1 when the source could not be read at the last refresh (its series are then absent)",
                                  labels=["source"])
        seconds = GaugeMetricFamily(PREFIX + "scrape_duration_seconds", "how long the source's last refresh took",
                                    labels=["source"])
        age = GaugeMetricFamily(PREFIX + "scrape_age_seconds",
                                "how old the source's answer is (its ttl, plus a refresh under way)", labels=["source"])
        now = self._clock()
        for name, answer in answers.items():
            error.add_metric([name], 1.0 if answer.error else 0.0)
            seconds.add_metric([name], answer.seconds)
            age.add_metric([name], max(now - answer.at, 0.0))
        yield error
        yield seconds
        yield age
        for answer in answers.values():
            yield from answer.metrics

    def prime(self, timeout: float = 60.0) -> list[str]:
        """Read every source not read yet, so that the first scrape answers from memory; returns
        the names of those still reading after ``timeout`` seconds (they go on in the background;
        until they answer, a scrape gives their scrape error). The sources that read the volume
        go one after another in one thread (side by side, Python threads contend for the GIL and
        are slower than in turn); each other source (a command, a driver: waiting outside Python)
        gets a thread of its own, so a ``squeue`` that hangs delays nobody."""
        with self._lock:
            unread = [s for s in self.sources
                      if self._cache[s.name].at == float("-inf") and not self._cache[s.name].refreshing]
            for source in unread:
                self._cache[source.name].refreshing = True
        volume = [s for s in unread if isinstance(s, VolumeReader)]
        groups = ([volume] if volume else []) + [[s] for s in unread if not isinstance(s, VolumeReader)]
        threads = [threading.Thread(target=lambda group=group: [self._refresh(s) for s in group],
                                    name=f"prime-{group[0].name}", daemon=True) for group in groups]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return [s.name for s in unread if self._cache[s.name].at == float("-inf")]

    def errors(self) -> dict[str, str]:
        """Each source whose last read failed, with why."""
        return {name: cached.error for name, cached in self._cache.items() if cached.error}

    def wait_refreshes(self, timeout: float = 60.0) -> bool:
        """Wait for background refreshes under way; False if one is still running at ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(c.refreshing for c in self._cache.values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def describe(self) -> list[Metric]:
        """Every family this collector's sources may export (``series.SERIES``), without samples."""
        return [GaugeMetricFamily(PREFIX + s.name, s.help, labels=list(s.labels))
                for s in series_of([source.name for source in self.sources])]
