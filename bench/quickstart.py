"""Time the README's quick start on this machine: a fresh venv to the end of `det-lab run vla --local`.

    python bench/quickstart.py [--no-pip-cache] [--keep]

Copies the working tree (tracked and new, unignored files) to a temporary directory, makes a new
venv there with this interpreter, and runs quick-start command 1 exactly as README.md shows it,
one `&&` step at a time in one shell, printing the seconds each step took and the total. pip uses
this machine's configuration (index, find-links, constraints: here the CPU torch wheel lies on
disk) and, unless --no-pip-cache, its HTTP cache. The lab's MLflow store goes to the temporary
directory too. Nothing outside it is written.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "@@quickstart-step@@"


def quickstart_command(readme: Path) -> str:
    """Command 1 of the README's quick start: the line after its '# 1.' comment."""
    lines = readme.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# 1."):
            return lines[i + 1].strip()
    raise SystemExit(f"{readme}: no '# 1.' quick-start command found")


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout
    for rel in filter(None, files.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-pip-cache", action="store_true", help="Run pip without its HTTP/wheel cache.")
    ap.add_argument("--keep", action="store_true", help="Keep the temporary directory and print it.")
    args = ap.parse_args()

    command = quickstart_command(REPO / "README.md")
    steps = [s.strip() for s in command.split("&&")]
    tmp = Path(tempfile.mkdtemp(prefix="det-lab-quickstart-"))
    src, venv = tmp / "det-lab", tmp / "venv"
    src.mkdir()
    copy_tree(src)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DET_LAB_", "MLFLOW_", "VIRTUAL_ENV", "PYTHONPATH", "DET_MASTER"))}
    env.update(XDG_DATA_HOME=str(tmp / "xdg-data"), XDG_CONFIG_HOME=str(tmp / "xdg-config"))
    if args.no_pip_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    script = [f'. "{venv}/bin/activate"', "set -e"]
    for step in steps:
        script += [f"echo {MARK} $(date +%s.%N)", step]
    script.append(f"echo {MARK} $(date +%s.%N)")

    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    t_venv = time.monotonic() - t0
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=src, env=env, capture_output=True, text=True)
    total = time.monotonic() - t0
    stamps = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    output = "\n".join(line for line in proc.stdout.splitlines() if not line.startswith(MARK))

    print(f"quick start: {command}")
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"pip cache {'off' if args.no_pip_cache else 'on'}; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (other work on the same CPUs slows every step)\n")
    print(f"{'step':<60} {'s':>7}")
    print(f"{'python -m venv':<60} {t_venv:7.1f}")
    for step, (a, b) in zip(steps, zip(stamps, stamps[1:])):
        print(f"{step[:60]:<60} {b - a:7.1f}")
    print(f"{'total (fresh venv to the end of the run)':<60} {total:7.1f}  ({int(total // 60)} min {total % 60:.0f} s)")
    if proc.returncode != 0:
        failed = steps[len(stamps) - 1] if 0 < len(stamps) <= len(steps) else "?"
        print(f"\nFAILED at: {failed} (exit {proc.returncode})\n{output[-3000:]}\n{proc.stderr[-3000:]}")
    else:
        summary = output[output.rfind("run vla-"):] if "run vla-" in output else output[-2000:]
        print("\nthe run's summary:\n" + re.sub(r"\n{3,}", "\n\n", summary))
    if args.keep:
        print(f"\nkept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
