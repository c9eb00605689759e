"""Image quality and resource metrics: PSNR, SSIM, optional LPIPS, peak memory."""

from __future__ import annotations

import functools
import resource
import sys

import torch
import torch.nn.functional as F


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1]."""
    mse = float(torch.mean((a.float() - b.float()) ** 2))
    return 10.0 * torch.log10(torch.tensor(1.0 / max(mse, 1e-10))).item()


@functools.lru_cache(maxsize=8)
def _gaussian_1d(size: int, sigma: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return (g / g.sum()).to(dtype=dtype, device=device)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM (Wang et al. 2004; 11x11 Gaussian window, sigma 1.5, as the 3DGS code) of two
    (H, W, 3) images in [0, 1]; differentiable. Borders are zero-padded like Inria's version.

    The 2D Gaussian window is the outer product of a 1D one, so the five local statistics
    (means, second moments, covariance) are filtered together as 15 channels by one row pass
    and one column pass: 22 multiply-adds per pixel and channel instead of 121, in 2 launches.
    """
    x, y = a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None]
    c = x.shape[1]
    g = _gaussian_1d(window, sigma, x.dtype, x.device)
    stats = torch.cat([x, y, x * x, y * y, x * y], dim=1)  # (1, 5C, H, W)
    pad = window // 2
    filt = F.conv2d(stats, g.view(1, 1, 1, window).expand(5 * c, 1, 1, window), padding=(0, pad), groups=5 * c)
    filt = F.conv2d(filt, g.view(1, 1, window, 1).expand(5 * c, 1, window, 1), padding=(pad, 0), groups=5 * c)
    mu_x, mu_y, xx, yy, xy = filt.split(c, dim=1)
    var_x, var_y, cov = xx - mu_x**2, yy - mu_y**2, xy - mu_x * mu_y
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
