"""The templates at GPU speed: VLA and 3DGS against the hardware and against gsplat, one run.

    python bench/gpu.py --prepare                 # here, once: baseline code + bench data (git, DVC)
    python bench/gpu.py --out DIR                 # on the GPU machine (no git or DVC needed there)
    python bench/gpu.py --out DIR --cpu-smoke     # every code path at toy sizes, on CPU
    python bench/gpu.py --out DIR --only vla,vla-large   # some sections (vla, 3dgs, vla-large)

On the GPU machine: the wheels of what its image lacks (determined, pydantic, flufl.lock, gsplat
...) installed to a directory on PYTHONPATH after ``.gpu-run/pkg``, and ``.gpu-run`` reachable at
the path it had here (the dataset is found by that path). gsplat's CUDA code is built in the
background while the VLA figures are measured.

``--prepare`` writes ``.gpu-run/`` (git-ignored): the templates' files as of BASELINE_REV (the
"today" side of every comparison, run in the same process as the new code), a copy of det_lab
(``PYTHONPATH=.gpu-run/pkg`` there, so the run sees the package as it was tested), a data root
with the VLA benchmark dataset (250 episodes, 10,000 frames of 32x32) published and pulled, so
the harness path finds its snapshot by repo, path and full commit without running git or DVC.

VLA (bf16 autocast, batch 256 on one GPU, ``gpu.yaml``'s model):
  ms/batch of the old template (its model, its per-item float loader with 6 workers, AdamW),
  and of the new one: the plain PyTorch loop (frame cache, 4 workers, pinned memory), the same
  loop on one batch kept on the GPU, and ``VLATrial`` through det_lab's ``run()`` and
  Determined's harness (local training mode), timed inside ``train_batch`` between two batches;
  achieved TFLOP/s = FLOPs of one forward+backward (torch's FlopCounterMode) / ms per batch.
  ``gpu-large.yaml`` (~100M parameters, two 224x224 cameras) likewise, plain loop and fixed batch.
3DGS (gsplat backend):
  at 100k and 1M Gaussians (1237x822, SH degree 3; at 1M also with 2.5x wider splats): gsplat's
  rasterization forward+backward alone, an iteration of the new loop (``step.TrainStep``; at 1M
  wide also without SSIM and without statistics), an iteration of the old loop; PSNR on held-out
  views of a generated scene after the same iterations, old loop vs new (and MCMC); the MCMC
  relocation against gsplat's CUDA kernel; the gsplat build time.
Profiles (20 costliest operators) of one VLA step and one 3DGS iteration go to ``<out>``.

Figures go to stdout and ``<out>/results.json`` as each is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
VLA_DIR = REPO / "experiment_templates" / "vla"
GS_DIR = REPO / "experiment_templates" / "gaussian_splatting"
RUN_DIR = REPO / ".gpu-run"
BASELINE_REV = "f4aa9e85d192f2c80ad1576f99b414326c224596"
BASELINE_FILES = {"vla_model.py": "experiment_templates/vla/model.py",
                  "vla_dataset.py": "experiment_templates/vla/dataset.py",
                  "vla_gpu.yaml": "experiment_templates/vla/gpu.yaml",
                  "gs_gaussians.py": "experiment_templates/gaussian_splatting/gaussians.py",
                  "gs_metrics.py": "experiment_templates/gaussian_splatting/metrics.py"}
RESULTS: dict[str, Any] = {}


def emit(out: Path, section: str, key: str, value: Any) -> None:
    RESULTS.setdefault(section, {})[key] = value
    shown = f"{value:.3f}" if isinstance(value, float) else value
    print(f"[{time.strftime('%H:%M:%S')}] {section:<10} {key:<48} {shown}", flush=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=2))


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- prepare (here, with git and DVC) ------------------------------------------------------------


def prepare() -> None:
    base = RUN_DIR / "baseline"
    base.mkdir(parents=True, exist_ok=True)
    for name, path in BASELINE_FILES.items():
        text = subprocess.run(["git", "show", f"{BASELINE_REV}:{path}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        (base / name).write_text(text)
    # det_lab as tested here, so the GPU run does not pick up half-finished edits in the tree
    pkg = RUN_DIR / "pkg" / "det_lab"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(REPO / "det_lab", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    from det_lab.data.demo import make_vla_demo
    from det_lab.data.git import resolve_revision
    from det_lab.data.publish import publish_directory
    from det_lab.data.pull import DatasetSpec, pull
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    root = RUN_DIR / "data"
    settings = load_settings(env={"DET_LAB_DATA_ROOT": str(root), "DET_LAB_TRACKING": "none"})
    root.mkdir(parents=True, exist_ok=True)
    init_volume(settings)
    spec_file = RUN_DIR / "vla-bench.json"
    if spec_file.exists():
        spec = json.loads(spec_file.read_text())
    else:
        src = RUN_DIR / "src" / "vla-bench"
        if not src.exists():
            make_vla_demo(src, episodes=250, frames_per_episode=40, image_size=32, seed=1)
        published = publish_directory(settings, "vla", "vla-bench", src, "GPU benchmark data")
        spec = {"repo": published.repo, "path": published.path, "rev": resolve_revision(published.repo, published.rev)}
    pulled = pull(DatasetSpec(project="vla", repo=spec["repo"], path=spec["path"], rev=spec["rev"]), settings,
                  progress=False)
    spec_file.write_text(json.dumps({**spec, "snapshot": str(pulled.path), "md5": pulled.identity.md5}))
    print(f"prepared {RUN_DIR}: baseline {BASELINE_REV[:10]}, dataset {pulled.path}")


# --- VLA ------------------------------------------------------------------------------------------


def two_camera_dataset(dest: Path, episodes: int) -> Path:
    """A demo dataset with a second camera (the same frames under another key)."""
    from det_lab.data.demo import IMAGE_KEY, make_vla_demo

    if dest.exists():
        return dest
    make_vla_demo(dest, episodes=episodes, frames_per_episode=40, image_size=32, seed=2)
    info = json.loads((dest / "meta/info.json").read_text())
    wrist = "observation.images.wrist"
    info["features"][wrist] = info["features"][IMAGE_KEY]
    (dest / "meta/info.json").write_text(json.dumps(info, indent=2))
    stats = json.loads((dest / "meta/stats.json").read_text())
    stats[wrist] = stats[IMAGE_KEY]
    (dest / "meta/stats.json").write_text(json.dumps(stats, indent=2))
    shutil.copytree(dest / "images" / IMAGE_KEY, dest / "images" / wrist)
    return dest


def vla_inputs(batch: dict[str, Any], device: torch.device) -> list[Any]:
    b = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else [t.to(device, non_blocking=True) for t in v])
         for k, v in batch.items()}
    return [b["images"], b["state"], b["text_ids"], b["text_valid"], b["action"], b["action_is_pad"]]


def vla_train_ms(policy: torch.nn.Module, opt: torch.optim.Optimizer, batches: Any, n: int, warmup: int,
                 device: torch.device, bf16: bool, clip: float) -> float:
    """ms per batch of the plain loop over ``batches`` (an iterator), after ``warmup`` batches."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    policy.train()
    start = 0.0
    for i in range(warmup + n):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        args = vla_inputs(next(batches), device)
        with amp:
            out = policy(*args)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return 1000 * (time.perf_counter() - start) / n


