"""How long `det-lab` takes to start: an older revision of det_lab against the working tree.

    python bench/cli_startup.py [--before REV] [--runs 5]

Runs `det-lab --help` and `det-lab data list --help` --runs times each, with det_lab taken from
REV (extracted with `git archive` to a temporary directory) and from this working tree, in this
interpreter, and prints the median wall seconds side by side, plus which heavy libraries each
one imported. The default REV is the last commit before the CLI modules imported lazily.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = "9e27606"  # last commit whose CLI imported determined, numpy, pydantic... at start
COMMANDS = (["--help"], ["data", "list", "--help"])
HEAVY = ("torch", "determined", "mlflow", "aim", "dvc", "optuna", "pandas", "numpy", "pydantic")
MAIN = "from det_lab.cli.app import main; main()"
PROBE = "import sys, det_lab.cli.app; print(' '.join(m for m in {h!r} if m in sys.modules) or '-')".format(h=HEAVY)


def extract(rev: str, dest: Path) -> None:
    """det_lab/ as it was at ``rev``, under ``dest``."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "det_lab"], cwd=REPO, check=True,
                             capture_output=True).stdout
    tar = dest / "det_lab.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")


def median_seconds(root: Path, args: list[str], runs: int) -> float:
    # cwd outside the repository: sys.path[0] would otherwise be the working tree for both
    env = {**os.environ, "PYTHONPATH": str(root)}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", MAIN, *args], cwd=root, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def heavy_imports(root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help=f"git revision to compare with (default {BEFORE})")
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        extract(opts.before, old)
        now = REPO
        print(f"{'command':<28} {opts.before + ' (s)':>14} {'working tree (s)':>17}   median of {opts.runs}")
        for args in COMMANDS:
            before, after = median_seconds(old, args, opts.runs), median_seconds(now, args, opts.runs)
            print(f"{'det-lab ' + ' '.join(args):<28} {before:>14.2f} {after:>17.2f}")
        print(f"heavy libraries imported by det_lab.cli.app at {opts.before}: {heavy_imports(old)}")
        print(f"heavy libraries imported by det_lab.cli.app in the working tree: {heavy_imports(now)}")


if __name__ == "__main__":
    main()
