"""How det_lab's listing commands and the exporter grow with the volume.

    python bench/scale.py [--sizes 1000,10000] [--runs 3] [--keep DIR]

For each size N it generates a volume (under a temporary directory on this machine's disk) with N
runs (half local, half Slurm; 1 % running, the rest finished; each run.json the size and shape of a
real VLA run's, about 6 KB, with the progress an ended run records, and 20 training and 4
validation reports; one in ten with a tracking journal
of 50 events, half of them undelivered), N/10 registered datasets each with a published snapshot
of 3 files, and 5 N checkpoint files (4 KiB each) under checkpoints/<project>/. Then it times, as
the median of --runs:

- the exporter: its start-up (the volume, runs and trackers sources read, one after another,
  before it listens), its first scrape after that, and a scrape after the sources' ttl (it answers with the
  last figures and the sources refresh in the background); and the time of each source's own read;
- ``det-lab runs list`` (the first listing, with its worker processes and without; one after a
  listing with nothing changed: it keeps
  what it read per user and re-reads only runs whose files changed; and, last, a first listing of
  runs that ended before det_lab recorded their progress in run.json, whose metrics it reads), ``det-lab data list`` and
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


def run_state(i: int, kind: str, name: str, project: str, slurm: bool) -> dict:
    """A run.json the size and shape of a finished VLA run's (about 6 KB: its config as run,
    hyperparameters, checkpoints and lineage), every value its own."""
    hparams = {"global_batch_size": 8 + i % 5, "lr": 0.001 * (1 + i % 9), "grad_clip": 1.0, "horizon": 8,
               "model": {"d_model": 64, "n_heads": 4, "n_layers": 2 + i % 3, "patch_size": 8, "vocab_size": 512,
                         "image_encoder": "cnn", "dropout": 0.0, "ff_mult": 2, "max_text_tokens": 8},
               "num_workers": 0, "split_seed": i, "torch_threads": 1, "val_episodes": 2, "warmup_batches": 50,
               "weight_decay": 0.0001, "bf16": False, "resize": None}
    config = {"name": name, "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py",
              "hyperparameters": hparams, "searcher": {"name": "single", "metric": "val_action_l1",
                                                       "smaller_is_better": True},
              "checkpoint_storage": {"type": "shared_fs", "storage_path": f"checkpoints/{project}"},
              "data": {"det_lab": {"dataset": f"ds-{i % 1000:05d}", "project": project,
                                   "max_length": {"batches": 100}, "reporting_batches": 5}},
              "min_validation_period": {"batches": 10}, "min_checkpoint_period": {"batches": 20},
              "max_restarts": 0, "resources": {"slots_per_trial": 1}}
    commit = f"{i:040x}"
    state = {"kind": kind, "name": name, "run_key": f"{kind}-{name}", "template": f"tmpl-{i % 7}",
             "config": f"/home/user{i % 12}/configs/{name}.yaml", "cwd": f"/srv/det-lab/experiment_templates/{project}",
             "command": ["/srv/det-lab/.venv/bin/python", "train.py"], "exp_conf": config, "hparams": hparams,
             "max_length": 100, "max_length_unit": "batches", "seed": i,
             "checkpoints": [{"uuid": f"{i:08x}-0000-4000-8000-{s:012x}", "step": s} for s in (20, 40, 60, 80, 100)],
             "latest_checkpoint": f"{i:08x}-0000-4000-8000-{100:012x}", "latest_checkpoint_step": 100,
             "created": "20261201-120000",
             "lineage": {"det_lab_version": "0.1.0", "determined_version": "0.38.1", "host": f"gpu-{i % 4}",
                         "python": "3.11.7", "code_commit": commit, "run_key": f"{kind}-{name}", "scheduler": kind,
                         "template": f"tmpl-{i % 7}", "seed": i, "config": config, "hyperparameters": hparams,
                         "code": {"repo": "/srv/git/lab.git", "root": "/srv/det-lab", "commit": commit,
                                  "subdir": f"experiment_templates/{project}", "template_tree": commit, "dirty": False},
                         "environment": {"hash": f"{i % 50:020x}", "python": "3.11.7", "packages": 257},
                         "dataset": {"project": project, "repo": f"/srv/git/ds-{i % 1000:05d}.git", "rev": "main",
                                     "commit": commit, "path": "data", "md5": f"{i:032x}.dir", "size": 110522,
                                     "nfiles": 485}},
             "trial_status": "FINISHED", "status": "finished", "exit_code": 0}
    if slurm:
        state["slurm"] = {"job_id": str(1000 + i), "partition": "gpu", "nodes": 1, "gpus_per_node": 1,
                          "attempts": [{"node": f"gpu-{i % 4}", "job_id": str(1000 + i), "restart": 0,
                                        "started": "2026-12-01T12:00:00"}]}
    return state


def metrics_lines(i: int) -> str:
    """20 training reports and 4 validations, as det_lab's record appends them."""
    lines = []
    for step in range(5, 101, 5):
        lines.append({"group": "training", "step": step, "metrics": {
            "loss": 1.0 / (step + i), "action_l1": 0.5 / (step + i), "lr": 0.001, "batches": float(step), "epochs": 0.0}})
        if step % 25 == 0:
            lines.append({"group": "validation", "step": step, "metrics": {
                "val_loss": 0.9 / (step + i), "val_action_l1": 0.4 / (step + i), "batches": float(step), "epochs": 0.0}})
    return "".join(json.dumps(line) + "\n" for line in lines)


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
        state = run_state(i, kind, name, project, slurm)
        metrics = metrics_lines(i)
        if running:
            for key in ("status", "trial_status", "exit_code"):
                del state[key]
        else:  # what RunRecord.record_end keeps at the end: the progress reached, the metrics' size then
            last_validation = json.loads(metrics[metrics.rindex('{"group": "validation"'):].splitlines()[0])
            state["progress"] = {"step": 100, "validation": last_validation["metrics"], "metrics_bytes": len(metrics)}
        (d / "run.json").write_text(json.dumps(state, indent=2) + "\n")  # as det_lab's record writes it
        (d / "metrics.jsonl").write_text(metrics)
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


