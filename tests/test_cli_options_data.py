"""`det-lab data list/status/verify --json` against the real git + DVC repositories they read,
and the dry runs of `data verify --repair` and `data import`: they say what would change, change
nothing, and the real command then does what they said."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from det_lab import data
from det_lab.data.git import git
from det_lab.data.publish import dataset_repo
from det_lab.data.registry import registry_file
from det_lab.volume import VolumeLayout, disk_usage
from tests.test_bad_inputs import cli
from tests.test_data_pull import _object, _toy, toy, tree_md5  # noqa: F401  (fixtures)
from tests.test_data_import import _team_dataset


def _json(lab, *args: str) -> dict:
    proc = cli(lab, *args, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def _volume_digest(root: Path) -> dict[str, tuple[int, str]]:
    """Every file on the volume: its mode and md5 (a dry run must leave each as it was)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = (p.stat().st_mode, hashlib.md5(p.read_bytes()).hexdigest())
    return out


def test_status_and_list_json_name_what_the_real_repository_and_volume_hold(toy):
    lab, volume = toy.lab, toy.settings
    head = git("rev-parse", "main", cwd=Path(toy.spec.repo)).strip()
    st = _json(lab, "data", "status", "toy")
    assert st["name"] == "toy" and st["identity"]["commit"] == head and st["identity"]["repo"] == toy.spec.repo
    assert st["identity"]["nfiles"] == len(toy.expected) == st["total_files"] and st["snapshot"] is None
    pulled = data.pull("toy", volume)
    st = _json(lab, "data", "status", "toy")
    assert st["snapshot"] == str(pulled.path.parent) and st["cached_files"] == len(toy.expected)
    assert st["identity"]["md5"] == pulled.identity.md5

    listed = _json(lab, "data", "list")
    layout = VolumeLayout(volume.data_root)
    vla = {p["project"]: p for p in listed["projects"]}["vla"]
    assert vla["registered"]["toy"]["repo"] == toy.spec.repo
    assert vla["cache_bytes"] == disk_usage(layout.dvc_cache("vla")) > 0
    assert vla["remote_bytes"] == disk_usage(layout.datasets("vla"))
    assert vla["quota_bytes"] == int(volume.projects["vla"].quota)
    assert [(s["commit"], s["nfiles"]) for s in vla["snapshots"]] == [(head, len(toy.expected))]
    # the table shows the same figures
    assert f"data/toy@{head[:10]}: {len(toy.expected)}" in cli(lab, "data", "list").stdout


def test_verify_repair_dry_run_names_what_the_repair_then_restores_and_deletes(toy):
    lab, volume, expected = toy.lab, toy.settings, toy.expected
    snap = data.pull("toy", volume).path
    victim = snap / "part2" / "f00002.bin"
    st = victim.stat()
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(st.st_size))
    os.chmod(victim, 0o444)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    # a cache object no snapshot links (its snapshot file was replaced by a copy, as an editor does)
    other = snap / "part3" / "f00003.bin"
    obj = _object(volume, expected["part3/f00003.bin"])
    os.chmod(other.parent, 0o755)
    body = other.read_bytes()
    other.unlink()
    other.write_bytes(body)
    os.chmod(other, 0o444)
    os.chmod(obj, 0o644)
    obj.write_bytes(b"bit rot")
    os.chmod(obj, 0o444)

    before = _volume_digest(lab.root)
    plan = _json(lab, "data", "verify", "--repair", "--dry-run")
    assert plan["to_restore"] == [str(victim)] and plan["to_delete"] == [str(obj)] and plan["repaired"] == []
    text = cli(lab, "data", "verify", "--repair", "--dry-run")
    assert text.returncode == 0 and f"would restore {victim}" in text.stdout and f"would delete  {obj}" in text.stdout
    assert _volume_digest(lab.root) == before  # nothing changed

    done = _json(lab, "data", "verify", "--repair")
    assert sorted(done["repaired"]) == sorted(plan["to_restore"] + plan["to_delete"]) and done["ok"]
    assert not obj.exists() and tree_md5(snap) == expected
    after = _json(lab, "data", "verify")
    assert after["damaged"] == [] and after["to_restore"] == after["to_delete"] == []


