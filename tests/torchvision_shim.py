"""Lets PyPI's torchvision import beside the CPU torch of the test machines (test set-up only).

PyPI's torchvision wheel is built against the CUDA torch: beside the local CPU build of torch its
C++ ops library (``torchvision/_C.so``) does not load, so its ops are never registered, and
``torchvision/_meta_registrations.py`` then fails at import (``operator torchvision::nms does not
exist``). Declaring the 13 op schemas that module registers fake kernels for, on a
``torch.library.Library("torchvision", "DEF")``, before the first ``import torchvision``, lets
the real package import; resnet18's forward and ``transforms.v2`` (what LeRobot's ACT and
Diffusion use) are plain PyTorch. torchvision's own C++ ops (nms, roi_align, ...) stay unavailable.

On a machine with a matching torch/torchvision pair the library loads and this does nothing.
det_lab itself never imports this module.

    import tests.torchvision_shim; tests.torchvision_shim.install()   # in a test, before LeRobot
    python tests/torchvision_shim.py train.py ARGS...                  # a trial process: shim, then run
    image_pth_line()   # a .pth line for a test's task image: every process declares them at its
                       # first ``import torchvision`` (what a lab's image, with a matching pair, needs not)
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import runpy
import sys
from pathlib import Path
from typing import Any

#: the schemas of the ops torchvision/_meta_registrations.py registers (torchvision 0.28, csrc/ops/*.cpp)
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_library: Any = None  # the Library object must outlive the definitions it holds


def needed() -> bool:
    """Whether torchvision's ops library fails to load here (and torchvision is not yet imported)."""
    if "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch  # noqa: F401  (torchvision's _C.so resolves torch's symbols from the loaded libraries)

    try:
        ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "_C.so"))
    except OSError:
        return True
    return False


def install() -> bool:
    """Declare the torchvision op schemas where its library does not load; True if it did so.

    Idempotent: a schema already declared (by an earlier call, or by another helper that declared
    ``nms``/``qnms`` itself) is left as it is."""
    global _library
    if not needed():
        return False
    import torch

    if _library is None:
        _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        name = schema.partition("(")[0]
        try:
            getattr(torch.ops.torchvision, name)
            continue
        except (AttributeError, RuntimeError):
            pass
        _library.define(schema)
    return True


class _InstallFirst(importlib.abc.MetaPathFinder):
    """Declares the schemas when ``torchvision`` is first imported, then steps aside (finds nothing)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            install()
        return None


def install_on_import() -> None:
    """:func:`install` at the process's first ``import torchvision`` (nothing is imported before)."""
    if not any(isinstance(f, _InstallFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallFirst())


def image_pth_line() -> str:
    """A ``.pth`` line (site-packages runs lines that start with ``import``) that loads this file by
    its path and calls :func:`install_on_import`: a test image's packages get it, no ``tests`` import."""
    # kept in sys.modules: the Library holding the definitions must live as long as the process
    return (f"import importlib.util as _u, sys; _s = _u.spec_from_file_location('det_lab_torchvision_shim', "
            f"{str(Path(__file__).resolve())!r}); _m = sys.modules.setdefault(_s.name, _u.module_from_spec(_s)); "
            "_s.loader.exec_module(_m); _m.install_on_import()\n")


def _main(argv: list[str]) -> None:
    """``python torchvision_shim.py SCRIPT ARGS...``: install, then run SCRIPT as ``__main__``."""
    if not argv:
        raise SystemExit("usage: python torchvision_shim.py SCRIPT [ARGS...]")
    install()
    script = Path(argv[0]).resolve()
    sys.argv = [str(script), *argv[1:]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1:])
