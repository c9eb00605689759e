"""One 3DGS training iteration, shared by ``train.py`` and ``bench/gpu.py``.

Render one view, loss ``(1 - λ)·L1 + λ·(1 - SSIM)`` (+ the MCMC regularisers), backward,
densification statistics, the density-control step when due, Adam. Nothing in a plain iteration
waits for the GPU: the loss comes back as a device tensor, statistics are accumulated with masks
rather than indexing, and the caller reads numbers only when it reports. Only density-control
steps (every ``densify_every`` iterations) synchronise, since they change the Gaussian count.

Strategies: ``default`` is Inria's clone/split/prune with opacity resets (:mod:`gaussians`);
``mcmc`` is gsplat's MCMC strategy (:mod:`mcmc`): relocation and growth up to ``cap_max`` on
the same schedule, position noise every iteration, no opacity resets.
"""

from __future__ import annotations

import logging

import torch
from gaussians import Densify, GaussianModel, Schedule
from mcmc import MCMC, add_new, inject_noise, regularizer, relocate_dead
from metrics import ssim
from rasterizer import Camera, Rasterizer, RenderOutput

log = logging.getLogger("3dgs")

STRATEGIES = ("default", "mcmc")


def render(model: GaussianModel, rast: Rasterizer, cam: Camera, background: torch.Tensor) -> RenderOutput:
    """The model's Gaussians (activated, SH up to the active degree) seen by ``cam``."""
    return rast.render(model.means, model.quats, model.scales, model.opacities, model.sh, cam,
                       background=background, sh_degree=model.active_sh_degree)


class TrainStep:
    """``step(i, camera, image, background)`` -> the loss as a device tensor (no host sync)."""

    def __init__(self, model: GaussianModel, rast: Rasterizer, schedule: Schedule, *, densify: Densify,
                 ssim_lambda: float = 0.2, strategy: str = "default", mcmc: MCMC | None = None, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"hyperparameters.strategy must be one of {STRATEGIES}, not {strategy!r}")
        self.model, self.rast, self.schedule = model, rast, schedule
        self.densify, self.ssim_lambda, self.seed = densify, ssim_lambda, seed
        self.mcmc = (mcmc or MCMC()) if strategy == "mcmc" else None
        self.gen = torch.Generator(device=device)

    def __call__(self, step: int, cam: Camera, image: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
        model, sched = self.model, self.schedule
        lr = model.step_lr(step, sched.iterations)
        model.step_sh_degree(step, sched.sh_degree_every)
        out = render(model, self.rast, cam, background)
        loss = (1 - self.ssim_lambda) * torch.abs(out.image - image).mean()
        if self.ssim_lambda:
            loss = loss + self.ssim_lambda * (1 - ssim(out.image, image))
        if self.mcmc is not None:
            loss = loss + regularizer(model, self.mcmc)
        loss.backward()
        self.gen.manual_seed(self.seed * 1_000_003 + step)  # a function of the step: resumable
        if self.mcmc is None:
            self._default(step, out, cam)
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
        else:
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            self._mcmc(step, lr)
        return loss.detach()

    @torch.no_grad()
    def _default(self, step: int, out: RenderOutput, cam: Camera) -> None:
        sched, model = self.schedule, self.model
        if step > sched.densify_until:
            return
        model.update_stats(out, cam.width, cam.height)
        if step >= sched.densify_from and step % sched.densify_every == 0:
            changed = model.densify_and_prune(self.densify, step > sched.opacity_reset_every, self.gen)
            log.debug("step %d: %s -> %d Gaussians", step, changed, len(model))
        if step % sched.opacity_reset_every == 0:
            model.reset_opacity()

    @torch.no_grad()
    def _mcmc(self, step: int, lr: float) -> None:
        sched, model, cfg = self.schedule, self.model, self.mcmc
        assert cfg is not None
        if sched.densify_from < step < sched.densify_until and step % sched.densify_every == 0:
            moved = relocate_dead(model, cfg, self.gen)
            added = add_new(model, cfg, self.gen)
            log.debug("step %d: relocated %d, added %d -> %d Gaussians", step, moved, added, len(model))
        inject_noise(model, cfg, lr, self.gen)