def time_exporter(config: Path, measure: str) -> float:
    """Seconds of one exporter step over the volume, runs and trackers sources: ``start-up`` (every
    source read before it listens), ``first`` (the first scrape after that), ``ttl``
    (a scrape with every answer past its ttl: it answers and refreshes in the background)."""
    from prometheus_client import generate_latest

    from det_lab.monitoring.exporter import build_sources, registry_for
    from det_lab.settings import load_settings

    registry, collector = registry_for(build_sources(load_settings(config, env={}), ["volume", "runs", "trackers"]))
    start = time.perf_counter()
    assert collector.prime() == []
    if measure == "start-up":
        return time.perf_counter() - start
    if measure == "ttl":
        for source in collector.sources:
            source.ttl = 1e-9
    start = time.perf_counter()
    text = generate_latest(registry)
    seconds = time.perf_counter() - start
    collector.wait_refreshes()
    assert b'det_lab_scrape_error{source="runs"} 0.0' in text, collector.errors()
    return seconds


def time_source(config: Path, name: str, again: bool = False) -> float:
    """Seconds of one read of the source ``name``: its first, or (``again``) the next one, with
    nothing changed on the volume (the runs source re-reads only run.json files that changed)."""
    from det_lab.monitoring.exporter import build_sources
    from det_lab.settings import load_settings

    (source,) = build_sources(load_settings(config, env={}), [name])
    if again:
        list(source.collect())
    start = time.perf_counter()
    list(source.collect())
    return time.perf_counter() - start


def time_cli(config: Path, *args: str, listed_before: bool | None = None, workers: int | None = None) -> float:
    """Seconds of one ``det-lab *args``. ``listed_before``: with ``runs list``'s cache of the
    previous listing (nothing changed since) or without one (the first listing, every file read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "SLURM_"))}
    cache = config.parent / "user-cache"
    env.update(DET_LAB_CONFIG=str(config), COLUMNS="200", XDG_CACHE_HOME=str(cache))
    if workers is not None:
        env["DET_LAB_LIST_WORKERS"] = str(workers)
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


def forget_progress(config: Path) -> Path:
    """Take the recorded progress out of every run.json, as runs that ended before det_lab kept it
    left them (their listing reads metrics.jsonl); once per volume."""
    marker = config.parent / "progress-forgotten"
    if not marker.exists():
        for path in (config.parent / "data" / "outputs").glob("*/*-runs/*/run.json"):
            state = json.loads(path.read_text())
            if state.pop("progress", None) is not None:
                path.write_text(json.dumps(state, indent=2) + "\n")
        marker.touch()
    return config


MEASURES = {
    "det-lab --help (start-up alone, for scale)": lambda c: time_cli(c, "--help"),
    "exporter start-up: volume, runs, trackers read before it listens": lambda c: time_exporter(c, "start-up"),
    "exporter scrape, the first after start-up": lambda c: time_exporter(c, "first"),
    "exporter scrape, ttl passed (refresh in the background)": lambda c: time_exporter(c, "ttl"),
    "volume source, a read": lambda c: time_source(c, "volume"),
    "runs source, first read": lambda c: time_source(c, "runs"),
    "runs source, next read (nothing changed)": lambda c: time_source(c, "runs", again=True),
    "trackers source, a read": lambda c: time_source(c, "trackers"),
    "det-lab runs list, first listing (every run read)": lambda c: time_cli(c, "runs", "list", listed_before=False),
    "det-lab runs list, first listing, read by this process alone (DET_LAB_LIST_WORKERS=1)":
        lambda c: time_cli(c, "runs", "list", listed_before=False, workers=1),
    "det-lab runs list, listed before (nothing changed)": lambda c: time_cli(c, "runs", "list", listed_before=True),
    "det-lab data list": lambda c: time_cli(c, "data", "list"),
    "det-lab tracking status": lambda c: time_cli(c, "tracking", "status"),
    # last: it rewrites every run.json
    "det-lab runs list, first listing, runs ended before det_lab kept their progress":
        lambda c: time_cli(forget_progress(c), "runs", "list", listed_before=False),
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
