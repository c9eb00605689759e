"""A trial's run record: every per-trial path and file format, in one place.

Whoever reads or writes a trial's files goes through a :class:`RunRecord`: the trial process
(:class:`det_lab.trials.session.LabSession`), ``det-lab run``, the notebooks, ``det-lab tracking
sync`` and the RL supervisor. Twins, chosen once where the trial starts (:func:`record_for`):

- :class:`LocalRunRecord` (a :class:`VolumeRunRecord`, as a Slurm run's is): a ``det-lab run
  --local`` run. Its directory
  ``<data root>/outputs/<project>/local-runs/<name>/`` holds ``run.json`` (state: config,
  hyperparameters, checkpoints, outcome), ``train.log``, ``metrics.jsonl`` (every metric group
  reported), ``tracking-summary.json`` (what the mirror delivered), ``tracking-journal/``, the
  RL supervisor's ``work/`` and the trial's outputs.
- :class:`ClusterRunRecord`: a trial run by a Determined master, which keeps its state, metrics
  and checkpoints itself. On the volume: ``<data root>/outputs/<project>/trials/<run key>/``
  (outputs, ``work/``, ``tracking-summary.json``); the journal at
  ``<data root>/outputs/<project>/tracking-journal/<run key>/``.

A new scheduler that runs trials through Determined's harness off-cluster (Slurm) keeps its runs
on the volume too: subclass :class:`VolumeRunRecord`, set ``kind`` and ``runs_dirname``, extend
:meth:`RunRecord.tracker_tags`/:meth:`RunRecord.lineage_extras`, and :func:`register` it;
``run.json``'s ``kind`` then selects it everywhere (:func:`open_record`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, cast

from det_lab.errors import UserError
from det_lab.jsonload import loads
from det_lab.ondisk import RUN_RECORD, check, refuse_overwrite, stamped
from det_lab.settings import LabSettings
from det_lab.runs.metrics_file import _progress_as_written, parse_progress  # noqa: F401  (re-exported)
from det_lab.runs.run_state import RunState, RunStatus  # noqa: F401  (RunStatus: re-exported)
from det_lab.volume import VolumeLayout, atomic_write_text

if TYPE_CHECKING:
    from det_lab.runs.fence import Fence

RUN_FILE = "run.json"
LOG_FILE = "train.log"
METRICS_FILE = "metrics.jsonl"
TRACKING_SUMMARY_FILE = "tracking-summary.json"
JOURNAL_DIR = "tracking-journal"
WORK_DIR = "work"
#: run.json key of a ``det-lab reproduce`` run: which run (and checkpoint) it reproduces
REPRODUCES_KEY: Final = "reproduces"
#: run.json key of the progress an ended run reached (:meth:`RunRecord.record_end`)
PROGRESS_KEY: Final = "progress"
#: run.json key of a local run waiting in line for GPUs: the host and pid of its ``det-lab run``
WAIT_KEY: Final = "waiting_for_gpus"


class RunRecordError(UserError, ValueError):
    """A damaged run.json, as one line naming it and the fix (a ValueError: readers that skip damaged runs catch that)."""


def read_run_file(path: Path) -> dict[str, Any]:
    """A run.json as a dict; a damaged one is a one-line :class:`RunRecordError` naming it and the fix."""
    with open(path, "rb") as f:
        return parse_run_file(f.read(), path)


def parse_run_file(data: bytes, path: Path | str) -> dict[str, Any]:
    """The bytes of the run.json at ``path`` as a dict (see :func:`read_run_file`); one a newer
    det_lab wrote is a :class:`~det_lab.ondisk.NewerFormat`."""
    try:
        state = loads(data)
        problem = None if isinstance(state, dict) else "not a JSON object"
    except ValueError as exc:  # also bytes that are not UTF-8
        problem = str(exc)
    if problem:
        raise RunRecordError(f"{path}: damaged run record ({problem}); this run cannot be resumed: "
                         "restore its run.json from a backup or start a new run")
    return cast(dict[str, Any], check(state, RUN_RECORD, path))


class RunRecord:
    """The files of one trial under ``dir`` (see the module docstring)."""

    kind: ClassVar[str] = ""
    #: whether det_lab keeps the trial's state and metrics (a Determined master keeps its own)
    keeps_progress: ClassVar[bool] = True

    def __init__(self, directory: Path) -> None:
        self.dir = directory if isinstance(directory, Path) else Path(directory)
        self._high_water: dict[tuple[str, str], int] | None = None  # (group, key) -> last step written
        #: the attempt this process writes as (a Slurm job's trial and driver; det_lab.runs.fence)
        self.fence: Fence | None = None

    def _replace(self, path: Path, text: str, what: str) -> None:
        if self.fence is None:
            atomic_write_text(path, text)
        else:
            self.fence.publish(path, text, what)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.dir)!r})"

    # --- paths ---------------------------------------------------------------------------------------

    @property
    def run_file(self) -> Path:
        return self.dir / RUN_FILE

    @property
    def log_file(self) -> Path:
        return self.dir / LOG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.dir / METRICS_FILE

    @property
    def tracking_summary_file(self) -> Path:
        return self.dir / TRACKING_SUMMARY_FILE

    @property
    def journal_dir(self) -> Path:
        return self.dir / JOURNAL_DIR

    @property
    def rl_work_dir(self) -> Path:
        """Where the RL supervisor runs its training command (its ``logs/`` tree lives there)."""
        return self.dir / WORK_DIR

    @property
    def outputs_dir(self) -> Path:
        """Where the trial writes anything besides checkpoints (renders, exported policies)."""
        return self.dir

    # --- state ---------------------------------------------------------------------------------------

    def state(self) -> RunState:
        """The run's ``run.json`` (:class:`~det_lab.runs.run_state.RunState`); a damaged one is a
        :class:`RunRecordError`."""
        return cast(RunState, read_run_file(self.run_file))

    def save(self, state: RunState | dict[str, Any]) -> None:
        """Write run.json, stamped; never over one a newer det_lab wrote (:class:`~det_lab.ondisk.NewerFormat`)."""
        refuse_overwrite(self.run_file, RUN_RECORD)
        self._replace(self.run_file, json.dumps(stamped(state, RUN_RECORD), indent=2, default=str) + "\n",
                      "the run record")

    def update(self, **changes: Any) -> RunState:
        state = cast(RunState, {**self.state(), **changes})
        self.save(state)
        return state

    def metrics(self) -> list[dict[str, Any]]:
        """Every ``{"group", "step", "metrics"}`` reported so far (a line being written is skipped)."""
        return self.metrics_since(0)[0]

    def metrics_since(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The records whose lines start at byte ``offset`` or later, and the offset to read from
        next time: a watcher polls a long run without reading it all again."""
        try:
            with open(self.metrics_file, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        out = []
        for line in complete.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out, offset + len(complete)

    def progress(self) -> tuple[int, dict[str, float]]:
        """Latest training step reported, and the latest validation metrics."""
        return parse_progress(self._metrics_bytes())

    def _metrics_bytes(self) -> bytes:
        try:
            return self.metrics_file.read_bytes()
        except FileNotFoundError:
            return b""

    def record_end(self, **changes: Any) -> RunState:
        """Update run.json with how the run ended (``status``, ...) and the progress it reached,
        under :data:`PROGRESS_KEY` with the size of ``metrics.jsonl`` it was read from: a listing
        takes it while the metrics keep that size (they only grow) instead of reading them."""
        data = self._metrics_bytes()
        step, validation = parse_progress(data)
        return self.update(**changes, **{PROGRESS_KEY: {"step": step, "validation": validation,
                                                        "metrics_bytes": len(data)}})

    def tracking_summary(self) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], json.loads(self.tracking_summary_file.read_text()))
        except FileNotFoundError:
            return None

    # --- written by the trial's chief process --------------------------------------------------------

    def append_metrics(self, group: str, step: int, metrics: dict[str, Any]) -> None:
        """Append one report; a key already recorded at this or a later step is left out (a
        resumed trial replays the steps after its checkpoint), so each (group, key, step) is once."""
        if not self.keeps_progress:
            return
        if self._high_water is None:
            self._high_water = {}
            for m in self.metrics():
                for key in m["metrics"]:
                    self._high_water[(m["group"], key)] = max(m["step"], self._high_water.get((m["group"], key), m["step"]))
        step = int(step)
        from det_lab.tracking.events import numeric  # the tracking package is not a listing's to import

        fresh = {k: v for k, v in numeric(metrics).items() if step > self._high_water.get((group, k), step - 1)}
        if not fresh:
            return
        self._high_water.update(((group, k), step) for k in fresh)
        line = json.dumps({"group": group, "step": step, "metrics": fresh}) + "\n"
        with open(self.metrics_file, "a") as f:
            if self.fence is not None:  # opened first: a copy cut off before this check writes nothing
                self.fence.check(f"{group} metrics of step {step}")
            f.write(line)

    def add_checkpoint(self, uuid: str, step: int) -> None:
        """A complete checkpoint: it becomes the latest only now, and only if no later step is latest
        already (a late report, such as a stale copy's after a partition, never moves it back)."""
        if self.keeps_progress:
            state = self.state()
            if state.get("latest_checkpoint") and step < int(state.get("latest_checkpoint_step") or 0):
                return
            state["latest_checkpoint"], state["latest_checkpoint_step"] = uuid, step
            state.setdefault("checkpoints", []).append({"uuid": uuid, "step": step})
            self.save(state)

    def note_lineage(self, lineage: dict[str, Any]) -> None:
        """Keep the lineage the run started with in ``run.json`` (a resume keeps the first: each
        checkpoint's metadata has its own)."""
        if self.keeps_progress and "lineage" not in self.state():
            self.update(lineage=lineage)

    def record_outcome(self, status: str, summary: dict[str, Any] | None) -> None:
        """How the trial ended (FINISHED, KILLED when stopped early, FAILED) and what the mirror delivered."""
        if summary is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._replace(self.tracking_summary_file,
                          json.dumps({**summary, "status": status}, indent=2, default=str) + "\n", "the tracking summary")
        if self.keeps_progress:
            self.update(trial_status=status)

    # --- what the trial's tracker run and lineage carry ----------------------------------------------

    def tracker_tags(self) -> dict[str, str]:
        return {}

    def lineage_extras(self) -> dict[str, Any]:
        return {}


