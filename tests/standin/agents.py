"""Several agents under one master stand-in: a trial whose ``slots_per_trial`` is more than one agent
has is fitted over several agents, one container on each, and its containers meet in the master's
rendezvous (Determined 0.38.1's agent resource manager and allocation, determined-ai/determined
v0.38.1 ``path:line``):

- fitting (master/internal/rm/agentrm/fitting.go:72-94 findFits): one agent with enough free slots
  (findSharedAgentFit :222-246, BestFit or WorstFit of fitting_methods.go:41-64, ties by the hash
  distance :248-257 and the agent id: candidateList.Less :46-66); else, unless the request is for one agent or at most one
  slot, agents with no slot in use (fitting_methods.go:31-33), grouped by their free slots, the
  largest group first, taking ``slots / n`` agents of the first group that has enough and divides the
  request (findDedicatedAgentFits :107-220; a mixed fit only with ``allow_heterogeneous_fits``).
  Anything else stays queued: 0.38.1 neither refuses it nor splits it otherwise.
- ranks (master/internal/task/resources_list.go:14-38): the containers ordered by their slots,
  smallest first (a stable sort of the fits), rank 0, 1, ... in that order; rank 0 is the chief.
- each container is started with host networking (allocation.go:709-713 IsMultiAgent -> resources.go:57
  -> task.go:274-277); the agent reports it started with the trial's exposed ports at the agent's
  address, the address the master sees the agent's connection come from (agent.go:366-371,
  :719-721; aproto/master_message.go:106-117 host mode); the trial exposes ``trial: 1734``
  (task_trial.go:166-184 MakeEnvPorts).
- rendezvous (task/rendezvous.go): each container's GET .../rendezvous waits until every container
  has started and is waiting, none has exited (:106-123 ready); then each gets every container's
  address in the rendezvous port range 1734-1765 (:17-27, :222-238), the chief's first and the rest
  by resources id (:207-218), their slot counts, and its own rank (:127-146).
- exit (allocation.go:780-835): a container that fails crashes the allocation (the others are killed);
  the allocation exits once all its containers have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.standin.master import ApiError, Master
from tests.standin.master_state import Alloc, now_iso
from tests.standin.master_task_api import task_spec
from tests.standin.model import TaskExit

#: task/rendezvous.go:17-27
MIN_RENDEZVOUS_PORT = 1734
MAX_RENDEZVOUS_PORT = MIN_RENDEZVOUS_PORT + 2 * 16 - 1
#: task/rendezvous.go:30 rendezvousTimeoutDuration
RENDEZVOUS_TIMEOUT = 600.0
_U64 = 2**64


@dataclass
class AgentState:
    """One agent of the pool: its id, slots, the address the master sees it at, its task runner
    (``runner(alloc, *, kill)`` as tests/standin/agent.py's)."""

    agent_id: str
    slots: int
    address: str
    runner: Callable[..., TaskExit]
    used: set[int] = field(default_factory=set)

    @property
    def free(self) -> list[int]:
        return [i for i in range(self.slots) if i not in self.used]


@dataclass
class Fit:
    agent: AgentState
    slots: int


@dataclass
class Resources:
    """One container of a multi-agent allocation (sproto.ResourcesID, cproto.ID, taskmodel.ResourcesWithState)."""

    id: str
    container_id: str
    agent: AgentState
    slot_ids: list[int]
    rank: int
    addresses: list[dict[str, Any]] | None = None  # ResourcesStarted.Addresses, once started
    exit_code: int | None = None
    waiting: bool = False  # a rendezvous watcher is registered (rendezvous.go:69-85)
    served: dict[str, Any] | None = None  # the rendezvous info its container was last given


def _hash(s: str) -> int:
    """fitting.go:248-251 stringHashNumber: the md5's first 8 bytes, little-endian."""
    return int.from_bytes(hashlib.md5(s.encode()).digest()[:8], "little")  # noqa: S324 (Go's choice)


def _score(needed: int, agent: AgentState, fitting: str) -> float:
    """fitting_methods.go:41-64 BestFit / WorstFit (slot requests: the zero-slot branches never apply)."""
    free = len(agent.free)
    return 1.0 / (1.0 + free) if fitting == "best" else free / agent.slots


def _order(alloc_id: str, needed: int, fitting: str) -> Callable[[AgentState], tuple[float, int, str]]:
    """fitting.go:46-66 candidateList.Less: score descending, hash distance ascending, agent id."""
    return lambda a: (-_score(needed, a, fitting), (_hash(alloc_id) - _hash(a.agent_id)) % _U64, a.agent_id)


def find_fits(alloc_id: str, needed: int, agents: list[AgentState], *, single_agent: bool = False,
              fitting: str = "best", heterogeneous: bool = False) -> list[Fit]:
    """fitting.go:72-94 findFits: where ``needed`` slots go; [] when they fit nowhere now."""
    shared = [a for a in agents if needed <= len(a.free)]  # :222-246 (slotsSatisfied)
    if shared:
        return [Fit(min(shared, key=_order(alloc_id, needed, fitting)), needed)]
    if single_agent or needed <= 1:
        return []
    by_free: dict[int, list[AgentState]] = {}
    for a in agents:  # :120-131 agentSlotUnusedSatisfied: no slot in use
        if not a.used:
            by_free.setdefault(len(a.free), []).append(a)
    groups = [(n, sorted(by_free[n], key=_order(alloc_id, needed, fitting))) for n in sorted(by_free, reverse=True) if n]
    for n, group in groups:  # :175-188
        if len(group) * n >= needed and needed % n == 0:
            return [Fit(a, n) for a in group[:needed // n]]
    if heterogeneous:  # :190-215
        fits, left = [], needed
        for n, group in groups:
            take = min(left // n, len(group))
            fits += [Fit(a, n) for a in group[:take]]
            left -= take * n
            if left == 0:
                return fits
    return []


def container_addresses(proxy: str, exposed_ports: dict[str, int]) -> list[dict[str, Any]]:
    """aproto/master_message.go:106-117 ContainerStarted.Addresses for ``--network host``: every exposed
    port at the agent's address."""
    return [{"containerIp": proxy, "containerPort": p, "hostIp": proxy, "hostPort": p}
            for p in sorted(set(exposed_ports.values()))]


def exposed_ports(config: dict[str, Any]) -> dict[str, int]:
    """task_trial.go:166-184 MakeEnvPorts: the environment's ports, the proxy ports, ``trial: 1734``."""
    env = config.get("environment") or {}
    ports = dict(env.get("ports") or {})
    for pp in env.get("proxy_ports") or []:
        ports[str(pp["proxy_port"])] = int(pp["proxy_port"])
    ports["trial"] = MIN_RENDEZVOUS_PORT
    return ports


def rendezvous_info(alloc: Alloc, resources_id: str) -> dict[str, Any]:
    """rendezvous.go:127-146 push / :187-242 info: what ``resources_id``'s container is told."""
    ordered = sorted(alloc.resources, key=lambda r: (r.rank != 0, r.id))
    addresses, slots, errors = [], [], []
    for r in ordered:
        mine = [a for a in r.addresses or [] if MIN_RENDEZVOUS_PORT <= a["containerPort"] <= MAX_RENDEZVOUS_PORT]
        if len(mine) == 1:
            addresses.append(mine[0]["hostIp"])
            slots.append(len(r.slot_ids))
        else:
            errors.append(f"found {len(mine)} rendezvous addresses instead of 1 for container {r.id}")
    if errors:
        raise ApiError(13, "; ".join(errors))
    rank = next(r.rank for r in alloc.resources if r.id == resources_id)
    return {"rendezvousInfo": {"addresses": addresses, "rank": rank, "slots": slots}}


def _ready(alloc: Alloc) -> bool:
    """rendezvous.go:106-123 ready: none exited, all started, all waiting (once true, true for good)."""
    if alloc.ready:
        return True
    rs = alloc.resources
    return (not any(r.exit_code is not None for r in rs) and all(r.addresses is not None for r in rs)
            and all(r.waiting for r in rs))


def watch_rendezvous(master: Master, alloc: Alloc, resources_id: str) -> dict[str, Any]:
    """api_trials.go:1575-1594 AllocationRendezvousInfo -> allocation.go:428-457 WatchRendezvous: wait
    for every container, then this one's rendezvous info; a complete rendezvous makes the allocation
    ready (allocation.go:381-394)."""
    state = master.state
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
    with state.changed:
        mine = next((r for r in alloc.resources if r.id == resources_id), None)
        if mine is None:  # rendezvous.go:69-72
            raise ApiError(3, f"stale resources {resources_id}")
        if mine.waiting and not alloc.ready:  # :72-74
            raise ApiError(3, f"resources already rendezvoused: {resources_id}")
        mine.waiting = True
        state.changed.notify_all()
        while not _ready(alloc):
            if alloc.state == "TERMINATED" or time.monotonic() > deadline:  # rendezvous.go:149-178
                mine.waiting = False
                raise ApiError(2, "task terminated")
            state.changed.wait(0.5)
        alloc.ready = True
        mine.waiting = False
        mine.served = rendezvous_info(alloc, resources_id)
        return mine.served


class AgentPool:
    """Agents of one resource pool under ``master`` (the ``default`` pool's scheduler settings:
    ``fitting_policy`` best, no heterogeneous fits): takes the pending allocations in order, fits each
    over the agents, starts one container per fit through its agent's runner, reports the exit."""

    def __init__(self, master: Master, agents: list[AgentState], *, fitting: str = "best",
                 heterogeneous: bool = False) -> None:
        self.master, self.agents, self.fitting, self.heterogeneous = master, agents, fitting, heterogeneous
        self.exits: list[tuple[Resources, TaskExit]] = []
        for a in agents:
            master.state.agent_slots[a.agent_id] = a.slots
        self.threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="det-standin-agents", daemon=True)
        self._thread.start()

    def _schedule(self) -> list[tuple[Alloc, Resources]]:
        """resource_pool.go:387-465 allocateResources, for each pending allocation in turn."""
        state, started = self.master.state, []
        for alloc in list(state.pending):
            conf = alloc.trial.experiment.config if alloc.trial else {}
            single = bool((conf.get("resources") or {}).get("is_single_node"))
            fits = find_fits(alloc.id, alloc.slots, self.agents, single_agent=single, fitting=self.fitting,
                             heterogeneous=self.heterogeneous)
            if not fits:
                continue
            state.pending.remove(alloc)
            resources = []
            for rank, fit in enumerate(sorted(fits, key=lambda f: f.slots)):  # resources_list.go:14-38
                slot_ids = fit.agent.free[:fit.slots]
                fit.agent.used.update(slot_ids)
                container = str(uuid.uuid4())
                resources.append(Resources(container, container, fit.agent, slot_ids, rank))
            alloc.resources = resources
            alloc.state, alloc.start_time = "RUNNING", now_iso()
            alloc.slot_ids = [i for r in resources for i in r.slot_ids]
            started += [(alloc, r) for r in resources]
        return started

    def _loop(self) -> None:
        state = self.master.state
        while not self._stop.is_set():
            with state.changed:
                started = self._schedule()
                if not started:
                    state.changed.wait(0.5)
                    continue
            for alloc, r in started:
                thread = threading.Thread(target=self._run, args=(alloc, r), name=f"task-{r.id[:8]}", daemon=True)
                self.threads.append(thread)
                thread.start()

    def _run(self, alloc: Alloc, r: Resources) -> None:
        multi = len(alloc.resources) > 1
        spec = dataclasses.replace(task_spec(self.master, alloc, r.slot_ids), resources_id=r.id,
                                   container_id=r.container_id, use_host_mode=multi)
        with self.master.state.changed:  # agent.go:719-721: ContainerStarted at the agent's address
            r.addresses = container_addresses(r.agent.address, exposed_ports(spec.config))
            self.master.state.changed.notify_all()
        try:
            result = r.agent.runner(spec, kill=alloc.kill)
        except Exception:  # the container could not be started: a failed task, as a Docker error is
            result = TaskExit(alloc.id, 1, "", traceback.format_exc())
        state = self.master.state
        with state.lock:
            self.exits.append((r, result))
            r.exit_code = result.exit_code
            r.agent.used.difference_update(r.slot_ids)
            if result.exit_code != 0 and not alloc.kill.is_set():  # allocation.go:812-829: crash kills the rest
                alloc.kill.set()
            if all(x.exit_code is not None for x in alloc.resources):
                codes = [x.exit_code for x in alloc.resources]
                state.allocation_exited(alloc, next((c for c in codes if c), 0))
            state.notify()

    def output(self) -> str:
        """Every container's output, rank by rank (for an assertion's message)."""
        return "\n".join(f"--- {r.agent.agent_id} rank {r.rank} exit {e.exit_code}\n{e.stdout[-3000:]}\n{e.stderr[-6000:]}"
                         for r, e in self.exits)

    def close(self, timeout: float = 30) -> None:
        """Stop taking work and kill what runs."""
        self._stop.set()
        for a in self.agents:
            self.master.state.agent_slots.pop(a.agent_id, None)
        self.master.state.notify()
        for alloc in list(self.master.state.allocs.values()):
            if alloc.resources and alloc.state != "TERMINATED":
                alloc.kill.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
