"""The exporter's GPU source on its NVML path, up to the driver: ``det-lab exporter --source gpus``
loads ``tests/nvml_shim.c`` (built here as ``libnvidia-ml.so.1``) through nvidia-ml-py, as it loads
the NVIDIA driver's library on a GPU machine, and labels real processes of two Unix users.

Each test states its GPUs in the shim's config (read again at every scrape's ``nvmlInit``); every
figure in it is distinct, so a GPU's figures on another GPU, or one process's on another, fail.
What the shim cannot show is the driver itself: that the real libnvidia-ml answers these calls
with what the GPUs are doing (checked on a GPU machine, not here).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from det_lab.monitoring.source_gpus import process_owner
from tests.test_monitoring import parse_exposition, samples, start_exporter, stop_exporter

SHIM_SOURCE = Path(__file__).with_name("nvml_shim.c")
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999
HOST = socket.gethostname().split(".")[0]

# two GPUs whose every figure differs from every other
GPU0 = {"uuid": "GPU-0c3e5a71-2b4d-4e8f-9a10-5d6c7b8e9f01", "model": "NVIDIA A100-SXM4-40GB",
        "util": 37, "used": 21_474_836_481, "total": 42_949_672_960}
GPU1 = {"uuid": "GPU-1f9d8c7b-6a5e-4d3c-8b2a-19f8e7d6c5b4", "model": "NVIDIA H100 80GB HBM3",
        "util": 81, "used": 3_221_225_473, "total": 85_899_345_920}
ROOT_JOB, NOBODY_JOB, RUN = "73311", "73312", "vla-act-0412"


def _gpu_line(gpu: dict, mem_util: int) -> str:
    return f"gpu {gpu['uuid']} {gpu['util']} {mem_util} {gpu['used']} {gpu['total']} {gpu['model']}\n"


def build_shim(lib: Path, *defines: str) -> dict[str, Path]:
    """The shim built as ``lib/libnvidia-ml.so.1`` (``-D`` each of ``defines``), its config file (no
    GPUs yet) and its call log; skips without gcc."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build the NVML shim (tests/nvml_shim.c)")
    built = subprocess.run([gcc, "-Wall", "-shared", "-fPIC", *(f"-D{d}" for d in defines),
                            "-o", str(lib / "libnvidia-ml.so.1"), str(SHIM_SOURCE)], capture_output=True, text=True)
    assert built.returncode == 0, f"gcc could not build {SHIM_SOURCE.name}: {built.stderr}"
    (lib / "nvml.conf").write_text("")
    return {"lib": lib, "config": lib / "nvml.conf", "log": lib / "calls.log"}


def exporter_env(nvml: dict[str, Path]) -> dict[str, str]:
    """The environment of ``det-lab exporter`` with the shim where the driver's library is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "NVML_SHIM_", "LD_"))}
    env.update(LD_LIBRARY_PATH=str(nvml["lib"]), NVML_SHIM_CONFIG=str(nvml["config"]), NVML_SHIM_LOG=str(nvml["log"]),
               XDG_CONFIG_HOME=str(nvml["lib"] / "xdg"))
    return env


@pytest.fixture(scope="module")
def nvml(tmp_path_factory) -> dict[str, Path]:
    return build_shim(tmp_path_factory.mktemp("nvml"))


@pytest.fixture(scope="module")
def exporter(nvml):
    """``det-lab exporter --source gpus`` as root starts it on a GPU machine."""
    url, proc = start_exporter(exporter_env(nvml), "gpus")
    yield url
    stop_exporter(proc)


def scrape(url: str, nvml: dict[str, Path], config: str) -> str:
    """The /metrics page once the shim's GPUs are ``config`` (written whole: a scrape never reads half)."""
    import urllib.request

    tmp = nvml["config"].with_suffix(".tmp")
    tmp.write_text(config)
    tmp.replace(nvml["config"])
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def gpu_series(text: str) -> list[str]:
    return sorted({name for name, _, _ in parse_exposition(text) if name.startswith("det_lab_gpu_")})


def scrape_error(text: str) -> float:
    return {labels["source"]: v for labels, v in samples(text, "det_lab_scrape_error")}["gpus"]


@pytest.fixture
def holders(tmp_path):
    """Real processes holding the GPUs: root's in Slurm job ROOT_JOB running det_lab run RUN, nobody's
    in job NOBODY_JOB, and one killed (-9, reaped) that NVML still lists."""
    if os.geteuid() != 0:
        pytest.skip("starting a process as the user nobody needs root")
    sleep = shutil.which("sleep")
    run_json = tmp_path / "outputs" / "vla" / "local-runs" / RUN / "run.json"
    root = subprocess.Popen([sleep, "60"], cwd="/", env={"SLURM_JOB_ID": ROOT_JOB, "DET_LAB_LOCAL_RUN": str(run_json)})
    nobody = subprocess.Popen([sleep, "60"], cwd="/", env={"SLURM_JOB_ID": NOBODY_JOB},
                              user="nobody", group="nogroup", extra_groups=[])
    dead = subprocess.Popen([sleep, "60"], cwd="/", env={"SLURM_JOB_ID": "73313"})
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    try:
        yield {"root": root.pid, "nobody": nobody.pid, "dead": dead.pid}
    finally:
        for proc in (root, nobody):
            proc.kill()
            proc.wait()


