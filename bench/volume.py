"""How the volume's clean-up plans grow with the volume: ``runs prune``, ``data gc --dry-run`` and
``volume usage``.

    python bench/volume.py [--sizes 1000,10000] [--runs 3] [--keep DIR]

For each size N it generates a volume (under a temporary directory on this machine's disk) with
three real dataset repositories (git + DVC, published with det_lab, one per project, each with two
revisions, every revision pulled so snapshots are hard links into the cache), N runs (half local,
half Slurm, run.json as ``bench/scale.py`` makes them: about 6 KB, five checkpoints listed,
lineage naming one of the real revisions; half of them last changed 40 days ago) and 5 N
checkpoints (``metadata.json`` and a 4 KiB ``state.pt`` each, the ones the run.json files list).
Then it times, in this process, as the median of --runs:

- ``runs prune --older-than 30d``'s plan (:func:`det_lab.lifecycle.prune.plan_prune`, in a child
  process stopped after 300 s; skipped, saying so, where that function does not exist): from
  scratch (``fresh``: every run.json read, every tree walked), as a user's first (no cache yet),
  and as every later one (this user's caches);
- ``data gc --dry-run``: its plan (:func:`det_lab.lifecycle.storage.data_gc`), once cold (DVC asked
  about every branch tip and tag: the first run on a volume) and then as every later run is (the
  answer of each commit kept on the volume);
- ``volume usage``: the walk alone, and with what data gc and runs prune would free.

It prints one row per size and measure, and the growth from the smallest size to the largest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scale import PROJECTS, metrics_lines, run_state  # noqa: E402

OLD = time.time() - 40 * 86400


def generate(root: Path, n_runs: int) -> Path:
    """A lab config and a volume with ``n_runs`` runs (see the module docstring)."""
    from det_lab import data
    from det_lab.data.publish import publish_directory
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    config = root / "lab.yaml"
    volume = root / "data"
    config.write_text(yaml.safe_dump({"data_root": str(volume), "tracking": {"backend": "none"}}))
    settings = load_settings(config, env={})
    init_volume(settings)
    identities = {}
    for k, project in enumerate(PROJECTS):
        src = root / f"src-{project}"
        revisions = []
        for rev in range(2):
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir()
            for f in range(20):
                (src / f"part-{f}.bin").write_bytes(os.urandom(2048) if f >= 18 else bytes([k, f]) * 1024)
            publish_directory(settings, project, f"ds-{project}", src, f"revision {rev}")
            spec = data.load_registry(settings)[f"ds-{project}"]
            revisions.append(data.pull(data.DatasetSpec(project, spec.repo, spec.path,
                                                        data.resolve(spec).commit), settings).identity)
        identities[project] = revisions
    block = os.urandom(4096)
    for i in range(n_runs):
        project = PROJECTS[i % len(PROJECTS)]
        slurm = i % 2 == 1
        kind, sub = ("slurm", "slurm-runs") if slurm else ("local", "local-runs")
        name = f"run-{i:06d}"
        d = volume / "outputs" / project / sub / name
        d.mkdir(parents=True)
        state = run_state(i, kind, name, project, slurm)
        identity = identities[project][i % 2]
        state["lineage"]["dataset"] = {**identity.__dict__}
        (d / "run.json").write_text(json.dumps(state, indent=2) + "\n")
        (d / "metrics.jsonl").write_text(metrics_lines(i))
        for entry in state["checkpoints"]:
            c = volume / "checkpoints" / project / entry["uuid"]
            c.mkdir(parents=True)
            (c / "metadata.json").write_text(json.dumps({"steps_completed": entry["step"]}))
            (c / "state.pt").write_bytes(block)
        if i % 2 == 0:
            os.utime(d / "run.json", (OLD, OLD))
    return config


def _median(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


PRUNE_LIMIT_S = 300

_PRUNE = """
import sys, time
from pathlib import Path
try:
    from det_lab.lifecycle.prune import plan_prune
except ImportError:
    print("missing"); sys.exit(0)
from det_lab.settings import load_settings
settings = load_settings(Path(sys.argv[1]), env={})
start = time.perf_counter()
try:
    plan_prune(settings, older_than="30d", fresh=sys.argv[2] == "fresh")
except TypeError:  # a det_lab without the caches: every plan is from scratch
    plan_prune(settings, older_than="30d")
