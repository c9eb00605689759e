"""Datasets that are not DVC-tracked: a directory read in place (hashed once, cached), and
``det-lab data import DIR NAME`` that versions it with real git + DVC on the volume."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from typer.testing import CliRunner

from det_lab import data
from det_lab.cli.app import app
from det_lab.data import DataError
from det_lab.data.directory import DirectorySpec, content_hash
from det_lab.data.importer import import_directory
from det_lab.data.publish import dataset_repo
from det_lab.settings import load_settings
from det_lab.volume import VolumeLayout, init_volume


@pytest.fixture
def volume(lab):
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    return settings


def _team_dataset(root: Path) -> Path:
    """A directory as another tool leaves it: a pandas-written parquet table and PNG frames."""
    rng = np.random.default_rng(0)
    (root / "meta").mkdir(parents=True)
    pd.DataFrame({"task_index": [0, 1], "task": ["pick", "place"]}).to_parquet(root / "meta" / "tasks.parquet")
    for cam in ("cam0", "cam1"):
        (root / "images" / cam).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / "images" / cam / f"{i:04d}.png")
    return root


def _tree_md5(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_import_versions_a_directory_that_then_pulls_like_any_dataset(lab, volume) -> None:
    src = _team_dataset(lab.root / "teams" / "garden")
    proc = lab.cli("data", "import", str(src), "garden", "--project", "3dgs")
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout and "data.det_lab.dataset: garden" in proc.stdout

    pulled = data.pull("garden", volume)
    assert _tree_md5(pulled.path) == _tree_md5(src)
    assert pulled.identity.nfiles == 7
    # a trial that read the directory in place records the same DVC hash as one that pulls the import
    in_place = data.pull(DirectorySpec("3dgs", "teams/garden"), volume)
    assert in_place.path == src.resolve() and in_place.identity.md5 == pulled.identity.md5

    # a second import of the same name is refused unless it is meant as a new revision
    (src / "meta" / "tasks.parquet").unlink()
    pd.DataFrame({"task_index": [0], "task": ["stack"]}).to_parquet(src / "meta" / "tasks.parquet")
    # (the same command in process: the installed script's start-up was shown above)
    again = CliRunner().invoke(app, ["data", "import", str(src), "garden", "--project", "3dgs"], env=lab.env)
    assert again.exit_code != 0 and again.stderr.startswith("error: dataset 'garden' is already registered")
    assert data.pull("garden", volume).identity.commit == pulled.identity.commit
    replaced = CliRunner().invoke(app, ["data", "import", str(src), "garden", "--project", "3dgs", "--replace"],
                                  env=lab.env)
    assert replaced.exit_code == 0, replaced.stderr
    new = data.pull("garden", volume)
    assert new.identity.commit != pulled.identity.commit
    assert pd.read_parquet(new.path / "meta" / "tasks.parquet")["task"].tolist() == ["stack"]


def test_import_refuses_bad_input_before_creating_anything(lab, volume) -> None:
    src = _team_dataset(lab.root / "src")
    (lab.root / "empty" / "sub").mkdir(parents=True)
    proc = lab.cli("data", "import", str(lab.root / "missing"), "x", "--project", "3dgs")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0] == f"error: {lab.root / 'missing'}: no such directory"
    for args, expected in [((lab.root / "empty", "x", "3dgs"), "holds no files"),
                           ((src, "bad/name", "3dgs"), "dataset name 'bad/name' may only hold"),
                           ((src, "x", "nope"), "nope")]:
        with pytest.raises((DataError, ValueError), match=expected):  # ValueError: the unknown project
            import_directory(volume, *args)
    assert not dataset_repo(volume, "3dgs", "x").exists() and not dataset_repo(volume, "3dgs", "bad/name").exists()
    assert data.load_registry(volume) == {}


def test_directory_hash_is_dvc_s_and_computed_once(lab, volume) -> None:
    src = _team_dataset(lab.root / "teams" / "d")
    first = data.pull(DirectorySpec("vla", str(src)), volume)  # absolute paths work too
    md5, size, nfiles = content_hash(src)
    assert first.identity.md5 == md5 and md5.endswith(".dir")
    assert (first.identity.size, first.identity.nfiles) == (size, nfiles) == (sum(
        p.stat().st_size for p in src.rglob("*") if p.is_file()), 7)
    assert first.identity.as_tags()["dataset.md5"] == md5
    caches = list((VolumeLayout.from_settings(volume).state / "directory-hashes").glob("*.json"))
    assert len(caches) == 1

    # the cache is trusted while size and mtime hold: rewriting a file's bytes behind an
    # unchanged size and mtime is not noticed (that is what makes later runs stat-only) ...
    frame = src / "images" / "cam0" / "0000.png"
    st = frame.stat()
    blob = bytearray(frame.read_bytes())
    blob[-20] ^= 0xFF
    frame.write_bytes(bytes(blob))
    os.utime(frame, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.pull(DirectorySpec("vla", str(src)), volume).identity.md5 == md5
    # ... while any edit that changes the mtime (every normal write) gives a new identity
    os.utime(frame, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = data.pull(DirectorySpec("vla", str(src)), volume).identity.md5
    assert changed != md5 and changed == content_hash(src)[0]


def test_directory_must_be_on_the_volume_and_exist(lab, volume, tmp_path: Path) -> None:
    outside = _team_dataset(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="is not on the volume"):
        data.pull(DirectorySpec("vla", str(outside)), volume)
    with pytest.raises(DataError, match="no such directory"):
        data.pull(DirectorySpec("vla", "teams/missing"), volume)
    with pytest.raises(DataError, match="is not on the volume"):
        data.pull(DirectorySpec("vla", "../elsewhere"), volume)


def test_experiment_config_names_a_directory(lab, volume) -> None:
    """``data.det_lab.dataset: {dir: ...}``: preflight checks it, the trial reads it in place."""
    import yaml

    from det_lab.runs.expconf import lab_section
    from det_lab.runs.validate import PreflightError, preflight

    src = _team_dataset(lab.root / "teams" / "garden")
    template = Path(__file__).resolve().parents[1] / "experiment_templates" / "gaussian_splatting" / "const.yaml"
    conf = yaml.safe_load(template.read_text())
    conf["data"]["det_lab"]["dataset"] = {"dir": "teams/garden"}
    preflight(conf, volume)
    spec = lab_section(conf).dataset_spec(lambda name: data.lookup(volume, name))
    pulled = data.pull(spec, volume)  # what the trial's session does with the spec
    assert pulled.path == src.resolve() and pulled.identity.md5 == content_hash(src)[0]

    conf["data"]["det_lab"]["dataset"] = {"dir": "teams/typo"}
    with pytest.raises(PreflightError, match=r"data\.det_lab\.dataset: .*teams/typo: no such directory"):
        preflight(conf, volume)
