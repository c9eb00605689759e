"""A trial over two Determined agents on two hosts: ``slots_per_trial: 2`` on agents of one CPU slot each.

The master stand-in (tests/standin/master*.py) listens on a bridge; two agents (tests/standin/agents.py),
one per namespace host (tests/multihost_agents.py), each run their container of the allocation through
the task stand-in (tests/standin/task_run.py: Determined 0.38.1's whole container chain in bubblewrap)
on their own host. What is checked follows determined-ai/determined v0.38.1:

- master/internal/rm/agentrm/fitting.go:72-220: two slots fit on no one agent, so on two agents with
  one free slot each, one container each; master/internal/task/resources_list.go:14-38 ranks them;
- master/internal/task/allocation.go:709-713 + pkg/tasks/task.go:274-277: the containers use host
  networking; rendezvous.go:127-242: each gets the agents' addresses, the chief's first, and its rank;
- harness/determined/exec/prep_container.py:49-60, :256-273 writes that rendezvous (_info.py:8, :42) to
  /run/determined/info/rendezvous.json; harness/determined/launch/torch_distributed.py:75-107 makes
  torchrun's ``--nnodes`` the number of containers, ``--node_rank`` the container's rank and
  ``--master_addr`` (and ``DET_CHIEF_IP``) the first address;
- harness/determined/core/_train.py and _checkpoint.py: only the chief (rank 0) reports metrics and
  checkpoints.

The trial is a Core API script (``TRAIN`` below): each rank trains a linear model on its half of eight
rows with DistributedDataParallel over gloo; the gradients are averaged, so both ranks end with the
weights of one process training on all eight rows (``_reference``).
"""

from __future__ import annotations

import functools
import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.multihost import namespaces_refused
from tests.multihost_agents import AgentHosts, start_hosts, stop_hosts
from tests.standin.agents import AgentPool, AgentState, find_fits, rendezvous_info
from tests.standin.master import Master
from tests.standin.task_config import LinkedUser
from tests.standin.task_image import make_image
from tests.standin.task_run import run_allocation
from tests.test_shared_volume import _add_user
from tests.test_task_chain import harness_wheels  # noqa: F401  (a fixture: the 0.38.1 harness wheel)

DET = Path(sys.executable).parent / "det"
STEPS = 4
LR = 0.1

#: the trial: a Core API script under Determined's torch_distributed launcher
TRAIN = f'''
import json, os, socket, time
import torch
import torch.distributed as dist
from determined import core

STEPS, LR = {STEPS}, {LR}


def data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 3, generator=g)
    return x, x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.1 * torch.randn(8, 1, generator=g)


dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
if os.environ.get("FAIL_RANK"):  # that rank fails; the others wait for nothing
    if rank == int(os.environ["FAIL_RANK"]):
        raise SystemExit(3)
    time.sleep(600)
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
x, y = data()
rows = list(range(rank, len(x), size))
# MANUAL: the image has no tensorboard (core/_context.py:311 imports it in AUTO mode; det_lab.core does the same)
with core.init(distributed=core.DistributedContext.from_torch_distributed(),
               tensorboard_mode=core.TensorboardMode.MANUAL) as ctx:
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[rows]), y[rows])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if ctx.distributed.rank == 0:
            ctx.train.report_training_metrics(steps_completed=step, metrics={{"loss": total.item() / size}})
    weights = [v for p in model.parameters() for v in p.detach().flatten().tolist()]
    if ctx.distributed.rank == 0:
        with ctx.checkpoint.store_path({{"steps_completed": STEPS}}) as (path, _):
            (path / "weights.json").write_text(json.dumps(weights))
    facts = {{"rank": rank, "size": size, "rows": rows, "weights": weights, "hostname": socket.gethostname(),
             "env": {{k: os.environ.get(k) for k in ("GROUP_RANK", "MASTER_ADDR", "DET_CHIEF_IP",
                                                  "DET_RESOURCES_ID", "DET_CONTAINER_ID")}},
             "rendezvous": json.load(open("/run/determined/info/rendezvous.json"))}}
    with open(f"/out/rank-{{rank}}.json", "w") as f:
        json.dump(facts, f)
'''


def _reference() -> tuple[list[float], list[float]]:
    """One process training on all eight rows: the losses at each step and the final weights."""
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 3, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.1 * torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [v for p in model.parameters() for v in p.detach().flatten().tolist()]


class Bed:
    def __init__(self, hosts: AgentHosts, master: Master, pool: AgentPool, env: dict[str, str], base: Path) -> None:
        self.hosts, self.master, self.pool, self.env, self.base = hosts, master, pool, env, base

    def det(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(DET), "-m", self.master.url, *args], capture_output=True, text=True,
                              env=self.env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def wait(self, exp_id: int, timeout: float = 240) -> str:
        deadline, state = time.monotonic() + timeout, self.master.state
        with state.changed:
            while state.experiments[exp_id].state not in ("COMPLETED", "ERROR", "CANCELED"):
                assert time.monotonic() < deadline, f"experiment {exp_id}: {state.experiments[exp_id].state}"
                state.changed.wait(0.5)
        return state.experiments[exp_id].state


