"""What publishing a dataset costs: an older revision of det_lab against the working tree.

    python bench/publish.py [--before REV] [--runs 3]

Each run, in a fresh interpreter with det_lab taken from REV (extracted with `git archive`) or from
this working tree: a new lab volume, then ``publish_directory`` of a small directory as a new dataset
(git + DVC repository made, objects pushed) and again as its next revision, as ``det-lab init
--demo`` and ``det-lab data import`` do. Prints the median wall and CPU seconds (the interpreter and
every process it started), side by side, and their ratios. The default REV is the last commit whose
publishing ran ``python -m dvc`` once per DVC command (five for a new dataset).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_startup import extract  # bench/ is sys.path[0] when this script runs: det_lab/ at a revision

REPO = Path(__file__).resolve().parents[1]
BEFORE = "2f2c65b"  # the last commit that published through `python -m dvc` subprocesses

#: one measured publish: a new dataset, then its next revision, in a lab made on the spot
SCRIPT = r"""
import json, resource, sys, time
from pathlib import Path
import yaml
base = Path(sys.argv[1])
base.mkdir(parents=True)
t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
from det_lab.data.publish import publish_directory
from det_lab.settings import load_settings
from det_lab.volume import init_volume
(base / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(base / "data"), "tracking": {"backend": "none"}}))
settings = load_settings(base / "lab.yaml", env={})
init_volume(settings)
src = base / "src"
(src / "sub").mkdir(parents=True)
(src / "a.txt").write_text("first\n")
(src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)
publish_directory(settings, "vla", "bench", src, "first")
(src / "a.txt").write_text("second\n")
publish_directory(settings, "vla", "bench", src, "second")
r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime + c1.ru_utime + c1.ru_stime
import det_lab
print(json.dumps({"wall": time.monotonic() - t0, "cpu": cpu, "det_lab": det_lab.__file__}))
"""


def measure(source: Path, work: Path) -> dict[str, float]:
    # cwd: sys.path[0] of ``python -c``, which would otherwise be this checkout for both
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(work)], cwd=source, capture_output=True, text=True,
                          env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin", "HOME": str(work),
                               "DVC_NO_ANALYTICS": "1"}, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"publishing with det_lab from {source} failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row.pop("det_lab").startswith(str(source)), f"det_lab was not imported from {source}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="det-lab-bench-publish-") as tmp:
        old = Path(tmp) / "before"
        old.mkdir()
        extract(args.before, old)
        rows: dict[str, list[dict[str, float]]] = {args.before: [], "working tree": []}
        for i in range(args.runs):  # interleaved, so that a slower moment of the machine hits both
            rows[args.before].append(measure(old, Path(tmp) / f"before-{i}"))
            rows["working tree"].append(measure(REPO, Path(tmp) / f"now-{i}"))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu")} for name, runs in rows.items()}
    print(f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; median of {args.runs}: a new dataset and its next revision")
    for name, m in med.items():
        print(f"  {name:>14}: {m['wall']:6.2f} s wall  {m['cpu']:6.2f} s CPU")
    new, before = med["working tree"], med[args.before]
    print(f"  working tree / {args.before}: wall {new['wall'] / before['wall']:.2f}, CPU {new['cpu'] / before['cpu']:.2f}")


if __name__ == "__main__":
    main()
