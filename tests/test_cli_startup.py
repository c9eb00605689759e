"""`det-lab --help` (and any command's --help) starts without loading the training, tracking or
data stacks: those cost seconds of imports on every invocation, and a user asking for help or
mistyping a flag should not pay them. Figures: bench/cli_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

#: libraries (top-level packages) a det-lab command imports only when it needs them (not pydantic:
#: typer itself imports it to convert any command's option values)
HEAVY = {"torch", "determined", "mlflow", "aim", "dvc", "optuna", "pandas", "numpy"}
VENV_BIN = Path(sys.executable).parent


def _imported_packages(stderr: str) -> set[str]:
    """Top-level packages named by ``-X importtime`` lines ('import time: self | cumulative | name')."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_det_lab_help_imports_no_heavy_library(tmp_path):
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Usage: det-lab" in proc.stdout and "data" in proc.stdout
    imported = _imported_packages(proc.stderr)
    assert "typer" in imported  # the importtime report was read (the check below is not vacuous)
    assert imported & HEAVY == set(), f"det-lab --help imports {sorted(imported & HEAVY)}"


def test_every_commands_help_imports_no_heavy_library(tmp_path):
    # one process walks every command's --help (as `det-lab <cmd> --help` does) and then lists
    # what it loaded; a command whose options need a heavy import would show here
    script = textwrap.dedent("""
        import json, sys
        import typer.main
        from typer.testing import CliRunner
        from det_lab.cli.app import app

        def walk(cmd, path=()):
            yield path
            for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
                yield from walk(sub, (*path, name))

        paths = list(walk(typer.main.get_command(app)))
        failed = [p for p in paths if CliRunner().invoke(app, [*p, "--help"]).exit_code != 0]
        print(json.dumps({"paths": [" ".join(p) for p in paths], "failed": failed,
                          "modules": sorted({m.split(".")[0] for m in sys.modules})}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert {"run", "data list", "data pull", "cluster up", "slurm search", "runs list", "tracking serve"} <= set(out["paths"])
    assert out["failed"] == []
    heavy = set(out["modules"]) & HEAVY
    assert heavy == set(), f"--help of some det-lab command imports {sorted(heavy)}"
