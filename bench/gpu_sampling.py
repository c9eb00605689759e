"""What a trial's GPU sampling (det_lab.trials.gpu_sampler) costs its training loop.

    python bench/gpu_sampling.py [--steps 3000] [--repeats 5] [--interval 10 0.05]

The same small torch training loop (CPU), side by side in one process, arms interleaved per repeat:

  a. no sampler;
  b. the sampler at each ``--interval`` (10 s is the default; 0.05 s exaggerates its share of the
     GIL 200-fold), reading GPUs through nvidia-ml-py.

Without an NVIDIA driver the bench builds the NVML stand-in (tests/nvml_shim.c) and re-runs itself
with it as libnvidia-ml.so.1: the figures are then the Python side's cost (the thread, the GIL,
pynvml's ctypes calls), not a real driver's call latency, which the sampler pays on its own thread.
Prints the median seconds per 1,000 steps of each arm and its ratio to a.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1] / "tests" / "nvml_shim.c"


def _with_shim() -> None:
    """Re-run this script with the NVML stand-in where libnvidia-ml.so.1 is looked for."""
    lib = Path(tempfile.mkdtemp(prefix="gpu-sampling-bench-"))
    gcc = shutil.which("gcc")
    if gcc is None:
        sys.exit("no NVIDIA driver and no gcc to build the NVML stand-in")
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"), str(SHIM)], check=True)
    (lib / "nvml.conf").write_text("gpu GPU-bench-0 63 20 9000000000 80000000000 NVIDIA A100-SXM4-80GB\npower 250000\n")
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "NVML_SHIM_CONFIG": str(lib / "nvml.conf"),
           "DET_LAB_BENCH_SHIM": "1", "CUDA_VISIBLE_DEVICES": "0"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def loop(steps: int) -> float:
    """Seconds for ``steps`` steps of a small MLP's training."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interval", type=float, nargs="+", default=[10.0, 0.05])
    args = parser.parse_args()

    from det_lab.nvml import nvml_module

    nvml = nvml_module()
    if nvml is None:
        if os.environ.get("DET_LAB_BENCH_SHIM"):
            sys.exit("the NVML stand-in did not load")
        _with_shim()
    nvml.nvmlShutdown()
    import torch

    torch.set_num_threads(1)
    from det_lab.trials.gpu_sampler import GpuSampler

    loop(300)  # warm up
    arms: dict[str, list[float]] = {"a. no sampler": []} | {f"b. sampler every {i:g} s": [] for i in args.interval}
    samples: dict[str, int] = {}
    order: list[float | None] = [None, *args.interval]
    for repeat in range(args.repeats):
        for interval in order[repeat % len(order):] + order[:repeat % len(order)]:  # each arm first in turn
            if interval is None:
                arms["a. no sampler"].append(loop(args.steps))
                continue
            name = f"b. sampler every {interval:g} s"
            sampler = GpuSampler(interval, on_sample=lambda step, metrics: None)
            assert sampler.start()
            arms[name].append(loop(args.steps))
            summary = sampler.stop() or {"gpus": [{"samples": 0}]}
            samples[name] = samples.get(name, 0) + summary["gpus"][0]["samples"]
    base = statistics.median(arms["a. no sampler"])
    where = "the NVML stand-in" if os.environ.get("DET_LAB_BENCH_SHIM") else "this machine's driver"
    print(f"{args.steps} steps x {args.repeats} repeats, GPUs read through {where}")
    for name, times in arms.items():
        per_k = statistics.median(times) / args.steps * 1000
        extra = f", {samples[name]} samples" if name in samples else ""
        print(f"{name:28s} {per_k:8.4f} s per 1,000 steps  ratio {statistics.median(times) / base:.4f}{extra}")


if __name__ == "__main__":
    main()
