"""``det-lab exporter``: the collector over the chosen sources, served over HTTP or written for
node_exporter's textfile collector."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile

from det_lab.errors import UserError
from det_lab.monitoring.collector import LabCollector, Source
from det_lab.settings import LabSettings

SOURCES = ("gpus", "slurm", "volume", "runs", "trackers")
DEFAULT_PORT = 9540
TEXTFILE_NAME = "det_lab.prom"


def default_sources(settings: LabSettings) -> list[str]:
    """Every source, Slurm only where this machine reaches a Slurm cluster (or a Slurm config says there is one)."""
    from det_lab.slurm.settings import default_slurm_file

    slurm = shutil.which("squeue") is not None or default_slurm_file(settings).is_file()
    return [s for s in SOURCES if s != "slurm" or slurm]


class ExporterError(UserError, ValueError):
    """An exporter option that names no source, as one line."""


def build_sources(settings: LabSettings, names: Sequence[str]) -> list[Source]:
    """The sources called ``names`` (see :data:`SOURCES`); :class:`ExporterError` for an unknown one."""
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ExporterError(f"unknown source {unknown[0]!r} (sources: {', '.join(SOURCES)})")
    out: list[Source] = []
    for name in dict.fromkeys(names):
        if name == "gpus":
            from det_lab.monitoring.source_gpus import GpuSource
            out.append(GpuSource())
        elif name == "slurm":
            from det_lab.monitoring.source_slurm import SlurmSource
            out.append(SlurmSource())
        elif name == "volume":
            from det_lab.monitoring.source_volume import VolumeSource
            out.append(VolumeSource(settings))
        elif name == "runs":
            from det_lab.monitoring.source_runs import RunsSource
            out.append(RunsSource(settings))
        else:
            from det_lab.monitoring.source_trackers import TrackersSource
            out.append(TrackersSource(settings))
    return out


def registry_for(sources: Sequence[Source]) -> tuple[CollectorRegistry, LabCollector]:
    registry = CollectorRegistry(auto_describe=False)
    collector = LabCollector(sources)
    registry.register(collector)
    return registry, collector


def serve(registry: CollectorRegistry, port: int, address: str):
    """Serve ``/metrics`` on ``address:port`` in a background thread; returns (server, thread)."""
    return start_http_server(port, addr=address, registry=registry)


def write_textfile(registry: CollectorRegistry, directory: Path) -> Path:
    """Write ``<directory>/det_lab.prom`` whole (a temp file renamed), for node_exporter."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TEXTFILE_NAME
    write_to_textfile(str(path), registry)  # writes <path>.<pid>.<thread>.tmp, then renames
    os.chmod(path, 0o644)
    return path
