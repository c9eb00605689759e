"""Two rasterizers for 3D Gaussians behind one interface.

``TorchRasterizer``: pure PyTorch, any device, differentiable through autograd. It is tile-less
and dense (every Gaussian against every pixel), which is fine for 64x64 images and a few
thousand Gaussians on a CPU, and is the reference the tests check against analytic cases.

``GsplatRasterizer``: ``gsplat.rasterization`` on CUDA, for real scenes. gsplat compiles its
CUDA code on first use; :func:`gsplat_extensions_dir` points that build at a per-machine cache
on local disk (see README, "Prebuilding gsplat").

Both follow gsplat's "classic" image model (itself the Inria one): EWA projection with the
Jacobian of the pinhole camera (clamped to 1.3x the field of view), a 0.3 px² low-pass added to
every 2D covariance, alpha = min(0.999, opacity * exp(-d²/2)), splats below 1/255 skipped,
front-to-back compositing by camera depth, stopping once transmittance would drop to 1e-4.
Pixel centres are at (col + 0.5, row + 0.5), as in COLMAP.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

EPS2D = 0.3  # px², screen-space low-pass (gsplat eps2d, Inria's 0.3)
ALPHA_MAX = 0.999
ALPHA_MIN = 1.0 / 255.0
T_MIN = 1e-4


@dataclass
class Camera:
    """A pinhole camera: 4x4 world-to-camera ``viewmat`` and 3x3 ``K``, on the render device."""

    viewmat: torch.Tensor
    K: torch.Tensor
    width: int
    height: int

    @property
    def center(self) -> torch.Tensor:
        R, t = self.viewmat[:3, :3], self.viewmat[:3, 3]
        return -R.T @ t


@dataclass
class RenderOutput:
    """``image`` (H, W, 3), ``alpha`` (H, W); per Gaussian: ``means2d`` (N, 2) pixels, whose
    ``.grad`` after backward is the screen-space gradient densification uses (read it through
    :meth:`means2d_grad`), ``radii`` (N,) pixels, 0 for Gaussians not drawn."""

    image: torch.Tensor
    alpha: torch.Tensor
    means2d: torch.Tensor
    radii: torch.Tensor

    def means2d_grad(self) -> torch.Tensor | None:
        g = self.means2d.grad
        return None if g is None else g.reshape(-1, 2)


class Rasterizer(Protocol):
    """Render N Gaussians (activated parameters) seen by one camera."""

    name: str

    def render(self, means: torch.Tensor, quats: torch.Tensor, scales: torch.Tensor,
               opacities: torch.Tensor, colors: torch.Tensor, camera: Camera,
               background: torch.Tensor | None = None, sh_degree: int | None = None) -> RenderOutput:
        """``means`` (N,3); ``quats`` (N,4) w-first; ``scales`` (N,3) std devs; ``opacities`` (N,)
        in [0, 1]; ``colors`` (N,3) RGB, or (N,K,3) SH coefficients with ``sh_degree`` set."""
        ...


def make_rasterizer(backend: str, device: torch.device) -> Rasterizer:
    """``"torch"`` or ``"gsplat"``; ``"auto"`` picks gsplat when CUDA and gsplat are usable."""
    if backend == "auto":
        backend = "gsplat" if device.type == "cuda" and gsplat_importable() else "torch"
    if backend == "torch":
        return TorchRasterizer()
    if backend == "gsplat":
        return GsplatRasterizer(device)
    raise ValueError(f"rasterizer backend must be torch, gsplat or auto, not {backend!r}")


# --- shared maths ----------------------------------------------------------------------------


def quat_to_rotmat(quats: torch.Tensor) -> torch.Tensor:
    """(N,4) quaternions (w, x, y, z), any length -> (N,3,3) rotation matrices."""
    w, x, y, z = torch.nn.functional.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).reshape(-1, 3, 3)


_SH_C0 = 0.28209479177387814
_SH_C1 = 0.4886025119029199
_SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
_SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
          -0.4570457994644658, 1.445305721320277, -0.5900435899266435)


def eval_sh(degree: int, coeffs: torch.Tensor, dirs: torch.Tensor) -> torch.Tensor:
    """Real spherical harmonics up to ``degree`` (<= 3): (N,K,3) coefficients, (N,3) unit
    directions -> (N,3) colour, with the +0.5 offset and clamp at 0 of 3DGS."""
    out = _SH_C0 * coeffs[:, 0]
    if degree > 0:
        x, y, z = dirs[:, 0:1], dirs[:, 1:2], dirs[:, 2:3]
        out = out - _SH_C1 * y * coeffs[:, 1] + _SH_C1 * z * coeffs[:, 2] - _SH_C1 * x * coeffs[:, 3]
        if degree > 1:
            xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
            out = (out + _SH_C2[0] * xy * coeffs[:, 4] + _SH_C2[1] * yz * coeffs[:, 5]
                   + _SH_C2[2] * (2 * zz - xx - yy) * coeffs[:, 6] + _SH_C2[3] * xz * coeffs[:, 7]
                   + _SH_C2[4] * (xx - yy) * coeffs[:, 8])
            if degree > 2:
                out = (out + _SH_C3[0] * y * (3 * xx - yy) * coeffs[:, 9] + _SH_C3[1] * xy * z * coeffs[:, 10]
                       + _SH_C3[2] * y * (4 * zz - xx - yy) * coeffs[:, 11]
                       + _SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy) * coeffs[:, 12]
                       + _SH_C3[4] * x * (4 * zz - xx - yy) * coeffs[:, 13]
                       + _SH_C3[5] * z * (xx - yy) * coeffs[:, 14] + _SH_C3[6] * x * (xx - 3 * yy) * coeffs[:, 15])
    return torch.clamp_min(out + 0.5, 0.0)


# --- pure PyTorch ------------------------------------------------------------------------------


class TorchRasterizer:
    """Differentiable reference rasterizer in plain PyTorch (see the module docstring).

    With ``tile_size=None`` it is dense: every visible Gaussian against every pixel. With a tile
    size, each Gaussian is evaluated only on the tiles its bounding box touches (the box where
    alpha >= 1/255, so the result is the same), padded per tile to the busiest tile's count:
    several times less work for small splats. Cost is ~40 bytes and a few dozen flops per
    (Gaussian, pixel) pair, forward and backward.
    """

    name = "torch"

    def __init__(self, tile_size: int | None = 8, near: float = 0.01, alpha_min: float = ALPHA_MIN,
                 alpha_max: float = ALPHA_MAX, t_min: float = T_MIN, eps2d: float = EPS2D) -> None:
        self.tile_size = tile_size
        self.near, self.alpha_min, self.alpha_max, self.t_min, self.eps2d = near, alpha_min, alpha_max, t_min, eps2d

    def project(self, means: torch.Tensor, quats: torch.Tensor, scales: torch.Tensor, camera: Camera):
        """Camera-space depth (N,), pixel means (N,2) and 2D covariances (N,2,2)."""
        R, t = camera.viewmat[:3, :3], camera.viewmat[:3, 3]
        fx, fy, cx, cy = camera.K[0, 0], camera.K[1, 1], camera.K[0, 2], camera.K[1, 2]
        cam = means @ R.T + t
        x, y, z = cam.unbind(-1)
        zs = torch.clamp_min(z, self.near)  # keeps culled Gaussians finite; they are masked later
        means2d = torch.stack([fx * x / zs + cx, fy * y / zs + cy], dim=-1)
        # Jacobian of the projection at x/z, y/z clamped to the image plus 30% of the half
        # field of view on each side (gsplat's persp_proj), so off-screen splats stay bounded
        lim_x = 0.3 * 0.5 * camera.width / fx
        lim_y = 0.3 * 0.5 * camera.height / fy
        tx = zs * torch.minimum(torch.maximum(x / zs, -cx / fx - lim_x), (camera.width - cx) / fx + lim_x)
        ty = zs * torch.minimum(torch.maximum(y / zs, -cy / fy - lim_y), (camera.height - cy) / fy + lim_y)
        zero = torch.zeros_like(zs)
        J = torch.stack([fx / zs, zero, -fx * tx / zs**2, zero, fy / zs, -fy * ty / zs**2], -1).reshape(-1, 2, 3)
        M = quat_to_rotmat(quats) * scales[:, None, :]  # R S
        JW = J @ R
        T = JW @ M
        cov2d = T @ T.transpose(1, 2) + self.eps2d * torch.eye(2, dtype=means.dtype, device=means.device)
        return z, means2d, cov2d

    def render(self, means: torch.Tensor, quats: torch.Tensor, scales: torch.Tensor,
               opacities: torch.Tensor, colors: torch.Tensor, camera: Camera,
               background: torch.Tensor | None = None, sh_degree: int | None = None) -> RenderOutput:
        """See :class:`Rasterizer`."""
        W, H = camera.width, camera.height
        z, means2d, cov2d = self.project(means, quats, scales, camera)
        if means2d.requires_grad:
            means2d.retain_grad()
        det = cov2d[:, 0, 0] * cov2d[:, 1, 1] - cov2d[:, 0, 1] ** 2
        with torch.no_grad():
            # box where alpha >= alpha_min: Mahalanobis extent sqrt(2 ln(o / alpha_min)), <= 3.33
            ratio = torch.clamp_min(opacities.detach() / max(self.alpha_min, 1e-12), 1.0)
            extent = torch.clamp_max(torch.sqrt(2.0 * torch.log(ratio)), 3.33)
            rx = torch.ceil(extent * torch.sqrt(torch.clamp_min(cov2d[:, 0, 0], 0)))
            ry = torch.ceil(extent * torch.sqrt(torch.clamp_min(cov2d[:, 1, 1], 0)))
            u, v = means2d[:, 0], means2d[:, 1]
            visible = ((z > self.near) & (det > 0) & (rx > 0) & (ry > 0) & (u + rx > 0) & (u - rx < W)
                       & (v + ry > 0) & (v - ry < H))
            radii = torch.where(visible, torch.maximum(rx, ry), torch.zeros_like(rx))
            idx = torch.nonzero(visible).squeeze(1)
            idx = idx[torch.argsort(z[idx], stable=True)]
        if sh_degree is not None:
            dirs = torch.nn.functional.normalize(means[idx] - camera.center.detach(), dim=-1)
            rgb = eval_sh(sh_degree, colors[idx], dirs)
        else:
            rgb = colors[idx]
        inv_det = 1.0 / det[idx]
        # conic (inverse covariance) entries; the padding row M is a transparent dummy
        conic = torch.stack([cov2d[idx, 1, 1], -cov2d[idx, 0, 1], cov2d[idx, 0, 0]], -1) * inv_det[:, None]
        pad = lambda t: torch.cat([t, torch.zeros_like(t[:1])])  # noqa: E731
        mu, conic, opac, rgb = pad(means2d[idx]), pad(conic), pad(opacities[idx]), pad(rgb)
        ts = self.tile_size or max(W, H)
        tiles_x, tiles_y = -(-W // ts), -(-H // ts)
        table = self._tile_table(mu[:-1].detach(), rx[idx], ry[idx], ts, tiles_x, tiles_y)  # (T, K)
        dev, dt = means.device, means.dtype
        py, px = torch.meshgrid(torch.arange(ts, device=dev, dtype=dt), torch.arange(ts, device=dev, dtype=dt),
                                indexing="ij")
        oy, ox = torch.meshgrid(torch.arange(tiles_y, device=dev, dtype=dt) * ts,
                                torch.arange(tiles_x, device=dev, dtype=dt) * ts, indexing="ij")
        pix_x = (ox.reshape(-1, 1) + px.reshape(1, -1) + 0.5)[:, None, :]  # (T, 1, P)
        pix_y = (oy.reshape(-1, 1) + py.reshape(1, -1) + 0.5)[:, None, :]
        g_mu, g_con = mu[table], conic[table]  # (T, K, 2), (T, K, 3)
        dx = pix_x - g_mu[..., 0:1]
        dy = pix_y - g_mu[..., 1:2]
        sigma = 0.5 * (g_con[..., 0:1] * dx * dx + g_con[..., 2:3] * dy * dy) + g_con[..., 1:2] * dx * dy
        alpha = torch.clamp_max(opac[table][..., None] * torch.exp(-sigma), self.alpha_max)
        alpha = alpha * (alpha >= self.alpha_min)
        # front to back: T_i = prod_{j<i} (1 - alpha_j); stop before T would fall to t_min
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha[:, :-1]], 1), dim=1)
        weights = trans * alpha * ((trans * (1.0 - alpha)) > self.t_min)
        g_rgb = rgb[table]  # (T, K, 3); per channel: far faster than a bmm with 3 columns on CPU
        tiles = torch.stack([(weights * g_rgb[..., i:i + 1]).sum(1) for i in range(3)], -1)  # (T, P, 3)
        acc = weights.sum(1)  # (T, P)
        if background is not None:
            tiles = tiles + (1.0 - acc)[..., None] * background
        image = tiles.reshape(tiles_y, tiles_x, ts, ts, 3).permute(0, 2, 1, 3, 4).reshape(tiles_y * ts, tiles_x * ts, 3)
        acc = acc.reshape(tiles_y, tiles_x, ts, ts).permute(0, 2, 1, 3).reshape(tiles_y * ts, tiles_x * ts)
        return RenderOutput(image[:H, :W], acc[:H, :W], means2d, radii)

    @staticmethod
    def _tile_table(mu: torch.Tensor, rx: torch.Tensor, ry: torch.Tensor, ts: int, tiles_x: int,
                    tiles_y: int) -> torch.Tensor:
        """(tiles, K) indices of the depth-sorted Gaussians touching each tile, in depth order,
        padded with M (the dummy row) to the busiest tile's count K."""
        M, dev = mu.shape[0], mu.device
        x0 = torch.clamp(torch.floor((mu[:, 0] - rx) / ts), 0, tiles_x - 1).long()
        x1 = torch.clamp(torch.floor((mu[:, 0] + rx) / ts), 0, tiles_x - 1).long()
        y0 = torch.clamp(torch.floor((mu[:, 1] - ry) / ts), 0, tiles_y - 1).long()
        y1 = torch.clamp(torch.floor((mu[:, 1] + ry) / ts), 0, tiles_y - 1).long()
        nx, ny = x1 - x0 + 1, y1 - y0 + 1
        counts = nx * ny
        gid = torch.repeat_interleave(torch.arange(M, device=dev), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        off = torch.arange(gid.shape[0], device=dev) - first
        tile = (y0[gid] + off // nx[gid]) * tiles_x + x0[gid] + off % nx[gid]
        tile, order = torch.sort(tile, stable=True)  # stable: depth order within each tile
        gid = gid[order]
        per_tile = torch.bincount(tile, minlength=tiles_x * tiles_y)
        k = torch.arange(tile.shape[0], device=dev) - (torch.cumsum(per_tile, 0) - per_tile)[tile]
        table = torch.full((tiles_x * tiles_y, max(int(per_tile.max()) if M else 0, 1)), M, device=dev,
                           dtype=torch.long)
        table[tile, k] = gid
        return table


# --- gsplat ------------------------------------------------------------------------------------


class GsplatUnavailable(RuntimeError):
    """gsplat cannot run here (not installed, no CUDA, or its CUDA build failed)."""


def build_tag() -> str:
    """What a CUDA extension build is tied to: Python, torch and CUDA versions (``py311-torch2.13.0-cu130``).

    torch keys its default build directory by Python and CUDA only when ``TORCH_EXTENSIONS_DIR`` is
    unset (``torch.utils.cpp_extension._get_build_directory``), and its versioner hashes sources and
    flags only; a cache shared across images or a torch upgrade needs this key of its own."""
    cuda = (torch.version.cuda or "cpu").replace(".", "")
    return f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}-cu{cuda}"


def _shared_subdir(parent: Path, name: str) -> Path:
    """``parent/name``, shared as ``parent`` is: the lab group's (setgid) or, without a group, like /tmp."""
    path = parent / name
    path.mkdir(exist_ok=True)
    if path.stat().st_uid == os.geteuid():
        mode = parent.stat().st_mode
        if mode & 0o1000 and mode & 0o002:
            path.chmod(0o1777)
        elif mode & 0o2000:
            path.chmod(0o2775)
    return path


def _cache_build_dir(base: Path) -> Path:
    """The build directory under a det_lab cache: one per :func:`build_tag`; in a cache without a lab
    group (world-writable, sticky) one per user too, since one user's build directory and lock file
    are not another's to write."""
    base.mkdir(parents=True, exist_ok=True)
    path = _shared_subdir(base, build_tag())
    mode = base.stat().st_mode
    if mode & 0o1000 and mode & 0o002:
        path = path / f"uid-{os.geteuid()}"
        path.mkdir(exist_ok=True)
    return path


def gsplat_extensions_dir() -> Path:
    """Where gsplat's JIT CUDA build is cached: the first writable of ``$TORCH_EXTENSIONS_DIR`` (as
    the task image sets it, where a build may be baked in), else the build's own directory
    (:func:`build_tag`) under ``$DET_LAB_LOCAL_CACHE/torch_extensions``,
    ``/var/cache/det-lab/torch_extensions`` or ``~/.cache/det-lab/torch_extensions``.

    Local disk on purpose: builds on an NFS home are slow and contend for gsplat's lock file. On a
    cluster ``$DET_LAB_LOCAL_CACHE`` is the agent's own, mounted into every task (the master config
    det_lab renders), so the build outlives the trial's container. A directory the task's user may
    not write is passed over with a warning: a rebuild costs minutes, a PermissionError the trial."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    caches = [Path(os.environ["DET_LAB_LOCAL_CACHE"]) / "torch_extensions"] if os.environ.get("DET_LAB_LOCAL_CACHE") else []
    caches += [Path("/var/cache/det-lab/torch_extensions"), Path.home() / ".cache" / "det-lab" / "torch_extensions"]
    if env:
        try:
            Path(env).mkdir(parents=True, exist_ok=True)
            if os.access(env, os.W_OK):
                return Path(env)
        except OSError:
            pass
    for base in caches:
        try:
            path = _cache_build_dir(base)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            if env:
                logging.getLogger("3dgs").warning(
                    "TORCH_EXTENSIONS_DIR=%s is not writable here; gsplat builds in %s instead (rebuilt "
                    "by every trial unless it is on a mounted path)", env, path)
            return path
    return caches[-1] / build_tag()


def gsplat_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("gsplat") is not None


def _import_gsplat():
    if not torch.cuda.is_available():
        raise GsplatUnavailable("the gsplat backend needs a CUDA GPU and this torch sees none "
                                f"(torch {torch.__version__}); use backend: torch for CPU runs")
    if not gsplat_importable():
        raise GsplatUnavailable("the gsplat backend needs the gsplat package (pip install gsplat==1.5.3, "
                                "or a prebuilt wheel: see the template README); use backend: torch for CPU runs")
    cache = gsplat_extensions_dir()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache))  # read by torch.utils.cpp_extension at build
    try:
        import gsplat
    except (ImportError, OSError, RuntimeError) as exc:
        raise GsplatUnavailable(f"gsplat failed to import or build its CUDA code (cache {cache}): {exc}") from exc
    return gsplat


class GsplatRasterizer:
    """``gsplat.rasterization`` (CUDA), unpacked so ``means2d`` has one row per Gaussian, as
    densification needs. Importing and the first call may compile CUDA code for
    minutes; later runs on the same machine reuse the cache from :func:`gsplat_extensions_dir`."""

    name = "gsplat"

    def __init__(self, device: torch.device | str = "cuda", rasterize_mode: str = "classic") -> None:
        self.gsplat = _import_gsplat()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise GsplatUnavailable(f"the gsplat backend renders on CUDA, not on {self.device}")
        self.rasterize_mode = rasterize_mode

    def render(self, means: torch.Tensor, quats: torch.Tensor, scales: torch.Tensor,
               opacities: torch.Tensor, colors: torch.Tensor, camera: Camera,
               background: torch.Tensor | None = None, sh_degree: int | None = None) -> RenderOutput:
        """See :class:`Rasterizer`."""
        render, alpha, meta = self.gsplat.rasterization(
            means, quats, scales, opacities, colors,
            viewmats=camera.viewmat[None].float(), Ks=camera.K[None].float(),
            width=camera.width, height=camera.height, sh_degree=sh_degree,
            backgrounds=None if background is None else background[None],
            packed=False, rasterize_mode=self.rasterize_mode, eps2d=EPS2D,
        )
        means2d = meta["means2d"]
        if means2d.requires_grad:
            means2d.retain_grad()
        radii = meta["radii"]
        if radii.dim() == 3:  # gsplat >= 1.5 returns (C, N, 2) per-axis radii
            radii = radii.max(dim=-1).values
        radii = radii.reshape(-1).float()
        return RenderOutput(render[0], alpha[0, ..., 0], means2d, radii.detach())


def benchmark_agreement(a: RenderOutput, b: RenderOutput) -> dict[str, float]:
    """Max and mean absolute difference of two renders of the same scene (README's tolerance)."""
    diff = (a.image.detach().float().cpu() - b.image.detach().float().cpu()).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "psnr": float(-10 * math.log10(max(float((diff**2).mean()), 1e-20)))}
