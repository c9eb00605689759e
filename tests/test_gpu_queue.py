"""The fair line's decisions and a lease holder's identity, without subprocesses: which waiting run
gets which free GPU (fair-share by recent GPU-hours and shares, member and project limits, a head of
line that holds up the rest, runs that name their GPUs), and when a holder counts as gone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from det_lab.gpus.holders import ProcessId, boot_id
from det_lab.gpus.journal import LeaseRecord, recent_gpu_hours
from det_lab.gpus.leases import Held
from det_lab.gpus.queue import Rules, plan, slurm_seconds
from det_lab.nvml import GpuReading


def gpus(n: int, busy: dict[int, list[tuple[int, int]]] | None = None) -> list[GpuReading]:
    return [GpuReading(i, f"GPU-{i}", "NVIDIA A100", 40 << 30, 0, 0.0, None, (busy or {}).get(i, [])) for i in range(n)]


def entry(eid: str, user: str, at: float, slots: int = 1, picks: list[int] | None = None, project: str = "vla") -> dict:
    return {"entry": eid, "user": user, "run": f"run-{eid}", "project": project, "slots": slots, "picks": picks,
            "enqueued": at}


def lease(user: str, *uuids: str, project: str = "vla") -> Held:
    me = ProcessId.me()
    return Held(Path("/nonexistent"), {"lease": "l-" + user, "host": "h", "user": user, "run": f"{user}-run",
                                       "project": project, "gpus": [{"index": int(u[4:]), "uuid": u} for u in uuids],
                                       "since": time.time() - 60}, me)


def test_the_member_with_fewer_recent_gpu_hours_goes_first_then_first_come():
    line = [entry("a1", "alice", 1), entry("a2", "alice", 2), entry("b1", "bob", 3), entry("b2", "bob", 4)]
    step = plan(gpus(2), [], line, {"alice": 5.0, "bob": 1.0}, Rules())
    assert step.order == ["b1", "b2", "a1", "a2"]
    assert step.starts == {"b1": [0], "b2": [1]}
    assert step.reasons["a1"].endswith("; 2 runs ahead") and step.reasons["a2"].endswith("; 3 runs ahead")
    # a larger share divides the usage: alice's 5 hours at share 10 count less than bob's 1 at share 1
    shared = plan(gpus(2), [], line, {"alice": 5.0, "bob": 1.0}, Rules(shares={"alice": 10}))
    assert shared.order == ["a1", "a2", "b1", "b2"]


def test_a_member_at_their_limit_waits_without_holding_up_the_others():
    held = [lease("alice", "GPU-0")]
    line = [entry("a1", "alice", 1), entry("b1", "bob", 2)]
    step = plan(gpus(3), held, line, {}, Rules(member_limits={"alice": 1}))
    assert step.starts == {"b1": [1]}
    assert "alice's limit of 1 GPU(s) at once is reached (1 held" in step.reasons["a1"]
    project = plan(gpus(3), held, [entry("b1", "bob", 2)], {}, Rules(project_limits={"vla": 1}))
    assert project.starts == {} and "project vla's limit of 1" in project.reasons["b1"]


def test_the_head_of_the_line_holds_up_smaller_runs_behind_it():
    line = [entry("big", "alice", 1, slots=2), entry("small", "bob", 2)]
    step = plan(gpus(2, {0: [(os.getpid(), 1 << 30)]}), [], line, {}, Rules())
    assert step.starts == {}  # one GPU free: the 2-GPU run waits, and so does the 1-GPU run behind it
    assert step.reasons["big"].startswith("1 of 2 GPUs free, 2 wanted")
    assert step.reasons["small"].endswith("; 1 run ahead")


def test_a_run_naming_its_gpus_waits_for_those_and_is_told_who_holds_them():
    held = [lease("alice", "GPU-1")]
    step = plan(gpus(2), held, [entry("p", "bob", 1, picks=[1]), entry("any", "carol", 2)], {}, Rules())
    assert step.starts == {"any": [0]}
    assert step.reasons["p"].startswith("GPU 1 held by alice alice-run since ")


def test_a_process_outside_det_lab_keeps_its_gpu():
    step = plan(gpus(2, {0: [(os.getpid(), 3 << 30)]}), [], [entry("a", "alice", 1), entry("b", "bob", 2)], {}, Rules())
    assert step.starts == {"a": [1]}
    assert f"pid {os.getpid()}" in step.reasons["b"] and "3,072 MiB" in step.reasons["b"]


def test_a_holder_counts_only_while_that_very_process_lives_on_this_boot():
    me = ProcessId.me()
    assert me.alive()
    assert not ProcessId(me.pid, me.start + 1, me.boot).alive()  # the pid reused by a later process
    assert not ProcessId(me.pid, me.start, "another-boot").alive()  # the machine rebooted since
    assert ProcessId.of(2**22 + 12345) is None
    assert me.boot == boot_id() != ""


def test_recent_use_decays_with_the_half_life_and_a_held_lease_counts_to_now():
    now = 1_000_000.0
    week = slurm_seconds("7-0")
    assert week == 7 * 86400 and slurm_seconds("90") == 5400 and slurm_seconds("1-12:00:00") == 1.5 * 86400
    old = LeaseRecord("o", "h", "alice", "r", "vla", "t", [(0, "GPU-0"), (1, "GPU-1")], 1, now - week - 3600, now - week)
    held = LeaseRecord("n", "h", "bob", "r", "vla", "t", [(0, "GPU-0")], 2, now - 1800)
    usage = recent_gpu_hours([old, held], now, week)
    assert abs(usage["alice"] - 1.0) < 1e-9  # 2 GPU-hours, a half-life ago
    assert abs(usage["bob"] - 0.5) < 1e-9
