"""3D Gaussian Splatting on a COLMAP scene, as a Core API loop on ``det_lab.core.init``.

One iteration = one training view. Every ``validate_every`` iterations (and at the end) the
held-out views (every ``test_every``-th image by name, Inria's ``--eval`` split) are rendered:
PSNR/SSIM (/LPIPS when installed) are reported, and the renders are saved as PNGs next to the
run and sent to MLflow/Aim. Checkpoints hold the Gaussians, Adam state and densification
statistics, so a resumed trial continues with the same Gaussian set.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gaussians import Densify, GaussianModel, LearningRates, Schedule
from mcmc import MCMC
from metrics import lpips_metric, peak_memory_mb, psnr, ssim
from PIL import Image
from rasterizer import Camera, make_rasterizer
from step import TrainStep, render

import det_lab.core
from det_lab.scenes import Scene, load_scene, render_keys

log = logging.getLogger("3dgs")


class Views:
    """A scene's views as tensors on the training device."""

    def __init__(self, scene: Scene, device: torch.device, test_every: int) -> None:
        self.names = render_keys([v.name for v in scene.views])  # cam0/0001.png -> cam0/0001: rigs keep apart
        self.images = [torch.tensor(v.image, device=device) for v in scene.views]
        self.cameras = [Camera(torch.tensor(v.viewmat, dtype=torch.float32, device=device),
                               torch.tensor(v.K, dtype=torch.float32, device=device), v.width, v.height)
                        for v in scene.views]
        n = len(scene.views)
        self.test = [i for i in range(n) if test_every > 0 and i % test_every == 0] if n > 1 else []
        self.train = [i for i in range(n) if i not in self.test]

    def train_view(self, step: int, seed: int) -> int:
        """Views in a fresh random order each epoch; a function of ``step``, so resumable."""
        epoch, k = divmod(step, len(self.train))
        return self.train[np.random.default_rng([seed, epoch]).permutation(len(self.train))[k]]


def renders_dir(ctx: Any) -> Path:
    """``<local run dir>/renders``, or on a cluster ``<data root>/outputs/<project>/<run key>/renders``."""
    return ctx.outputs_dir / "renders"