class VolumeRunRecord(RunRecord):
    """A run whose directory det_lab keeps on the volume, ``<data root>/outputs/<project>/<kind's
    runs directory>/<name>/``: the base of a local run's record and a Slurm run's."""

    runs_dirname: ClassVar[str]

    @classmethod
    def runs_root(cls, layout: VolumeLayout, project: str) -> Path:
        return layout.outputs(project) / cls.runs_dirname

    @classmethod
    def scheduler_listing(cls) -> contextlib.AbstractContextManager[None]:
        """A block within which :meth:`scheduled` of many runs of this kind asks the scheduler
        once (a Slurm run's overrides it); nothing to do by default."""
        return contextlib.nullcontext()

    def scheduled(self, state: RunState) -> str | None:
        """Why a scheduler will still start or is running this run's trial, in words; None when
        none will."""
        return None

    def tracker_tags(self) -> dict[str, str]:
        tags = {"det.local_run": self.dir.name, "det.local_run_dir": str(self.dir)}
        origin = self.state().get(REPRODUCES_KEY) if self.run_file.is_file() else None
        if origin:  # a det-lab reproduce run names the run it reproduces
            tags.update({f"det_lab.reproduces.{k}": str(v) for k, v in origin.items() if v is not None})
        return tags


class LocalRunRecord(VolumeRunRecord):
    """A ``det-lab run --local`` run: ``<data root>/outputs/<project>/local-runs/<name>/``."""

    kind = "local"
    runs_dirname: ClassVar[str] = "local-runs"

    def scheduled(self, state: RunState) -> str | None:
        """A local run in line for GPUs while its det-lab run lives; its trainer lock says the
        rest (run_guard)."""
        wait = state.get(WAIT_KEY) if state.get("status") == RunStatus.WAITING else None
        if not isinstance(wait, dict):
            return None
        import socket

        from det_lab.data.lock import pid_alive

        pid = int(wait.get("pid") or 0)
        if wait.get("host") == socket.gethostname().split(".")[0] and (pid <= 0 or not pid_alive(pid)):
            return None  # its det-lab run is gone: it will never start
        return f"it waits for GPUs as pid {wait.get('pid')} on host {wait.get('host')}"


