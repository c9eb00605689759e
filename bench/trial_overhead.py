"""Per-step cost of det_lab's PyTorchTrial base class against a plain Determined Trainer.

    python bench/trial_overhead.py [--batches 300 1200] [--repeats 3]

The same model and data, side by side in one run, in Determined's local training mode:

  a. a plain ``det.pytorch.PyTorchTrial`` through ``det.pytorch.init`` + ``Trainer.fit``;
  b. the same trial on ``LabPyTorchTrial`` through ``det_lab.trials.pytorch.run`` with tracking
     off (session, shims, lineage, local checkpoints);
  c. as b with the MLflow mirror on (a local SQLite store).

Checkpointing and validation happen once, at the end, in every arm. Each arm runs for two
lengths; the per-batch cost is the slope between them (so one-off setup, such as creating a
fresh MLflow store, is reported apart), median of --repeats, and its ratio to a.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from determined import core, pytorch

from det_lab.settings import load_settings
from det_lab.trials.pytorch import LabPyTorchTrial, run
from det_lab.volume import init_volume


class Body:
    """The model, data and steps, shared by both trial classes."""

    def setup(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
        self.opt = context.wrap_optimizer(torch.optim.Adam(self.model.parameters(), lr=1e-3))
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4096, 64, generator=g), torch.randn(4096, 8, generator=g)

    def build_training_data_loader(self):
        return pytorch.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=32)

    def build_validation_data_loader(self):
        return pytorch.DataLoader(torch.utils.data.TensorDataset(self.x[:256], self.y[:256]), batch_size=64)

    def train_batch(self, batch, epoch_idx, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}

    def evaluate_batch(self, batch):
        x, y = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}


class Plain(Body, pytorch.PyTorchTrial):
    def __init__(self, context):
        self.setup(context)


class Lab(Body, LabPyTorchTrial):
    def __init__(self, context):
        LabPyTorchTrial.__init__(self, context)
        self.setup(context)


def plain(batches: int, ckpt_dir: Path) -> float:
    orig = core.init
    core.init = functools.partial(orig, checkpoint_storage=str(ckpt_dir))
    try:
        with pytorch.init(hparams={}, enable_tensorboard_logging=False) as ctx:
            start = time.perf_counter()
            pytorch.Trainer(Plain(ctx), ctx).fit(max_length=pytorch.Batch(batches), checkpoint_policy="none",
                                                  reporting_period=pytorch.Batch(50))
            return time.perf_counter() - start
    finally:
        core.init = orig


def lab(batches: int, root: Path, backend: str, mlflow_db: Path) -> float:
    os.environ["DET_LAB_TRACKING"] = backend
    settings = load_settings(env={"DET_LAB_DATA_ROOT": str(root), "DET_LAB_TRACKING": backend,
                                  "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}"})
    root.mkdir(parents=True, exist_ok=True)
    init_volume(settings)
    exp_conf = {"name": f"bench-{backend}", "searcher": {"name": "single", "metric": "val_loss"},
                "data": {"det_lab": {"project": "vla", "tracking": backend, "max_length": {"batches": batches},
                                     "reporting_batches": 50}}}
    start = time.perf_counter()
    run(Lab, settings=settings, exp_conf=exp_conf, hparams={})
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs=2, default=[300, 2400])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.WARNING)
    short, long_ = args.batches
    slopes: dict[str, list[float]] = {}
    setups: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-") as tmp_name:
        tmp = Path(tmp_name)
        db = tmp / "mlflow.db"  # one store for every run, as on a workstation: no per-run migrations
        arms = {
            "a. plain Trainer": lambda n, d: plain(n, d),
            "b. LabPyTorchTrial, no tracking": lambda n, d: lab(n, d / "data", "none", db),
            "c. LabPyTorchTrial, MLflow mirror": lambda n, d: lab(n, d / "data", "mlflow", db),
        }
        slopes.update({a: [] for a in arms})
        setups.update({a: [] for a in arms})
        lab(50, tmp / "warm-up" / "data", "mlflow", db)
        for r in range(args.repeats):  # interleaved, so machine load hits every arm alike
            for i, (arm, fn) in enumerate(arms.items()):
                t_short = fn(short, tmp / f"{i}-{r}-short")
                t_long = fn(long_, tmp / f"{i}-{r}-long")
                slope = (t_long - t_short) / (long_ - short)
                slopes[arm].append(slope)
                setups[arm].append(t_short - short * slope)
    base = statistics.median(slopes["a. plain Trainer"])
    print(f"\nbatches of 32, MLP 64-256-8, Determined local training mode; slope between {short} and "
          f"{long_} batches, median of {args.repeats}\n")
    print(f"{'arm':<40} {'ms/batch':>10} {'vs a':>8} {'setup (s)':>10}")
    for arm in arms:
        med = statistics.median(slopes[arm])
        print(f"{arm:<40} {med * 1000:>10.3f} {med / base:>7.3f}x {statistics.median(setups[arm]):>10.2f}")


if __name__ == "__main__":
    main()