def profile_table(out: Path, name: str, fn: Any, device: torch.device) -> None:
    """Where a step's GPU time goes: the 20 costliest operators (self time) of ``fn()`` into
    ``<out>/<name>_profile.txt``."""
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            (out / f"{name}_profile.txt").write_text(events.table(sort_by=key, row_limit=20))
            return
        except (AttributeError, KeyError, ValueError):
            continue


def forever(loader: Any):
    while True:
        yield from loader


def repeat(batch: dict[str, Any], device: torch.device):
    fixed = dict(zip(["images", "state", "text_ids", "text_valid", "action", "action_is_pad"], vla_inputs(batch, device)))
    while True:
        yield fixed


def count_flops(policy: torch.nn.Module, batch: dict[str, Any], device: torch.device, bf16: bool) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    amp = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with FlopCounterMode(display=False) as counter:
        with amp:
            out = policy(*vla_inputs(batch, device))
        out["loss"].backward()
    policy.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def build_policy(model_mod: ModuleType, hp: dict[str, Any], full: Any, device: torch.device) -> torch.nn.Module:
    shape = (3, int(hp["resize"]), int(hp["resize"])) if hp.get("resize") else full.image_shape(full.cameras[0])
    cfg = model_mod.VLAConfig.from_hparams(hp["model"], state_dim=full.state_dim, action_dim=full.action_dim,
                                           horizon=int(hp["horizon"]), image_shape=shape, n_cameras=len(full.cameras))
    stats = {k: full.norm_stats(k) for k in ("observation.state", "action", *full.cameras) if k in full.stats}
    torch.manual_seed(0)
    return model_mod.VLAPolicy(cfg, stats, full.cameras).to(device)