class ClusterRunRecord(RunRecord):
    """A trial run by a Determined master (or a bare ``det_lab.core.init`` outside any run)."""

    kind = "cluster"
    keeps_progress = False

    def __init__(self, layout: VolumeLayout, project: str, run_key: str) -> None:
        super().__init__(layout.outputs(project) / "trials" / run_key)
        self._journal = layout.outputs(project) / JOURNAL_DIR / run_key

    @property
    def journal_dir(self) -> Path:
        return self._journal

    @classmethod
    def journals(cls, layout: VolumeLayout, project: str) -> list[Path]:
        return sorted(p.parent for p in (layout.outputs(project) / JOURNAL_DIR).glob(f"*/{RUN_FILE}"))


_KINDS: dict[str, type[VolumeRunRecord]] = {LocalRunRecord.kind: LocalRunRecord}


def register(cls: type[VolumeRunRecord]) -> type[VolumeRunRecord]:
    """Make a local-style record kind known to :func:`open_record` and :func:`iter_records`."""
    _KINDS[cls.kind] = cls
    return cls


def open_record(directory: Path) -> VolumeRunRecord:
    """The record of an existing local-style run directory, of the kind its ``run.json`` names.

    A kind not registered yet is looked for in ``det_lab.<kind>.record`` (``det_lab.slurm.record``),
    so a trial process gets its twin without importing it first."""
    kind = read_run_file(Path(directory) / RUN_FILE).get("kind", LocalRunRecord.kind)
    return _load_kind(kind)(Path(directory))


