"""The 3D Gaussian model, its optimiser, and adaptive density control (Inria 3DGS).

Parameters (N Gaussians): ``means`` (N,3), ``log_scales`` (N,3), ``quats`` (N,4, w first),
``opacity_logits`` (N,), ``sh0`` (N,1,3) and ``shN`` (N,K-1,3) spherical-harmonics colour.
Each has its own Adam group. Densification clones small Gaussians and splits large ones whose
mean view-space (NDC) positional gradient exceeds a threshold; pruning drops nearly
transparent ones and, after the first opacity reset, ones too large on screen or in the world.
The schedule defaults are the Inria/gsplat 30k-iteration ones; :meth:`Schedule.scaled` shrinks
them proportionally for short runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from rasterizer import _SH_C0, RenderOutput, quat_to_rotmat


@dataclass
class Schedule:
    """When things happen, in iterations (defaults: the standard 30k schedule)."""

    iterations: int = 30_000
    densify_from: int = 500
    densify_until: int = 15_000
    densify_every: int = 100
    opacity_reset_every: int = 3_000
    sh_degree_every: int = 1_000

    @classmethod
    def scaled(cls, iterations: int, **overrides: Any) -> Schedule:
        """The standard schedule stretched to ``iterations``; explicit ``overrides`` win."""
        f = iterations / 30_000
        base = cls()
        values = {fl.name: max(1, round(getattr(base, fl.name) * f)) for fl in fields(cls) if fl.name != "iterations"}
        values["densify_every"] = max(values["densify_every"], 10)  # gradient stats need several views
        values.update({k: int(v) for k, v in overrides.items() if v is not None})
        return cls(iterations=iterations, **values)


@dataclass
class LearningRates:
    """Adam learning rates (Inria defaults); ``means`` decays exponentially to ``means_final``
    and both are multiplied by the scene extent."""

    means: float = 1.6e-4
    means_final: float = 1.6e-6
    sh0: float = 2.5e-3
    shN: float = 2.5e-3 / 20  # noqa: N815 (the usual name)
    opacities: float = 0.05
    scales: float = 5e-3
    quats: float = 1e-3

    def means_at(self, step: int, total: int, extent: float) -> float:
        t = min(max(step / max(total, 1), 0.0), 1.0)
        return extent * math.exp((1 - t) * math.log(self.means) + t * math.log(self.means_final))


@dataclass
class Densify:
    """Adaptive density control thresholds (Inria/gsplat DefaultStrategy defaults)."""

    grad_threshold: float = 2e-4  # mean |d loss / d mean2d| in NDC units
    percent_dense: float = 0.01  # clone below, split above this fraction of the scene extent
    prune_opacity: float = 0.005
    max_screen_size: float = 20.0  # pixels; applied after the first opacity reset
    max_world_size: float = 0.1  # fraction of the scene extent; idem
    max_gaussians: int | None = None  # cap (CPU runs); the highest-gradient candidates win


_PARAMS = ("means", "log_scales", "quats", "opacity_logits", "sh0", "shN")
_LR_KEY = {"means": "means", "log_scales": "scales", "quats": "quats", "opacity_logits": "opacities",
           "sh0": "sh0", "shN": "shN"}


class GaussianModel:
    """Parameters, Adam state and densification statistics of a set of 3D Gaussians."""

    def __init__(self, params: dict[str, torch.Tensor], sh_degree: int, lrs: LearningRates, extent: float) -> None:
        self.max_sh_degree, self.active_sh_degree = sh_degree, 0
        self.lrs, self.extent = lrs, extent
        self.params = {k: torch.nn.Parameter(params[k].contiguous()) for k in _PARAMS}
        # fused: one kernel updates all six groups on CUDA (the unfused step is ~20 launches)
        self.optimizer = torch.optim.Adam(
            [{"params": [self.params[k]], "lr": getattr(lrs, _LR_KEY[k]) * (extent if k == "means" else 1.0),
              "name": k} for k in _PARAMS], lr=0.0, eps=1e-15, fused=self.means.is_cuda or None)
        self._reset_stats()

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_points(cls, xyz: torch.Tensor, rgb: torch.Tensor, sh_degree: int, lrs: LearningRates,
                    extent: float, init_opacity: float = 0.1) -> GaussianModel:
        """Isotropic Gaussians at SfM points: scale = RMS distance to the 3 nearest neighbours,
        colour from the points' RGB (0..1) as the SH DC term."""
        n, dev = xyz.shape[0], xyz.device
        dist = _knn_rms(xyz, 3).clamp_min(1e-7)
        k = (sh_degree + 1) ** 2
        params = {
            "means": xyz.float(),
            "log_scales": torch.log(dist)[:, None].repeat(1, 3),
            "quats": torch.tensor([1.0, 0.0, 0.0, 0.0], device=dev).repeat(n, 1),
            "opacity_logits": torch.logit(torch.full((n,), init_opacity, device=dev)),
            "sh0": ((rgb.float() - 0.5) / _SH_C0)[:, None, :],
            "shN": torch.zeros(n, k - 1, 3, device=dev),
        }
        return cls(params, sh_degree, lrs, extent)

    @classmethod
    def from_state(cls, state: dict[str, Any], lrs: LearningRates, device: torch.device) -> GaussianModel:
        """Rebuild from :meth:`state_dict` (any Gaussian count), with Adam state and statistics."""
        model = cls({k: state["params"][k].to(device) for k in _PARAMS}, state["max_sh_degree"], lrs, state["extent"])
        model.active_sh_degree = state["active_sh_degree"]
        model.optimizer.load_state_dict(state["optimizer"])
        for k in ("grad2d", "count", "max_radii"):
            setattr(model, k, state["stats"][k].to(device))
        return model

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": {k: v.detach().cpu() for k, v in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "stats": {"grad2d": self.grad2d.cpu(), "count": self.count.cpu(), "max_radii": self.max_radii.cpu()},
            "max_sh_degree": self.max_sh_degree, "active_sh_degree": self.active_sh_degree,
            "extent": self.extent, "lrs": asdict(self.lrs),
        }

    # --- activated views ----------------------------------------------------------------------

    def __len__(self) -> int:
        return self.params["means"].shape[0]

    @property
    def means(self) -> torch.Tensor:
        return self.params["means"]

    @property
    def scales(self) -> torch.Tensor:
        return torch.exp(self.params["log_scales"])

    @property
    def quats(self) -> torch.Tensor:
        return torch.nn.functional.normalize(self.params["quats"], dim=-1)

    @property
    def opacities(self) -> torch.Tensor:
        return torch.sigmoid(self.params["opacity_logits"])

    @property
    def sh(self) -> torch.Tensor:
        """(N, (active degree + 1)², 3) coefficients in use."""
        k = (self.active_sh_degree + 1) ** 2
        return torch.cat([self.params["sh0"], self.params["shN"]], 1)[:, :k]

    # --- optimisation -------------------------------------------------------------------------

    def step_lr(self, step: int, total: int) -> float:
        lr = self.lrs.means_at(step, total, self.extent)
        for group in self.optimizer.param_groups:
            if group["name"] == "means":
                group["lr"] = lr
        return lr

    def step_sh_degree(self, step: int, every: int) -> None:
        self.active_sh_degree = min(self.max_sh_degree, step // max(every, 1))

    def update_stats(self, out: RenderOutput, width: int, height: int) -> None:
        """Accumulate the view-space positional gradient of the Gaussians drawn in ``out``.
        Masks by multiplication, not indexing: no host synchronisation."""
        grad = out.means2d_grad()
        if grad is None:
            return
        grad = grad.detach()
        norm = torch.hypot(grad[:, 0] * (width / 2.0), grad[:, 1] * (height / 2.0))  # pixels -> NDC
        drawn = out.radii > 0
        self.grad2d.add_(norm * drawn)
        self.count.add_(drawn)
        torch.maximum(self.max_radii, out.radii.float(), out=self.max_radii)  # radii are 0 where not drawn

    # --- adaptive density control -------------------------------------------------------------

    @torch.no_grad()
    def densify_and_prune(self, cfg: Densify, prune_big: bool, generator: torch.Generator | None = None) -> dict[str, int]:
        """Clone, split and prune (one Inria ``densify_and_prune`` step); returns the counts."""
        grads = self.grad2d / self.count.clamp_min(1)
        scale_max = self.scales.max(dim=-1).values
        prune = self.opacities < cfg.prune_opacity
        if prune_big:
            prune |= (self.max_radii > cfg.max_screen_size) | (scale_max > cfg.max_world_size * self.extent)
        high = (grads >= cfg.grad_threshold) & ~prune
        small = scale_max <= cfg.percent_dense * self.extent
        clone, split = high & small, high & ~small
        if cfg.max_gaussians is not None:
            room = cfg.max_gaussians - (len(self) - int(prune.sum()))
            clone, split = _cap(grads, clone, split, room)
        # split: two children sampled from the parent, each 1/1.6 its size
        n_split = int(split.sum())
        stds = self.scales[split].repeat(2, 1)
        samples = torch.randn(stds.shape, device=stds.device, generator=generator) * stds
        rots = quat_to_rotmat(self.params["quats"][split]).repeat(2, 1, 1)
        children: dict[str, torch.Tensor] = {k: v[split].repeat(2, *[1] * (v.dim() - 1)) for k, v in self.params.items()}
        children["means"] = (rots @ samples[..., None]).squeeze(-1) + children["means"]
        children["log_scales"] = torch.log(stds / 1.6)
        clones = {k: v[clone] for k, v in self.params.items()}
        keep = ~(prune | split)
        self._replace(keep, [clones, children])
        return {"cloned": int(clone.sum()), "split": n_split, "pruned": int(prune.sum())}

    @torch.no_grad()
    def reset_opacity(self, value: float = 0.01) -> None:
        """Clamp every opacity to at most ``value`` and forget its Adam moments."""
        logits = torch.minimum(self.params["opacity_logits"], torch.logit(torch.tensor(value)))
        self.params["opacity_logits"].data.copy_(logits)
        state = self.optimizer.state.get(self.params["opacity_logits"], {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].zero_()

    @torch.no_grad()
    def append(self, rows: dict[str, torch.Tensor]) -> None:
        """Add Gaussians (one tensor per parameter) with fresh Adam moments."""
        self._replace(torch.ones(len(self), dtype=torch.bool, device=self.means.device), [rows])

    @torch.no_grad()
    def zero_adam_rows(self, rows: torch.Tensor) -> None:
        """Forget the Adam moments of Gaussians ``rows`` (their parameters were replaced)."""
        for state in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key][rows] = 0

    def _replace(self, keep: torch.Tensor, extra: list[dict[str, torch.Tensor]]) -> None:
        """Keep rows ``keep`` and append ``extra`` rows, in every parameter and its Adam state."""
        for group in self.optimizer.param_groups:
            name, old = group["name"], group["params"][0]
            added = [e[name] for e in extra]
            new = torch.nn.Parameter(torch.cat([old.data[keep], *added]).contiguous())
            state = self.optimizer.state.pop(old, None)
            if state:
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.cat([state[key][keep], *[torch.zeros_like(a) for a in added]])
                self.optimizer.state[new] = state
            group["params"][0] = new
            self.params[name] = new
        self._reset_stats()

    def _reset_stats(self) -> None:
        n, dev = len(self), self.means.device
        self.grad2d = torch.zeros(n, device=dev)
        self.count = torch.zeros(n, device=dev)
        self.max_radii = torch.zeros(n, device=dev)


def _cap(grads: torch.Tensor, clone: torch.Tensor, split: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the highest-gradient clone/split candidates that fit in ``room`` new Gaussians
    (a clone adds one, a split replaces one by two: also one)."""
    cand = torch.nonzero(clone | split).squeeze(1)
    if len(cand) <= room:
        return clone, split
    chosen = torch.zeros_like(clone)
    if room > 0:
        chosen[cand[torch.topk(grads[cand], room).indices]] = True
    return clone & chosen, split & chosen


def _knn_rms(xyz: torch.Tensor, k: int, chunk: int = 4096) -> torch.Tensor:
    """RMS distance of each point to its ``k`` nearest others (Inria's distCUDA2), chunked."""
    out = []
    for i in range(0, xyz.shape[0], chunk):
        d2 = torch.cdist(xyz[i:i + chunk], xyz).pow(2)
        d2[torch.arange(d2.shape[0]), torch.arange(i, i + d2.shape[0])] = float("inf")
        kk = min(k, xyz.shape[0] - 1)
        out.append(torch.topk(d2, kk, largest=False).values.mean(-1).sqrt() if kk else torch.ones(d2.shape[0]))
    return torch.cat(out)
