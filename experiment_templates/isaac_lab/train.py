"""Isaac Lab (rsl_rl) as a det_lab Core API trial: the supervisor runs the training command.

Inside an Isaac Lab container (``isaaclab.sh`` and ``scripts/reinforcement_learning/rsl_rl/train.py``
under ``hyperparameters.isaaclab_path``, ``$ISAACLAB_PATH`` or /workspace/isaaclab) it runs Isaac
Lab's own train.py headless; anywhere else it runs the CPU stand-in (:mod:`det_lab.rl.standin`)
and says so, unless ``require_isaaclab`` is true.
"""

from __future__ import annotations

import sys

from det_lab.rl import commands
from det_lab.rl.supervisor import supervise
from det_lab.settings import env_value


def make_build(ctx):
    hp = ctx.hparams
    root = commands.isaaclab_root(hp.get("isaaclab_path"))
    if root is None:
        if hp.get("require_isaaclab"):
            sys.exit("train.py: Isaac Lab not found (isaaclab_path, $ISAACLAB_PATH, /workspace/isaaclab) "
                     "and require_isaaclab is true")
        print("[isaac template] Isaac Lab is not installed here: running the CPU stand-in "
              "(rsl_rl PPO on a point-mass task) instead of " + str(hp.get("task")), flush=True)
        return lambda restore, remaining: commands.standin_command(hp, restore, remaining)
    cache = hp.get("isaac_cache") or {}
    cache_root = commands.isaac_cache_root(cache.get("root"))
    if cache_root is not None:
        slot = commands.acquire_cache_slot(cache_root, int(cache.get("slots", 8)))
        for line in commands.link_caches(slot):
            print(f"[isaac template] cache {line}", flush=True)
    print(f"[isaac template] Isaac Lab found at {root}: training {hp['task']}", flush=True)
    return lambda restore, remaining: commands.isaaclab_command(root, hp, restore, remaining)


if __name__ == "__main__":
    supervise(make_build, preempt_timeout_s=env_value("DET_LAB_RL_PREEMPT_TIMEOUT", 90.0))
