"""Off-cluster ``torchrun`` (a Slurm job of several GPUs): every process knows its rank."""

from __future__ import annotations

import json
import subprocess
import sys

from det_lab.settings import load_settings
from det_lab.tracking.mlflow_server import free_port
from det_lab.volume import init_volume

SCRIPT = """
import json
import det_lab.core
conf = {"name": "dist", "entrypoint": "python3 loop.py",
        "searcher": {"name": "single", "metric": "loss", "max_length": 1},
        "data": {"det_lab": {"project": "vla", "max_length": {"batches": 1}}}}
with det_lab.core.init(exp_conf=conf) as ctx:
    d = ctx.distributed
    print("RESULT " + json.dumps({"rank": d.rank, "size": d.size, "ranks": d.allgather(d.rank),
                                  "mirror": type(ctx.mirror).__name__}), flush=True)
"""


def test_torchrun_processes_get_their_own_ranks(lab, tmp_path):
    lab.write_config(tracking={"backend": "none"})
    init_volume(load_settings(lab.config, env={}))  # `det-lab init` itself: tests/test_volume_init.py
    (tmp_path / "loop.py").write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "loop.py"],
        cwd=tmp_path, env=lab.env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # the two ranks share the pipe: one's line may land in the middle of the other's
    decoder = json.JSONDecoder()
    results = sorted((decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["ranks"] == [0, 1] for r in results)
    assert results[1]["mirror"] == "NullMirror"  # only the chief mirrors
