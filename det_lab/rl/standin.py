"""CPU stand-in for Isaac Lab's ``scripts/reinforcement_learning/rsl_rl/train.py``.

Real rsl_rl (``OnPolicyRunner`` + PPO) on a batched point-mass reach task in plain torch, with
Isaac Lab's command-line flags and output layout::

    python -m det_lab.rl.standin --task PointMass-Reach-v0 --num_envs 64 --max_iterations 30 \
        [--resume --load_run <regex> --checkpoint <regex>] [--logger det_lab|tensorboard]

writes ``logs/rsl_rl/<experiment>/<YYYY-mm-dd_HH-MM-SS>/`` (relative to the cwd) with
``params/{env,agent}.yaml``, TensorBoard events and ``model_<iter>.pt`` every ``--save_interval``.

Test hooks: ``$DET_LAB_RL_STOP_FILE`` (stop cleanly right after the next save once the file
exists) and ``$DET_LAB_STANDIN_CRASH_AT`` (raise at that iteration).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from det_lab.rl.supervisor import STOP_FILE_ENV
from det_lab.settings import env_value

CRASH_ENV = "DET_LAB_STANDIN_CRASH_AT"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="PointMass-Reach-v0")
    p.add_argument("--num_envs", type=int, default=64)
    p.add_argument("--max_iterations", type=int, default=30)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cpu")
    p.add_argument("--headless", action="store_true", help="accepted for Isaac Lab compatibility")
    p.add_argument("--experiment_name", default="point_mass_reach")
    p.add_argument("--run_name", default="")
    p.add_argument("--save_interval", type=int, default=10)
    p.add_argument("--num_steps_per_env", type=int, default=24)
    p.add_argument("--logger", choices=["det_lab", "tensorboard"], default="det_lab")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--load_run", default=".*")
    p.add_argument("--checkpoint", default="model_.*.pt")
    p.add_argument("--iteration_sleep", type=float, default=0.0, help="seconds added per iteration (tests)")
    return p.parse_args(argv)


def make_env(num_envs: int, device: str, seed: int):
    """A batched 2-D point mass that must reach a random goal; implements rsl_rl's ``VecEnv``."""
    import torch
    from rsl_rl.env import VecEnv
    from tensordict import TensorDict

    class PointMassReach(VecEnv):
        def __init__(self) -> None:
            self.num_envs, self.num_actions, self.device = num_envs, 2, device
            self.max_episode_length = 100
            self.cfg = {"task": "PointMass-Reach-v0", "dt": 0.05, "max_force": 1.0, "episode_length": 100}
            self.gen = torch.Generator(device="cpu").manual_seed(seed)
            self.pos = torch.zeros(num_envs, 2)
            self.vel = torch.zeros(num_envs, 2)
            self.goal = torch.zeros(num_envs, 2)
            self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
            self._reset(torch.arange(num_envs))

        def _reset(self, ids) -> None:
            n = len(ids)
            self.pos[ids] = torch.rand(n, 2, generator=self.gen) * 2 - 1
            self.goal[ids] = torch.rand(n, 2, generator=self.gen) * 2 - 1
            self.vel[ids] = 0.0
            self.episode_length_buf[ids] = 0

        def get_observations(self):
            obs = torch.cat([self.pos, self.vel, self.goal - self.pos], dim=1)
            return TensorDict({"policy": obs}, batch_size=[self.num_envs])

        def step(self, actions):
            a = actions.clamp(-1.0, 1.0)
            self.vel = 0.9 * self.vel + a * 0.05
            self.pos = (self.pos + self.vel * 0.05 * 10).clamp(-2.0, 2.0)
            dist = (self.goal - self.pos).norm(dim=1)
            rew = -dist - 0.01 * (a ** 2).sum(dim=1) + (dist < 0.1).float()
            self.episode_length_buf += 1
            time_outs = self.episode_length_buf >= self.max_episode_length
            extras = {"time_outs": time_outs}
            if time_outs.any():
                ids = time_outs.nonzero(as_tuple=False).flatten()
                extras["log"] = {"final_distance": dist[ids].mean()}
                self._reset(ids)
            return self.get_observations(), rew, time_outs.long(), extras

    return PointMassReach()


