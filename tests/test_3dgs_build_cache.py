"""Where gsplat's JIT CUDA build is kept (``rasterizer.gsplat_extensions_dir``): the audit of main
806f3ee found a build baked into the image hidden by the agent's cache mount (B1), one build
directory shared across torch versions (R6), and, without a lab group, one user's build directory
blocking the next user's lock file (R7). Path logic only: no CUDA is needed to see where a build goes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TEMPLATE = Path(__file__).resolve().parents[1] / "experiment_templates" / "gaussian_splatting"


@pytest.fixture
def rasterizer(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("_rasterizer_build_cache", TEMPLATE / "rasterizer.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return module


def _agent_cache(tmp_path: Path, mode: int) -> Path:
    """An agent's task cache as 'cluster agent-up' makes it (det_lab.cluster.render.prepare_local_cache)."""
    cache = tmp_path / "agent-cache"
    (cache / "torch_extensions").mkdir(parents=True)
    for d in (cache, cache / "torch_extensions"):
        d.chmod(mode)
    return cache


def test_a_build_for_another_torch_goes_to_another_directory(rasterizer, monkeypatch, tmp_path):
    """R6: with TORCH_EXTENSIONS_DIR set, torch builds straight into <dir>/gsplat_cuda (its
    _get_build_directory adds py/cu only when the variable is unset), so det_lab keys its own."""
    monkeypatch.setenv("DET_LAB_LOCAL_CACHE", str(_agent_cache(tmp_path, 0o2775)))
    here = rasterizer.gsplat_extensions_dir()
    assert here.parent == tmp_path / "agent-cache" / "torch_extensions"
    assert f"torch{torch.__version__.split('+')[0]}" in here.name
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu999")
    assert rasterizer.gsplat_extensions_dir() != here


def test_without_a_lab_group_each_user_builds_in_a_directory_of_their_own(rasterizer, monkeypatch, tmp_path):
    """R7: the cache is 1777 without a group; a build directory made by one user (0755, theirs) would
    refuse the next user's gsplat lock file, and GsplatUnavailable would end that trial."""
    monkeypatch.setenv("DET_LAB_LOCAL_CACHE", str(_agent_cache(tmp_path, 0o1777)))
    path = rasterizer.gsplat_extensions_dir()
    assert path.name == f"uid-{os.geteuid()}"
    assert path.parent.stat().st_mode & 0o7777 == 0o1777  # the next user can make theirs beside it


def test_with_a_lab_group_the_members_share_one_build(rasterizer, monkeypatch, tmp_path):
    monkeypatch.setenv("DET_LAB_LOCAL_CACHE", str(_agent_cache(tmp_path, 0o2775)))
    path = rasterizer.gsplat_extensions_dir()
    assert path.name == rasterizer.build_tag() and path.stat().st_mode & 0o7777 == 0o2775


def test_a_build_baked_into_the_image_outside_the_agent_cache_is_used(rasterizer, monkeypatch, tmp_path):
    """B1: the README bakes the build under the image's own TORCH_EXTENSIONS_DIR, outside
    tasks.local_cache (which the master bind-mounts over anything the image has there)."""
    baked = tmp_path / "opt" / "det-lab" / "torch_extensions"
    baked.mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(baked))
    monkeypatch.setenv("DET_LAB_LOCAL_CACHE", str(_agent_cache(tmp_path, 0o2775)))
    assert rasterizer.gsplat_extensions_dir() == baked
    readme = (TEMPLATE / "README.md").read_text()
    assert "ENV TORCH_EXTENSIONS_DIR=/opt/det-lab/torch_extensions" in readme
    assert "ENV TORCH_EXTENSIONS_DIR=/var/cache/det-lab" not in readme
