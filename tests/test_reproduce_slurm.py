"""A run of the tiny trial made by the test Slurm cluster, reproduced here with det-lab reproduce
--local (in the Slurm group of test files: it shares their session's cluster and volume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.slurm_cluster import TINY, SlurmCluster, make_slurm_lab, slurm_cluster, slurm_volume  # noqa: F401
from tests.test_reproduce import git, ok


def test_a_slurm_run_reproduced_locally_and_on_slurm(tmp_path, slurm_cluster: SlurmCluster, slurm_volume: Path):
    lab = make_slurm_lab(tmp_path, None, slurm_cluster, slurm_volume)
    repo = tmp_path / "code"
    shutil.copytree(TINY, repo / "trial", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "--quiet", "--initial-branch=main")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "tiny trial")
    out = ok(lab.cli("run", str(repo / "trial"), "--slurm", "--wait"))
    name, job_id = out.split()[1].rstrip(":"), out.split()[4]
    slurm_dir = lab.root / "outputs" / "vla" / "slurm-runs" / name
    lineage = json.loads((slurm_dir / "run.json").read_text())["lineage"]
    assert lineage["scheduler"] == "slurm" and str(lineage["slurm_job_id"]) == job_id

    out = ok(lab.cli("reproduce", name, "--local", "--run", f"{name}-here"))
    assert f"reproducing {name} (found by run) as run {name}-here" in out and "verdict: reproduced exactly" in out
    here = lab.root / "outputs" / "vla" / "local-runs" / f"{name}-here"
    assert (here / "metrics.jsonl").read_text() == (slurm_dir / "metrics.jsonl").read_text()

    diff = json.loads(ok(lab.cli("runs", "diff", name, f"{name}-here", "--json")))
    assert [(d["section"], d["field"], d["a"], d["b"]) for d in diff["differences"]] == \
        [("scheduler", "scheduler", "slurm", "local")]
    assert diff["ids"]["a"]["slurm_job_id"] == lineage["slurm_job_id"] and "slurm_job_id" not in diff["ids"]["b"]

    out = ok(lab.cli("reproduce", name, "--slurm", "--run", f"{name}-again"))
    assert "Slurm job" in out and "verdict: reproduced exactly" in out
    again = lab.root / "outputs" / "vla" / "slurm-runs" / f"{name}-again"
    assert (again / "metrics.jsonl").read_text() == (slurm_dir / "metrics.jsonl").read_text()
    assert json.loads((again / "run.json").read_text())["reproduces"]["run"] == name