#: the kinds det_lab ships besides "local"; each module registers its kind when imported
SHIPPED_KINDS = ("slurm",)


def _load_kind(kind: str) -> type[VolumeRunRecord]:
    """The record class of ``kind``, importing ``det_lab.<kind>.record`` if it is not registered
    yet (plain local records for a kind det_lab does not know)."""
    if kind not in _KINDS and re.fullmatch(r"[a-z_]+", kind):
        try:
            importlib.import_module(f"det_lab.{kind}.record")
        except ImportError:
            pass
    return _KINDS.get(kind, LocalRunRecord)


def run_dirs(layout: VolumeLayout, project: str, probe: bool = True) -> list[tuple[Path, type[VolumeRunRecord]]]:
    """Every local-style run directory of ``project`` with its record class, in no order: one
    listing per kind's runs directory, no run file read (where a run is says its kind). Only those
    holding a run.json, unless not ``probe`` (a caller that reads each run.json, skipping those
    that are not there)."""
    for kind in SHIPPED_KINDS:  # a caller that never imported a kind's module still sees its runs
        _load_kind(kind)
    out: list[tuple[Path, type[VolumeRunRecord]]] = []  # each kind its own directory: no run twice
    for cls in set(_KINDS.values()):
        root = cls.runs_root(layout, project)
        try:
            with os.scandir(root) as entries:
                names = [e.name for e in entries if not e.name.startswith(".")]  # .<name>.tmp: being created
        except OSError:  # absent, or a project this user may not read (as glob did)
            continue
        base = str(root)
        out.extend((root / name, cls) for name in names
                   if not probe or os.path.exists(os.path.join(base, name, RUN_FILE)))
    return out


def iter_records(layout: VolumeLayout, project: str) -> Iterator[VolumeRunRecord]:
    """Every local-style run of ``project`` (each kind's runs directory), oldest first."""
    for d, cls in sorted(run_dirs(layout, project), key=lambda item: item[0].stat().st_mtime):
        yield cls(d)


def find_journals(layout: VolumeLayout, projects: list[str]) -> Iterator[Path]:
    """Every tracking journal on the volume: cluster trials' and local-style runs'."""
    for project in sorted(projects):
        yield from ClusterRunRecord.journals(layout, project)
        # the run directories, then one stat each: not a record (and a run.json read) per run
        yield from sorted(d / JOURNAL_DIR for d, _ in run_dirs(layout, project, probe=False)
                          if os.path.exists(os.path.join(d, JOURNAL_DIR, RUN_FILE)))


def volume_journals(settings: LabSettings) -> Iterator[Path]:
    """Every tracking journal on the volume of ``settings``, over all its projects (:func:`find_journals`)."""
    yield from find_journals(VolumeLayout.from_settings(settings), list(settings.projects))


def record_for(layout: VolumeLayout, project: str, run_key: str, record_dir: Path | None) -> RunRecord:
    """The record twin of a starting trial: its local-style run's, else the cluster one."""
    if record_dir is not None:
        return open_record(record_dir)
    return ClusterRunRecord(layout, project, run_key)
