"""3D Gaussian Splatting template: COLMAP reader, CPU rasterizer, end-to-end local runs."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import yaml

from det_lab.data.demo import make_3dgs_demo
from det_lab.scenes import ColmapError, load_scene, read_model
from tests import expconf
from tests.conftest import VENV_BIN, Lab

TEMPLATE = Path(__file__).resolve().parents[1] / "experiment_templates" / "gaussian_splatting"


def _template_module(name: str) -> ModuleType:
    """Import a template module (rasterizer, gaussians, metrics) under a unique name."""
    key = f"gaussian_splatting_{name}"
    if key in sys.modules:
        return sys.modules[key]
    sys.path.insert(0, str(TEMPLATE))  # the template's modules import each other by plain name
    try:
        spec = importlib.util.spec_from_file_location(key, TEMPLATE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TEMPLATE))
    return module


R = _template_module("rasterizer")
M = _template_module("metrics")


# --- COLMAP reader -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {fmt: make_3dgs_demo(tmp_path_factory.mktemp(fmt) / "scene", n_views=4, fmt=fmt)  # type: ignore[arg-type]
            for fmt in ("text", "binary")}


def _copy(scenes: dict[str, Path], fmt: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(scenes[fmt], tmp_path / fmt))


def test_text_and_binary_models_are_the_same(scenes: dict[str, Path]) -> None:
    text, binary = read_model(scenes["text"] / "sparse/0"), read_model(scenes["binary"] / "sparse/0")
    assert (text.format, binary.format) == ("text", "binary")
    assert text.cameras == binary.cameras
    assert text.cameras[1].model == "PINHOLE" and text.cameras[1].K[0, 0] == 64.0
    assert text.images.keys() == binary.images.keys() == {1, 2, 3, 4}
    for iid, a in text.images.items():
        b = binary.images[iid]
        assert (a.name, a.camera_id) == (b.name, b.camera_id)
        for field in ("qvec", "tvec", "xys", "point3d_ids"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_allclose(a.R @ a.R.T, np.eye(3), atol=1e-12)
    pa, pb = text.points3d, binary.points3d
    assert len(pa) == len(pb) == 200
    for field in ("ids", "xyz", "rgb", "errors"):
        np.testing.assert_array_equal(getattr(pa, field), getattr(pb, field))
    assert all(np.array_equal(x, y) for x, y in zip(pa.tracks, pb.tracks))
    # the keypoints are the points' projections (plus the generator's 0.3 px noise)
    sa, sb = load_scene(scenes["text"]), load_scene(scenes["binary"])
    index = {int(p): k for k, p in enumerate(pa.ids)}
    for view, im in zip(sa.views, sorted(text.images.values(), key=lambda i: i.name)):
        cam = pa.xyz[[index[int(p)] for p in im.point3d_ids]] @ view.R.T + view.t
        uv = cam @ view.K.T
        assert np.abs(uv[:, :2] / uv[:, 2:] - im.xys).max() < 2.0
    for va, vb in zip(sa.views, sb.views):
        assert va.name == vb.name and va.image.shape == (64, 64, 3) and va.image.dtype == np.float32
        np.testing.assert_array_equal(va.image, vb.image)
        np.testing.assert_array_equal(va.viewmat, vb.viewmat)


def test_other_camera_models_give_pinhole_intrinsics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cams = [(1, "SIMPLE_PINHOLE", 0, [50.0, 32.0, 24.0]), (2, "SIMPLE_RADIAL", 2, [60.0, 31.5, 23.5, 0.01]),
            (3, "OPENCV", 4, [70.0, 71.0, 30.0, 20.0, 0.1, -0.02, 0.001, 0.002])]
    for fmt in ("text", "binary"):
        sparse = tmp_path / fmt
        sparse.mkdir()
        if fmt == "text":
            (sparse / "cameras.txt").write_text("# comment\n" + "".join(
                f"{cid} {name} 64 48 {' '.join(map(repr, p))}\n" for cid, name, _, p in cams))
            (sparse / "images.txt").write_text("1 1 0 0 0 0 0 4 3 a.png\n\n")
            (sparse / "points3D.txt").write_text("")
        else:
            blob = struct.pack("<Q", len(cams)) + b"".join(
                struct.pack(f"<iiQQ{len(p)}d", cid, mid, 64, 48, *p) for cid, _, mid, p in cams)
            (sparse / "cameras.bin").write_bytes(blob)
            (sparse / "images.bin").write_bytes(struct.pack("<Q", 1) + struct.pack("<i7di", 1, 1, 0, 0, 0, 0, 0, 4, 3)
                                                 + b"a.png\x00" + struct.pack("<Q", 0))
            (sparse / "points3D.bin").write_bytes(struct.pack("<Q", 0))
        with caplog.at_level("WARNING", logger="det_lab.scenes"):
            model = read_model(sparse)
        assert model.format == fmt
        np.testing.assert_array_equal(model.cameras[1].K, [[50, 0, 32], [0, 50, 24], [0, 0, 1]])
        np.testing.assert_array_equal(model.cameras[2].K, [[60, 0, 31.5], [0, 60, 23.5], [0, 0, 1]])
        np.testing.assert_array_equal(model.cameras[3].K, [[70, 0, 30], [0, 71, 20], [0, 0, 1]])
        assert model.cameras[3].distortion == {"k1": 0.1, "k2": -0.02, "p1": 0.001, "p2": 0.002}
        assert model.images[1].xys.shape == (0, 2) and len(model.points3d) == 0
        assert "distortion" in caplog.text and "ignored" in caplog.text
        caplog.clear()


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


BROKEN = {
    # name: (format, breaks the scene, file named in the message, words in the message)
    "missing file": ("binary", lambda s: (s / "sparse/0/points3D.bin").unlink(), "points3D.bin", "missing"),
    "truncated binary": ("binary", lambda s: _truncate(s / "sparse/0/images.bin", 500), "images.bin", "truncated"),
    "truncated count": ("binary", lambda s: _truncate(s / "sparse/0/cameras.bin", 5), "cameras.bin", "truncated"),
    "trailing bytes": ("binary", lambda s: (s / "sparse/0/cameras.bin").write_bytes(
        (s / "sparse/0/cameras.bin").read_bytes() + b"\x00\x01"), "cameras.bin", "unexpected"),
    "bad line": ("text", lambda s: _edit(s / "sparse/0/cameras.txt", "1 PINHOLE 64 64", "1 PINHOLE 64 sixty"),
                 "cameras.txt", "line 4"),
    "wrong parameter count": ("text", lambda s: _edit(s / "sparse/0/cameras.txt", "1 PINHOLE 64 64 64.0 ",
                                                      "1 PINHOLE 64 64 "), "cameras.txt", "takes 4 parameters"),
    "unknown camera model": ("text", lambda s: _edit(s / "sparse/0/cameras.txt", "PINHOLE", "PINHOLIO"),
                             "cameras.txt", "unknown camera model"),
    "odd points2D": ("text", lambda s: _edit(s / "sparse/0/images.txt", " 1 view_000.png\n", " 1 view_000.png\n1.0 "),
                     "images.txt", "triples"),
    "unknown camera": ("text", lambda s: _edit(s / "sparse/0/images.txt", " 1 view_002.png", " 7 view_002.png"),
                       "images.txt", "unknown camera 7"),
    "image file missing": ("text", lambda s: (s / "images/view_001.png").unlink(), "view_001.png", "missing"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_model_gives_one_clear_line(case: str, scenes: dict[str, Path], tmp_path: Path) -> None:
    fmt, breaker, file, words = BROKEN[case]
    scene = _copy(scenes, fmt, tmp_path)
    breaker(scene)
    with pytest.raises(ColmapError) as info:
        load_scene(scene)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message and file in message and words in message, message


# --- CPU rasterizer against analytic cases ------------------------------------------------------


def _camera(f: float = 20.0, size: int = 17, dtype=torch.float64) -> R.Camera:
    K = torch.tensor([[f, 0, size / 2], [0, f, size / 2], [0, 0, 1]], dtype=dtype)
    return R.Camera(torch.eye(4, dtype=dtype), K, size, size)


def _one(mean, sigma: float, opacity: float, color=(1.0, 1.0, 1.0)):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return (t([mean]), t([[1.0, 0, 0, 0]]), t([[sigma] * 3]), t([opacity]), t([list(color)]))


@pytest.mark.parametrize(("tile_size", "alpha_min"), [(None, 0.0), (4, R.ALPHA_MIN)])
def test_single_gaussian_footprint(tile_size: int | None, alpha_min: float) -> None:
    """An isotropic Gaussian (std s) at depth d renders a blob centred at its projection, peak
    alpha = opacity, 2D covariance s² J Jᵀ + 0.3 px² (on the axis: std sqrt((f s/d)² + 0.3))."""
    f, d, s, o, size = 20.0, 4.0, 0.3, 0.8, 33
    cam = _camera(f, size)
    rast = R.TorchRasterizer(tile_size=tile_size, alpha_min=alpha_min)
    ys, xs = np.mgrid[0:size, 0:size] + 0.5
    for x, y in ((0.0, 0.0), (0.4, -0.2)):
        out = rast.render(*_one([x, y, d], s, o), cam)
        u, v = f * x / d + size / 2, f * y / d + size / 2
        J = np.array([[f / d, 0, -f * x / d**2], [0, f / d, -f * y / d**2]])
        cov = s**2 * J @ J.T + R.EPS2D * np.eye(2)
        dx, dy = xs - u, ys - v
        inv = np.linalg.inv(cov)
        expected = o * np.exp(-0.5 * (inv[0, 0] * dx**2 + 2 * inv[0, 1] * dx * dy + inv[1, 1] * dy**2))
        expected[expected < alpha_min] = 0
        alpha = out.alpha.numpy()
        np.testing.assert_allclose(alpha, expected, atol=1e-12)
        np.testing.assert_allclose(out.image.numpy(), alpha[..., None] * np.ones(3), atol=1e-12)
        w = alpha / alpha.sum()
        assert (w * xs).sum() == pytest.approx(u, abs=1e-3) and (w * ys).sum() == pytest.approx(v, abs=1e-3)
        assert out.means2d[0].tolist() == pytest.approx([u, v])
        if x == 0:
            std = math.sqrt((f * s / d) ** 2 + R.EPS2D)
            assert alpha.max() == pytest.approx(o)  # the centre pixel (16, 16) sits on the mean
            if alpha_min == 0:
                assert math.sqrt((w * dx**2).sum()) == pytest.approx(std, rel=1e-3)
            assert out.radii[0] == math.ceil(min(3.33, math.sqrt(2 * math.log(o / max(alpha_min, 1e-12)))) * std)


def test_front_to_back_compositing_and_culling() -> None:
    cam = _camera(20.0, 9)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # listed back first, and one behind the camera: the renderer sorts by depth and culls
    means, quats = t([[0, 0, 6.0], [0, 0, 3.0], [0, 0, -2.0]]), t([[1.0, 0, 0, 0]] * 3)
    scales, opac = t([[1.0] * 3] * 3), t([0.6, 0.5, 0.9])
    colors, bg = t([[0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0]]), t([0.2, 0.2, 0.2])
    out = R.TorchRasterizer(tile_size=None).render(means, quats, scales, opac, colors, cam, background=bg)
    # at the centre pixel, on both means: front red (alpha 0.5) over blue (0.6) over the background
    expected = np.array([0.5, 0.0, 0.5 * 0.6]) + 0.5 * 0.4 * 0.2
    np.testing.assert_allclose(out.image[4, 4].numpy(), expected, atol=1e-12)
    assert out.alpha[4, 4].item() == pytest.approx(1 - 0.5 * 0.4)
    assert out.radii[2] == 0 and out.radii[0] > 0 and out.radii[1] > 0


def test_tiled_equals_dense_on_a_random_scene() -> None:
    g = torch.Generator().manual_seed(0)
    n = 60
    params = [torch.randn(n, 3, generator=g) * 0.5 + torch.tensor([0, 0, 4.0]), torch.randn(n, 4, generator=g),
              torch.rand(n, 3, generator=g) * 0.1 + 0.02, torch.rand(n, generator=g), torch.rand(n, 3, generator=g)]
    cam = _camera(30.0, 40, torch.float32)

    def run(tile_size):
        leaves = [p.clone().requires_grad_() for p in params]
        out = R.TorchRasterizer(tile_size=tile_size).render(*leaves, cam)
        (out.image * torch.linspace(0, 1, 3)).sum().backward()
        return out.image.detach(), [p.grad for p in leaves]

    dense, dense_grads = run(None)
    for ts in (8, 16, 64):
        image, grads = run(ts)
        torch.testing.assert_close(image, dense, atol=1e-5, rtol=0)
        for a, b in zip(grads, dense_grads):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_gradients_match_finite_differences_and_analytic_values() -> None:
    cam = _camera(6.0, 6)
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=True)  # noqa: E731
    rast = R.TorchRasterizer(tile_size=None, alpha_min=0.0, t_min=0.0)
    means, quats = t([[0.05, -0.1, 3.0], [-0.2, 0.1, 4.0]]), t([[0.9, 0.1, 0.2, -0.1], [1.0, 0.0, 0.3, 0.0]])
    scales, opac, colors = t([[0.4, 0.3, 0.5], [0.6, 0.5, 0.4]]), t([0.4, 0.7]), t([[0.9, 0.2, 0.1], [0.1, 0.5, 0.8]])
    bg = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)

    def f(*args):
        return rast.render(*args, cam, background=bg).image

    assert torch.autograd.gradcheck(f, (means, quats, scales, opac, colors), eps=1e-6, atol=1e-6)
    # analytic, one Gaussian on the axis: I(p) = o g(p) c + (1 - o g(p)) bg, g = exp(-|p - uv|² / 2 var)
    f0, d, s, o, c, b = 6.0, 3.0, 0.4, 0.5, 0.9, 0.1
    m, op = t([[0.0, 0.0, d]]), t([o])
    out = rast.render(m, torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64), torch.full((1, 3), s, dtype=torch.float64),
                      op, torch.full((1, 3), c, dtype=torch.float64), cam, background=bg)
    px, py, u, v = 4.5, 2.5, 3.0, 3.0  # pixel (row 2, col 4); the mean projects to the centre
    var = (f0 * s / d) ** 2 + R.EPS2D
    g = math.exp(-((px - u) ** 2 + (py - v) ** 2) / (2 * var))
    out.image[2, 4, 0].backward()
    dI_du = (c - b) * o * g * (px - u) / var  # the covariance is flat in x at x = 0
    assert op.grad.item() == pytest.approx((c - b) * g, rel=1e-9)
    assert out.means2d.grad[0, 0].item() == pytest.approx(dI_du, rel=1e-9)
    assert m.grad[0, 0].item() == pytest.approx(dI_du * f0 / d, rel=1e-9)
    assert m.grad[0, 1].item() == pytest.approx((c - b) * o * g * (py - v) / var * f0 / d, rel=1e-9)


def test_gsplat_backend_fails_clearly_without_cuda() -> None:
    if torch.cuda.is_available() and R.gsplat_importable():
        pytest.skip("gsplat and CUDA are here: the backend is usable")
    with pytest.raises(R.GsplatUnavailable, match="backend: torch"):
        R.make_rasterizer("gsplat", torch.device("cpu"))
    assert isinstance(R.make_rasterizer("auto", torch.device("cpu")), R.TorchRasterizer)


def test_ssim_and_psnr() -> None:
    g = torch.Generator().manual_seed(0)
    img = torch.rand(32, 32, 3, generator=g)
    assert M.ssim(img, img).item() == pytest.approx(1.0)
    assert M.ssim(img, (img + 0.2 * torch.randn(32, 32, 3, generator=g)).clamp(0, 1)).item() < 0.9
    assert M.psnr(img, (img + 0.1).clamp(0, 1)) == pytest.approx(20.0, abs=0.6)
    assert M.lpips_metric(torch.device("cpu")) is None or importlib.util.find_spec("lpips")


def test_densify_prune_and_state_round_trip() -> None:
    G = _template_module("gaussians")
    xyz = torch.randn(50, 3, generator=torch.Generator().manual_seed(1))
    model = G.GaussianModel.from_points(xyz, torch.rand(50, 3), 1, G.LearningRates(), extent=4.0)
    model.active_sh_degree = 1
    cam = R.Camera(torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 5], [0, 0, 0, 1]]),
                   torch.tensor([[32.0, 0, 16], [0, 32, 16], [0, 0, 1]]), 32, 32)
    out = R.TorchRasterizer().render(model.means, model.quats, model.scales, model.opacities, model.sh, cam,
                                     sh_degree=1)
    out.image.sum().backward()
    model.update_stats(out, 32, 32)
    model.optimizer.step()
    with torch.no_grad():
        model.params["opacity_logits"][:5] = -10.0  # below the pruning opacity
    changed = model.densify_and_prune(G.Densify(grad_threshold=0.0, max_gaussians=80), prune_big=False)
    assert changed["pruned"] >= 5 and changed["cloned"] + changed["split"] == 80 - (50 - changed["pruned"])
    assert len(model) == 80
    for group in model.optimizer.param_groups:
        p = group["params"][0]
        assert p.shape[0] == 80 and model.optimizer.state[p]["exp_avg"].shape == p.shape
    restored = G.GaussianModel.from_state(model.state_dict(), G.LearningRates(), torch.device("cpu"))
    assert len(restored) == 80 and restored.active_sh_degree == 1
    torch.testing.assert_close(restored.means, model.means)


def _ssim_2d_window(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Inria's SSIM: a full 11x11 Gaussian window, five separate convolutions."""
    x, y = a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None]
    t = torch.arange(11, dtype=a.dtype) - 5
    g = torch.exp(-(t**2) / (2 * 1.5**2))
    g = g / g.sum()
    w = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)
    conv = lambda v: torch.nn.functional.conv2d(v, w, padding=5, groups=3)  # noqa: E731
    mu_x, mu_y = conv(x), conv(y)
    var_x, var_y, cov = conv(x * x) - mu_x**2, conv(y * y) - mu_y**2, conv(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    return (((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))).mean()


def test_separable_ssim_equals_the_full_window_and_its_gradient() -> None:
    g = torch.Generator().manual_seed(5)
    a = torch.rand(37, 29, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = (a.detach() + 0.1 * torch.randn(37, 29, 3, generator=g, dtype=torch.float64)).clamp(0, 1)
    fast, ref = M.ssim(a, b), _ssim_2d_window(a, b)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    (g_fast,), (g_ref,) = torch.autograd.grad(fast, a), torch.autograd.grad(ref, a)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-8, atol=1e-12)


def _scene(n: int = 60, seed: int = 1):
    G = _template_module("gaussians")
    g = torch.Generator().manual_seed(seed)
    model = G.GaussianModel.from_points(torch.randn(n, 3, generator=g), torch.rand(n, 3, generator=g), 1,
                                        G.LearningRates(), extent=4.0)
    cam = R.Camera(torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 5], [0, 0, 0, 1]]),
                   torch.tensor([[32.0, 0, 16], [0, 32, 16], [0, 0, 1]]), 32, 32)
    return G, model, cam