@pytest.fixture(scope="module")
def bed(harness_wheels):  # noqa: F811
    if os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("useradd"):
        pytest.skip("needs root, useradd and bubblewrap (Debian's bubblewrap) for a linked non-root task user")
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    if not DET.exists():
        pytest.skip("needs Determined's det CLI")
    base = Path(tempfile.mkdtemp(prefix="det-lab-agents-", dir="/var/tmp"))  # the hosts' /tmp is their own
    base.chmod(0o755)
    tag = uuid.uuid4().hex[:6]
    group = f"dlma{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    user, hosts, master, pool = None, None, None, None
    try:
        user = _add_user(f"dlmu{tag}", group, base)
        for d in ("checkpoints", "out"):
            (base / d).mkdir()
            os.chown(base / d, user.uid, user.gid)
        image = make_image(base / "image", probe_uid=user.uid)
        hosts = start_hosts(base, 2)
        config = {"checkpoint_storage": {"type": "shared_fs", "host_path": str(base / "checkpoints")},
                  "task_container_defaults": {"shm_size_bytes": 64 * 1024**2, "network_mode": "bridge"},
                  "resource_pools": [{"pool_name": "default"}]}
        master = Master(config, host=hosts.login_addr)
        linked = LinkedUser(user.name, user.uid, user.gid, group=grp.getgrgid(user.gid).gr_name)
        agents = []
        for h in hosts.hosts:
            runner = functools.partial(run_allocation, master=config, user=linked, image=image, wheel_dir=harness_wheels,
                                       master_addr=(hosts.login_addr, master.port), cluster_id=master.cluster_id,
                                       master_id=master.master_id, timeout=180, machine=hosts.machine(h),
                                       agent={"agent_id": h.name})
            agents.append(AgentState(h.name, 1, h.addr, runner))
        pool = AgentPool(master, agents)
        home = base / "det-home"
        home.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "DET_USER": "determined", "DET_PASS": "",
               "LANG": "C.UTF-8"}
        yield Bed(hosts, master, pool, env, base)
    finally:
        if pool is not None:
            pool.close()
        if master is not None:
            master.close()
        if hosts is not None:
            stop_hosts(hosts)
        if user is not None:
            subprocess.run(["userdel", user.name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _create(bed: Bed, *env: str) -> int:
    """``det experiment create`` of ``TRAIN`` with two slots per trial and the variables ``env``."""
    ctx = bed.base / "context"
    ctx.mkdir(exist_ok=True)
    (ctx / "train.py").write_text(TRAIN)
    conf = {"name": "two-agents", "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
            "resources": {"slots_per_trial": 2}, "max_restarts": 0, "hyperparameters": {},
            "searcher": {"name": "single", "metric": "loss", "max_length": 1, "smaller_is_better": True},
            "environment": {"environment_variables": list(env)},
            "bind_mounts": [{"host_path": str(bed.base / "out"), "container_path": "/out"}]}
    path = bed.base / f"exp-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(conf))
    out = bed.det("experiment", "create", str(path), str(ctx)).stdout
    return int(out.split("Created experiment ")[1].split()[0])


@pytest.fixture(scope="module")
def trial(bed):
    """One experiment of ``TRAIN`` with two slots per trial, run to its end."""
    exp_id = _create(bed)
    state = bed.wait(exp_id)
    assert state == "COMPLETED", bed.pool.output()
    (t,) = [t for t in bed.master.state.trials.values() if t.experiment.id == exp_id]
    (alloc,) = [bed.master.state.allocs[a] for a in t.allocation_ids]
    ranks = {}
    for r in range(2):
        path = bed.base / "out" / f"rank-{r}.json"
        assert path.exists(), bed.pool.output()
        ranks[r] = json.loads(path.read_text())
    return t, alloc, ranks


def test_two_slots_are_fitted_over_the_two_one_slot_agents_one_container_each(bed, trial):
    """fitting.go:72-220 findFits: no agent has two free slots, so one slot on each of two agents;
    resources_list.go:14-38: ranks 0 and 1; allocation.go:712: each container with host networking."""
    _, alloc, _ = trial
    assert sorted(r.agent.agent_id for r in alloc.resources) == sorted(h.name for h in bed.hosts.hosts)
    assert sorted(r.rank for r in alloc.resources) == [0, 1]
    assert all(len(r.slot_ids) == 1 and r.exit_code == 0 for r in alloc.resources)


def test_each_rank_trains_its_own_shard_on_its_own_host_and_both_end_with_one_processs_weights(bed, trial):
    """torch_distributed.py:83-91: node rank = container rank; DDP averages the two shards' gradients,
    which is one process's gradient over all rows (equal halves)."""
    _, alloc, ranks = trial
    losses, weights = _reference()
    by_rank = {r.rank: r for r in alloc.resources}
    assert ranks[0]["rows"] == [0, 2, 4, 6] and ranks[1]["rows"] == [1, 3, 5, 7]
    for r, facts in ranks.items():
        res = by_rank[r]
        assert facts["size"] == 2 and facts["env"]["GROUP_RANK"] == str(r)  # torchrun's --node_rank
        assert facts["hostname"] == res.agent.agent_id  # ran on its agent's host (host networking)
        assert facts["env"]["DET_RESOURCES_ID"] == res.id
        assert facts["weights"] == pytest.approx(weights, abs=1e-6)
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_the_rendezvous_the_tasks_saw_is_the_masters_with_the_chief_first(bed, trial):
    """rendezvous.go:127-242 and prep_container.py:49-60: the agents' addresses, the chief's first, each
    container's own rank; torch_distributed.py:83-91: the chief's address is DET_CHIEF_IP and
    torchrun's --master_addr."""
    _, alloc, ranks = trial
    chief = next(r for r in alloc.resources if r.rank == 0)
    other = next(r for r in alloc.resources if r.rank == 1)
    for r, facts in ranks.items():
        res = next(x for x in alloc.resources if x.rank == r)
        given = res.served["rendezvousInfo"]  # what the master answered this container
        assert given == rendezvous_info(alloc, res.id)["rendezvousInfo"]
        assert given["addresses"] == [chief.agent.address, other.agent.address]
        assert facts["rendezvous"] == {"container_addrs": given["addresses"], "container_rank": r,
                                       "container_slot_counts": [1, 1]}
        assert facts["env"]["DET_CHIEF_IP"] == facts["env"]["MASTER_ADDR"] == chief.agent.address


def test_only_the_chief_reports_each_metric_once_and_the_one_checkpoint(bed, trial):
    """core/_train.py, _checkpoint.py: the chief reports; the master's record has each step once, the
    losses of one process over all rows, and one checkpoint with the chief's weights."""
    t, _, ranks = trial
    losses, weights = _reference()
    rows = [m for m in bed.master.state.metrics if m.trial_id == t.id]
    assert [(m.group, m.total_batches) for m in rows] == [("training", s) for s in range(1, STEPS + 1)]
    assert [m.metrics["avg_metrics"]["loss"] for m in rows] == pytest.approx(losses, abs=1e-6)
    (ckpt,) = [c for c in bed.master.state.checkpoints.values() if c.trial_id == t.id]
    # nothing from the other rank beside it (the cluster id's directory: shared_fs's tensorboard path)
    assert set(os.listdir(bed.base / "checkpoints")) - {bed.master.cluster_id} == {ckpt.uuid}
    saved = json.loads((bed.base / "checkpoints" / ckpt.uuid / "weights.json").read_text())
    assert saved == ranks[0]["weights"]


def test_a_rank_that_fails_on_one_host_ends_the_trial_and_kills_the_container_on_the_other(bed):
    """allocation.go:812-829: a container that exits with a failure crashes the allocation, which kills
    the other containers (here one waiting on the other host); with max_restarts 0 the trial errors."""
    started = time.monotonic()
    exp_id = _create(bed, "FAIL_RANK=1")
    assert bed.wait(exp_id, timeout=120) == "ERROR", bed.pool.output()
    assert time.monotonic() - started < 90  # not the waiting rank's 600 s, nor the task timeout
    (t,) = [t for t in bed.master.state.trials.values() if t.experiment.id == exp_id]
    (alloc,) = [bed.master.state.allocs[a] for a in t.allocation_ids]
    codes = {r.rank: r.exit_code for r in alloc.resources}
    assert codes[1] not in (0, 137) and codes[0] == 137, codes  # the failed one; the killed one
    assert not [m for m in bed.master.state.metrics if m.trial_id == t.id]


def test_fitting_refuses_what_determined_refuses():
    """fitting.go:72-220: a request that fits on one agent goes there alone; one agent only
    (resources.is_single_node) or one slot is never split; a split needs agents with no slot in use
    and a slot count the agents' free slots divide; otherwise nothing (the allocation stays queued)."""
    def agents(*spec: tuple[int, int]) -> list[AgentState]:
        out = [AgentState(f"agent-{i}", slots, f"10.0.0.{i}", lambda *a, **k: None) for i, (slots, _) in enumerate(spec)]
        for a, (_, used) in zip(out, spec):
            a.used = set(range(used))
        return out

    def fit(needed: int, ags: list[AgentState], **kw: Any) -> list[tuple[str, int]]:
        return sorted((f.agent.agent_id, f.slots) for f in find_fits("alloc-1", needed, ags, **kw))

    assert fit(2, agents((1, 0), (1, 0))) == [("agent-0", 1), ("agent-1", 1)]
    assert fit(2, agents((1, 0), (2, 0), (1, 0))) == [("agent-1", 2)]  # the shared fit first
    assert fit(2, agents((1, 0), (1, 0)), single_agent=True) == []
    assert fit(3, agents((2, 0), (2, 0))) == []  # 3 is no multiple of 2
    assert fit(2, agents((2, 1), (1, 0))) == []  # an agent with a slot in use is not split onto
    assert fit(3, agents((2, 0), (1, 0)), heterogeneous=True) == [("agent-0", 2), ("agent-1", 1)]
    assert fit(3, agents((2, 0), (1, 0))) == []
    # BestFit: of two agents that both fit, the one with fewer free slots
    assert fit(1, agents((4, 0), (2, 0))) == [("agent-1", 1)]