def vla_old(args: argparse.Namespace, out: Path, snapshot: Path, device: torch.device, batch: int) -> float:
    """Today's template: its model and loader (per-item float32 frames), torch's default AdamW."""
    base = RUN_DIR / "baseline"
    old_model = load_module("old_vla_model", base / "vla_model.py")
    old_dataset = load_module("old_vla_dataset", base / "vla_dataset.py")
    hp = yaml.safe_load((base / "vla_gpu.yaml").read_text())["hyperparameters"]
    hp = shrink(hp, args) | {"val_episodes": 2}
    splits = old_dataset.load_splits(snapshot, hp)
    policy = build_policy(old_model, hp, splits.full, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"]))
    workers = 0 if args.cpu_smoke else int(hp["num_workers"])
    loader = torch.utils.data.DataLoader(splits.train, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                         persistent_workers=workers > 0, pin_memory=device.type == "cuda")
    bf16 = device.type == "cuda"
    ms = vla_train_ms(policy, opt, forever(loader), args.vla_batches, args.warmup, device, bf16, 1.0)
    emit(out, "vla", "old: plain loop ms/batch", ms)
    fixed = next(iter(loader))
    ms_fixed = vla_train_ms(policy, opt, repeat(fixed, device), args.vla_batches, args.warmup, device, bf16, 1.0)
    emit(out, "vla", "old: fixed GPU batch ms/batch", ms_fixed)
    flops = count_flops(policy, fixed, device, bf16)
    emit(out, "vla", "old: GFLOP per batch (fwd+bwd)", flops / 1e9)
    emit(out, "vla", "old: TFLOP/s (fixed batch)", flops / ms_fixed / 1e9)
    del loader
    return ms


def shrink(hp: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Toy sizes for --cpu-smoke; the config as it is otherwise."""
    hp = json.loads(json.dumps(hp))
    if args.cpu_smoke:
        hp["model"].update(d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_text_tokens=8)
        hp["num_workers"] = 0
        hp["compile"] = False
        if hp.get("resize"):
            hp["resize"] = 32
    return hp


def vla_new(args: argparse.Namespace, out: Path, name: str, hp: dict[str, Any], snapshot: Path, device: torch.device,
            batch: int, cache_dir: Path, revision: str | None = None) -> tuple[float, float]:
    """The new template's plain loop (frame cache, speed switches) and its fixed-batch loop."""
    for mod in ("model", "dataset", "frame_cache"):
        sys.modules.pop(mod, None)
    import dataset as vla_dataset
    import model as vla_model

    t0 = time.perf_counter()
    splits = vla_dataset.load_splits(snapshot, hp, cache_dir, revision)
    emit(out, "vla", f"{name}: frame cache ready (s)", time.perf_counter() - t0)
    policy = build_policy(vla_model, hp, splits.full, device)
    emit(out, "vla", f"{name}: parameters (M)", sum(p.numel() for p in policy.parameters()) / 1e6)
    bf16 = device.type == "cuda" and bool(hp.get("bf16"))
    workers = int(hp.get("num_workers", 0))
    loader = torch.utils.data.DataLoader(splits.train, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                         persistent_workers=workers > 0, pin_memory=device.type == "cuda",
                                         collate_fn=vla_dataset.collate_batch)
    fixed = next(iter(loader))
    flops = count_flops(policy, fixed, device, bf16)
    emit(out, "vla", f"{name}: GFLOP per batch (fwd+bwd)", flops / 1e9)
    opt = vla_model.build_optimizer(policy, hp)
    clip = float(hp.get("grad_clip") or 1.0)
    eager = {**hp, "compile": False}
    vla_model.apply_speed_switches(policy, eager)
    ms_eager = vla_train_ms(policy, opt, repeat(fixed, device), args.vla_batches, args.warmup, device, bf16, clip)
    emit(out, "vla", f"{name}: fixed batch, no compile ms/batch", ms_eager)
    if hp.get("compile"):
        t0 = time.perf_counter()
        try:
            vla_model.apply_speed_switches(policy, hp)  # as the template does: compile and its options
            vla_train_ms(policy, opt, repeat(fixed, device), 1, 2, device, bf16, clip)
            emit(out, "vla", f"{name}: torch.compile warm-up (s)", time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 (measure the rest without it, and say so)
            traceback.print_exc()
            emit(out, "vla", f"{name}: torch.compile", "FAILED (traceback above); measured without")
            hp["compile"] = False
            policy = build_policy(vla_model, hp, splits.full, device)
            vla_model.apply_speed_switches(policy, hp)
            opt = vla_model.build_optimizer(policy, hp)
    ms_fixed = vla_train_ms(policy, opt, repeat(fixed, device), args.vla_batches, args.warmup, device, bf16, clip)
    emit(out, "vla", f"{name}: fixed GPU batch ms/batch", ms_fixed)
    profile_table(out, f"vla_{name}", lambda: vla_train_ms(policy, opt, repeat(fixed, device), 5, 0, device, bf16, clip), device)
    ms_loop = vla_train_ms(policy, opt, forever(loader), args.vla_batches, args.warmup, device, bf16, clip)
    emit(out, "vla", f"{name}: plain loop ms/batch", ms_loop)
    emit(out, "vla", f"{name}: TFLOP/s (fixed batch)", flops / ms_fixed / 1e9)
    emit(out, "vla", f"{name}: TFLOP/s (plain loop)", flops / ms_loop / 1e9)
    emit(out, "vla", f"{name}: loader cost (plain / fixed)", ms_loop / ms_fixed)
    return ms_loop, ms_fixed


def vla_harness(args: argparse.Namespace, out: Path, hp: dict[str, Any], spec: dict[str, str], batch: int) -> float:
    """``VLATrial`` through det_lab's run() and Determined's harness; ms/batch between two batches."""
    for mod in ("model", "dataset", "frame_cache", "train"):
        sys.modules.pop(mod, None)
    import train as vla_train

    from det_lab.settings import load_settings
    from det_lab.trials.pytorch import run

    marks: dict[int, float] = {}
    first, last = args.warmup + 5, args.warmup + 5 + args.vla_batches

    class TimedVLATrial(vla_train.VLATrial):
        def train_batch(self, batch, epoch_idx, batch_idx):  # noqa: ANN001, ANN202
            if batch_idx in (first, last):
                sync(self.context.device)
                marks[batch_idx] = time.perf_counter()
            return super().train_batch(batch, epoch_idx, batch_idx)

        def evaluate_batch(self, batch, batch_idx):  # noqa: ANN001, ANN202
            # Determined validates once at the end, after the timed batches: skipping the model
            # there spares the device a second torch.compile (eval mode) that nothing here times
            return {"val_action_l1": 0.0}

    root = Path(args.data_root)
    settings = load_settings(env={"DET_LAB_DATA_ROOT": str(root), "DET_LAB_TRACKING": "none"})
    exp_conf = {"name": "bench-vla-harness", "searcher": {"name": "single", "metric": "val_action_l1", "smaller_is_better": True},
                "min_validation_period": {"batches": 100_000}, "min_checkpoint_period": {"batches": 100_000},
                "data": {"det_lab": {"project": "vla", "tracking": "none", "max_length": {"batches": last + 1},
                                     "reporting_batches": 100, "dataset": {k: spec[k] for k in ("repo", "path", "rev")}}}}
    hp = {**hp, "global_batch_size": batch}
    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(VLA_DIR)  # as `det-lab run vla`: Determined copies the working directory into checkpoints
    try:
        run(TimedVLATrial, settings=settings, exp_conf=exp_conf, hparams=hp)
    finally:
        os.chdir(cwd)
    emit(out, "vla", "harness: whole run incl. setup, compile (s)", time.perf_counter() - t0)
    ms = 1000 * (marks[last] - marks[first]) / (last - first)
    emit(out, "vla", "new: det_lab run() + harness ms/batch", ms)
    return ms


def vla_section(args: argparse.Namespace, out: Path, device: torch.device) -> None:
    sys.path.insert(0, str(VLA_DIR))
    spec = json.loads((RUN_DIR / "vla-bench.json").read_text())
    snapshot = Path(spec["snapshot"])
    batch = 8 if args.cpu_smoke else 256
    cache_dir = Path(args.scratch) / "frame-cache"
    old_ms = vla_old(args, out, snapshot, device, batch)
    hp = shrink(yaml.safe_load((VLA_DIR / "gpu.yaml").read_text())["hyperparameters"], args) | {"val_episodes": 2}
    new_ms, fixed_ms = vla_new(args, out, "new", hp, snapshot, device, batch, cache_dir, spec["md5"])
    emit(out, "vla", "speed-up, plain loop (old ms / new ms)", old_ms / new_ms)
    try:
        harness_ms = vla_harness(args, out, {**hp, "frame_cache": str(cache_dir)}, spec, batch)
        emit(out, "vla", "harness / fixed batch", harness_ms / fixed_ms)
        emit(out, "vla", "speed-up, harness vs old plain loop", old_ms / harness_ms)
    except Exception:  # noqa: BLE001 (report and go on to the other figures)
        traceback.print_exc()
        emit(out, "vla", "harness", "FAILED (traceback above)")


def vla_large_section(args: argparse.Namespace, out: Path, device: torch.device) -> None:
    """gpu-large.yaml (~100M parameters, two 224x224 cameras): achieved TFLOP/s."""
    if str(VLA_DIR) not in sys.path:
        sys.path.insert(0, str(VLA_DIR))
    large = shrink(yaml.safe_load((VLA_DIR / "gpu-large.yaml").read_text())["hyperparameters"], args) | {"val_episodes": 2}
    two_cams = two_camera_dataset(Path(args.scratch) / "vla-two-cameras", 6 if args.cpu_smoke else 100)
    batches, args.vla_batches, args.warmup = (args.vla_batches, args.warmup), max(3, args.vla_batches // 2), max(1, args.warmup // 2)
    try:
        vla_new(args, out, "large", large, two_cams, device, 4 if args.cpu_smoke else 128, Path(args.scratch) / "frame-cache")
    finally:
        args.vla_batches, args.warmup = batches


# --- 3DGS -------------------------------------------------------------------------------------------


def look_at(center: np.ndarray) -> np.ndarray:
    """World-to-camera 4x4 (OpenCV axes: x right, y down, z forward) looking at the origin."""
    f = -center / np.linalg.norm(center)
    right = np.cross(f, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    down = np.cross(f, right)
    rot = np.stack([right, down, f])
    view = np.eye(4)
    view[:3, :3], view[:3, 3] = rot, -rot @ center
    return view


def cameras(R: ModuleType, n: int, width: int, height: int, focal: float, radius: float, device: torch.device) -> list[Any]:
    K = torch.tensor([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]], dtype=torch.float32, device=device)
    out = []
    for i in range(n):
        az, el = 2 * math.pi * i / n, math.radians(20.0 if i % 2 else -10.0)
        c = radius * np.array([math.cos(az) * math.cos(el), math.sin(az) * math.cos(el), math.sin(el)])
        out.append(R.Camera(torch.tensor(look_at(c), dtype=torch.float32, device=device), K, width, height))
    return out


def random_gaussians(n: int, sh_degree: int, device: torch.device, seed: int, log_scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    xyz = torch.randn(n, 3, generator=g)
    xyz = xyz / xyz.norm(dim=-1, keepdim=True) * torch.rand(n, 1, generator=g) ** (1 / 3)  # uniform in the unit ball
    k = (sh_degree + 1) ** 2
    rgb = 0.5 + 0.45 * torch.sin(3.0 * xyz + torch.tensor([0.0, 2.0, 4.0]))  # smooth colours: a learnable scene
    params = {
        "means": xyz,
        "log_scales": log_scale + 0.3 * torch.randn(n, 3, generator=g),
        "quats": torch.randn(n, 4, generator=g),
        "opacity_logits": torch.logit(0.3 + 0.6 * torch.rand(n, generator=g)),
        "sh0": ((rgb - 0.5) / 0.28209479177387814)[:, None, :],
        "shN": 0.05 * torch.randn(n, k - 1, 3, generator=g),
    }
    return {k: v.to(device) for k, v in params.items()}


def gs_old_iteration(old_G: ModuleType, old_M: ModuleType, model: Any, rast: Any, cam: Any, image: torch.Tensor,
                     background: torch.Tensor, step: int, schedule: Any, densify: Any, gen: torch.Generator,
                     device: torch.device, seed: int = 0) -> float:
    """One iteration of train.py's loop as of BASELINE_REV (its body, verbatim in substance)."""
    model.step_lr(step, schedule.iterations)
    model.step_sh_degree(step, schedule.sh_degree_every)
    out = rast.render(model.means, model.quats, model.scales, model.opacities, model.sh, cam,
                      background=background, sh_degree=model.active_sh_degree)
    l1 = torch.abs(out.image - image).mean()
    loss = 0.8 * l1 + 0.2 * (1 - old_M.ssim(out.image, image))
    loss.backward()
    with torch.no_grad():
        if step <= schedule.densify_until:
            model.update_stats(out, cam.width, cam.height)
            if step >= schedule.densify_from and step % schedule.densify_every == 0:
                gen.manual_seed(seed * 1_000_003 + step)
                model.densify_and_prune(densify, step > schedule.opacity_reset_every, gen)
            if step % schedule.opacity_reset_every == 0:
                model.reset_opacity()
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    sync(device)
    return float(loss.detach())


def gs_modules() -> dict[str, ModuleType]:
    sys.path.insert(0, str(GS_DIR))
    import gaussians
    import mcmc
    import rasterizer
    import step

    base = RUN_DIR / "baseline"
    old_metrics = load_module("old_gs_metrics", base / "gs_metrics.py")
    old_gaussians = load_module("old_gs_gaussians", base / "gs_gaussians.py")
    return {"G": gaussians, "R": rasterizer, "S": step, "MC": mcmc, "old_G": old_gaussians, "old_M": old_metrics}


def gs_timing(args: argparse.Namespace, out: Path, m: dict[str, ModuleType], rast: Any, device: torch.device) -> None:
    """Iteration time against gsplat's forward+backward. Two footprints at 1M: splats ~3x the
    mean spacing (as at 100k) and 2.5x wider (more tile intersections: gsplat's own cost grows,
    the loop's does not). At 1M wide, the loop's parts by difference: SSIM, densification stats."""
    G, R, S, old_G, old_M = m["G"], m["R"], m["S"], m["old_G"], m["old_M"]
    width, height = (64, 48) if args.cpu_smoke else (1237, 822)
    cam = cameras(R, 1, width, height, 0.8 * width, 3.0, device)[0]
    target = torch.rand(height, width, 3, generator=torch.Generator().manual_seed(0)).to(device)
    bg = torch.zeros(3, device=device)
    small, large = (200, 1000) if args.cpu_smoke else (100_000, 1_000_000)
    cases = [(f"{small // 1000}k", small, 1.0), ("1M", large, 1.0), ("1M wide", large, 2.5)]
    reps, warm = (3, 1) if args.cpu_smoke else (30, 5)
    # statistics accumulate, no densify event inside the timed window
    schedule = G.Schedule(iterations=10**6, densify_from=10**6, densify_until=10**6, densify_every=100,
                          opacity_reset_every=10**6, sh_degree_every=1)
    no_stats = G.Schedule(iterations=10**6, densify_from=10**6, densify_until=0, densify_every=100,
                          opacity_reset_every=10**6, sh_degree_every=1)
    for label, n, widen in cases:
        params = random_gaussians(n, 3, device, 0, math.log(widen * 0.8 / n ** (1 / 3)))
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}

        def fwd_bwd() -> None:
            colors = torch.cat([leaves["sh0"], leaves["shN"]], 1)
            o = rast.render(leaves["means"], torch.nn.functional.normalize(leaves["quats"], dim=-1),
                            torch.exp(leaves["log_scales"]), torch.sigmoid(leaves["opacity_logits"]), colors, cam,
                            background=bg, sh_degree=3)
            torch.abs(o.image - target).mean().backward()

        gsplat_ms = time_ms(fwd_bwd, reps, warm, device)
        emit(out, "3dgs", f"{label}: gsplat fwd+bwd ms", gsplat_ms)
        variants = [("new loop iteration ms", schedule, 0.2)]
        if label == "1M wide":
            variants += [("new loop without SSIM ms", schedule, 0.0), ("new loop without stats ms", no_stats, 0.2)]
        for name, sched, lam in variants:
            model = G.GaussianModel({k: v.clone() for k, v in params.items()}, 3, G.LearningRates(), 3.0)
            model.active_sh_degree = 3
            trainer = S.TrainStep(model, rast, sched, densify=G.Densify(), ssim_lambda=lam, device=device)
            it = iter(range(1, 10**9))
            emit(out, "3dgs", f"{label}: {name}", time_ms(lambda: trainer(next(it), cam, target, bg), reps, warm, device))
            if label == "1M wide" and name == "new loop iteration ms":
                profile_table(out, "gs_1M_wide", lambda: [trainer(next(it), cam, target, bg) for _ in range(5)], device)
            del model, trainer
        emit(out, "3dgs", f"{label}: new / gsplat fwd+bwd", RESULTS["3dgs"][f"{label}: new loop iteration ms"] / gsplat_ms)
        old = old_G.GaussianModel({k: v.clone() for k, v in params.items()}, 3, old_G.LearningRates(), 3.0)
        old.active_sh_degree = 3
        gen = torch.Generator(device=device)
        it = iter(range(1, 10**9))
        ms_old = time_ms(lambda: gs_old_iteration(old_G, old_M, old, rast, cam, target, bg, next(it), schedule,
                                                  old_G.Densify(), gen, device), reps, warm, device)
        emit(out, "3dgs", f"{label}: old loop iteration ms", ms_old)
        emit(out, "3dgs", f"{label}: old / gsplat fwd+bwd", ms_old / gsplat_ms)
        del old, leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()


def time_ms(fn: Any, reps: int, warm: int, device: torch.device) -> float:
    for _ in range(warm):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return 1000 * (time.perf_counter() - start) / reps


def gs_quality(args: argparse.Namespace, out: Path, m: dict[str, ModuleType], rast: Any, device: torch.device) -> None:
    """PSNR on held-out views after the same iterations: old loop, new loop, new loop with MCMC."""
    G, R, S, MC, old_G, old_M = m["G"], m["R"], m["S"], m["MC"], m["old_G"], m["old_M"]
    width, height, n_gt, iters = (48, 36, 300, 60) if args.cpu_smoke else (640, 480, 100_000, args.gs_iters)
    views = cameras(R, 24, width, height, 0.9 * width, 3.5, device)
    gt = random_gaussians(n_gt, 0, device, 1, math.log(0.6 / n_gt ** (1 / 3)))
    bg = torch.zeros(3, device=device)
    with torch.no_grad():
        images = [rast.render(gt["means"], torch.nn.functional.normalize(gt["quats"], dim=-1), torch.exp(gt["log_scales"]),
                              torch.sigmoid(gt["opacity_logits"]), gt["sh0"], c, background=bg, sh_degree=0).image.clamp(0, 1)
                  for c in views]
    test = list(range(0, len(views), 8))
    train = [i for i in range(len(views)) if i not in test]
    g = torch.Generator().manual_seed(3)
    pick = torch.randperm(n_gt, generator=g)[: n_gt // 10].to(device)
    xyz = gt["means"][pick] + 0.01 * torch.randn(len(pick), 3, generator=g).to(device)
    rgb = (gt["sh0"][pick, 0] * 0.28209479177387814 + 0.5).clamp(0, 1)
    extent = 1.1 * 3.5
    f = iters / 2000
    # No opacity reset inside so short a run: after one, Inria's rule prunes splats wider than 20 px,
    # which at 640x480 is most of a scene still being split (both loops fell to ~100 Gaussians)
    schedule = G.Schedule(iterations=iters, densify_from=max(1, int(100 * f)), densify_until=int(1500 * f),
                          densify_every=max(10, int(100 * f)), opacity_reset_every=iters + 1,
                          sh_degree_every=max(1, int(300 * f)))
    order = np.random.default_rng(0).choice(train, size=iters)

    def held_out_psnr(model: Any) -> float:
        with torch.no_grad():
            scores = []
            for i in test:
                o = S.render(model, rast, views[i], bg)
                scores.append(10 * math.log10(1 / max(float(((o.image.clamp(0, 1) - images[i]) ** 2).mean()), 1e-12)))
        return float(np.mean(scores))

    runs = {"old loop": None, "new loop": "default", "new loop, MCMC": "mcmc"}
    for name, strategy in runs.items():
        mod = old_G if strategy is None else G
        model = mod.GaussianModel.from_points(xyz, rgb, 3, mod.LearningRates(), extent)
        start = time.perf_counter()
        if strategy is None:
            gen = torch.Generator(device=device)
            for s in range(1, iters + 1):
                gs_old_iteration(old_G, old_M, model, rast, views[order[s - 1]], images[order[s - 1]], bg, s, schedule,
                                 old_G.Densify(), gen, device)
        else:
            trainer = S.TrainStep(model, rast, schedule, densify=G.Densify(), strategy=strategy,
                                  mcmc=MC.MCMC(cap_max=n_gt), device=device)
            for s in range(1, iters + 1):
                trainer(s, views[order[s - 1]], images[order[s - 1]], bg)
        sync(device)
        emit(out, "3dgs", f"scene: {name}: s for {iters} iterations", time.perf_counter() - start)
        emit(out, "3dgs", f"scene: {name}: held-out PSNR dB", held_out_psnr(model))
        emit(out, "3dgs", f"scene: {name}: Gaussians", len(model))
        del model


def gs_relocation_check(out: Path, m: dict[str, ModuleType], device: torch.device) -> None:
    """mcmc.relocation (PyTorch) against gsplat's compute_relocation CUDA kernel."""
    from gsplat.relocation import compute_relocation

    n = 100_000
    g = torch.Generator(device="cpu").manual_seed(0)
    o = (0.01 + 0.98 * torch.rand(n, generator=g)).to(device)
    s = torch.rand(n, 3, generator=g).to(device)
    ratios = torch.randint(1, 8, (n,), generator=g).to(device)
    binoms = torch.tensor([[math.comb(a, b) for b in range(51)] for a in range(51)], dtype=torch.float32, device=device)
    ref_o, ref_s = compute_relocation(o, s, ratios.clone(), binoms)
    new_o, new_s = m["MC"].relocation(o, s, ratios)
    emit(out, "3dgs", "MCMC relocation vs gsplat: max |opacity diff|", float((ref_o - new_o).abs().max()))
    emit(out, "3dgs", "MCMC relocation vs gsplat: max rel scale diff", float(((ref_s - new_s).abs() / ref_s).max()))


def gs_section(args: argparse.Namespace, out: Path, device: torch.device, build: subprocess.Popen | None) -> None:
    m = gs_modules()
    if args.cpu_smoke:
        rast = m["R"].TorchRasterizer()
    else:
        t0 = time.perf_counter()
        rc = build.wait() if build else 0
        emit(out, "3dgs", "waited for the gsplat build after the VLA figures (s)", time.perf_counter() - t0)
        built = [ln for ln in (out / "gsplat-build.log").read_text().splitlines() if ln.startswith("BUILT_IN")]
        emit(out, "3dgs", f"gsplat JIT build, MAX_JOBS={os.environ.get('MAX_JOBS')} (s)",
             float(built[-1].split()[1]) if built else "no timing in the log")
        if rc != 0:
            emit(out, "3dgs", "gsplat build", f"FAILED rc={rc}: see {out}/gsplat-build.log")
            return
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", GSPLAT_IMPORT], check=True)
        emit(out, "3dgs", "gsplat import from the built cache, new process (s)", time.perf_counter() - t0)
        rast = m["R"].GsplatRasterizer(device)
    gs_timing(args, out, m, rast, device)
    gs_quality(args, out, m, rast, device)
    if not args.cpu_smoke:
        gs_relocation_check(out, m, device)


GSPLAT_IMPORT = "from gsplat.cuda._backend import _C; assert _C is not None"


def start_gsplat_build(out: Path, scratch: Path) -> subprocess.Popen:
    """gsplat's JIT CUDA build in the background, while the VLA figures are measured, into a
    cache directory this process then loads it from (as a task image with the build baked in)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(scratch / "torch_extensions")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "6")  # the rest of the 16 cores: loader workers, torch.compile
    log = open(out / "gsplat-build.log", "w")  # noqa: SIM115 (closed with the process)
    code = f"import time; t = time.time(); {GSPLAT_IMPORT}; print('BUILT_IN', time.time() - t)"
    return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="write .gpu-run/ (baseline code, data root)")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: every code path, no figures")
    ap.add_argument("--out", default=str(RUN_DIR / "out"))
    ap.add_argument("--data-root", default=str(RUN_DIR / "data"))
    ap.add_argument("--scratch", default="/tmp/det-lab-gpu-bench")
    ap.add_argument("--vla-batches", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--gs-iters", type=int, default=2000)
    ap.add_argument("--only", type=lambda v: v.split(","), help="sections, comma-separated: vla,3dgs,vla-large")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.cpu_smoke:
        args.vla_batches, args.warmup = 3, 1
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda":
        emit(out, "machine", "gpu", torch.cuda.get_device_name())
        emit(out, "machine", "torch", torch.__version__)
    build = None if args.cpu_smoke or (args.only and "3dgs" not in args.only) else start_gsplat_build(out, Path(args.scratch))
    for name, section in (("vla", lambda: vla_section(args, out, device)),
                          ("3dgs", lambda: gs_section(args, out, device, build)),
                          ("vla-large", lambda: vla_large_section(args, out, device))):
        if args.only and name not in args.only:
            continue
        try:
            section()
        except Exception:  # noqa: BLE001 (one failed section must not lose the other's figures)
            traceback.print_exc()
            emit(out, name, "section", "FAILED (traceback above)")
    if args.cpu_smoke:  # what the GPU machine must have or be given as wheels
        (out / "modules.txt").write_text("\n".join(sorted({m.split(".")[0] for m in sys.modules})) + "\n")
    print("\n" + json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