def test_import_dry_run_says_what_it_writes_and_replaces_and_writes_nothing(lab):
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    settings = load_settings(lab.config, env={})
    init_volume(settings)
    src = _team_dataset(lab.root / "teams" / "garden")
    repo = dataset_repo(settings, "3dgs", "garden")
    before = _volume_digest(lab.root)
    plan = _json(lab, "data", "import", str(src), "garden", "--project", "3dgs", "--dry-run")
    assert plan["new_repository"] and plan["replaces"] is None and plan["files"] == 7
    assert plan["bytes"] == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert plan["registers"] == {"project": "3dgs", "repo": str(repo), "path": "data/garden", "rev": "main"}
    assert _volume_digest(lab.root) == before and not repo.exists() and data.load_registry(settings) == {}

    proc = cli(lab, "data", "import", str(src), "garden", "--project", "3dgs", "--json")
    assert proc.returncode == 0, proc.stderr
    done = json.loads(proc.stdout)
    assert done["registered"] == plan["registers"] and done["identity"]["nfiles"] == plan["files"]
    assert data.load_registry(settings)["garden"].repo == plan["registers"]["repo"]
    first = git("rev-parse", "main", cwd=repo).strip()
    n_commits = git("rev-list", "--count", "main", cwd=repo).strip()

    # a registration made by hand elsewhere: --replace --dry-run names it as what goes
    subprocess.run(["cp", "-a", str(repo), str(lab.root / "hand.git")], check=True)
    data.register("garden", data.DatasetSpec("3dgs", str(lab.root / "hand.git"), "data/garden", "main"), settings,
                  replace=True)
    (src / "extra.txt").write_text("more\n")
    before = _volume_digest(lab.root)
    plan = _json(lab, "data", "import", str(src), "garden", "--project", "3dgs", "--replace", "--dry-run")
    assert not plan["new_repository"] and plan["replaces"]["repo"] == str(lab.root / "hand.git")
    assert plan["files"] == 8
    text = cli(lab, "data", "import", str(src), "garden", "--project", "3dgs", "--replace", "--dry-run").stdout
    assert f"would replace the registration of garden ({lab.root / 'hand.git'}" in text
    assert _volume_digest(lab.root) == before
    assert git("rev-parse", "main", cwd=repo).strip() == first

    assert cli(lab, "data", "import", str(src), "garden", "--project", "3dgs", "--replace").returncode == 0
    assert data.load_registry(settings)["garden"].repo == str(repo)  # what the plan said replaces the hand one
    assert int(git("rev-list", "--count", "main", cwd=repo).strip()) == int(n_commits) + 1
    # refused input is refused by the dry run too, in one line
    proc = cli(lab, "data", "import", str(lab.root / "missing"), "x", "--project", "3dgs", "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {lab.root / 'missing'}: no such directory"


def test_register_dry_run_names_the_registration_it_replaces_and_writes_nothing(toy):
    lab, volume = toy.lab, toy.settings
    registry = registry_file(volume)
    before = registry.read_bytes()
    head = git("rev-parse", "main", cwd=Path(toy.spec.repo)).strip()
    args = ("data", "register", "toy", "--project", "vla", "--repo", toy.spec.repo, "--path", toy.spec.path,
            "--rev", head)
    dry, real = cli(lab, *args, "--dry-run"), cli(lab, *args)  # the same refusal, in the same one line
    assert dry.returncode == real.returncode == 2 and dry.stderr == real.stderr
    assert "already registered" in dry.stderr and registry.read_bytes() == before
    proc = cli(lab, *args, "--replace", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (f"would register toy: {toy.spec.repo} {toy.spec.path}@{head} (now {head[:10]}, {len(toy.expected)} files"
            in proc.stdout) and f"replacing {toy.spec.repo} {toy.spec.path}@{toy.spec.rev}" in proc.stdout
    assert registry.read_bytes() == before
    assert cli(lab, *args, "--replace").returncode == 0
    assert data.load_registry(volume)["toy"].rev == head  # what the dry run said it would record
