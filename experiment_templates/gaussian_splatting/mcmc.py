"""MCMC densification (Kheradmand et al. 2024, "3D Gaussian Splatting as Markov Chain Monte
Carlo"), as gsplat's ``MCMCStrategy`` does it, on :class:`gaussians.GaussianModel`.

Instead of clone/split/prune by gradient, every refine step:

- *relocates* dead Gaussians (opacity <= ``min_opacity``) onto live ones sampled in proportion
  to opacity, splitting the source's opacity and scale so the sum of the copies renders like the
  source did (Eq. 9 of the paper: :func:`relocation`);
- *adds* 5 % more Gaussians the same way, up to ``cap_max``;

and after every step it nudges positions with noise shaped by each Gaussian's covariance, strong
for nearly transparent ones (``noise_lr`` x the position learning rate). The loss gains small
opacity and scale regularisers. The Gaussian count is bounded by ``cap_max`` from the start,
which makes memory and iteration time predictable.

:func:`relocation` is gsplat's ``compute_relocation`` CUDA kernel in PyTorch (so the strategy
also runs on CPU); ``bench/gpu.py`` compares the two on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from gaussians import GaussianModel
from rasterizer import quat_to_rotmat

N_MAX = 51  # gsplat's cap on how many copies one Gaussian is split into per step


@dataclass
class MCMC:
    """gsplat ``MCMCStrategy`` / ``simple_trainer`` MCMC defaults."""

    cap_max: int = 1_000_000
    noise_lr: float = 5e5
    min_opacity: float = 0.005
    opacity_reg: float = 0.01
    scale_reg: float = 0.01
    grow: float = 0.05  # fraction added per refine step, until cap_max


def _split_coefficients(device: torch.device) -> torch.Tensor:
    """``S[n-1, k] = sum_{i=1..n} C(i-1, k) (-1)^k / sqrt(k+1)``: Eq. 9's double sum, regrouped
    by power k so a Gaussian split n ways needs one row (float64: the terms alternate)."""
    c = torch.zeros(N_MAX, N_MAX, dtype=torch.float64)
    for i in range(1, N_MAX + 1):
        for k in range(i):
            c[i - 1, k] = math.comb(i - 1, k) * (-1) ** k / math.sqrt(k + 1)
    return torch.cumsum(c, 0).to(device)


def relocation(opacities: torch.Tensor, scales: torch.Tensor, ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Opacity and scale of each of ``ratios`` copies of a Gaussian (gsplat ``compute_relocation``):
    ``o' = 1 - (1 - o)^(1/n)`` and ``s' = s * o / sum_{i,k} ...`` (Eq. 9)."""
    n = ratios.clamp(1, N_MAX).long()
    o = opacities.double()
    new_o = 1.0 - torch.pow(1.0 - o, 1.0 / n)
    powers = new_o[:, None] ** torch.arange(1, N_MAX + 1, device=o.device, dtype=torch.float64)
    denom = (_split_coefficients(o.device)[n - 1] * powers).sum(-1)
    coeff = o / denom
    return new_o.to(opacities.dtype), (coeff[:, None] * scales.double()).to(scales.dtype)


@torch.no_grad()
def relocate_dead(model: GaussianModel, cfg: MCMC, generator: torch.Generator | None = None) -> int:
    """Move dead Gaussians onto live ones sampled by opacity; returns how many moved."""
    opac = model.opacities
    dead = opac <= cfg.min_opacity
    dead_idx, alive_idx = torch.nonzero(dead).squeeze(1), torch.nonzero(~dead).squeeze(1)
    n = len(dead_idx)
    if n == 0 or len(alive_idx) == 0:
        return 0
    src = alive_idx[torch.multinomial(opac[alive_idx], n, replacement=True, generator=generator)]
    _share(model, src, cfg)
    for p in model.params.values():
        p.data[dead_idx] = p.data[src]
    model.zero_adam_rows(src)
    return n


@torch.no_grad()
def add_new(model: GaussianModel, cfg: MCMC, generator: torch.Generator | None = None) -> int:
    """Add ``grow`` x N Gaussians (up to ``cap_max``) as copies of ones sampled by opacity."""
    n = max(0, min(cfg.cap_max, int((1 + cfg.grow) * len(model))) - len(model))
    if n == 0:
        return 0
    src = torch.multinomial(model.opacities, n, replacement=True, generator=generator)
    _share(model, src, cfg)
    model.append({name: p.data[src] for name, p in model.params.items()})
    return n


def _share(model: GaussianModel, src: torch.Tensor, cfg: MCMC) -> None:
    """Give each sampled source the opacity and scale of one of its (count + 1) copies."""
    ratios = torch.bincount(src, minlength=len(model))[src] + 1
    new_o, new_s = relocation(model.opacities[src], model.scales[src], ratios)
    eps = torch.finfo(torch.float32).eps
    model.params["opacity_logits"].data[src] = torch.logit(new_o.clamp(cfg.min_opacity, 1.0 - eps))
    model.params["log_scales"].data[src] = torch.log(new_s)


@torch.no_grad()
def inject_noise(model: GaussianModel, cfg: MCMC, lr_means: float, generator: torch.Generator | None = None) -> None:
    """Perturb positions by covariance-shaped noise, ~only for nearly transparent Gaussians."""
    means = model.params["means"]
    rot = quat_to_rotmat(model.params["quats"])
    s2 = model.scales**2
    covars = (rot * s2[:, None, :]) @ rot.transpose(1, 2)
    gate = torch.sigmoid(100.0 * ((1.0 - model.opacities) - 0.995))
    noise = torch.randn(means.shape, device=means.device, generator=generator) * gate[:, None] * (lr_means * cfg.noise_lr)
    means.data.add_(torch.einsum("bij,bj->bi", covars, noise))


def regularizer(model: GaussianModel, cfg: MCMC) -> torch.Tensor:
    """The MCMC loss terms: mean opacity and mean scale, weighted."""
    return cfg.opacity_reg * model.opacities.mean() + cfg.scale_reg * model.scales.mean()