def test_densification_statistics_without_indexing_match_the_indexed_ones() -> None:
    G, model, cam = _scene()
    with torch.no_grad():
        model.params["means"][:10, 2] = -20.0  # behind the camera: not drawn
    model.max_radii[:] = torch.rand(len(model)) * 3  # some history the update must keep
    grad2d, count, max_radii = model.grad2d.clone(), model.count.clone(), model.max_radii.clone()
    out = R.TorchRasterizer().render(model.means, model.quats, model.scales, model.opacities, model.sh, cam, sh_degree=0)
    out.image.sum().backward()
    model.update_stats(out, 32, 32)
    drawn = out.radii > 0
    assert 0 < int(drawn.sum()) < len(model)
    ndc = out.means2d.grad * torch.tensor([16.0, 16.0])  # the pre-change update: boolean indexing
    grad2d[drawn] += ndc[drawn].norm(dim=-1)
    count[drawn] += 1
    max_radii[drawn] = torch.maximum(max_radii[drawn], out.radii[drawn])
    torch.testing.assert_close(model.grad2d, grad2d)
    torch.testing.assert_close(model.count, count)
    torch.testing.assert_close(model.max_radii, max_radii)


def test_mcmc_relocation_keeps_what_the_copies_render() -> None:
    MC = _template_module("mcmc")
    g = torch.Generator().manual_seed(2)
    o, s = 0.02 + 0.95 * torch.rand(200, generator=g), torch.rand(200, 3, generator=g)
    n = torch.randint(1, 30, (200,), generator=g)
    new_o, new_s = MC.relocation(o, s, n)
    # n copies at opacity o' are as opaque as the original: 1 - (1 - o')^n = o
    torch.testing.assert_close(1 - (1 - new_o.double()) ** n, o.double(), rtol=1e-5, atol=1e-6)
    assert (new_s <= s + 1e-6).all() and (new_o <= o).all()
    one_o, one_s = MC.relocation(o, s, torch.ones(200, dtype=torch.long))  # one copy: unchanged
    torch.testing.assert_close(one_o, o)
    torch.testing.assert_close(one_s, s)
    # n = 2 in closed form (Eq. 9): s' = s * o / (2 o' - o'^2 / sqrt 2)
    o2, s2 = MC.relocation(o, s, torch.full((200,), 2))
    torch.testing.assert_close(s2, s * (o / (2 * o2 - o2**2 / math.sqrt(2)))[:, None], rtol=1e-5, atol=1e-6)


