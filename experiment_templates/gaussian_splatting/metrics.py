"""Image quality and resource metrics: PSNR, SSIM, optional LPIPS, peak memory."""

from __future__ import annotations

import resource
import sys

import torch
import torch.nn.functional as F


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1]."""
    mse = float(torch.mean((a.float() - b.float()) ** 2))
    return 10.0 * torch.log10(torch.tensor(1.0 / max(mse, 1e-10))).item()


def _window(size: int, sigma: float, channels: int, like: torch.Tensor) -> torch.Tensor:
    x = torch.arange(size, dtype=like.dtype, device=like.device) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM (Wang et al. 2004; 11x11 Gaussian window, sigma 1.5, as the 3DGS code) of two
    (H, W, 3) images in [0, 1]; differentiable. Borders are zero-padded like Inria's version."""
    x, y = a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None]
    w = _window(window, sigma, x.shape[1], x)
    conv = lambda t: F.conv2d(t, w, padding=window // 2, groups=x.shape[1])  # noqa: E731
    mu_x, mu_y = conv(x), conv(y)
    var_x, var_y = conv(x * x) - mu_x**2, conv(y * y) - mu_y**2
    cov = conv(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return s.mean()


def lpips_metric(device: torch.device):
    """LPIPS (AlexNet) as ``f(a, b) -> float`` when the ``lpips`` package and its weights are
    there, else None (the metric is then reported as unavailable, never approximated)."""
    try:
        import lpips  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        net = lpips.LPIPS(net="alex", verbose=False).to(device).eval()
    except Exception:  # weights not downloadable offline, etc.
        return None

    def f(a: torch.Tensor, b: torch.Tensor) -> float:
        with torch.no_grad():
            return float(net(a.permute(2, 0, 1)[None] * 2 - 1, b.permute(2, 0, 1)[None] * 2 - 1))

    return f


def peak_memory_mb(device: torch.device) -> tuple[str, float]:
    """``("peak_cuda_alloc_mb", torch.cuda.max_memory_allocated)`` on CUDA (tensors only);
    on CPU ``("peak_rss_mb", ru_maxrss)``: the whole process's resident high-water mark,
    Python and libraries included."""
    if device.type == "cuda":
        return "peak_cuda_alloc_mb", torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak_rss_mb", rss / (2**20 if sys.platform == "darwin" else 2**10)
