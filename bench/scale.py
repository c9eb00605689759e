"""How det_lab's listing commands and the exporter grow with the volume.

    python bench/scale.py [--sizes 1000,10000] [--runs 3] [--keep DIR]

For each size N it generates a volume (under a temporary directory on this machine's disk) with N
runs (half local, half Slurm; 1 % running, the rest finished; one in ten with a tracking journal
of 50 events, half of them undelivered), N/10 registered datasets each with a published snapshot
of 3 files, and 5 N checkpoint files (4 KiB each) under checkpoints/<project>/. Then it times, as
the median of --runs:

- one exporter scrape: cold (the exporter's first: the volume, runs and trackers sources read in
  the scrape), within the sources' ttl, and after it (the scrape answers with the last figures and
  the sources refresh in the background); and the time of each source's own refresh;
- ``det-lab runs list`` (the first listing, and one after a listing with nothing changed: it keeps
  what it read per user and re-reads only runs whose files changed), ``det-lab data list`` and
  ``det-lab tracking status``, each the installed console script as a user runs it (its
  interpreter start included).

It prints one table row per size and command, and the growth from the smallest to the largest.
No Slurm cluster: the generated Slurm runs are ended, so ``runs list`` asks Slurm nothing, and
the exporter runs without its Slurm and GPU sources (their cost does not grow with the volume).
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

import yaml

REPO = Path(__file__).resolve().parents[1]
DET_LAB = Path(sys.executable).with_name("det-lab")
PROJECTS = ("vla", "isaac", "3dgs")


def generate(root: Path, n_runs: int) -> Path:
    """A lab config and an initialised volume with ``n_runs`` runs (see the module docstring)."""
    from det_lab.settings import load_settings
    from det_lab.tracking.events import Metrics, RunInfo
    from det_lab.tracking.journal import Cursor, Journal
    from det_lab.volume import init_volume

    config = root / "lab.yaml"
    data = root / "data"
    config.write_text(yaml.safe_dump({"data_root": str(data), "tracking": {"backend": "none"}}))
    settings = load_settings(config, env={})
    init_volume(settings)
    now = time.time()
    for i in range(n_runs):
        project = PROJECTS[i % len(PROJECTS)]
        slurm = i % 2 == 1
        kind, sub = ("slurm", "slurm-runs") if slurm else ("local", "local-runs")
        name = f"run-{i:06d}"
        d = data / "outputs" / project / sub / name
        d.mkdir(parents=True)
        running = i % 100 == 0 and not slurm
        state = {"kind": kind, "name": name, "run_key": f"{kind}-{name}", "template": f"tmpl-{i % 7}",
                 "max_length": 100, "checkpoints": [], "latest_checkpoint": None, "hparams": {"lr": 0.001}}
        if not running:
            state["status"] = "finished"
        if slurm:
            state["slurm"] = {"job_id": str(1000 + i), "attempts": [{"node": "n1", "job_id": str(1000 + i)}]}
        (d / "run.json").write_text(json.dumps(state))
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"group": "training", "step": s, "metrics": {"loss": 1.0 / s}}) + "\n" for s in range(1, 21)))
        if running:
            (d / "trainer.lock").write_text("")
        if i % 10 == 0:
            journal = Journal(d / "tracking-journal")
            journal.describe_run(RunInfo(f"{kind}-{name}", name), {"mlflow": "http://127.0.0.1:9/"})
            journal.append([Metrics("training", s, {"loss": 1.0 / s}, timestamp=now - 600 + s) for s in range(1, 51)])
            journal.advance("mlflow", Cursor(25))
            journal.close()
    registry = {}
    for k in range(max(n_runs // 10, 1)):
        project = PROJECTS[k % len(PROJECTS)]
        stem = f"ds-{k:05d}"
        registry[stem] = {"project": project, "repo": f"/srv/git/{stem}.git", "path": "data", "rev": "HEAD"}
        snap = data / "snapshots" / project / stem
        snap.mkdir(parents=True)
        for f in range(3):
            (snap / f"part-{f}.bin").write_bytes(b"x" * 2048)
        identity = {"project": project, "repo": f"/srv/git/{stem}.git", "rev": "HEAD", "commit": f"{k:040x}",
                    "path": "data", "md5": f"{k:032x}", "size": 6144, "nfiles": 3}
        (snap / "snapshot.json").write_text(json.dumps({"identity": identity, "files": 3}))
    (data / ".det-lab" / "datasets.yaml").write_text(yaml.safe_dump(registry))
    block = os.urandom(4096)
    for c in range(5 * n_runs):
        project = PROJECTS[c % len(PROJECTS)]
        d = data / "checkpoints" / project / f"exp-{c // 50:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"ckpt-{c:06d}.pt").write_bytes(block)
    return config


def time_scrape(config: Path, warm: bool, expired: bool = False) -> float:
    from prometheus_client import generate_latest

    from det_lab.monitoring.exporter import build_sources, registry_for
    from det_lab.settings import load_settings

    registry, collector = registry_for(build_sources(load_settings(config, env={}), ["volume", "runs", "trackers"]))
    if warm:
        generate_latest(registry)
    if expired:  # every answer past its ttl: the scrape answers with it and refreshes in the background
        for source in collector.sources:
            source.ttl = 1e-9
    start = time.perf_counter()
    text = generate_latest(registry)
    seconds = time.perf_counter() - start
    collector.wait_refreshes()
    assert b'det_lab_scrape_error{source="runs"} 0.0' in text, collector.last_errors
    return seconds


def time_source(config: Path, name: str) -> float:
    from det_lab.monitoring.exporter import build_sources
    from det_lab.settings import load_settings

    (source,) = build_sources(load_settings(config, env={}), [name])
    start = time.perf_counter()
    list(source.collect())
    return time.perf_counter() - start


def time_cli(config: Path, *args: str, listed_before: bool | None = None) -> float:
    """Seconds of one ``det-lab *args``. ``listed_before``: with ``runs list``'s cache of the
    previous listing (nothing changed since) or without one (the first listing, every file read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "SLURM_"))}
    cache = config.parent / "user-cache"
    env.update(DET_LAB_CONFIG=str(config), COLUMNS="200", XDG_CACHE_HOME=str(cache))
    if listed_before is not None:
        shutil.rmtree(cache, ignore_errors=True)
        if listed_before:
            subprocess.run([str(DET_LAB), *args], env=env, capture_output=True, cwd=config.parent, check=True)
    start = time.perf_counter()
    proc = subprocess.run([str(DET_LAB), *args], env=env, capture_output=True, text=True, cwd=config.parent)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # tracking status exits 0; a listing never fails here
        raise SystemExit(f"det-lab {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
    return seconds


MEASURES = {
    "det-lab --help (start-up alone, for scale)": lambda c: time_cli(c, "--help"),
    "exporter scrape, cold (volume+runs+trackers)": lambda c: time_scrape(c, warm=False),
    "exporter scrape, within the ttl": lambda c: time_scrape(c, warm=True),
    "exporter scrape, ttl passed (refresh in the background)": lambda c: time_scrape(c, warm=True, expired=True),
    "volume source refresh": lambda c: time_source(c, "volume"),
    "runs source refresh": lambda c: time_source(c, "runs"),
    "trackers source refresh": lambda c: time_source(c, "trackers"),
    "det-lab runs list, first listing (every run read)": lambda c: time_cli(c, "runs", "list", listed_before=False),
    "det-lab runs list, listed before (nothing changed)": lambda c: time_cli(c, "runs", "list", listed_before=True),
    "det-lab data list": lambda c: time_cli(c, "data", "list"),
    "det-lab tracking status": lambda c: time_cli(c, "tracking", "status"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of runs, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="repetitions per measure (median)")
    parser.add_argument("--keep", type=Path, help="generate under DIR and keep it")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[int, float]] = {m: {} for m in MEASURES}
    for n in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"det-lab-scale-{n}-", dir=args.keep))
        try:
            start = time.perf_counter()
            config = generate(root, n)
            print(f"# {n} runs, {max(n // 10, 1)} datasets, {5 * n} checkpoints generated in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
            for name, measure in MEASURES.items():
                results[name][n] = statistics.median(measure(config) for _ in range(args.runs))
                print(f"{n:>7} runs  {results[name][n]:7.3f} s  {name}", flush=True)
        finally:
            if args.keep is None:
                shutil.rmtree(root, ignore_errors=True)
    print()
    print("| measure | " + " | ".join(f"{n:,} runs" for n in sizes) + f" | growth {sizes[0]:,} -> {sizes[-1]:,} |")
    print("|---|" + "---|" * len(sizes) + "---|")
    for name, by_size in results.items():
        cells = " | ".join(f"{by_size[n]:.3f} s" for n in sizes)
        print(f"| {name} | {cells} | x{by_size[sizes[-1]] / by_size[sizes[0]]:.1f} |")


if __name__ == "__main__":
    main()