def test_mcmc_relocates_dead_gaussians_and_grows_to_the_cap() -> None:
    G, model, cam = _scene(n=50)
    MC = _template_module("mcmc")
    with torch.no_grad():
        model.params["opacity_logits"][:8] = -10.0  # dead
    out = R.TorchRasterizer().render(model.means, model.quats, model.scales, model.opacities, model.sh, cam, sh_degree=0)
    out.image.sum().backward()
    model.optimizer.step()
    cfg = MC.MCMC(cap_max=55)
    gen = torch.Generator().manual_seed(0)
    assert MC.relocate_dead(model, cfg, gen) == 8
    assert len(model) == 50 and (model.opacities > cfg.min_opacity).all()
    moved = model.means[:8]
    assert all((model.means[8:] == m).all(-1).any() for m in moved)  # each dead one now sits on a live one
    state = model.optimizer.state[model.params["means"]]
    copied_from = [int(torch.nonzero((model.means[8:] == m).all(-1))[0]) + 8 for m in moved]
    assert (state["exp_avg"][copied_from] == 0).all()  # the sources' moments are forgotten
    assert MC.add_new(model, cfg, gen) == 2  # 5 % of 50, rounded down, within the cap
    assert MC.add_new(model, cfg, gen) == 2 and MC.add_new(model, cfg, gen) == 1 and len(model) == 55
    assert MC.add_new(model, cfg, gen) == 0
    for group in model.optimizer.param_groups:
        assert group["params"][0].shape[0] == 55


