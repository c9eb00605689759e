"""Every run's GPU efficiency: a real tiny trial whose chief samples its GPU through nvidia-ml-py, loaded
from the NVML stand-in (tests/nvml_shim.c, its figures changed mid-run by rewriting its config).

The stand-in's two GPUs have figures unlike each other's and the trial sees only the first
(``CUDA_VISIBLE_DEVICES`` names its UUID): the summary in run.json must be that GPU's, its mean
utilization what the stand-in said throughout, its peak memory the first phase's (not the second's,
nor the mean), its power the stand-in's milliwatts in watts; ``runs show`` prints it with its notes.
An NVML that fails mid-run ends the sampling and never the trial.
"""

from __future__ import annotations

import os
import time

import pytest

from det_lab.settings import load_settings
from det_lab.volume import init_volume
from tests.conftest import Lab, publish_tiny_data
from tests.test_monitoring_nvml import build_shim
from tests.test_trials_local import (
    held_after,
    run_state,
    runs_dir,
    start_run,
    wait_for_step,
)

TOTAL = 80_000_000_000
GPU0 = "GPU-5d2a9c71-0e4b-4f8a-b3c6-1a7e9d0f2b48"
GPU1 = "GPU-c0f3e8a2-7b19-4d65-9e2c-8f4a1b6d3e07"


def shim_config(util: int, used: int, error: str = "") -> str:
    return (f"reload\n{error}gpu {GPU0} {util} 3 {used} {TOTAL} NVIDIA A100-SXM4-80GB\npower 123456\n"
            f"gpu {GPU1} 91 44 71000000000 {TOTAL} NVIDIA H100 80GB HBM3\npower 301000\n")


def write(nvml, text: str) -> None:
    tmp = nvml["config"].with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(nvml["config"])


@pytest.fixture(scope="module")
def gpu_lab(tmp_path_factory):
    """A lab with the tiny dataset, no tracker, and a trial environment that loads the NVML stand-in."""
    tmp = tmp_path_factory.mktemp("gpu-lab")
    (tmp / "nvml").mkdir()
    nvml = build_shim(tmp / "nvml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg"), COLUMNS="200",
               LD_LIBRARY_PATH=str(nvml["lib"]), NVML_SHIM_CONFIG=str(nvml["config"]),
               CUDA_VISIBLE_DEVICES=GPU0, DET_LAB_GPU_SAMPLE_INTERVAL="0.2",
               DET_LAB_GPU_STATE_DIR=str(tmp / "gpu-state"))  # this module's GPU leases: not another test's
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "none"})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp)
    return lab, nvml


def test_efficiency_summary_is_what_the_gpu_reported(gpu_lab):
    lab, nvml = gpu_lab
    write(nvml, shim_config(7, 9_000_000_000))
    proc = start_run(held_after(lab, 40), "--run", "eff", "--set", "hyperparameters.num_workers=0")
    run_dir = wait_for_step(runs_dir(lab), "eff", 40, proc)
    write(nvml, shim_config(7, 5_000_000_000))  # the second phase: less memory, same utilization
    time.sleep(1.5)
    lab.cli("runs", "cancel", "eff", check=True)
    proc.communicate(timeout=120)
    state = run_state(run_dir)
    eff = state["gpu_efficiency"]
    (gpu,) = eff["gpus"]
    assert (gpu["index"], gpu["uuid"], gpu["name"]) == (0, GPU0, "NVIDIA A100-SXM4-80GB")
    assert gpu["utilization_mean"] == 7
    assert gpu["memory_peak_bytes"] == 9_000_000_000 and gpu["memory_total_bytes"] == TOTAL
    assert 5_000_000_000 < gpu["memory_mean_bytes"] < 9_000_000_000
    assert gpu["power_mean_w"] == pytest.approx(123.456)
    assert gpu["samples"] >= 8
    assert eff["notes"] == ["GPU busy 7 % of the time: the data loader may be the bottleneck (num_workers=0)",
                            "GPU peak memory 9 of 80 GB"]
    shown = lab.cli("runs", "show", "eff", check=True).stdout
    assert "GPU 0 (NVIDIA A100-SXM4-80GB): utilization 7.0 %, memory peak 9.0 of 80.0 GB, power 123 W" in shown
    assert "the data loader may be the bottleneck (num_workers=0)" in shown

    # the exporter's runs source: the same figures, per run and GPU
    from det_lab.monitoring.source_runs import RunsSource

    found = {(s.name, s.labels.get("run"), s.labels.get("gpu")): s.value
             for fam in RunsSource(load_settings(lab.config, env={})).collect() for s in fam.samples}
    assert found[("det_lab_run_gpu_utilization_ratio", "eff", "0")] == pytest.approx(0.07)
    assert found[("det_lab_run_gpu_memory_peak_bytes", "eff", "0")] == 9_000_000_000


def test_a_failing_driver_ends_sampling_not_the_trial(gpu_lab):
    """NVML answering "unknown error" mid-run: the trial trains to its end, the summary keeps what was
    sampled before and says why sampling stopped."""
    lab, nvml = gpu_lab
    write(nvml, shim_config(12, 4_000_000_000))
    proc = start_run(lab, "--run", "broken-driver", "--set", "hyperparameters.sleep_per_batch=0.05")
    try:
        run_dir = wait_for_step(runs_dir(lab), "broken-driver", 40, proc)
        write(nvml, shim_config(12, 4_000_000_000, error="count_error 999\n"))
        out, err = proc.communicate(timeout=120)
    finally:
        write(nvml, shim_config(12, 4_000_000_000))
    assert proc.returncode == 0, out + err
    state = run_state(run_dir)
    assert state["status"] == "finished" and state["progress"]["step"] == 80
    assert "NVMLError" in state["gpu_efficiency"]["error"]
    assert state["gpu_efficiency"]["gpus"][0]["utilization_mean"] == 12
