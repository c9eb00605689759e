"""Mirror tracking events into an Aim repository (a local repo or a remote ``aim server``).

Aim 3.29 specifics this backend deals with:

* **Run identity.** ``Run(run_hash=...)`` only *opens* an existing run (``MissingRunError``
  otherwise), and a new ``Run()`` gets a random ``uuid4().hex[:24]``. A restarted trial on another
  machine must continue the same run, so the hash is derived from ``RunInfo.key`` and the run's
  meta chunk is created under that hash before ``Run`` opens it.
* **Readability.** Readers (``Run(hash, read_only=True)``, ``Repo.query_metrics``, ``aim up``)
  read run metadata from the repo's ``meta/index`` database only; a run's own chunk
  (``meta/chunks/<hash>``) is copied into it by ``aim.sdk.index_manager.RepoIndexManager.index``,
  which runs only inside ``aim up`` (a background watcher) or ``aim storage reindex``. Neither the
  SDK writer nor ``aim server`` ever does it, so runs stay invisible to the SDK. This backend
  finalizes the run's chunk into the index itself on ``close`` (and, if asked, periodically
  while the run is open). Metric points are read from the run's own ``seqs`` chunk, so between
  indexings only new metric names, params and tags are missing.
  The index is a RocksDB that one process at a time can write. ``aim up``'s indexer does not
  survive finding it locked (``RepoIndexManager.index`` opens it outside its ``try``; the
  indexing thread dies), so indexing while ``aim up`` runs on the same repo is a small risk
  to ``aim up``: hence once per run by default, not periodically.
* **Remote writes are asynchronous.** Through ``aim://`` every write is queued in the client and
  sent by a background thread that retries forever while the server is down; ``deliver`` waits,
  bounded, until the queue has drained so that a failure raises instead of being lost.
* **Re-delivery.** Aim keys a metric point by the hash of its step, so tracking the same
  ``(name, context, step)`` again overwrites the point: replayed events never duplicate.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from det_lab.tracking.aim_remote import discard_queued_writes, probe_tcp, release_remote_resources
from det_lab.tracking.aim_schema import (  # noqa: F401 (importable from here, as before)
    GROUP_CONTEXT,
    META_SECTION,
    PARAMS_SECTION,
    RUN_HASH_LENGTH,
    coerce_param,
    derive_run_hash,
    merge_dotted,
)
from det_lab.tracking.backend import RunStatus, TrackerBackend
from det_lab.tracking.events import Artifact, Checkpoint, Event, Metrics, Params, RunInfo, Tags
from det_lab.tracking.targets import default_local_repo  # noqa: F401 (where readers import it from)

logger = logging.getLogger(__name__)

REMOTE_SCHEME = "aim://"


class AimBackend(TrackerBackend):
    """Tracks runs in the Aim repo ``repo``: a local path or ``aim://host:port``.

    Args:
        repo: Local repository directory (its ``.aim`` is created if missing) or the URI of an
            ``aim server``.
        connect_timeout_s: Bound on reaching a remote server when opening.
        flush_timeout_s: Bound on waiting for queued remote writes to reach the server.
        index_interval_s: While a run is open, re-index it for SDK readers at most this often;
            ``None`` (default): only on close. ``0`` indexes after every batch.
        take_over_lock: Continue a run whose lock a previous, dead writer left behind (a
            crashed container of the same trial on another machine). Determined runs one
            instance of a trial at a time, so such a lock is stale.
    """

    name = "aim"

    def __init__(
        self,
        repo: str,
        *,
        connect_timeout_s: float = 5.0,
        flush_timeout_s: float = 60.0,
        index_interval_s: float | None = None,
        take_over_lock: bool = True,
    ) -> None:
        self.repo_uri = repo
        self.connect_timeout_s = connect_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.index_interval_s = index_interval_s
        self.take_over_lock = take_over_lock
        self._repo: Any = None  # aim.Repo
        self._run: Any = None  # aim.Run
        self._track: Callable[..., None] | None = None
        self._hparams: dict[str, Any] = {}
        self._opened: tuple[RunInfo, str] | None = None  # until closed, also across failures
        self._exit_hook = False
        self._last_index = 0.0

    @property
    def is_remote(self) -> bool:
        return self.repo_uri.startswith(REMOTE_SCHEME)

    def describe(self) -> str:
        return f"Aim {self.repo_uri}"

    # --- TrackerBackend --------------------------------------------------------------------------

    def open(self, run: RunInfo, resume_id: str | None) -> str:
        """Create or continue the Aim run for ``run.key`` and return its hash."""
        if self._repo is not None:
            self._abandon()
        run_hash = resume_id or derive_run_hash(run.key)
        with self._abandon_on_error():
            self._repo = self._connect()
            self._ensure_run_exists(run_hash)
            self._run = self._open_run(run_hash)
            self._track = self._pick_track_function(self._run)
            # Kept here and merged locally: a remote read would wait, unbounded, for queued writes.
            self._hparams = self._run.get(PARAMS_SECTION, {}) or {}
            self._run.name = run.name
            self._run.experiment = run.experiment
            for key, value in {**run.tags, "run_key": run.key}.items():
                self._run.set((META_SECTION, key), value, strict=False)
            self._flush()
        self._opened = (run, run_hash)
        _close_at_exit(self)
        self._last_index = time.monotonic()
        logger.debug("Aim run %s open in %s", run_hash, self.repo_uri)
        return run_hash

    def deliver(self, events: Sequence[Event]) -> None:
        """Send events to the open run; any exception means "not delivered".

        After a failure the run is dropped and the next ``open`` continues it.
        """
        if self._run is None:
            raise RuntimeError("AimBackend.deliver called without an open run")
        handlers: dict[type, Callable[[Any], None]] = {
            Metrics: self._deliver_metrics,
            Params: self._deliver_params,
            Tags: self._deliver_tags,
            Checkpoint: self._deliver_checkpoint,
            Artifact: self._deliver_artifact,
        }
        with self._abandon_on_error():
            for event in events:
                handlers[type(event)](event)
            self._flush()
        if self.index_interval_s is not None and time.monotonic() - self._last_index >= self.index_interval_s:
            self._index(attempts=1, quiet=True)

    def close(self, status: RunStatus) -> None:
        """Record ``status``, end the run, index it for SDK readers and disconnect."""
        if self._opened is None:
            return
        if self._run is None:  # dropped after a failure: continue it to record its end
            self.open(*self._opened)
        run_hash = self._run.hash
        with self._abandon_on_error():
            self._run.set((META_SECTION, "status"), status)
            self._flush()
            self._run.close()
        self._run = self._track = self._opened = None
        try:
            self._index(attempts=10, run_hash=run_hash)
        finally:
            self._disconnect()

    # --- events ----------------------------------------------------------------------------------

    def _deliver_metrics(self, event: Metrics) -> None:
        context = {GROUP_CONTEXT: event.group}
        try:  # the whole group in one call: Aim's per-call work (and, remote, one message) is shared
            self._track(dict(event.values), event.timestamp, None, event.step, context)
            return
        except (TypeError, ValueError):
            pass  # one value Aim refuses: track them one by one (re-tracking a step overwrites it)
        for name, value in event.values.items():
            try:
                self._track(value, event.timestamp, name, event.step, context)
            except (TypeError, ValueError) as e:  # not a number, or a sequence's type changed
                logger.debug("Aim: skipped %s=%r at step %s: %s", name, value, event.step, e)

    def _deliver_params(self, event: Params) -> None:
        self._hparams = merge_dotted(self._hparams, event.values)
        self._run[PARAMS_SECTION] = self._hparams

    def _deliver_tags(self, event: Tags) -> None:
        for key, value in event.values.items():
            self._run.set((META_SECTION, key), value, strict=False)

    def _deliver_checkpoint(self, event: Checkpoint) -> None:
        record = {"step": event.step, "timestamp": event.timestamp, **event.metadata}
        self._run.set(("checkpoints", event.uuid), record, strict=False)
        self._run.set((META_SECTION, "latest_checkpoint"), event.uuid)

    def _deliver_artifact(self, event: Artifact) -> None:
        path = Path(event.path)
        if not path.exists():  # deleted before delivery: skipped, not retried forever
            return
        if event.media == "image":
            from aim import Image

            self._run.track(Image(str(path)), name=event.name, step=event.step)
        self._run.set(("artifacts", event.name, str(event.step)), str(path), strict=False)

    # --- connection and run ----------------------------------------------------------------------

    def _connect(self) -> Any:
        from aim import Repo

        if self.is_remote:
            address = urlsplit(self.repo_uri)
            probe_tcp(address.hostname or "", address.port or 53800, self.connect_timeout_s)
            # A fresh client each time: a pooled one may still hold a dead server's connection.
            return Repo(self.repo_uri)
        return Repo.from_path(self.repo_uri, init=not Repo.exists(self.repo_uri))

    def _ensure_run_exists(self, run_hash: str) -> None:
        """Create the run's meta chunk so that ``Run(run_hash)`` opens it instead of failing."""
        if self._run_exists(run_hash):
            return
        # Opening the chunk for writing creates it (local) or has the server create it (remote).
        tree = self._repo.request_tree("meta", run_hash, read_only=False)
        del tree
        # Repo._all_run_hashes is a 0.5 s TTL cache, on the server too for remote repos.
        deadline = time.monotonic() + 5.0
        while not self._run_exists(run_hash):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Aim run {run_hash} was created but does not show in {self.repo_uri}")
            time.sleep(0.1)

    def _run_exists(self, run_hash: str) -> bool:
        from aim import Repo

        Repo._all_run_hashes.cache_clear()
        return self._repo.run_exists(run_hash)

    def _open_run(self, run_hash: str) -> Any:
        from aim import Run
        from aim.sdk.errors import RunLockingError
        from filelock import Timeout

        def run(force: bool) -> Any:
            # No system metrics, no terminal-log capture: this process only mirrors a trial.
            return Run(
                run_hash, repo=self._repo, force_resume=force,
                system_tracking_interval=None, capture_terminal_logs=False, log_system_params=False,
            )

        try:
            return run(force=False)
        except (RunLockingError, Timeout):
            if not self.take_over_lock:
                raise
            logger.info("Aim run %s is locked by a previous writer; taking the lock over", run_hash)
            return run(force=True)

    @staticmethod
    def _pick_track_function(run: Any) -> Callable[..., None]:
        """A ``track(value, timestamp, name, step, context)`` for ``run`` (``value`` a number with
        its ``name``, or a ``{name: number}`` dict with ``name=None``).

        ``Run.track`` stamps points with the time of the call, which squashes a replay after an
        outage into one instant; the tracker's ``_track`` takes the event's own time. Fall back
        to the public API if that private method ever changes shape.
        """
        private = getattr(getattr(run, "_tracker", None), "_track", None)
        expected = ["value", "track_time", "name", "step", "epoch", "context"]
        if private is not None and list(inspect.signature(private).parameters) == expected:
            return lambda value, ts, name, step, ctx: private(value, ts, name, step, None, context=ctx)
        logger.debug("Aim: RunTracker._track changed; points get the delivery time")
        return lambda value, ts, name, step, ctx: run.track(value, name=name, step=step, context=ctx)

    def _flush(self) -> None:
        """Wait, bounded, until queued remote writes have reached the server."""
        client = getattr(self._repo, "_client", None)
        if client is None:
            return
        request_queue = client.get_queue()
        pending = getattr(request_queue, "_queue", None)
        worker = getattr(request_queue, "_thread", None)
        if pending is None or worker is None:  # unknown client internals: unbounded wait
            request_queue.wait_for_finish()
            return
        deadline = time.monotonic() + self.flush_timeout_s
        while pending.unfinished_tasks:
            if not worker.is_alive():
                raise ConnectionError(f"Aim client lost its connection to {self.repo_uri}; writes were not sent")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Aim server {self.repo_uri} did not take writes within {self.flush_timeout_s} s")
            time.sleep(0.02)

    # --- index -----------------------------------------------------------------------------------

    def _index(self, attempts: int, run_hash: str | None = None, quiet: bool = False) -> None:
        """Copy the run's meta chunk into the repo index, as ``RepoIndexManager.index`` does.

        The index is one RocksDB that a single process can write at a time (``aim up``'s indexer,
        another trial's backend), so a busy index is retried briefly and then left: ``aim up``
        indexes outdated runs itself.
        """
        run_hash = run_hash or self._run.hash
        for attempt in range(1, attempts + 1):
            try:
                self._finalize_into_index(run_hash)
                self._last_index = time.monotonic()
                return
            except Exception as e:  # RocksIOError (lock), server errors: not fatal for delivery
                if attempt == attempts:
                    level = logging.DEBUG if quiet else logging.WARNING
                    logger.log(level, "Aim: could not index run %s in %s (%s); SDK readers will not see its "
                               "latest state until `aim up` or `aim storage reindex` runs", run_hash, self.repo_uri, e)
                else:
                    time.sleep(0.2)

    def _finalize_into_index(self, run_hash: str) -> None:
        index = self._repo._get_index_tree("meta", 0).view(())
        if self.is_remote:
            chunk = self._repo.request_tree("meta", run_hash, read_only=True)
        else:
            # skip_read_optimization: the read path would otherwise try to open the chunk for
            # writing (to flush its WAL) while this process's Run still holds it.
            chunk = self._repo.request_tree("meta", run_hash, read_only=True, skip_read_optimization=True)
        chunk.subtree("meta").subtree("chunks").subtree(run_hash).finalize(index=index)

    # --- failure and shutdown ------------------------------------------------------------------

    @contextmanager
    def _abandon_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Drop a run and repo left in an unknown state (failed call, lost server).

        Unsent remote writes are discarded (the journal replays them): otherwise Aim's cleanup
        waits for its write queue forever, at garbage collection or at interpreter exit.
        """
        run = self._run
        self._run = self._track = None
        client = getattr(self._repo, "_client", None)
        if client is not None:
            discard_queued_writes(client.get_queue())
        if run is not None:
            try:
                run.close()
            except Exception as e:
                logger.debug("Aim: ignoring error while dropping run %s: %s", run.hash, e)
        self._disconnect()

    def _disconnect(self) -> None:
        """Release the repo; for a remote one, every server-side resource of its client.

        Aim releases remote resources in finalizers; one still pending at interpreter exit runs
        in ``aim.ext.cleanup.AutoClean.cleanup``, which waits forever if a finalizer raises
        (server down). So they are all run here, now, with their errors ignored.
        """
        from aim import Repo

        repo, self._repo = self._repo, None
        client = getattr(repo, "_client", None)
        if client is not None:
            release_remote_resources(client)
            try:
                repo.close()
            except Exception as e:
                logger.debug("Aim: ignoring error while disconnecting from %s: %s", self.repo_uri, e)
        # Repo._all_run_hashes' TTL cache holds the repo (and its remote proxy) as a key.
        Repo._all_run_hashes.cache_clear()

    def _at_exit(self) -> None:
        """Leave nothing for Aim's exit cleanup that could block on an unreachable server."""
        if self._repo is None or not self.is_remote:
            return
        try:
            self._flush()
        except Exception as e:
            logger.warning("Aim: dropping unsent writes to %s at exit: %s", self.repo_uri, e)
        self._abandon()


def _close_at_exit(backend: AimBackend) -> None:
    """Run ``backend._at_exit`` before Aim's own exit cleanup (atexit runs handlers LIFO)."""
    if backend._exit_hook:
        return
    ref = weakref.ref(backend)

    def hook() -> None:
        alive = ref()
        if alive is not None:
            alive._at_exit()

    atexit.register(hook)
    backend._exit_hook = True