@pytest.mark.parametrize("strategy", ["default", "mcmc"])
def test_train_step_learns_with_either_strategy(strategy: str) -> None:
    G, model, cam = _scene(n=80, seed=3)
    S, MC = _template_module("step"), _template_module("mcmc")
    target = R.TorchRasterizer().render(*(t.detach() for t in (model.means + 0.05, model.quats, model.scales,
                                                               model.opacities)), torch.rand(80, 3), cam).image
    schedule = G.Schedule(iterations=40, densify_from=10, densify_until=30, densify_every=10,
                          opacity_reset_every=1000, sh_degree_every=1000)
    step = S.TrainStep(model, R.TorchRasterizer(), schedule, densify=G.Densify(max_gaussians=120),
                       strategy=strategy, mcmc=MC.MCMC(cap_max=100))
    losses = [float(step(i, cam, target, torch.zeros(3))) for i in range(1, 41)]
    assert losses[-1] < 0.7 * losses[0]
    assert len(model) <= (100 if strategy == "mcmc" else 120) and len(model) != 80
    with pytest.raises(ValueError, match="strategy must be one of"):
        S.TrainStep(model, R.TorchRasterizer(), schedule, densify=G.Densify(), strategy="clone-everything")


# --- end to end -----------------------------------------------------------------------------------


