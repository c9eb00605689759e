"""Who gets which free GPU: the fair order between waiting runs, the members' limits, and why a run waits.

The order is Slurm's fair-share in miniature: the member with the fewest recent GPU-hours
(decayed with ``accounting.half_life``, divided by their ``fairshare``) goes first, then the earliest
in line. A member at their ``gpu_limit`` (``accounting.members`` / ``defaults`` in slurm.yaml, the
rules ``det-lab slurm accounts`` gives Slurm; a project's own ``gpu_limit`` likewise) waits without
holding up the others. A run that names GPUs (``--gpus``) waits for those; any other run at the head
of the line that cannot start holds up those behind it, so a 2-GPU run is not starved by 1-GPU runs.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

from det_lab.errors import UserError
from det_lab.gpus.holders import describe
from det_lab.gpus.leases import Held
from det_lab.nvml import GpuReading
from det_lab.settings import LabSettings

_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class GpusError(UserError):
    """A GPU request that cannot be met or is wrong, in one line."""


def slurm_seconds(text: str) -> float:
    """A Slurm duration (``7-0``, ``1-12:00:00``, ``90``: minutes) in seconds."""
    m = _SLURM_TIME.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time")
    days, a, b, c = (int(x) if x else 0 for x in m.groups())
    if m.group(1) is not None:  # D-HH[:MM[:SS]]
        return float(days * 86400 + a * 3600 + b * 60 + c)
    if m.group(3) is None:
        return a * 60.0  # minutes
    if m.group(4) is None:
        return float(a * 60 + b)  # MM:SS
    return float(a * 3600 + b * 60 + c)


@dataclass
class Rules:
    """The lab's rules for sharing GPUs, from slurm.yaml's ``accounting`` section (none: no limits)."""

    member_limits: dict[str, int | None] = field(default_factory=dict)
    default_limit: int | None = None
    shares: dict[str, int] = field(default_factory=dict)
    default_share: int = 1
    project_limits: dict[str, int | None] = field(default_factory=dict)
    half_life_s: float = 7 * 86400.0
    source: str = "slurm.yaml"

    def limit(self, user: str) -> int | None:
        return self.member_limits.get(user, self.default_limit)

    def share(self, user: str) -> int:
        return self.shares.get(user, self.default_share)


def lab_rules(settings: LabSettings) -> Rules:
    """The rules of the lab's slurm.yaml; none without one (a bad one: one line)."""
    from det_lab.slurm.settings import SlurmConfigError, load_slurm_settings

    try:
        slurm = load_slurm_settings(settings)
    except SlurmConfigError as exc:
        raise GpusError(str(exc)) from None
    acct = slurm.accounting
    if acct is None:
        return Rules()
    return Rules(member_limits={m.user: acct.gpu_limit(m) for m in acct.members}, default_limit=acct.defaults.gpu_limit,
                 shares={m.user: acct.fairshare(m) for m in acct.members}, default_share=acct.defaults.fairshare,
                 project_limits={p: lim.gpu_limit for p, lim in acct.projects.items()},
                 half_life_s=slurm_seconds(acct.half_life), source=str(slurm.source or "slurm.yaml"))


def since_words(epoch: float) -> str:
    when = dt.datetime.fromtimestamp(epoch)
    return f"{when:%H:%M}" if when.date() == dt.date.today() else f"{when:%Y-%m-%d %H:%M}"


def holder_words(held: Held) -> str:
    d = held.data
    return f"{d['user']} {d['run'] or '(starting)'} since {since_words(float(d['since']))}"


@dataclass
class Plan:
    """What the queue's next step is: GPUs for the entries that may start, a reason for the rest."""

    starts: dict[str, list[int]]
    reasons: dict[str, str]
    order: list[str]


def gpu_holders(readings: list[GpuReading], live: list[Held]) -> dict[int, str]:
    """Who holds each GPU that is not free, in words: a lease's user, run and since when, or the
    processes outside det_lab on it (user, pid, command, memory)."""
    by_uuid = {u: h for h in live for u in h.uuids}
    out: dict[int, str] = {}
    for r in readings:
        if r.uuid in by_uuid:
            out[r.index] = holder_words(by_uuid[r.uuid])
        elif r.processes:
            out[r.index] = ", ".join(describe(pid, used).words() for pid, used in r.processes)
    return out


def plan(readings: list[GpuReading], live: list[Held], entries: list[dict[str, Any]], usage: dict[str, float],
         rules: Rules) -> Plan:
    """The next starts for ``entries`` (queue entries' data) given the GPUs, the live leases and each
    member's recent GPU-hours (see the module's docstring)."""
    holders = gpu_holders(readings, live)
    free = [r.index for r in readings if r.index not in holders]
    held_user: dict[str, int] = {}
    held_project: dict[str, int] = {}
    for h in live:
        held_user[h.data["user"]] = held_user.get(h.data["user"], 0) + len(h.data["gpus"])
        p = h.data.get("project", "")
        held_project[p] = held_project.get(p, 0) + len(h.data["gpus"])
    order = sorted(entries, key=lambda e: (usage.get(e["user"], 0.0) / rules.share(e["user"]), e["enqueued"], e["entry"]))
    starts: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    blocked = False
    ahead = 0
    for e in order:
        user, project, slots = e["user"], e.get("project", ""), int(e["slots"])
        limit, plimit = rules.limit(user), rules.project_limits.get(project)
        if limit is not None and held_user.get(user, 0) + slots > limit:
            reasons[e["entry"]] = (f"{user}'s limit of {limit} GPU(s) at once is reached ({held_user.get(user, 0)} held; "
                                   f"accounting in {rules.source})")
            continue
        if plimit is not None and held_project.get(project, 0) + slots > plimit:
            reasons[e["entry"]] = f"project {project}'s limit of {plimit} GPU(s) at once is reached"
            continue
        picks = e.get("picks")
        if picks:
            taken = [i for i in picks if i not in free]
            if not taken and not blocked:
                got = list(picks)
            else:
                why = "; ".join(f"GPU {i} held by {holders[i]}" if i in holders else f"GPU {i} promised to a run ahead"
                                for i in taken) or "runs ahead in line"
                reasons[e["entry"]] = why + _ahead(ahead)
                ahead += 1
                continue
        elif not blocked and len(free) >= slots:
            got = free[:slots]
        else:
            blocked = True
            busy = ", ".join(holders[i] for i in sorted(holders)) or "none"
            n = len(readings)
            what = ("both GPUs held" if n == 2 and len(holders) == 2 else
                    f"all {n} GPUs held" if len(holders) == n else f"{len(free)} of {n} GPUs free, {slots} wanted")
            reasons[e["entry"]] = f"{what} ({busy})" + _ahead(ahead)
            ahead += 1
            continue
        starts[e["entry"]] = got
        ahead += 1
        holders.update({i: f"{user} {e['run']} (starting)" for i in got})
        free = [i for i in free if i not in got]
        held_user[user] = held_user.get(user, 0) + slots
        held_project[project] = held_project.get(project, 0) + slots
    return Plan(starts, reasons, [e["entry"] for e in order])


def _ahead(n: int) -> str:
    return f"; {n} run{'s' if n != 1 else ''} ahead" if n else ""
