"""A trial's det_lab session: it composes the trial layer's concerns around one Core API context.

=====================  =================================================  =========================
concern                object                                             twins
=====================  =================================================  =========================
who the trial is       :class:`~det_lab.runs.identity.TrialIdentity`    cluster / local-style run
its files              :class:`~det_lab.runs.record.RunRecord`          Cluster / Local (/ Slurm)
its dataset            :func:`det_lab.data.pull` (once per node)
its lineage            :func:`~det_lab.runs.lineage.collect_lineage`
its tracker run        :class:`~det_lab.tracking.Mirror`                  chief / NullMirror
Determined internals   :mod:`det_lab.runs.harness`
=====================  =================================================  =========================

PyTorchTrials get the Core API context from ``det.pytorch.init``; Core API loops from
:func:`det_lab.core.init`. :func:`~det_lab.runs.harness.intercept` routes its metric,
checkpoint and preemption calls to this session, which hands them to the mirror and the record:
a checkpoint becomes the run's latest only once complete, so a crash mid-write leaves the
previous one latest; off-cluster, SIGTERM asks the trial to checkpoint and stop, as a cluster
preemption would, and the mirror is flushed before the trial exits.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import determined as det

from det_lab.data import DatasetIdentity, PulledDataset, lookup
from det_lab.data import pull as pull_dataset
from det_lab.data.lock import VolumeLock
from det_lab.settings import LabSettings, env_value
from det_lab.tracking import DeliverySummary, Mirror, open_mirror
from det_lab.tracking.events import flatten
from det_lab.tracking.null_mirror import NullMirror
from det_lab.runs.fence import CHECKPOINT_ATTEMPT_KEY, Fence, sweep_unrecorded
from det_lab.runs.expconf import LabTrialConfig, Length, lab_section, training_length
from det_lab.trials.gpu_sampler import DEFAULT_INTERVAL_S, GpuSampler
from det_lab.trials.gpu_sampler import merge as merge_efficiency
from det_lab.trials.searcher_stop import DEFAULT_POLL_S, SearcherStopWatcher, watch_searcher_stops
from det_lab.runs.harness import intercept
from det_lab.runs.identity import TrialIdentity
from det_lab.runs.base_models import check_base_models
from det_lab.runs.lineage import collect_lineage, seed_everything, tracker_view
from det_lab.runs.lineage import ENVIRONMENTS_DIR
from det_lab.runs.record import RunRecord, record_for
from det_lab.runs.run_guard import BUSY_EXIT_CODE, RunBusy, hold, lock_lifetime_s, parent_gone, watch_parent
from det_lab.data.directory import DIRECTORY_REV
from det_lab.data.lastuse import note_use
from det_lab.volume import VolumeLayout, share_with_group
from det_lab.runs.run_state import RunStatus

log = logging.getLogger("det_lab.trials")


def local_checkpoint_dir(settings: LabSettings, project: str, exp_conf: dict[str, Any] | None = None) -> Path:
    """Where off-cluster checkpoints go: where the cluster puts them (``<data root>/checkpoints/<project>``)."""
    return VolumeLayout.from_settings(settings).experiment_checkpoints(project, exp_conf)


class LabSession:
    """What det_lab adds to one trial process. Use :meth:`start` then :meth:`close`."""

    def __init__(self, settings: LabSettings, identity: TrialIdentity, core_context: Any,
                 lab: LabTrialConfig | None = None, checkpoint_dir: Path | None = None) -> None:
        self.settings = settings
        #: where this trial's checkpoints go off-cluster (what retention deletes from)
        self.checkpoint_dir = checkpoint_dir
        self.identity = identity
        self.lab = lab or lab_section(identity.exp_conf)
        self.core = core_context
        self.record: RunRecord = record_for(VolumeLayout.from_settings(settings), identity.project,
                                            identity.run.key, identity.record_dir)
        self.dataset: PulledDataset | None = None
        #: a scheduler's attempt of the run (Slurm): a stale copy writes nothing and stops (runs.fence)
        self.fence = Fence.from_env(identity.record_dir)
        if self.fence.active:  # its record's files are replaced and appended through the fence
            self.record.fence = self.fence
        self.mirror: Mirror | NullMirror = NullMirror(identity.run)
        self.lineage: dict[str, Any] = {}
        self.preempted = False
        #: a non-zero ``SystemExit`` code a trial method raised (legacy entrypoint: see close_at_exit)
        self.exit_code: int | str | None = None
        self._preempt_requested = False
        self._trainer_lock: VolumeLock | None = None
        self._gpu_sampler: GpuSampler | None = None
        self._searcher_stop: SearcherStopWatcher | None = None

    @property
    def is_chief(self) -> bool:
        return self.core.distributed.rank == 0

    @property
    def training_length(self) -> Length:
        return training_length(self.identity.exp_conf, self.lab)

    @property
    def outputs_dir(self) -> Path:
        return self.record.outputs_dir

    # --- start ---------------------------------------------------------------------------------------

    def start(self) -> LabSession:
        # an unknown project: one line before anything is pulled, written or mirrored (on a cluster no
        # 'det-lab run' preflight ran: the config came through det experiment create or the Web UI)
        self.settings.project(self.identity.project)
        # a base model, tokenizer or backbone file the volume lacks: one line naming its import,
        # before the dataset is pulled (on a cluster no preflight ran)
        check_base_models(self.settings, self.identity.exp_conf or {}, self.identity.hparams,
                          source="experiment config")
        share_with_group()  # what the trial writes on the volume stays the group's, whatever the umask
        if not self.identity.on_cluster and not logging.getLogger().handlers:
            # Determined's harness configures logging on a cluster; locally train.log would stay empty
            logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
        if not self.identity.on_cluster:
            signal.signal(signal.SIGTERM, self._request_preempt)
            watch_parent(self._parent_gone)
        self.fence.watch()
        if self.is_chief and self.record.keeps_progress:  # a local-style run: one trainer at a time
            try:  # a new attempt waits for a stale copy to stop (or a dead one's lock to expire)
                self._trainer_lock = hold(self.record.dir, self.identity.run.name,
                                          wait=self.fence.lock_wait_s(lock_lifetime_s()))
                self.fence.on_stale.append(self._release_trainer_lock)
            except RunBusy as exc:  # a second --resume that passed det-lab run's check at the same time
                print(f"error: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(BUSY_EXIT_CODE) from None
            # what runs list and the exporter show while it trains (a resumed run said "stopped")
            self.fence.check("the run record")
            self.record.update(status=RunStatus.RUNNING.value)
            self._retain()  # a retention pass a kill interrupted is finished before training
            self._sweep_stale_attempts()
        if self.identity.seed is not None:
            seed_everything(self.identity.seed)
        self.dataset = self._pull_dataset()
        environments = VolumeLayout.from_settings(self.settings).outputs(self.identity.project) / ENVIRONMENTS_DIR
        # the code's patch and the environment's list once per trial, by the chief (the one that
        # writes run.json, the tracker tags and, merged with the others', the checkpoint metadata)
        self.lineage = collect_lineage(self.identity, self.dataset, self.record, environments,
                                       code_and_environment=self.is_chief)
        if self.is_chief:
            self.record.note_lineage(self.lineage)
            self.mirror = open_mirror(self.settings, self.identity.run, self.record.journal_dir, self.lab.tracking,
                                      fence=self.fence if self.fence.active else None)
            self.mirror.log_params(self.identity.hparams)
            self.mirror.set_tags(flatten(tracker_view(self.lineage)))
            self._start_gpu_sampler()
        intercept(self.core, self)
        if self.identity.on_cluster:  # adaptive_asha's early stops reach the trial (trials/searcher_stop.py)
            self._searcher_stop = watch_searcher_stops(self.core, env_value("DET_LAB_SEARCHER_POLL", DEFAULT_POLL_S))
        return self

    def _start_gpu_sampler(self) -> None:
        """The chief's own GPUs, sampled off the training thread (system metrics; run.json at the end)."""
        mirror = self.mirror
        sampler = GpuSampler(env_value("DET_LAB_GPU_SAMPLE_INTERVAL", DEFAULT_INTERVAL_S),
                             on_sample=lambda step, metrics: mirror.log_metrics("system", step, metrics))
        if sampler.start():
            self._gpu_sampler = sampler

    def _stop_gpu_sampler(self) -> None:
        sampler, self._gpu_sampler = self._gpu_sampler, None
        if sampler is None:
            return
        workers = next((v for k, v in flatten(dict(self.identity.hparams or {})).items()
                        if k.split(".")[-1] == "num_workers"), None)
        summary = sampler.stop({"num_workers": workers} if workers is not None else {})
        if summary is not None and self.record.keeps_progress:
            try:
                previous = self.record.state().get("gpu_efficiency")
            except (OSError, ValueError):
                previous = None
            self.record.update(gpu_efficiency=merge_efficiency(previous, summary))

    def _pull_dataset(self) -> PulledDataset | None:
        """Pull once per node (local rank 0); the node's other ranks wait for the result."""
        spec = self.lab.dataset_spec(lambda name: lookup(self.settings, name))
        if spec is None:
            return None
        dist = self.core.distributed
        if dist.local_rank == 0:
            pulled = pull_dataset(spec, self.settings)
            dist.broadcast_local((str(pulled.path), asdict(pulled.identity), pulled.fetched))
            return pulled
        path, ident, fetched = dist.broadcast_local(None)
        return PulledDataset(Path(path), DatasetIdentity(**ident), fetched)

    # --- what harness.intercept calls --------------------------------------------------------------

    def on_metrics(self, group: str, step: int, metrics: dict[str, Any]) -> None:
        if self.is_chief:  # the chief alone journals and records them
            self.fence.check(f"{group} metrics of step {step}")
        self.mirror.log_metrics(group, step, metrics)
        if self.is_chief:
            self.record.append_metrics(group, step, metrics)

    def checkpoint_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        self.fence.check("a checkpoint")  # called before the checkpoint's files are written
        if self.fence.active:  # which attempt wrote it: the next one removes it if it stays unrecorded
            return {**metadata, "det_lab": {**self.lineage, CHECKPOINT_ATTEMPT_KEY: self.fence.epoch}}
        return {**metadata, "det_lab": self.lineage}

    def checkpoint_written(self, path: Path) -> None:
        self.fence.check(f"the metadata.json of checkpoint {path.name}")  # what makes it a checkpoint

    def on_checkpoint(self, storage_id: str, metadata: dict[str, Any]) -> None:
        step = int(metadata.get("steps_completed", 0))
        self.fence.check(f"the latest-checkpoint pointer (step {step})")
        self.mirror.log_checkpoint(storage_id, step, {"dataset.md5": self.lineage.get("dataset", {}).get("md5", "")})
        self.mirror.flush(timeout=2)
        self._note_dataset_use()
        if self.is_chief:
            self.record.add_checkpoint(storage_id, step)
            self._retain()

    def _note_dataset_use(self) -> None:
        """Record that the trial still reads its snapshot (``det-lab data gc`` evicts snapshots
        by their last use; a cluster trial that trains for weeks pulled it only at its start)."""
        ds = self.dataset.identity if self.dataset is not None else None
        if ds is not None and ds.rev != DIRECTORY_REV:
            note_use(VolumeLayout.from_settings(self.settings), ds.project, ds.md5.removesuffix(".dir"))

    def _checkpoint_root(self) -> Path:
        layout = VolumeLayout.from_settings(self.settings)
        return self.checkpoint_dir or layout.experiment_checkpoints(self.identity.project, self.identity.exp_conf)

    def _sweep_stale_attempts(self) -> None:
        """Remove the complete checkpoints an older attempt of this run left unrecorded (it was found
        stale before its pointer switch; runs.fence); a failure is logged, never fatal."""
        if not self.fence.active:
            return
        try:
            recorded = [c["uuid"] for c in self.record.state().get("checkpoints", [])]
            removed = sweep_unrecorded(self._checkpoint_root(), self.identity.run.key, self.fence.epoch, recorded)
        except Exception as exc:  # noqa: BLE001 (a sweep must never stop a trial)
            log.warning("det_lab: checkpoints of older attempts not swept: %s", exc)
            return
        for uuid, step in removed:
            log.info("det_lab: removed checkpoint %s (step %s): an older attempt of this run wrote it "
                     "and stopped before recording it", uuid, step)

    def _retain(self) -> None:
        """Apply the experiment config's checkpoint retention to a local-style run (a master
        applies its own); a failure is logged, never fatal to training."""
        if not self.record.keeps_progress or self.identity.on_cluster:
            return
        from det_lab.runs import retention

        layout = VolumeLayout.from_settings(self.settings)
        root = self._checkpoint_root()
        try:
            outcome = retention.retain(self.record, layout, self.identity.project, root)
        except Exception as exc:  # noqa: BLE001 (retention must never stop a trial)
            log.warning("det_lab: checkpoint retention skipped: %s", exc)
            return
        for gone in outcome.deleted:
            log.info("det_lab: deleted checkpoint %s (step %s): %s", gone["uuid"], gone["step"], gone["reason"])
        for problem in outcome.problems:
            log.warning("det_lab: checkpoint retention: %s", problem)

    def on_should_preempt(self, answer: bool) -> bool:
        answer = answer or self._preempt_requested
        if answer and not self.preempted:
            self.preempted = True
            log.warning("det_lab: preemption requested: checkpointing and stopping")
            self.mirror.flush(timeout=5)
        return answer

    def _request_preempt(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self._preempt_requested = True

    def _parent_gone(self, pid: int) -> None:
        log.warning("det_lab: det-lab run (pid %d) is gone: checkpointing and stopping", pid)
        self._preempt_requested = True

    # --- close ---------------------------------------------------------------------------------------

    def close(self, status: str) -> DeliverySummary | None:
        """End the tracker run and record the outcome: FINISHED (KILLED when stopped early) or FAILED."""
        if status == "FINISHED" and self.preempted:
            status = "KILLED"
        if self.is_chief:
            self.fence.check("the run's outcome")
            try:
                self._stop_gpu_sampler()
            except Exception as exc:  # noqa: BLE001 (the efficiency summary never fails a trial)
                log.warning("det_lab: GPU efficiency not recorded: %s", exc)
        if self._searcher_stop is not None:
            self._searcher_stop.close()
        summary = self.mirror.close(status)  # type: ignore[arg-type]
        if self.is_chief:
            self.record.record_outcome(status, None if summary is None else
                                       {**asdict(summary), "journal": str(summary.journal)})
            if parent_gone():  # det-lab run died first: nobody else will record how the run ended
                self.record.record_end(status={"FINISHED": RunStatus.FINISHED, "KILLED": RunStatus.STOPPED}.get(
                    status, RunStatus.FAILED).value)
        self._release_trainer_lock()
        return summary

    def _release_trainer_lock(self) -> None:
        lock, self._trainer_lock = self._trainer_lock, None
        if lock is not None:
            lock.__exit__(None, None, None)

    def close_at_exit(self) -> DeliverySummary | None:
        """:meth:`close` from ``atexit`` (the legacy ``module:Class`` entrypoint, where Determined's
        harness owns the training loop): FAILED when the process ends with an unhandled exception."""
        crashed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set before atexit runs
        # a SystemExit is not "unhandled" to Python (no last_exc): the trial's methods note its code
        failed = crashed is not None or self.exit_code not in (None, 0)
        return self.close("FAILED" if failed else "FINISHED")