def _config(tmp: Path, name: str, iterations: int, **hparams) -> Path:
    conf = yaml.safe_load((TEMPLATE / "const.yaml").read_text())
    conf["name"] = name
    conf["data"]["det_lab"]["max_length"] = {"batches": iterations}
    conf["data"]["det_lab"]["reporting_batches"] = 10
    conf["hyperparameters"].update(hparams)
    conf["hyperparameters"]["densify"]["max_gaussians"] = 500
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def _runs(lab: Lab) -> set[Path]:
    return set((lab.root / "outputs/3dgs/local-runs").glob("gaussian_splatting-*"))


def test_local_run_preempts_resumes_with_the_same_gaussians_and_learns(demo_lab, shared_mlflow_server,
                                                                     tmp_path: Path) -> None:
    """One run end to end: Ctrl-C after its first checkpoint, ``--resume`` to the end; validations,
    renders, checkpoints (the final one with a PLY) and MLflow across both processes."""
    from mlflow.tracking import MlflowClient

    lab, total = demo_lab, 120
    cfg = _config(tmp_path, "e2e", total, validate_every=40, checkpoint_every=20, densify_from=20,
                  densify_until=100, densify_every=20, opacity_reset_every=1000, sh_degree_every=60)
    before = _runs(lab)
    proc = subprocess.Popen([str(VENV_BIN / "det-lab"), "run", "3dgs", "--local", "--exp-config", str(cfg)],
                            env=lab.env, cwd=lab.config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
            new = _runs(lab) - before
            if new:
                run_dir = next(iter(new))
                if json.loads((run_dir / "run.json").read_text()).get("latest_checkpoint"):
                    break
        assert run_dir is not None and proc.poll() is None, "no checkpoint while the run was going"
        proc.send_signal(signal.SIGINT)  # Ctrl-C: det-lab asks the trial to checkpoint and stop
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state = json.loads((run_dir / "run.json").read_text())
    stop = state["latest_checkpoint_step"]
    assert 20 <= stop < total, out
    assert "preempted at step" in (run_dir / "train.log").read_text()
    ckpt = lab.root / "checkpoints/3dgs" / state["latest_checkpoint"]
    count = json.loads((ckpt / "gaussians.json").read_text())["num_gaussians"]
    saved = torch.load(ckpt / "gaussians.pt", weights_only=False)
    assert saved["step"] == stop and saved["model"]["params"]["means"].shape[0] == count
    seen = len((run_dir / "metrics.jsonl").read_text().splitlines())

    resumed = lab.cli("run", "3dgs", "--local", "--resume")
    log = (run_dir / "train.log").read_text()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + log[-3000:]
    assert f"resumed from checkpoint {state['latest_checkpoint']} at step {stop} with {count} Gaussians" in log
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [x["step"] for x in lines[seen:] if x["group"] == "training"]
    assert after and min(after) > stop and max(after) == total  # continued, not restarted

    val = [x for x in lines if x["group"] == "validation"]
    assert [x["step"] for x in val] == [40, 80, 120]
    first, last = val[0]["metrics"], val[-1]["metrics"]
    assert last["psnr"] > first["psnr"] + 2.0 and last["psnr"] > 25, val
    assert 0 < last["ssim"] <= 1 and last["num_gaussians"] > 0 and "lpips" not in last
    train = [x["metrics"] for x in lines if x["group"] == "training"]
    assert {"loss", "num_gaussians", "iter_ms", "its_per_s", "peak_rss_mb"} <= train[-1].keys()
    assert "LPIPS unavailable" in log
    # renders of both held-out views at every validation, on disk and in MLflow
    for step in (40, 80, 120):
        for view in ("view_000", "view_008"):
            png = run_dir / "renders" / f"step_{step:08d}" / f"{view}.png"
            assert png.is_file() and png.stat().st_size > 0
    summary = json.loads((run_dir / "tracking-summary.json").read_text())
    (backend,) = summary["backends"]
    assert backend["pending"] == 0
    client = MlflowClient(shared_mlflow_server.uri)
    steps = [a.path for a in client.list_artifacts(backend["run_id"], "renders/view_008")]
    assert steps == [f"renders/view_008/step_{s:08d}" for s in (40, 80, 120)], steps
    assert client.list_artifacts(backend["run_id"], steps[-1])[0].path.endswith(".png")
    history = sorted((m.step, m.value) for m in client.get_metric_history(backend["run_id"], "validation/psnr"))
    assert [s for s, _ in history] == [40, 80, 120]
    # checkpoints on the volume: every 20 iterations and at the Ctrl-C; the final one with a PLY
    final_state = json.loads((run_dir / "run.json").read_text())
    assert final_state["latest_checkpoint_step"] == total and final_state["resumed"] == 1
    made = final_state["checkpoints"] + final_state.get("checkpoints_deleted", [])  # kept, or deleted by retention
    assert sorted(c["step"] for c in made) == sorted({*range(20, total + 1, 20), stop})
    final = lab.root / "checkpoints/3dgs" / final_state["latest_checkpoint"]
    assert (final / "gaussians.pt").is_file() and (final / "point_cloud.ply").is_file()
    meta = json.loads((final / "gaussians.json").read_text())
    assert meta["num_gaussians"] == last["num_gaussians"] and meta["steps_completed"] == total


def test_template_configs_pass_validate_expconf() -> None:
    configs = sorted(TEMPLATE.glob("*.yaml"))
    assert {p.name for p in configs} >= {"const.yaml", "search.yaml", "gpu.yaml"}
    expconf.assert_valid(configs)
