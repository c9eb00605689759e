"""The GPUs of one ``det-lab run --local``: chosen, waited for in line, handed to the trial, given back.

A run takes ``resources.slots_per_trial`` GPUs of this machine (Determined's default: 1), or the GPUs
``--gpus`` names. With 0, or on a machine without GPUs, it takes none and trains on the CPU as before
(with 0 on a GPU machine its trial sees no GPU). Inside a Slurm job or a Determined task
(``SLURM_JOB_ID`` / ``DET_TASK_ID`` set) the run uses the GPUs it was given and takes no lease. The
trial gets ``CUDA_VISIBLE_DEVICES`` by GPU UUID (an index would change meaning under another
``CUDA_DEVICE_ORDER``). The lease is held by this ``det-lab run`` process: it ends with it, however it ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from det_lab import nvml
from det_lab.gpus import journal
from det_lab.gpus.holders import ProcessId, user_name
from det_lab.gpus.leases import HEARTBEAT_S, Held, HostBook, host_name, shared_dir, write_json
from det_lab.gpus.queue import GpusError, Rules, lab_rules, plan
from det_lab.settings import LabSettings
from det_lab.runs.record import WAIT_KEY, LocalRunRecord
from det_lab.runs.run_guard import lock_lifetime_s

#: set in a Slurm job's and a Determined task's environment: their GPUs are given, not leased here
SCHEDULED_ENV = ("SLURM_JOB_ID", "DET_TASK_ID")
POLL_S = 0.5


def parse_picks(text: str | None) -> list[int] | None:
    """``--gpus 0,1`` as indices (None: not given); a malformed list is one line."""
    if text is None:
        return None
    try:
        picks = [int(p) for p in text.split(",") if p.strip() != ""]
    except ValueError:
        raise GpusError(f"--gpus {text}: give GPU indices separated by commas, such as 0,1 (det-lab gpus lists them)") from None
    if not picks or any(p < 0 for p in picks) or len(set(picks)) != len(picks):
        raise GpusError(f"--gpus {text}: give distinct GPU indices separated by commas, such as 0,1")
    return picks


def wanted_slots(conf: dict[str, Any]) -> int:
    raw = (conf.get("resources") or {}).get("slots_per_trial")
    slots = 1 if raw is None else int(raw)
    if slots < 0:
        raise GpusError(f"resources.slots_per_trial={slots}: give 0 (CPU) or a number of GPUs")
    return slots


class LocalClaim:
    """The GPUs of one local run; a context manager whose exit gives them back."""

    def __init__(self, settings: LabSettings, picks: str | None = None, queue: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.picks = parse_picks(picks)
        self.queue = queue
        self.env = os.environ if env is None else env
        self.book = HostBook()
        self.held: Held | None = None
        self.slots = 0
        self.readings: list[nvml.GpuReading] = []
        self.rules = Rules()
        self.pending: dict[str, Any] | None = None  # the queue entry to wait with, when the GPUs were not free
        self.cpu_env: dict[str, str] = {}
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    # -- before the run exists -------------------------------------------------------------
    def check(self, conf: dict[str, Any], run: str, template: str) -> None:
        """Called by :func:`det_lab.runs.local.prepare` before it makes anything: refuse a request
        this machine cannot meet, take the GPUs when they are free, else (with ``--queue``) get ready to wait."""
        scheduled = next((v for v in SCHEDULED_ENV if self.env.get(v)), None)
        if scheduled:
            if self.picks is not None:
                raise GpusError(f"--gpus: this run is inside a scheduled task ({scheduled} is set) and uses the GPUs it was given")
            return
        self.slots = len(self.picks) if self.picks is not None else wanted_slots(conf)
        self.readings = _read_gpus()
        if not self.readings:
            if self.picks is not None:
                raise GpusError(f"--gpus {','.join(map(str, self.picks))}: this machine has no GPU that NVML sees")
            return  # CPU, as on any machine without GPUs
        if self.slots == 0:
            self.cpu_env = {"CUDA_VISIBLE_DEVICES": ""}  # asked for none: the trial sees none
            return
        n = len(self.readings)
        bad = [i for i in self.picks or [] if i >= n]
        if bad:
            raise GpusError(f"--gpus {','.join(map(str, self.picks or []))}: this machine has GPU{'s' if n > 1 else ''} "
                            f"{'0' if n == 1 else f'0-{n - 1}'}, no GPU {bad[0]} (det-lab gpus lists them)")
        if self.slots > n:
            raise GpusError(f"resources.slots_per_trial={self.slots}, but this machine has {n} GPU(s): "
                            f"--set resources.slots_per_trial={n} or fewer")
        self.rules = lab_rules(self.settings)
        user = user_name()
        limit = self.rules.limit(user)
        if limit is not None and self.slots > limit:
            raise GpusError(f"{user} may hold at most {limit} GPU(s) at once (accounting in {self.rules.source}); "
                            f"ask for fewer (--set resources.slots_per_trial={limit})")
        lab = ((conf.get("data") or {}).get("det_lab") or {})
        plimit = self.rules.project_limits.get(str(lab.get("project") or ""))
        if plimit is not None and self.slots > plimit:
            raise GpusError(f"project {lab.get('project')} may hold at most {plimit} GPU(s) at once (accounting in "
                            f"{self.rules.source}); ask for fewer (--set resources.slots_per_trial={plimit})")
        entry = {"entry": os.urandom(6).hex(), "user": user, "run": run, "project": str(lab.get("project") or ""),
                 "template": template, "slots": self.slots, "picks": self.picks,
                 "holder": ProcessId.me().as_dict(), "enqueued": time.time(), "words": ""}
        why = self._try(entry)
        if why is None:
            return
        if not self.queue:
            raise GpusError(f"run {run} needs {self.slots} GPU(s) of {host_name()}: {why}. Pass --queue to wait "
                            f"in line (det-lab gpus shows who holds them)")
        self.pending = entry

    def _try(self, entry: dict[str, Any], enqueued: bool = False) -> str | None:
        """Take the GPUs for ``entry`` if the queue's plan starts it now (None), else why it waits."""
        with self.book.lock():
            live = self.book.reap(self.settings)
            readings = _read_gpus()
            queue = [h.data for h in self.book.queue() if h.data["entry"] != entry["entry"]] + [entry]
            now = time.time()
            usage = journal.recent_gpu_hours(journal.read_records(self.settings), now, self.rules.half_life_s)
            step = plan(readings, live, queue, usage, self.rules)
            got = step.starts.get(entry["entry"])
            if got is None:
                why = step.reasons.get(entry["entry"], "waiting")
                if enqueued and why != entry["words"]:
                    entry["words"] = why
                    write_json(self.book.queue_dir / f"{entry['entry']}.json", entry)
                return why
            by_index = {r.index: r.uuid for r in readings}
            try:
                self.held = self.book.take(self.settings, [(i, by_index[i]) for i in got], entry["run"],
                                           entry["project"], entry["template"], ProcessId.from_dict(entry["holder"]))
            except OSError as exc:
                raise GpusError(f"cannot journal the GPU lease on the volume ({exc}); is {self.settings.data_root} "
                                f"mounted and writable?") from None
            # beating on the volume from now (its own thread: a volume that hangs must not stop the local heartbeat)
            self._beats = threading.Thread(target=self._volume_heartbeat, name="det-lab-gpu-lease-volume", daemon=True)
            self._beats.start()
            if enqueued:
                (self.book.queue_dir / f"{entry['entry']}.json").unlink(missing_ok=True)
            return None

    # -- once the run exists -----------------------------------------------------------------
    def wait(self, run: LocalRunRecord, on_wait: Callable[[str], None] | None = None) -> dict[str, str]:
        """Wait in line when the GPUs were not free (``run`` marked ``waiting`` meanwhile, with the
        waiting process in ``WAIT_KEY``, so it lists as waiting and nothing deletes it; SIGTERM from
        ``det-lab runs cancel`` ends the wait with KeyboardInterrupt); then the trial's environment:
        ``CUDA_VISIBLE_DEVICES`` of the lease."""
        entry = self.pending
        if entry is not None:
            with self.book.lock():
                write_json(shared_dir(self.book.queue_dir) / f"{entry['entry']}.json", entry)
            run.update(status="waiting", **{WAIT_KEY: {"host": host_name(), "pid": os.getpid()}})
            old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
            said = None
            try:
                while True:
                    why = self._try(entry, enqueued=True)
                    if why is None:
                        break
                    if on_wait and why != said:
                        on_wait(why)
                        said = why
                    time.sleep(POLL_S)
            except BaseException:
                (self.book.queue_dir / f"{entry['entry']}.json").unlink(missing_ok=True)
                raise
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
            self.pending = None
            run.update(status="created", **{WAIT_KEY: None})  # the trial says "running" once it trains
        if self.held is None:
            return dict(self.cpu_env)
        threading.Thread(target=self._heartbeat, name="det-lab-gpu-lease", daemon=True).start()
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.held.uuids), "DET_LAB_GPU_LEASE": self.held.id}

    def _heartbeat(self) -> None:
        held = self.held
        while held is not None and not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(held.path)
            except OSError:
                pass

    def _volume_heartbeat(self) -> None:
        """Beat on the volume every third of the lock lifetime, so other machines see the holder lives."""
        held, period = self.held, lock_lifetime_s() / 3
        while held is not None and not self._stop.wait(period):
            try:
                journal.beat(self.settings, held.id)
            except OSError:
                pass

    def gpus_words(self) -> str:
        """The GPUs held, for the run's first lines ('' for none)."""
        if self.held is None:
            return ""
        names = {r.index: r.name for r in self.readings}
        return ", ".join(f"GPU {g['index']} ({names.get(int(g['index']), '')} {g['uuid']})".replace(" )", ")").replace("( ", "(")
                         for g in self.held.data["gpus"])

    def release(self) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5)  # its last beat lands before the end, not after
        if self.held is not None:
            self.book.release(self.settings, self.held)
            self.held = None

    def __enter__(self) -> LocalClaim:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _read_gpus() -> list[nvml.GpuReading]:
    try:
        return nvml.read_gpus()
    except Exception as exc:  # pynvml.NVMLError (its subclasses are made at import): a broken driver is not a CPU machine
        raise GpusError(f"NVML cannot read this machine's GPUs ({exc}); fix the driver, or train on the CPU with "
                        f"--set resources.slots_per_trial=0") from None


def _interrupt(signum: int, frame: object) -> None:  # noqa: ARG001 (signal handler signature)
    raise KeyboardInterrupt

