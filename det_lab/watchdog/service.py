"""``det-lab watchdog``: sample this machine's GPUs, judge each holder's window, warn, then act.

Each pass reads the GPUs (:mod:`det_lab.nvml`) and their holders, adds a sample to each holder's
window and judges it (:mod:`det_lab.watchdog.window`). An idle holder is warned (journal, webhook,
mail, its run's notice) with a deadline ``grace`` later; still idle at the deadline, it is acted on
(:mod:`det_lab.watchdog.actions`). A holder that uses its GPU again before that is cleared. Exempt
and snoozed holders are left alone. A Slurm job with GPUs on several nodes is judged by the watchdog
of its first node alone, on every node's samples (each node's watchdog keeps its own on the
volume): idle only when its GPUs are idle on every node, warned once, acted on once; while a node's
samples are missing or old (its watchdog is not running) it is not judged. ``dry_run``: everything is judged and said, nothing is written,
sent or stopped.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from det_lab.nvml import GpuReading, read_gpus
from det_lab.settings import LabSettings
from det_lab.slurm.record import JOB_SCRIPT
from det_lab.watchdog import actions, notify
from det_lab.watchdog.holders import Holder, discover
from det_lab.watchdog.journal import HolderState, MachineState, WatchdogJournal, read_samples
from det_lab.watchdog.window import Sample, Verdict, judge, trim
from det_lab.watchdog_settings import IdleRule

log = logging.getLogger("det_lab.watchdog")
#: another node's samples count while its newest is at most two intervals and this much old (each
#: watchdog passes at its own moments, and an NFS client may see another's file late)
REMOTE_SLACK_S = 60.0
PAST = {"checkpoint and stop": "stopped (checkpointed, resumable)", "cancel": "cancelled", "kill": "killed"}


def span(seconds: float) -> str:
    """``45 s``, ``60 min``, ``2 h`` (whole units where they are whole)."""
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200 or seconds % 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S")


class Watchdog:
    """The watchdog of one machine (``node``: its Slurm node name, default the host name)."""

    def __init__(self, settings: LabSettings, node: str | None = None, dry_run: bool = False,
                 slurm_env: Mapping[str, str] | None = None, say: Callable[[str], None] = print,
                 read: Callable[[], list[GpuReading]] = read_gpus, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.wd = settings.watchdog
        self.host = socket.gethostname().split(".")[0]
        self.node = node or self.host
        self.dry_run = dry_run
        self.slurm_env = slurm_env
        self.say = say
        self.read = read
        self.clock = clock
        self.journal = WatchdogJournal(settings.data_root)
        self.machine = MachineState(settings.data_root, self.host, self.node)
        self.samples = self.machine.load_samples()
        self._last_pass: float | None = None
        self._job_runs: dict[str, Path | None] = {}
        self._snoozes: list[dict] = []

    # --- one pass ------------------------------------------------------------------------------------

    def pass_once(self) -> list[Holder]:
        """Sample, judge and act once; returns the holders seen."""
        now = self.clock()
        readings = {g.index: g for g in self.read()}
        holders = discover(list(readings.values()), self.node, self.host, self.settings, self.slurm_env)
        entries = list(self.journal.entries())  # read once a pass
        states, self._snoozes = self.journal.states(entries), self.journal.snoozes(entries)
        elapsed = min(now - self._last_pass, 2 * self.wd.interval) if self._last_pass else self.wd.interval
        idle_seconds: dict[str, float] = {}
        others: dict[str, dict[str, dict[int, list[Sample]]]] = {}  # other nodes' samples, read once a pass
        for h in holders:
            rule = self.wd.rule_for(h.partition)
            per_gpu = self.samples.setdefault(h.key, {})
            for g in h.gpus:
                r = readings.get(g)
                if r is None or r.utilization is None or not r.memory_total:
                    continue
                mem = 100.0 * r.memory_used / r.memory_total
                kept = trim(per_gpu.get(g, []), rule.window + 2 * self.wd.interval, now)
                per_gpu[g] = kept + [(now, r.utilization, mem)]
                if r.utilization < rule.utilization_below and mem < rule.memory_below:
                    idle_seconds[h.user or "?"] = idle_seconds.get(h.user or "?", 0.0) + elapsed
            if h.nodes and h.first_node != self.node:
                continue  # sampled here; judged by the watchdog of the job's first node
            verdict = self._job_window(h, per_gpu, rule, now, others) if h.nodes else \
                judge(per_gpu, rule, now, self.wd.interval)
            self._decide(h, rule, verdict, states.get(h.key, HolderState()), now)
        self.samples = {k: v for k, v in self.samples.items() if k in {h.key for h in holders}}
        self._last_pass = now
        if not self.dry_run:
            self.machine.save_samples(self.samples)
            self.machine.add_idle(idle_seconds, dt.date.fromtimestamp(now).isoformat())
        return holders

    def _job_window(self, h: Holder, mine: dict[int, list[Sample]], rule: IdleRule, now: float,
                    others: dict[str, dict[str, dict[int, list[Sample]]]]) -> Verdict:
        """The verdict on a job with GPUs on several nodes: this node's samples and the other nodes'
        (their watchdogs' files on the volume); not covered while a node's are missing or old."""
        merged: dict[tuple[str, int], list[Sample]] = {}
        fresh_after = now - 2 * self.wd.interval - REMOTE_SLACK_S
        for node, gpus in h.nodes:
            if node == self.node:
                per_gpu = mine
            else:
                if node not in others:
                    others[node] = read_samples(self.settings.data_root, node)
                per_gpu = others[node].get(h.key, {})
            for g in gpus:
                kept = per_gpu.get(g)
                if not kept or (node != self.node and kept[-1][0] < fresh_after):
                    return Verdict(False, False, 0.0, 0.0, 0.0, 0)
                merged[(node, g)] = kept
        return judge(merged, rule, now, self.wd.interval)

    def _where(self, h: Holder) -> str:
        """``gpu1 (GPU 0)``; for a job on several nodes ``n1, n2 (GPU 0 on n1; GPU 0,1 on n2)``."""
        if not h.nodes:
            return f"{self.host} (GPU {','.join(map(str, h.gpus))})"
        return (", ".join(n for n, _ in h.nodes) + " (" +
                "; ".join(f"GPU {','.join(map(str, g))} on {n}" for n, g in h.nodes) + ")")

    def _decide(self, h: Holder, rule: IdleRule, verdict: Verdict, st: HolderState, now: float) -> None:
        exemption = self.wd.exemption_for(h.user, h.partition, h.name, dt.datetime.fromtimestamp(now))
        if exemption is not None:
            return
        snooze = self._snooze(h, now)
        if snooze is not None:
            if st.warned_at is not None and not st.acted:
                self._record(h, "cleared", st.episode, verdict, message=f"{h.what}: snoozed by {snooze['by']} "
                             f"until {_clock(float(snooze['until']))}")
            return
        if not verdict.covered:
            return
        if not verdict.idle:
            if st.warned_at is not None and not st.acted:
                self._record(h, "cleared", st.episode, verdict,
                             message=f"{h.what} uses its GPU again (mean {verdict.mean_utilization:.1f} %)")
            return
        if st.acted:
            return
        what_next = actions.plan(h, rule, self._det_lab_run(h) is not None)
        if st.warned_at is None:
            deadline = now + rule.grace
            if what_next.verb:
                then = (f"It will be {PAST[what_next.verb]} at {_clock(deadline)} unless it uses its GPU again; "
                        f"to keep it: det-lab watchdog snooze {h.job_id or h.name} 2h")
            else:
                then = f"It is not stopped ({what_next.why_not}): please release it."
            message = (f"{h.what} of {h.user or '?'} on {self._where(h)} has been idle for {span(rule.window)}: "
                       f"mean utilization {verdict.mean_utilization:.1f} % (rule: under "
                       f"{rule.utilization_below:g} %), memory {verdict.mean_memory:.1f} % (under {rule.memory_below:g} %). "
                       f"{then}")
            self._record(h, "warned", st.episode, verdict, message=message, deadline=deadline,
                         deadline_time=dt.datetime.fromtimestamp(deadline).astimezone().isoformat(timespec="seconds"),
                         action=what_next.verb or None)
            return
        if not what_next.verb or now < float(st.deadline or 0):
            return
        if self.dry_run:
            self.say(f"dry run: would {what_next.verb} {h.what} of {h.user}")
            return
        try:
            done = actions.act(h, self.settings, self.slurm_env)
        except actions.ActionError as exc:
            log.warning("watchdog: %s: %s", h.what, exc)
            return
        resume = self._resume_hint(h)
        self._record(h, "acted", st.episode, verdict, action=what_next.verb,
                     message=f"{h.what} of {h.user or '?'} on {', '.join(n for n, _ in h.nodes) or self.host}: "
                             f"{done} (its GPU{'s' if h.nodes else ''} idle for "
                             f"{span(rule.window)}, warned at {_clock(st.warned_at)}){resume}")

    # --- helpers -------------------------------------------------------------------------------------

    def _record(self, h: Holder, event: str, episode: int, verdict: Verdict, message: str, **extra) -> None:
        """Journal ``event`` once; then (first time only) tell the holder where the lab config says."""
        entry = {"holder": h.key, "event": event, "episode": episode, "host": self.host, "kind": h.kind,
                 "user": h.user, "name": h.name, "partition": h.partition, "gpus": list(h.gpus),
                 **verdict.figures(), "message": message, **extra}
        if h.nodes:
            entry["nodes"] = {n: list(g) for n, g in h.nodes}
        if self.dry_run:
            self.say(f"dry run: would journal {event}: {message}")
            return
        if not self.journal.append(entry):
            return
        self.say(f"{event}: {message}")
        run_dir = Path(h.run_dir) if h.run_dir else self._det_lab_run(h)
        if run_dir is not None:
            notify.write_notice(run_dir, {**entry, "time": dt.datetime.now().astimezone().isoformat(timespec="seconds")})
        if event == "cleared":
            return
        if self.wd.webhook is not None:
            notify.post_webhook(self.wd.webhook, f"det-lab watchdog: {message}")
        if self.wd.mail is not None:
            subject = f"det-lab watchdog: {'idle GPU' if event == 'warned' else 'stopped'}: {h.what}"
            notify.send_mail(self.wd.mail, h.user, subject, message)

    def _snooze(self, h: Holder, now: float) -> dict | None:
        """The snooze in force for ``h``: asked by its user (or root), naming one of its aliases."""
        for s in reversed(self._snoozes):
            if s.get("target") in h.aliases and float(s.get("until", 0)) > now and s.get("by") in (h.user, "root"):
                return s
        return None

    def _det_lab_run(self, h: Holder) -> Path | None:
        """The run directory of the det_lab run that submitted Slurm job ``h`` (None: another tool's)."""
        if h.kind != "slurm" or not h.job_id:
            return None
        if h.job_id not in self._job_runs:
            self._job_runs[h.job_id] = _run_of_job(self.settings, h.job_id)
        return self._job_runs[h.job_id]

    def _resume_hint(self, h: Holder) -> str:
        if h.kind == "run":
            return f"; resume it with: det-lab run <template> --local --resume --run {h.name}"
        run_dir = self._det_lab_run(h)
        return f"; resume it with: sbatch {run_dir / JOB_SCRIPT}" if run_dir else ""

    # --- the service ---------------------------------------------------------------------------------

    def serve(self, passes: int | None = None) -> None:
        """Pass every ``interval`` seconds (``passes`` of them, or until stopped); a driver that fails
        is logged and the pass skipped, never the end of the service."""
        done = 0
        while passes is None or done < passes:
            started = time.monotonic()
            try:
                self.pass_once()
            except Exception as exc:  # noqa: BLE001 (NVMLError, a volume hiccup: the next pass tries again)
                log.warning("watchdog: pass failed: %s: %s", type(exc).__name__, exc)
            done += 1
            if passes is None or done < passes:
                time.sleep(max(self.wd.interval - (time.monotonic() - started), 0.0))


def _run_of_job(settings: LabSettings, job_id: str) -> Path | None:
    from det_lab.runs.record import read_run_file, run_dirs
    from det_lab.volume import VolumeLayout

    layout = VolumeLayout.from_settings(settings)
    for project in settings.projects:
        for d, cls in run_dirs(layout, project):
            if cls.kind != "slurm":
                continue
            try:
                st = read_run_file(d / "run.json")
            except (OSError, ValueError):
                continue
            slurm = st.get("slurm") or {}
            ids = {str(slurm.get("job_id"))} | {str(a.get("job_id")) for a in slurm.get("attempts") or []}
            if job_id in ids:
                return d
    return None
