"""A cluster trial that Determined 0.38.1's searcher stops early stops (adaptive_asha's decisions).

In 0.38.1 the master marks a trial its searcher stops STOPPING_COMPLETED
(``master/internal/trial.go`` l.227-248 ``PatchSearcherState``) but signals its allocation only for
the canceled, killed and errored stopping states (``trial.go`` l.769-777; the fix of
determined-ai/determined#9605 was reverted before 0.38.0), and the 0.38 harness has no searcher
operations left to learn it from. So a stopped trial trains to its full length and an ASHA search
saves no time. The chief of a det_lab trial on a cluster watches its trial's state and, once the master
has marked it stopping, raises the harness's own preemption flag: every rank's next
``should_preempt()`` says yes (the chief's answer is what the workers are given), the trial
checkpoints and exits 0, and the master ends it COMPLETED, as it would have after a preemption.

Never fatal: a failed poll is logged and tried again at the next interval.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from det_lab.runs.harness import raise_preemption_flag

log = logging.getLogger("det_lab")

#: seconds between two looks at the trial's state (DET_LAB_SEARCHER_POLL)
DEFAULT_POLL_S = 10.0


class SearcherStopWatcher(threading.Thread):
    """Polls ``GetTrial`` for ``trial_id``; on STOPPING_COMPLETED sets ``preempt``'s watcher flag."""

    def __init__(self, session: Any, trial_id: int, preempt: Any, interval_s: float = DEFAULT_POLL_S) -> None:
        super().__init__(name="det-lab-searcher-stop", daemon=True)
        self.session, self.trial_id, self.preempt, self.interval_s = session, trial_id, preempt, interval_s
        self.stopped_by_searcher = False
        self._closing = threading.Event()

    def _stopping(self) -> bool:
        from determined.common.api import bindings

        trial = bindings.get_GetTrial(self.session, trialId=self.trial_id).trial
        return trial.state == bindings.trialv1State.STOPPING_COMPLETED

    def run(self) -> None:
        while not self._closing.wait(self.interval_s):
            if not self.stopped_by_searcher:
                try:
                    self.stopped_by_searcher = self._stopping()
                except Exception as exc:  # noqa: BLE001 (the master unreachable for a moment: look again later)
                    log.debug("det_lab: could not read the trial's state: %s", exc)
                    continue
                if self.stopped_by_searcher:
                    log.warning("det_lab: the searcher stopped this trial early: checkpointing and stopping")
            if self.stopped_by_searcher:  # kept raised: the watcher's long poll writes its answer back
                raise_preemption_flag(self.preempt)

    def close(self) -> None:
        self._closing.set()


def watch_searcher_stops(core: Any, interval_s: float) -> SearcherStopWatcher | None:
    """Start the watcher for the cluster trial ``core`` trains (None off a cluster or on a worker)."""
    import determined as det
    from determined.common.api import authentication, certs

    info = det.get_cluster_info()
    if info is None or info.task_type != "TRIAL" or core.distributed.rank != 0:
        return None
    session = authentication.login_from_task(master_address=info.master_url, cert=certs.default_load(info.master_url))
    watcher = SearcherStopWatcher(session, info.trial.trial_id, core.preempt, interval_s)
    watcher.start()
    return watcher