def save_render(path: Path, render_img: torch.Tensor, truth: torch.Tensor) -> None:
    """PNG of the render (left) next to the ground truth (right)."""
    pair = torch.cat([render_img.detach(), truth], dim=1).clamp(0, 1).cpu().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.round(pair * 255).astype(np.uint8)).save(path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with det_lab.core.init() as ctx:
        train(ctx)


def train(ctx: Any) -> None:  # noqa: PLR0915 (one loop, read top to bottom)
    hp = ctx.hparams
    total = ctx.training_length.value
    report_every = ctx.lab.reporting_batches or 50
    seed = int(hp.get("seed", 0))
    backend = hp.get("backend", "torch")
    device = torch.device("cuda" if backend != "torch" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and hp.get("cpu_threads"):
        # On a shared CPU box, OpenMP with more threads than free cores is ~10x slower.
        torch.set_num_threads(int(hp["cpu_threads"]))
    rast = make_rasterizer(backend, device)
    if ctx.dataset is None:
        raise SystemExit("3dgs: data.det_lab.dataset is not set: name the COLMAP scene to train on")
    scene = load_scene(ctx.dataset.path / hp.get("scene_subdir", ""), images=hp.get("images", "images"))
    views = Views(scene, device, int(hp.get("test_every", 8)))
    schedule = Schedule.scaled(total, **{k: hp.get(k) for k in
                                         ("densify_from", "densify_until", "densify_every",
                                          "opacity_reset_every", "sh_degree_every")})
    lrs = LearningRates(**{k: float(v) for k, v in (hp.get("lr") or {}).items()})
    densify = Densify(**{k: v for k, v in (hp.get("densify") or {}).items()})
    background = torch.tensor(hp.get("background", [0.0, 0.0, 0.0]), dtype=torch.float32, device=device)
    validate_every, checkpoint_every = int(hp.get("validate_every", 100)), int(hp.get("checkpoint_every", 500))
    ssim_lambda = float(hp.get("ssim_lambda", 0.2))
    lpips = lpips_metric(device)
    out_dir = renders_dir(ctx)

    start, window = 0, (0.0, 0)
    if ctx.latest_checkpoint:
        with ctx.checkpoint.restore_path(ctx.latest_checkpoint) as path:
            state = torch.load(Path(path) / "gaussians.pt", map_location=device, weights_only=False)
        model = GaussianModel.from_state(state["model"], lrs, device)
        start = int(state["step"])
        window = state.get("loss_window", (0.0, 0))  # the reporting window a stop fell into
        log.info("resumed from checkpoint %s at step %d with %d Gaussians", ctx.latest_checkpoint, start, len(model))
    else:
        pts = scene.model.points3d
        model = GaussianModel.from_points(torch.tensor(pts.xyz, dtype=torch.float32, device=device),
                                          torch.tensor(pts.rgb / 255.0, dtype=torch.float32, device=device),
                                          int(hp.get("sh_degree", 3)), lrs, scene.extent,
                                          float(hp.get("init_opacity", 0.1)))
        log.info("initialised %d Gaussians from %d SfM points; %d training / %d held-out views; extent %.3f",
                 len(model), len(pts), len(views.train), len(views.test), scene.extent)
    if lpips is None:
        log.info("LPIPS unavailable (the lpips package is not installed): not reported")

    def checkpoint(step: int, final: bool = False) -> None:
        meta = {"steps_completed": step, "num_gaussians": len(model), "backend": rast.name}
        with ctx.checkpoint.store_path(meta) as (path, storage_id):
            torch.save({"model": model.state_dict(), "step": step, "loss_window": (float(loss_sum), window_steps)},
                       Path(path) / "gaussians.pt")
            (Path(path) / "gaussians.json").write_text(json.dumps(meta) + "\n")
            if final:
                write_ply(model, Path(path) / "point_cloud.ply")
        log.info("checkpoint %s at step %d (%d Gaussians)", storage_id, step, len(model))

    def validate(step: int) -> None:
        scores: dict[str, list[float]] = {"psnr": [], "ssim": [], "lpips": [], "render_ms": []}
        with torch.no_grad():
            for i in views.test:
                t0 = time.perf_counter()
                out = render(model, rast, views.cameras[i], background)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                scores["render_ms"].append(1000 * (time.perf_counter() - t0))
                img = out.image.clamp(0, 1)
                scores["psnr"].append(psnr(img, views.images[i]))
                scores["ssim"].append(float(ssim(img, views.images[i])))
                if lpips is not None:
                    scores["lpips"].append(lpips(img, views.images[i]))
                file = out_dir / f"step_{step:08d}" / f"{views.names[i]}.png"
                save_render(file, img, views.images[i])
                ctx.mirror.log_artifact(file, f"renders/{views.names[i]}", step, media="image")
        metrics = {k: float(np.mean(v)) for k, v in scores.items() if v}
        metrics.update(num_gaussians=len(model), batches=step)  # batches: ASHA's time_metric
        ctx.train.report_validation_metrics(step, metrics)
        log.info("validation at step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})

    trainer = TrainStep(model, rast, schedule, densify=densify, ssim_lambda=ssim_lambda,
                        strategy=hp.get("strategy", "default"), mcmc=MCMC(**(hp.get("mcmc") or {})), seed=seed,
                        device=device)
    loss_sum, window_steps = torch.tensor(window[0], device=device), int(window[1])
    window_start = time.perf_counter()
    for step in range(start + 1, total + 1):
        i = views.train_view(step - 1, seed)
        loss_sum += trainer(step, views.cameras[i], views.images[i], background)
        window_steps += 1
        reported = step % report_every == 0 or step == total
        if reported:  # the only host sync of a plain iteration: once per reporting window
            loss = float(loss_sum) / window_steps
            elapsed = time.perf_counter() - window_start
            mem_key, mem = peak_memory_mb(device)
            ctx.train.report_training_metrics(step, {
                "loss": loss, "num_gaussians": len(model), "lr_means": lrs.means_at(step, total, model.extent),
                "iter_ms": 1000 * elapsed / window_steps, "its_per_s": window_steps / elapsed,
                "sh_degree": model.active_sh_degree, mem_key: mem})
            ctx.train.report_progress(step / total)
            loss_sum.zero_()
            window_steps = 0
        if views.test and (step % validate_every == 0 or step == total):
            validate(step)
        preempt = ctx.preempt.should_preempt()
        if step % checkpoint_every == 0 or step == total or preempt:
            checkpoint(step, final=step == total)
        if preempt:
            log.info("preempted at step %d: checkpointed, stopping", step)
            return
        if reported:
            window_start = time.perf_counter()  # validation and checkpoints stay out of iter_ms


def write_ply(model: GaussianModel, path: Path) -> None:
    """The Gaussians as an Inria-format PLY (x y z nx ny nz f_dc_* f_rest_* opacity scale_* rot_*),
    which 3DGS viewers open directly."""
    p = {k: v.detach().cpu().float().numpy() for k, v in model.params.items()}
    n = len(model)
    f_rest = p["shN"].transpose(0, 2, 1).reshape(n, -1)  # channel-major, as Inria stores it
    cols = [p["means"], np.zeros((n, 3), np.float32), p["sh0"].reshape(n, 3), f_rest,
            p["opacity_logits"][:, None], p["log_scales"], p["quats"]]
    names = (["x", "y", "z", "nx", "ny", "nz"] + [f"f_dc_{i}" for i in range(3)]
             + [f"f_rest_{i}" for i in range(f_rest.shape[1])] + ["opacity"]
             + [f"scale_{i}" for i in range(3)] + [f"rot_{i}" for i in range(4)])
    data = np.concatenate(cols, axis=1).astype("<f4")
    header = ["ply", "format binary_little_endian 1.0", f"element vertex {n}",
              *[f"property float {name}" for name in names], "end_header"]
    with open(path, "wb") as f:
        f.write(("\n".join(header) + "\n").encode())
        f.write(data.tobytes())


if __name__ == "__main__":
    main()
