"""A real local trial records that it still reads its snapshot at each checkpoint, so
``det-lab data gc`` does not take a snapshot from under a trial that trains for longer than ``--days``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from det_lab.data.lastuse import last_use_file
from det_lab.settings import load_settings
from det_lab.volume import VolumeLayout, init_volume
from tests.conftest import publish_tiny_data

TINY = Path(__file__).parent / "fixtures" / "tiny"


def test_each_checkpoint_records_the_snapshot_use(lab, tmp_path):
    lab.write_config(tracking={"backend": "none"})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp_path)
    trial = tmp_path / "tiny"
    shutil.copytree(TINY, trial)
    conf = yaml.safe_load((trial / "const.yaml").read_text())
    conf["hyperparameters"]["sleep_per_batch"] = 0.05  # 2 s from the pull to the first checkpoint
    (trial / "const.yaml").write_text(yaml.safe_dump(conf))
    proc = lab.cli("run", str(trial), "--local", "--run", "long")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = VolumeLayout(settings.data_root)
    (snap,) = [p for p in layout.snapshots("vla").iterdir() if not p.name.startswith(".")]
    first = min((p / "metadata.json").stat().st_mtime for p in layout.project_checkpoints("vla").iterdir())
    used = os.stat(last_use_file(layout, "vla", snap.name)).st_mtime
    assert used >= first  # touched at a checkpoint, after the pull at the trial's start
