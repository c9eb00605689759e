"""Determined 0.38.1's bitrot: `det deploy` must work after `pip install det-lab`."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import VENV_BIN


def test_det_deploy_local_help_runs():
    proc = subprocess.run([str(VENV_BIN / "det"), "deploy", "local", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cluster-up" in proc.stdout and "master-up" in proc.stdout
    assert "pkg_resources" not in proc.stderr  # neither the crash nor setuptools' removal warning


def test_deploy_imports_even_without_pkg_resources():
    """Where a newer setuptools was forced in, det_lab's own deploy import still works."""
    code = (
        "import sys; sys.modules['pkg_resources'] = None\n"  # makes 'import pkg_resources' fail
        "import importlib\n"
        "try:\n"
        "    importlib.import_module('determined.deploy.local.cluster_utils')\n"
        "    raise SystemExit('upstream import unexpectedly worked')\n"
        "except ImportError:\n"
        "    pass\n"
        "del sys.modules['pkg_resources']\n"
        "import builtins; real = builtins.__import__\n"
        "def no_pkg(name, *a, **k):\n"
        "    if name == 'pkg_resources' and 'pkg_resources' not in sys.modules: raise ImportError(name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = no_pkg\n"
        "from det_lab.compat import import_deploy\n"
        "cu = import_deploy()\n"
        "assert hasattr(cu, 'master_up') and hasattr(cu, 'agent_up')\n"
        "import pkg_resources\n"
        "try:\n"
        "    pkg_resources.parse_version('1')\n"
        "except RuntimeError as e:\n"
        "    assert 'setuptools' in str(e); print('stubbed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stubbed"
