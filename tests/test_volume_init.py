"""`det-lab init`: the shared layout, group-shared permissions, idempotent on a populated volume."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from det_lab.settings import load_settings
from det_lab.volume import QuotaExceeded, VolumeLayout, check_quota, disk_usage, init_volume
from tests.test_bad_inputs import cli as cli_in_process  # det-lab in process: the installed script runs above


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root -> sha256 of its content."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def test_init_fresh_root_creates_shared_layout(lab):
    proc = lab.cli("init", check=True)
    assert "nothing overwritten" in proc.stdout
    layout = VolumeLayout(lab.root)
    for project in ("vla", "3dgs", "isaac"):
        for d in (layout.datasets(project), layout.dvc_cache(project), layout.outputs(project),
                  layout.project_checkpoints(project), layout.snapshots(project)):
            assert d.is_dir(), d
            mode = stat.S_IMODE(d.stat().st_mode)
            assert mode & stat.S_ISGID and mode & stat.S_IWGRP, f"{d} mode {mode:o}"
    assert layout.marker.is_file()


def test_a_directory_another_host_makes_meanwhile_is_taken_as_there(lab, monkeypatch):
    """Two machines initialising one fresh volume at once (or a test bed making its mount point): a
    layout directory another host creates just before this one's mkdir is kept as existing, not
    refused as "exists and is not a directory" (the check and the mkdir were two steps)."""
    settings = load_settings(lab.config, env={})
    raced = VolumeLayout(lab.root).outputs("vla")
    real_mkdir = Path.mkdir

    def other_host_first(self: Path, *args, **kwargs):
        if self == raced and not raced.exists():
            real_mkdir(self)  # the other host's, between this one's look and its mkdir
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", other_host_first)
    report = init_volume(settings)
    assert raced in report.existing and raced not in report.created
    assert all(d.is_dir() for d in VolumeLayout(lab.root).directories(sorted(settings.projects)))


def test_init_respects_umask_for_group_sharing(lab):
    old = os.umask(0o077)
    try:
        init_volume(load_settings(lab.config, env={}))
    finally:
        os.umask(old)
    mode = stat.S_IMODE((lab.root / "checkpoints").stat().st_mode)
    assert mode == 0o2775


def test_init_on_populated_root_loses_nothing(lab):
    init_volume(load_settings(lab.config, env={}))
    layout = VolumeLayout(lab.root)
    # a team has been working: data, checkpoints, a tightened dir, an unrelated folder
    (layout.datasets("vla") / "files" / "md5" / "ab").mkdir(parents=True)
    (layout.datasets("vla") / "files" / "md5" / "ab" / "cdef").write_bytes(os.urandom(4096))
    ckpt = layout.checkpoints / "0b7f-uuid"
    ckpt.mkdir()
    (ckpt / "state_dict.pth").write_bytes(os.urandom(1000))
    (lab.root / "someone-elses-stuff").mkdir()
    (lab.root / "someone-elses-stuff" / "notes.txt").write_text("keep me")
    marker_before = layout.marker.read_text()
    os.chmod(layout.outputs("isaac"), 0o700)
    before = tree_digest(lab.root)

    # a new project in the config appears on re-run
    lab.write_config(projects={"grasping": {"quota": "1GiB"}})
    proc = lab.cli("init", check=True)

    assert tree_digest(lab.root) == before  # every file byte-identical, none added
    assert layout.marker.read_text() == marker_before
    assert layout.datasets("grasping").is_dir()
    assert stat.S_IMODE(layout.outputs("isaac").stat().st_mode) & 0o2070 == 0o2070
    assert "created" in proc.stdout and "0 already there" not in proc.stdout


def test_init_refuses_a_file_where_a_directory_belongs(lab):
    lab.root.mkdir()
    (lab.root / "checkpoints").write_text("not a dir")
    proc = cli_in_process(lab, "init")
    assert proc.returncode == 2
    assert "checkpoints exists and is not a directory" in proc.stderr
    assert (lab.root / "checkpoints").read_text() == "not a dir"


def test_init_with_unknown_group_is_a_clear_error(lab):
    lab.write_config(group="no-such-group-xyz")
    proc = cli_in_process(lab, "init")
    assert proc.returncode == 2 and "no-such-group-xyz" in proc.stderr and "Traceback" not in proc.stderr


def test_disk_usage_counts_hardlinks_once_and_ignores_symlinks(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").symlink_to(tmp_path / "a")
    single = disk_usage(tmp_path)
    assert 100_000 <= single < 200_000


def test_quota_check_refuses_before_writing(lab):
    lab.write_config(projects={"vla": {"quota": "64KiB"}})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    (VolumeLayout(lab.root).outputs("vla") / "blob").write_bytes(os.urandom(40_000))
    assert check_quota(settings, "vla", incoming=1000) > 0
    with pytest.raises(QuotaExceeded, match=r"project 'vla' would use .* of its 64\.0 KiB quota"):
        check_quota(settings, "vla", incoming=40_000)
