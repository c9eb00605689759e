"""Apptainer images for Slurm jobs: definition files, and how a job runs its trial in one.

Two definitions (``det-lab slurm image``):

- ``det-lab-task.def``: the lab's task image: PyTorch with CUDA (NVIDIA's container), det_lab and
  the templates' dependencies from the volume's wheelhouse, and gsplat's CUDA kernels compiled
  while the image is built (``TORCH_CUDA_ARCH_LIST`` of the lab's GPUs), not on a job's first run;
- ``isaac-lab.def``: NVIDIA's Isaac Lab container with det_lab in Isaac Sim's Python; the EULA
  and privacy consent accepted through the environment; the Kit/shader caches on the node's
  local disk (bound at ``/det-lab-cache``, where the template's ``train.py`` links them).

A job whose experiment config names an image that the Slurm config maps to a ``.sif``
(``images: {isaac-lab-base:latest: /mnt/data/.det-lab/images/isaac-lab.sif}``; ``default`` for
configs naming none) runs its trial under ``apptainer exec --nv``: the volume bound at the same
path, the template's directory, the config's own ``bind_mounts``, its environment variables, and
``--writable-tmpfs`` (the caches and torch's extension lock write into the read-only image).
The driver itself runs on the node, outside the image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from det_lab.settings import LabSettings

TASK_BASE = "nvcr.io/nvidia/pytorch:24.10-py3"
ISAAC_BASE = "nvcr.io/nvidia/isaac-lab:2.1.0"
GSPLAT = "gsplat==1.5.3"
#: compute capabilities built into gsplat: Ampere (A100, RTX 30xx), Ada (RTX 40xx), Hopper (H100/H200)
CUDA_ARCHS = "8.0;8.6;8.9;9.0"
ISAAC_CACHE = "/var/cache/det-lab/isaac"
EULA_ENV = {"ACCEPT_EULA": "Y", "PRIVACY_CONSENT": "Y", "OMNI_KIT_ACCEPT_EULA": "YES", "OMNI_KIT_ALLOW_ROOT": "1"}


def _wheels(lab: LabSettings) -> Path:
    return lab.data_root / ".det-lab" / "wheels"


def render_task_def(lab: LabSettings, base: str = TASK_BASE, archs: str = CUDA_ARCHS) -> str:
    """The lab's task image: det_lab, the templates' dependencies, gsplat built for ``archs``."""
    wheels = _wheels(lab)
    return f"""Bootstrap: docker
From: {base}

%labels
    org.det-lab.image task
    org.det-lab.built-from {wheels}

%files
    {wheels} /opt/det-lab-wheels

%environment
    export DET_LAB_DATA_ROOT={lab.data_root}
    export TORCH_EXTENSIONS_DIR=/opt/torch_extensions
    export PYTHONUNBUFFERED=1

%post
    set -e
    # det_lab (and determined, dvc, mlflow...) from the wheelhouse 'pip wheel' filled on the volume
    python -m pip install --no-cache-dir --find-links /opt/det-lab-wheels det-lab
    # the templates' own dependencies; gsplat compiles its CUDA kernels now, not in a job
    python -m pip install --no-cache-dir ninja jaxtyping rich {GSPLAT}
    export TORCH_EXTENSIONS_DIR=/opt/torch_extensions TORCH_CUDA_ARCH_LIST="{archs}" MAX_JOBS=8
    python -c "from gsplat.cuda._backend import _C; assert _C is not None"
    rm -rf /opt/det-lab-wheels

%test
    python -c "import det_lab, determined, torch, gsplat; print('det_lab', det_lab.__version__, 'torch', torch.__version__)"
"""


def render_isaac_def(lab: LabSettings, base: str = ISAAC_BASE) -> str:
    """Isaac Lab from NVIDIA's container, det_lab in Isaac Sim's Python, caches bound from local disk."""
    wheels = _wheels(lab)
    env = "\n".join(f"    export {k}={v}" for k, v in EULA_ENV.items())
    return f"""Bootstrap: docker
From: {base}

%labels
    org.det-lab.image isaac-lab
    org.det-lab.built-from {wheels}

%files
    {wheels} /opt/det-lab-wheels

%environment
{env}
    export ISAACLAB_PATH=/workspace/isaaclab
    export DET_LAB_DATA_ROOT={lab.data_root}
    export PYTHONUNBUFFERED=1

%post
    set -e
    /isaac-sim/python.sh -m pip install --no-cache-dir --find-links /opt/det-lab-wheels det-lab
    # bind target of the node-local cache ({ISAAC_CACHE}); train.py links Kit's caches into a slot there
    mkdir -p /det-lab-cache {lab.data_root}
    rm -rf /opt/det-lab-wheels

%test
    /isaac-sim/python.sh -c "import det_lab, determined, isaaclab; print('det_lab', det_lab.__version__)"
"""


def render_images(lab: LabSettings) -> dict[str, str]:
    return {"det-lab-task.def": render_task_def(lab), "isaac-lab.def": render_isaac_def(lab)}


def config_image(exp_conf: dict[str, Any]) -> str:
    """The image an experiment config names (``environment.image``, its ``cuda`` entry), or ``default``."""
    image = (exp_conf.get("environment") or {}).get("image")
    if isinstance(image, dict):
        image = image.get("cuda") or image.get("gpu") or image.get("cpu")
    return image or "default"


def config_env(exp_conf: dict[str, Any]) -> list[str]:
    """``environment.environment_variables`` as ``K=V`` strings (a list, or per-device lists)."""
    env = (exp_conf.get("environment") or {}).get("environment_variables") or []
    if isinstance(env, dict):
        env = env.get("cuda") or env.get("gpu") or env.get("cpu") or []
    return [str(e) for e in env]


def apptainer_prefix(sif: Path, lab: LabSettings, cwd: Path, exp_conf: dict[str, Any],
                     extra_binds: list[Path]) -> list[str]:
    """``apptainer exec --nv ...`` with the volume, the template, the config's mounts and variables."""
    binds = [f"{lab.data_root}:{lab.data_root}", f"{cwd}:{cwd}", *(f"{p}:{p}" for p in extra_binds)]
    targets = set()
    for m in exp_conf.get("bind_mounts") or []:
        targets.add(m.get("container_path") or m["host_path"])
        spec = f"{m['host_path']}:{m.get('container_path') or m['host_path']}"
        binds.append(spec + (":ro" if m.get("read_only") else ""))
    # an Isaac trial keeps Kit's caches in the node's local cache (train.py: det_lab.rl.commands.isaac_cache_root)
    if "isaac_cache" in (exp_conf.get("hyperparameters") or {}) and "/det-lab-cache" not in targets \
            and Path(ISAAC_CACHE).is_dir():
        binds.append(f"{ISAAC_CACHE}:/det-lab-cache")
    argv = ["apptainer", "exec", "--nv", "--writable-tmpfs", "--pwd", str(cwd), "--bind", ",".join(dict.fromkeys(binds))]
    for e in config_env(exp_conf):
        argv += ["--env", e]
    return [*argv, str(sif)]


def container_command(command: list[str], host_python: str) -> list[str]:
    """The trial command as the image runs it: the image's ``python3``, not the host interpreter."""
    return ["python3" if c == host_python else c for c in command]
