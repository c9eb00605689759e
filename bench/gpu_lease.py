"""What a GPU lease costs at a local run's start: 8 GPUs (the NVML stand-in), 100 leases in the journal.

    python bench/gpu_lease.py [--repeat 50]

Times, in this one process, ``LocalClaim.check`` (read NVML, take the host lock, read the lease
files and the queue, read the whole journal for the fair order, choose, journal the start, write
the lease) plus its release (journal the end, remove the file), against the same claim on a
machine without GPUs (today's path: NVML read, nothing taken). The stand-in ``tests/nvml_shim.c`` is
built with gcc and loaded as libnvidia-ml.so.1 (the script re-runs itself with LD_LIBRARY_PATH set).
Target: under 50 ms per lease.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_GPUS, N_LEASES = 8, 100


def _setup(base: Path) -> dict[str, str]:
    gcc = shutil.which("gcc")
    if gcc is None:
        sys.exit("needs gcc to build tests/nvml_shim.c")
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(base / "libnvidia-ml.so.1"), str(ROOT / "tests/nvml_shim.c")],
                   check=True)
    (base / "nvml.conf").write_text("".join(
        f"gpu GPU-{i:08x}-0000-4000-8000-{i:012x} 0 0 0 85899345920 NVIDIA H100 80GB HBM3\n" for i in range(N_GPUS)))
    (base / "empty.conf").write_text("")
    data = base / "data"
    journal = data / ".det-lab/gpus/journal"
    journal.mkdir(parents=True)
    now = time.time()
    lines = []
    for k in range(N_LEASES):
        since = now - 86400 + k * 600
        lines.append(json.dumps({"event": "start", "lease": f"old{k:04d}", "host": "box", "user": f"user{k % 5}",
                                 "run": f"vla-{k}", "project": "vla", "template": "vla",
                                 "gpus": [{"index": k % N_GPUS, "uuid": f"GPU-{k % N_GPUS:08x}"}], "pid": 1000 + k,
                                 "since": since}))
        lines.append(json.dumps({"event": "end", "lease": f"old{k:04d}", "at": since + 500, "how": "released"}))
    (journal / "box.bench.jsonl").write_text("\n".join(lines) + "\n")
    (base / "lab.yaml").write_text(f"data_root: {data}\ntracking: {{backend: none}}\n")
    return {"LD_LIBRARY_PATH": str(base), "NVML_SHIM_CONFIG": str(base / "nvml.conf"),
            "DET_LAB_GPU_STATE_DIR": str(base / "state"), "DET_LAB_CONFIG": str(base / "lab.yaml"),
            "BENCH_BASE": str(base)}


def _time(settings, repeat: int) -> list[float]:
    from det_lab.gpus import LocalClaim

    conf = {"resources": {"slots_per_trial": 1}, "data": {"det_lab": {"project": "vla"}}}
    out = []
    for k in range(repeat):
        t0 = time.perf_counter()
        with LocalClaim(settings) as claim:
            claim.check(conf, f"bench-{k}", "vla")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _measure(repeat: int) -> None:
    from det_lab.settings import load_settings

    base = Path(os.environ["BENCH_BASE"])
    settings = load_settings()
    from det_lab.gpus.journal import read_records

    held = len(read_records(settings))
    _time(settings, 3)  # imports and first reads
    with_gpus = _time(settings, repeat)
    os.environ["NVML_SHIM_CONFIG"] = str(base / "empty.conf")
    without = _time(settings, repeat)
    med, cpu = statistics.median(with_gpus), statistics.median(without)
    print(f"lease at a run's start, {N_GPUS} GPUs, {held} leases in the journal at first ({repeat} runs, each adding one):")
    print(f"  take + give back: median {med:.1f} ms, p90 {sorted(with_gpus)[int(repeat * 0.9)]:.1f} ms "
          f"(target < 50 ms: {'met' if med < 50 else 'NOT met'})")
    print(f"  a machine without GPUs (nothing taken): median {cpu:.2f} ms; the lease adds {med - cpu:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    if "BENCH_BASE" in os.environ:
        return _measure(args.repeat)
    base = Path(tempfile.mkdtemp(prefix="det-lab-bench-lease-"))
    try:
        env = {**os.environ, **_setup(base)}
        subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat)], env=env, check=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