def train_cfg(args: argparse.Namespace) -> dict:
    """rsl_rl (>= 5) runner config, sized for a CPU."""
    logger = {"class_name": "det_lab.rl.rsl_writer:DetLabLogWriter"} if args.logger == "det_lab" else "tensorboard"
    return {
        "num_steps_per_env": args.num_steps_per_env,
        "save_interval": args.save_interval,
        "experiment_name": args.experiment_name,
        "run_name": args.run_name,
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "logger": logger,
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 2, "num_mini_batches": 2, "learning_rate": 3e-3,
                      "schedule": "adaptive", "desired_kl": 0.01, "entropy_coef": 0.005, "gamma": 0.98},
        "actor": {"class_name": "MLPModel", "hidden_dims": [32, 32], "activation": "elu",
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": 0.8}},
        "critic": {"class_name": "MLPModel", "hidden_dims": [32, 32], "activation": "elu"},
    }


class StopAfterSave(Exception):
    """Raised right after a save once the stop file exists."""


def make_runner(env, cfg: dict, log_dir: str, device: str, iteration_sleep: float, crash_at: int | None):
    from rsl_rl.runners import OnPolicyRunner

    stop_file = env_value(STOP_FILE_ENV)

    class Runner(OnPolicyRunner):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.logger.git_status_repos = []  # rsl_rl would run git status/diff on the package's checkout
            log = self.logger.log

            def log_iteration(*la, **lk):
                it = lk.get("it", la[0] if la else None)
                if crash_at is not None and it is not None and it >= crash_at:
                    raise RuntimeError(f"stand-in: simulated crash at iteration {it} ({CRASH_ENV}={crash_at})")
                if iteration_sleep:
                    time.sleep(iteration_sleep)
                return log(*la, **lk)

            self.logger.log = log_iteration

        def save(self, path: str, infos: dict | None = None) -> None:
            super().save(path, infos)
            print(f"[stand-in] saved {path}", flush=True)
            if stop_file and Path(stop_file).exists():
                raise StopAfterSave(path)

    return Runner(env, cfg, log_dir=log_dir, device=device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from det_lab.rl.tbshim import ensure_torch_tensorboard

    tb = ensure_torch_tensorboard()
    import torch
    import yaml

    from det_lab.rl.log_parsers import checkpoint_path

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    print(f"[stand-in] CPU stand-in for Isaac Lab's rsl_rl train.py: task {args.task}, {args.num_envs} envs, "
          f"TensorBoard writer: {tb}", flush=True)
    env = make_env(args.num_envs, args.device, args.seed)
    cfg = train_cfg(args)
    log_root = Path("logs") / "rsl_rl" / args.experiment_name
    resume_path = checkpoint_path(log_root, args.load_run, args.checkpoint) if args.resume else None
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    log_dir = (log_root / (stamp + (f"_{args.run_name}" if args.run_name else ""))).resolve()
    (log_dir / "params").mkdir(parents=True, exist_ok=True)
    (log_dir / "params" / "env.yaml").write_text(yaml.safe_dump(env.cfg))
    (log_dir / "params" / "agent.yaml").write_text(yaml.safe_dump(cfg))
    print(f"[stand-in] logging experiment in directory: {log_dir}", flush=True)
    crash = env_value(CRASH_ENV)
    runner = make_runner(env, cfg, str(log_dir), args.device, args.iteration_sleep, int(crash) if crash else None)
    if resume_path is not None:
        print(f"[stand-in] loading model checkpoint from: {resume_path}", flush=True)
        runner.load(str(resume_path))
    try:
        runner.learn(num_learning_iterations=args.max_iterations, init_at_random_ep_len=True)
    except StopAfterSave as stop:
        runner.logger.stop_logging_writer()
        print(f"[stand-in] stop requested: stopped after saving {Path(str(stop)).name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