def test_each_gpu_and_each_process_holding_it_with_its_user_job_and_run(exporter, nvml, holders):
    """Per GPU, its own utilisation, memory, uuid and model; per process on it, its memory there and
    who holds it: root's in its Slurm job and det_lab run, nobody's in its job, a process gone since
    NVML listed it with no owner (and no failed scrape); root's process on both GPUs on each."""
    root, nobody, dead = holders["root"], holders["nobody"], holders["dead"]
    config = (_gpu_line(GPU0, 12) + f"proc {root} 1111490560\nproc {nobody} 2222981120\n"
              + _gpu_line(GPU1, 45) + f"proc {root} 3334471680\nproc {dead} 4445962240\n")
    assert not Path(f"/proc/{dead}").exists()
    text = scrape(exporter, nvml, config)

    assert scrape_error(text) == 0
    g0, g1 = ("0", GPU0["uuid"]), ("1", GPU1["uuid"])

    def per_gpu(name: str) -> dict[tuple[str, str], float]:
        found = samples(text, name)
        assert all(labels["host"] == HOST for labels, _ in found)
        return {(labels["gpu"], labels["uuid"]): v for labels, v in found}

    assert {(lb["gpu"], lb["uuid"], lb["model"]): v for lb, v in samples(text, "det_lab_gpu_info")} == \
        {(*g0, GPU0["model"]): 1, (*g1, GPU1["model"]): 1}
    assert per_gpu("det_lab_gpu_utilization_ratio") == {g0: 0.37, g1: 0.81}
    assert per_gpu("det_lab_gpu_memory_used_bytes") == {g0: GPU0["used"], g1: GPU1["used"]}
    assert per_gpu("det_lab_gpu_memory_total_bytes") == {g0: GPU0["total"], g1: GPU1["total"]}

    container = process_owner(os.getpid())["container"]  # the holders are in the tests' own cgroup
    procs = {(lb["gpu"], lb["uuid"], lb["pid"]): ((lb["user"], lb["slurm_job"], lb["run"], lb["container"]), v)
             for lb, v in samples(text, "det_lab_gpu_process_memory_bytes")}
    assert all(lb["host"] == HOST for lb, _ in samples(text, "det_lab_gpu_process_memory_bytes"))
    assert procs == {
        (*g0, str(root)): (("root", ROOT_JOB, RUN, container), 1111490560),
        (*g0, str(nobody)): (("nobody", NOBODY_JOB, "", container), 2222981120),
        (*g1, str(root)): (("root", ROOT_JOB, RUN, container), 3334471680),
        (*g1, str(dead)): (("", "", "", ""), 4445962240),
    }


def test_no_nvidia_driver_is_no_gpus_and_no_error(exporter, nvml):
    """nvmlInit's "driver not loaded" (a CPU machine with the library installed): no GPU series, and
    the source is not broken."""
    text = scrape(exporter, nvml, f"init_error {NVML_ERROR_DRIVER_NOT_LOADED}\n" + _gpu_line(GPU0, 12))
    assert scrape_error(text) == 0
    assert gpu_series(text) == []


@pytest.mark.parametrize("failure, call", [
    (f"init_error {NVML_ERROR_LIB_RM_VERSION_MISMATCH}", "nvmlInitWithFlags"),
    (f"count_error {NVML_ERROR_UNKNOWN}", "nvmlDeviceGetCount_v2"),
], ids=["init-version-mismatch", "count-unknown"])
def test_a_failing_driver_is_a_scrape_error_and_the_exporter_serves_on(exporter, nvml, failure, call):
    """A driver that fails (nvmlInit: the library and the kernel module differ, as after an upgrade
    without a reboot; nvmlDeviceGetCount: "unknown error") is the source's scrape error, never a
    machine without GPUs; NVML is shut down after every init; the next scrape of a working driver has
    its GPUs back, with a process whose memory NVML cannot tell at 0 bytes."""
    nvml["log"].unlink(missing_ok=True)
    text = scrape(exporter, nvml, f"{failure}\n" + _gpu_line(GPU0, 12) + "proc 1 1111490560\n")
    assert scrape_error(text) == 1
    assert gpu_series(text) == []

    text = scrape(exporter, nvml, _gpu_line(GPU1, 45) + "proc 1 -\n")
    assert scrape_error(text) == 0
    assert {lb["uuid"]: v for lb, v in samples(text, "det_lab_gpu_utilization_ratio")} == {GPU1["uuid"]: 0.81}
    assert [(lb["uuid"], lb["pid"], lb["user"], v) for lb, v in samples(text, "det_lab_gpu_process_memory_bytes")] == \
        [(GPU1["uuid"], "1", "root", 0)]

    calls = nvml["log"].read_text().splitlines()
    assert f"{call} {failure.split()[1]}" in calls
    assert calls.count("nvmlInitWithFlags 0") == calls.count("nvmlShutdown 0") > 0


@pytest.mark.parametrize("define", ["SHIM_BEFORE_R510", "SHIM_WITHOUT_INIT_WITH_FLAGS"])
def test_an_older_drivers_library(tmp_path, define):
    """A driver before R510 lists processes with the ``_v2`` call only: its GPUs and their processes
    are exported all the same. A library without the ``nvmlInitWithFlags`` nvidia-ml-py calls is the
    source's scrape error, not a machine without GPUs."""
    nvml = build_shim(tmp_path, define)
    url, proc = start_exporter(exporter_env(nvml), "gpus")
    try:
        text = scrape(url, nvml, _gpu_line(GPU0, 12) + "proc 1 1111490560\n")
    finally:
        stop_exporter(proc)
    if define == "SHIM_BEFORE_R510":
        assert scrape_error(text) == 0
        assert [(lb["uuid"], lb["pid"], v) for lb, v in samples(text, "det_lab_gpu_process_memory_bytes")] == \
            [(GPU0["uuid"], "1", 1111490560)]
        assert "nvmlDeviceGetComputeRunningProcesses_v2 0" in nvml["log"].read_text().splitlines()
    else:
        assert scrape_error(text) == 1
        assert gpu_series(text) == []
