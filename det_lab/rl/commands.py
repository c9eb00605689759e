"""Training commands for the supervisor: Isaac Lab's rsl_rl ``train.py`` and the CPU stand-in.

Both drive rsl_rl's ``OnPolicyRunner``, which on resume re-runs the restored iteration
(``learn`` starts at the loaded ``iter``), so a resumed command trains ``remaining + 1``
iterations and the supervisor drops the repeated one.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Any

from det_lab.rl.supervisor import ChildCommand, Restore
from det_lab.templates import ISAACLAB_DEFAULT, ISAACLAB_TRAIN, isaaclab_root  # noqa: F401  (re-exported)

UNATTENDED_ENV = {"ACCEPT_EULA": "Y", "PRIVACY_CONSENT": "Y", "OMNI_KIT_ACCEPT_EULA": "YES"}
# Kit/Omniverse caches (Isaac Lab docker-compose volumes) -> name of the subdirectory in a cache slot
ISAAC_CACHES = {"/isaac-sim/kit/cache": "kit", "~/.cache/ov": "ov", "~/.nv/ComputeCache": "compute",
                "~/.cache/nvidia/GLCache": "glcache"}
_held_locks: list[int] = []  # cache slot locks live as long as the supervisor


def resume_flags(restore: Restore | None) -> list[str]:
    """Isaac Lab's resume flags for a restored checkpoint (its directory name is unique, so exact)."""
    if restore is None:
        return []
    return ["--resume", "--load_run", restore.run_dir.name, "--checkpoint", restore.model.name]


def _iterations(restore: Restore | None, remaining: int) -> int:
    return remaining + 1 if restore is not None else remaining


def isaaclab_command(root: Path, hp: dict[str, Any], restore: Restore | None, remaining: int) -> ChildCommand:
    """``isaaclab.sh -p scripts/reinforcement_learning/rsl_rl/train.py --task ... --headless`` (+ Hydra overrides)."""
    argv = [str(root / "isaaclab.sh"), "-p", str(root / ISAACLAB_TRAIN), "--task", str(hp["task"]), "--headless",
            "--num_envs", str(hp["num_envs"]), "--max_iterations", str(_iterations(restore, remaining)),
            "--seed", str(hp.get("seed", 42)), "--device", str(hp.get("device", "cuda:0"))]
    if hp.get("enable_cameras"):
        argv.append("--enable_cameras")
    argv += resume_flags(restore)
    argv += [f"agent.save_interval={int(hp['save_interval'])}", *map(str, hp.get("hydra_overrides") or [])]
    return ChildCommand(argv, env=dict(UNATTENDED_ENV), metrics="tfevents",
                        description=f"Isaac Lab ({root}) task {hp['task']}")


def standin_command(hp: dict[str, Any], restore: Restore | None, remaining: int) -> ChildCommand:
    """The CPU stand-in (:mod:`det_lab.rl.standin`) with the same flags and log layout."""
    s = hp.get("standin") or {}
    metrics = str(s.get("metrics", "jsonl"))
    argv = [sys.executable, "-m", "det_lab.rl.standin", "--task", str(s.get("task", "PointMass-Reach-v0")), "--headless",
            "--num_envs", str(s.get("num_envs", 64)), "--max_iterations", str(_iterations(restore, remaining)),
            "--seed", str(hp.get("seed", 42)), "--device", "cpu", "--save_interval", str(int(hp["save_interval"])),
            "--experiment_name", restore.experiment if restore else str(s.get("experiment_name", "point_mass_reach")),
            "--logger", "det_lab" if metrics == "jsonl" else "tensorboard",
            "--iteration_sleep", str(float(s.get("iteration_sleep", 0.0)))]
    argv += resume_flags(restore)
    return ChildCommand(argv, metrics=metrics, description="CPU stand-in (det_lab.rl.standin: rsl_rl PPO, point mass)")


#: where a Slurm job's Apptainer image has the node's Isaac cache bound (det_lab.slurm.images)
SLURM_ISAAC_CACHE = Path("/det-lab-cache")


def isaac_cache_root(configured: str | None, env: dict[str, str] | None = None) -> Path | None:
    """Where the Kit caches' slots live: ``configured`` (``isaac_cache.root``) if set, else, in a
    Determined task, ``$DET_LAB_LOCAL_CACHE/isaac`` (the agent's task cache det_lab mounts into every
    task; 'cluster agent-up' makes it under whatever ``tasks.local_cache`` is), else the Slurm image's
    ``/det-lab-cache`` where it is bound; None (no cache kept) off both."""
    env = dict(os.environ) if env is None else env
    if configured:
        return Path(configured) if Path(configured).is_dir() else None
    if env.get("DET_LAB_LOCAL_CACHE"):
        return Path(env["DET_LAB_LOCAL_CACHE"]) / "isaac"
    return SLURM_ISAAC_CACHE if SLURM_ISAAC_CACHE.is_dir() else None


def acquire_cache_slot(root: Path, slots: int = 8) -> Path:
    """The first cache slot ``root/slot-<n>`` no other job on this host holds (an exclusive flock).

    One Kit cache per running job (two Kit processes on one cache lock each other out of it),
    reused by later jobs on the host, so caches stay warm without being shared concurrently.
    """
    for n in range(slots):
        slot = Path(root) / f"slot-{n}"
        slot.mkdir(parents=True, exist_ok=True)
        fd = os.open(slot / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held_locks.append(fd)
        return slot
    raise RuntimeError(f"all {slots} Isaac cache slots under {root} are in use; raise isaac_cache.slots")


def link_caches(slot: Path, caches: dict[str, str] = ISAAC_CACHES) -> list[str]:
    """Point each container cache path at its directory in ``slot`` (a directory already there is moved aside)."""
    done = []
    for container_path, name in caches.items():
        target = Path(slot) / name
        target.mkdir(parents=True, exist_ok=True)
        link = Path(os.path.expanduser(container_path))
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            link.rename(link.with_name(link.name + ".image"))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target, target_is_directory=True)
        done.append(f"{link} -> {target}")
    return done