print(time.perf_counter() - start)
"""


def _prune_plan(config: Path, runs: int, how: str = "cached") -> float | None:
    """The median time of ``plan_prune`` in a child process (killed past ``PRUNE_LIMIT_S``: then
    ``inf``); None where det_lab has no ``plan_prune``. ``how``: ``cached`` (this user's caches as
    the last plan left them), ``first`` (no cache yet: a fresh ``XDG_CACHE_HOME`` each time) or
    ``fresh`` (every run.json read, every tree walked)."""
    import subprocess

    times = []
    for _ in range(runs):
        env = dict(os.environ)
        if how == "first":
            env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="det-lab-bench-cache-")
        try:
            out = subprocess.run([sys.executable, "-c", _PRUNE, str(config), how], capture_output=True, text=True,
                                 timeout=PRUNE_LIMIT_S, check=True, env=env).stdout.strip()
        except subprocess.TimeoutExpired:
            return float("inf")
        if out == "missing":
            return None
        times.append(float(out))
        if times[-1] > 30:  # one slow reading is enough
            break
    return statistics.median(times)


def measure(config: Path, runs: int) -> dict[str, float | None]:
    from det_lab.data.gc import USED_DIR
    from det_lab.settings import load_settings
    from det_lab.lifecycle.space import volume_space
    from det_lab.lifecycle.storage import data_gc
    from det_lab.volume import VolumeLayout

    settings = load_settings(config, env={})
    out: dict[str, float | None] = {}
    out["runs prune --older-than 30d (plan, every run.json read, every tree walked)"] = _prune_plan(config, 1, "fresh")
    out["runs prune --older-than 30d (plan, the user's first: caches made)"] = _prune_plan(config, 1, "first")
    _prune_plan(config, 1)  # this user's caches, as the last plan left them
    out["runs prune --older-than 30d (plan)"] = _prune_plan(config, runs)
    known = VolumeLayout.from_settings(settings).state / USED_DIR

    def cold() -> None:
        shutil.rmtree(known, ignore_errors=True)
        data_gc(settings, 30)

    out["data gc --dry-run, first on the volume"] = _median(cold, runs)
    out["data gc --dry-run"] = _median(lambda: data_gc(settings, 30), runs)
    out["volume usage (walk only)"] = _median(lambda: volume_space(settings, reclaimable=False), runs)
    out["volume usage (with what gc and prune free)"] = _median(lambda: volume_space(settings), runs)
    return out


def _reference() -> float:
    """Seconds of a fixed piece of pure Python, to compare machines and loads."""
    start = time.perf_counter()
    sum(range(10**7))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of runs, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="repetitions per measure (median)")
    parser.add_argument("--keep", type=Path, help="generate under DIR/volume-N and keep it (a later run reuses it)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[int, float | None]] = {}
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"reference: sum(range(10**7)) takes {_reference():.3f} s here", flush=True)
    for n in sizes:
        root = args.keep / f"volume-{n}" if args.keep else Path(tempfile.mkdtemp(prefix=f"det-lab-volume-{n}-"))
        try:
            if not (root / "lab.yaml").is_file():
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
                start = time.perf_counter()
                generate(root, n)
                print(f"# {n} runs, {5 * n} checkpoints, 3 dataset repositories generated in "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
            else:
                print(f"# {n} runs: the volume generated before under {root}", flush=True)
            config = root / "lab.yaml"
            for name, seconds in measure(config, args.runs).items():
                results.setdefault(name, {})[n] = seconds
                shown = ("skipped: det_lab.lifecycle.prune.plan_prune does not exist" if seconds is None else
                         f"over {PRUNE_LIMIT_S} s (stopped)" if seconds == float("inf") else f"{seconds:7.3f} s")
                print(f"{n:>7} runs  {shown}  {name}", flush=True)
        finally:
            if args.keep is None:
                shutil.rmtree(root, ignore_errors=True)
    print()
    print("| measure | " + " | ".join(f"{n:,} runs" for n in sizes) + f" | growth {sizes[0]:,} -> {sizes[-1]:,} |")
    print("|---|" + "---|" * len(sizes) + "---|")
    for name, by_size in results.items():
        if any(v is None for v in by_size.values()):
            print(f"| {name} | " + " | ".join("skipped" for _ in sizes) + " | - |")
            continue
        cells = " | ".join(f"{by_size[n]:.3f} s" for n in sizes)
        print(f"| {name} | {cells} | x{by_size[sizes[-1]] / by_size[sizes[0]]:.1f} |")


if __name__ == "__main__":
    main()
