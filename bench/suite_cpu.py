"""Where the test suite's CPU goes: CPU-seconds per test file, counting every process a test started.

    sudo python bench/suite_cpu.py [PYTEST ARGS...]    # the whole suite, as the README runs it
    sudo python bench/suite_cpu.py tests/test_vla.py   # one file

The suite's time on a 2-core machine follows its CPU work (the CPUs are busy through a whole run), so
this is what to read before cutting it. Each pytest-xdist worker moves itself into its own cgroup
(cgroup v1 ``cpuacct``, root only), which every process it starts inherits: trials, servers, Slurm
daemons, the namespace hosts. Each test's CPU is that cgroup's usage over the test (set-up and
teardown included); a module's daemons count towards the tests that ran while they worked. Prints
the files by CPU, with their summed durations, then the total; the per-test rows are left in
``$SUITE_CPU_OUT`` (default a temporary directory), one JSON line per test.

Not a test: it changes nothing the tests see but the cgroup their processes run in.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct")
OUT_ENV = "SUITE_CPU_OUT"
#: the workers' cgroups are named after the run (the pid of this script), which removes them at its end
RUN_ENV = "SUITE_CPU_RUN"


class _WorkerProfile:
    """Registered in each xdist worker: its cgroup and a JSON line per test."""

    def __init__(self, worker: str, out: Path) -> None:
        self.cgroup = ROOT / f"det-lab-suite-{os.environ.get(RUN_ENV, os.getppid())}-{worker}"
        self.cgroup.mkdir(exist_ok=True)
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        out.mkdir(parents=True, exist_ok=True)
        self.rows = open(out / f"{worker}.jsonl", "a")  # noqa: SIM115 (open for the worker's life)

    def _usage(self) -> float:
        return int((self.cgroup / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Any:  # noqa: ARG002
        cpu, start = self._usage(), time.monotonic()
        yield
        self.rows.write(json.dumps({"id": item.nodeid, "cpu": self._usage() - cpu,
                                    "wall": time.monotonic() - start}) + "\n")
        self.rows.flush()



def pytest_configure(config: Any) -> None:
    """pytest's hook (this module loaded with ``-p suite_cpu``): profile each xdist worker."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker and os.environ.get(OUT_ENV):
        config.pluginmanager.register(_WorkerProfile(worker, Path(os.environ[OUT_ENV])), "suite-cpu-worker")


def report(out: Path) -> str:
    """The files by CPU-seconds, their summed durations, and the total."""
    rows = [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]
    cpu: collections.Counter[str] = collections.Counter()
    wall: collections.Counter[str] = collections.Counter()
    for row in rows:
        name = row["id"].split("::")[0]
        cpu[name] += row["cpu"]
        wall[name] += row["wall"]
    lines = [f"{'CPU s':>8} {'test s':>8}  file"]
    lines += [f"{c:8.1f} {wall[name]:8.1f}  {name}" for name, c in cpu.most_common()]
    lines.append(f"{sum(cpu.values()):8.1f} {sum(wall.values()):8.1f}  all {len(rows)} tests")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if os.geteuid() != 0 or not ROOT.is_dir():
        print("error: needs root and cgroup v1's cpuacct at /sys/fs/cgroup/cpuacct", file=sys.stderr)
        return 2
    out = Path(os.environ.get(OUT_ENV) or tempfile.mkdtemp(prefix="suite-cpu-"))
    env = {**os.environ, OUT_ENV: str(out), RUN_ENV: str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_cpu", *argv],
                               cwd=Path(__file__).resolve().parents[1], env=env)
    finally:
        for cgroup in ROOT.glob(f"det-lab-suite-{os.getpid()}-*"):
            try:
                cgroup.rmdir()  # empty once every process a worker started has ended
            except OSError:
                print(f"{cgroup} still holds processes a test left running: {(cgroup / 'cgroup.procs').read_text().split()}",
                      file=sys.stderr)
    print(f"\n{started}, {os.cpu_count()} CPUs; per test: {out}\n{report(out)}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
