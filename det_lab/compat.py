"""Narrow shields against Determined 0.38.1's bitrot on a current Python stack.

Determined is frozen at 0.38.1 (the open-source project was defunded). Each shim here is the
smallest change that keeps one documented upstream behaviour working; nothing in the installed
``determined`` package is edited.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

DETERMINED_VERSION = "0.38.1"


def _pkg_resources_stub() -> types.ModuleType:
    """A stand-in for ``pkg_resources``.

    ``determined.deploy`` imports it at module level, but only its AWS and GCP deploy paths call
    it; ``det deploy local`` never does. det_lab pins a setuptools that still ships the real
    module, so the stub only matters where that pin was overridden.
    """
    stub = types.ModuleType("pkg_resources")

    def __getattr__(name: str):
        raise RuntimeError(
            f"pkg_resources.{name} is unavailable (setuptools >= 82 removed it); "
            "det deploy aws/gcp need 'pip install \"setuptools<81\"'"
        )

    stub.__getattr__ = __getattr__  # type: ignore[attr-defined]
    stub.__det_lab_stub__ = True  # type: ignore[attr-defined]
    return stub


def ensure_pkg_resources() -> bool:
    """Make ``import pkg_resources`` succeed. Returns True when the real module is there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pkg_resources  # noqa: F401
            return True
        except ImportError:
            sys.modules["pkg_resources"] = _pkg_resources_stub()
            return False


def import_deploy() -> types.ModuleType:
    """Import Determined's ``det deploy local`` implementation, shielded from bitrot."""
    ensure_pkg_resources()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # google-api-core's Python-version notice
        return importlib.import_module("determined.deploy.local.cluster_utils")
