"""Time from command to first training step: ``det-lab run vla --local`` against ``--slurm``.

Starts its own one-node Slurm (munged + slurmctld + slurmd, as the tests do) and a lab in a
temporary directory with the VLA demo dataset, then runs the VLA template's tiny config (20
batches, a report every batch) alternately through both paths and prints, side by side, the
seconds from the command's start until the trial reported its first training step (and, for
Slurm, until the job was running). Metrics tracking is off: this measures the scheduler.

    python bench/slurm_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm_cluster import missing_binaries, start_cluster  # noqa: E402

SETS = ["--set", "data.det_lab.max_length.batches=20", "--set", "data.det_lab.reporting_batches=1",
        "--set", "min_validation_period.batches=20", "--set", "min_checkpoint_period.batches=20"]


def first_step(root: Path, kind: str, before: set[Path], proc: subprocess.Popen, start: float) -> tuple[float, Path]:
    runs = root / "outputs" / "vla" / kind
    while True:
        new = [p for p in runs.glob("vla-*") if p not in before]
        if new and (new[0] / "metrics.jsonl").exists():
            if any('"training"' in line for line in (new[0] / "metrics.jsonl").read_text().splitlines()):
                return time.monotonic() - start, new[0]
        if proc.poll() is not None and proc.returncode != 0:
            raise RuntimeError(f"det-lab failed: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.05)


def one(mode: str, root: Path, env: dict[str, str]) -> dict[str, float]:
    kind = "local-runs" if mode == "--local" else "slurm-runs"
    before = set((root / "outputs" / "vla" / kind).glob("vla-*"))
    start = time.monotonic()
    wall_start = time.time()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "det-lab"), "run", "vla", mode, *SETS,
                             *(["--wait"] if mode == "--slurm" else [])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds, run_dir = first_step(root, kind, before, proc, start)
    proc.wait(timeout=600)
    out = {"first_step": seconds}
    if mode == "--slurm":
        started = json.loads((run_dir / "run.json").read_text())["slurm"]["attempts"][0]["started"]
        out["job_running"] = time.mktime(time.strptime(started, "%Y-%m-%dT%H:%M:%S")) - wall_start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if missing_binaries():
        sys.exit(f"Slurm is not installed (missing {', '.join(missing_binaries())}): apt-get install slurm-wlm munge")
    from det_lab.data.publish import publish_demos
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    with tempfile.TemporaryDirectory(prefix="det-lab-slurm-bench-") as tmp:
        tmp_path = Path(tmp)
        cluster = start_cluster(tmp_path / "slurm")
        try:
            root = tmp_path / "data"
            (tmp_path / "lab.yaml").write_text(f"data_root: {root}\ntracking: {{backend: none}}\n")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_"))}
            env.update(DET_LAB_CONFIG=str(tmp_path / "lab.yaml"), **cluster.env,
                       DET_LAB_TEMPLATES=str(REPO / "experiment_templates"))
            settings = load_settings(tmp_path / "lab.yaml", env={})
            init_volume(settings)
            publish_demos(settings)
            results: dict[str, list[dict[str, float]]] = {"--local": [], "--slurm": []}
            for _ in range(args.repeats):
                for mode in results:
                    results[mode].append(one(mode, root, env))
        finally:
            cluster.stop()
    local = statistics.median(r["first_step"] for r in results["--local"])
    slurm = statistics.median(r["first_step"] for r in results["--slurm"])
    running = statistics.median(r["job_running"] for r in results["--slurm"])
    print(f"command to first training step, VLA tiny config, median of {args.repeats} (seconds):")
    print(f"{'':28}{'--local':>10}{'--slurm':>10}")
    print(f"{'first training step':28}{local:>10.2f}{slurm:>10.2f}")
    print(f"{'job running (Slurm)':28}{'':>10}{running:>10.2f}")
    print(f"{'scheduler overhead':28}{'':>10}{slurm - local:>+10.2f}")
    print("runs:", json.dumps(results))


if __name__ == "__main__":
    main()
