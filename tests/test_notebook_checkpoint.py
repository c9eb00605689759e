"""The notebooks' best checkpoint of a cluster experiment on shared_fs storage is read in place
on the volume, not copied: Determined's own ``Checkpoint`` (the real class, its ``download`` as
shipped: ``harness/determined/common/experimental/checkpoint/_checkpoint.py`` l.278-283 copies a
shared_fs tree with ``shutil.copytree``) is what the SDK stub returns; only the master is absent."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from det_lab import notebook as nb

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "experiment_templates" / "vla"


def _real_checkpoint(uuid: str, storage: dict):
    from determined.common.experimental.checkpoint._checkpoint import CheckpointState, CheckpointTrainingMetadata
    from determined.experimental import Checkpoint

    ckpt = Checkpoint(session=None, uuid=uuid)  # type: ignore[arg-type]  # no master: download is direct
    ckpt.metadata, ckpt.state = {"steps_completed": 80}, CheckpointState.COMPLETED  # as the master lists it
    ckpt.training = CheckpointTrainingMetadata(
        experiment_config={"checkpoint_storage": storage}, experiment_id=3, trial_id=7, hparams={},
        validation_metrics={"avgMetrics": {"val_action_l1": 0.1}})
    return ckpt


def _submit(tmp_path, monkeypatch, ckpt):
    from determined.experimental import client

    from det_lab.settings import LabSettings

    trial = SimpleNamespace(id=7, hparams={"lr": 0.002}, iter_metrics=lambda group: [])
    exp = SimpleNamespace(id=3, wait=lambda interval: SimpleNamespace(name="COMPLETED"),
                          top_checkpoint=lambda: ckpt, list_trials=lambda: [trial])
    monkeypatch.setattr(client, "login", lambda master=None, **kw: None)
    monkeypatch.setattr(client, "create_experiment", lambda config, model_dir=None, template=None, **kw: exp)
    monkeypatch.setenv(nb.OUT_ENV, str(tmp_path / "out"))
    conf = yaml.safe_load((TEMPLATE / "const.yaml").read_text())
    settings = LabSettings(data_root=tmp_path / "data", master_url="http://master:8080")
    return nb.best_checkpoint(nb.submit("vla", conf, settings=settings, mode="cluster"))


def _write_checkpoint(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text('{"steps_completed": 80}')
    (directory / "state_dict.pth").write_bytes(b"\x00" * 4096)


def test_a_shared_fs_checkpoint_is_read_in_place_on_the_volume(tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    on_volume = root / "checkpoints" / "vla" / "ckpt-1"
    _write_checkpoint(on_volume)
    ckpt = _real_checkpoint("ckpt-1", {"type": "shared_fs", "host_path": str(root),
                                       "storage_path": "checkpoints/vla"})
    best = _submit(tmp_path, monkeypatch, ckpt)
    assert best.path == on_volume and best.step == 80 and best.metrics == {"val_action_l1": 0.1}
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing copied
    assert "(read in place on the shared volume)" in capsys.readouterr().out


def test_a_checkpoint_not_on_a_mounted_volume_is_downloaded(tmp_path, monkeypatch):
    """Only a shared_fs checkpoint whose directory is here is read in place; anything else goes
    through Determined's own download (here a ``directory`` storage, copied by it)."""
    elsewhere = tmp_path / "elsewhere"
    _write_checkpoint(elsewhere / "checkpoints" / "ckpt-2")
    ckpt = _real_checkpoint("ckpt-2", {"type": "shared_fs", "host_path": str(elsewhere),
                                       "storage_path": "checkpoints"})
    from det_lab.notebook.submit import shared_fs_dir

    assert shared_fs_dir(ckpt) == elsewhere / "checkpoints" / "ckpt-2"
    # a storage_path that leaves host_path (Determined refuses it) is not followed outside
    (elsewhere / "other" / "ckpt-2").mkdir(parents=True)
    outside = _real_checkpoint("ckpt-2", {"type": "shared_fs", "host_path": str(elsewhere / "checkpoints"),
                                          "storage_path": "../other"})
    assert shared_fs_dir(outside) is None
    gone = _real_checkpoint("ckpt-3", {"type": "shared_fs", "host_path": str(elsewhere), "storage_path": "checkpoints"})
    assert shared_fs_dir(gone) is None
    s3 = _real_checkpoint("ckpt-2", {"type": "s3", "bucket": "b"})
    assert shared_fs_dir(s3) is None
    # copied by Determined's own download when it is not on the volume here: a directory of its own
    moved = _real_checkpoint("ckpt-2", {"type": "directory", "container_path": str(elsewhere / "checkpoints")})
    best = _submit(tmp_path, monkeypatch, moved)
    assert best.path == tmp_path / "out" / "checkpoints" / "ckpt-2"
    assert (best.path / "state_dict.pth").read_bytes() == b"\x00" * 4096
