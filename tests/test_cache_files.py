"""This user's caches of the volume (run.json facts, tree listings, checkpoint figures) are never
trusted: a cache file damaged on disk, cut short, of another format, or crafted to run code is
ignored and rebuilt, and ``volume usage`` and ``runs prune``'s plan stay what ``du`` and the plan
made from scratch say."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import time
from pathlib import Path

import pytest

from det_lab.settings import load_settings
from det_lab.runs import cachefile
from det_lab.lifecycle import prune, space, trees
from det_lab.volume import VolumeLayout, init_volume

OLD = time.time() - 40 * 86400
HEAD = len(b"det-lab-cache\n") + 2 + 16  # magic, version, digest
KIND_DIRS = ("dvc-cache", "snapshots", "datasets", "checkpoints", "outputs")


def du(*paths: Path) -> list[int]:
    out = subprocess.run(["du", "-s", "-B1", *map(str, paths)], check=True, capture_output=True, text=True).stdout
    return [int(line.split("\t")[0]) for line in out.splitlines()]


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(space, "SETTLED_S", 0.0)  # a checkpoint written before the walk counts as settled
    monkeypatch.setattr(trees, "SETTLED_S", 0.0)
    config = tmp_path / "lab.yaml"
    config.write_text(f"data_root: {tmp_path / 'data'}\ntracking:\n  backend: none\n")
    settings = load_settings(config, env={})
    init_volume(settings)
    layout = VolumeLayout(settings.data_root)
    ck, runs = layout.project_checkpoints("vla"), layout.outputs("vla") / "local-runs"
    for i in range(4):
        run = runs / f"r{i}"
        run.mkdir(parents=True)
        uuids = [f"r{i}-c{j}" for j in range(2)]
        (run / "run.json").write_text(json.dumps({
            "name": run.name, "status": "finished", "kind": "local", "run_key": f"local-{run.name}",
            "exp_conf": {"data": {"det_lab": {"project": "vla"}}},
            "checkpoints": [{"uuid": u, "step": 1} for u in uuids], "latest_checkpoint": uuids[-1]}))
        (run / "metrics.jsonl").write_bytes(os.urandom(7000 + 1000 * i))
        os.utime(run / "run.json", (OLD, OLD))
        for u in uuids:
            (ck / u).mkdir(parents=True)
            (ck / u / "state.pt").write_bytes(os.urandom(30000))
            (ck / u / "metadata.json").write_text("{}")
    return settings, layout


def _answers(settings, layout) -> tuple[dict, dict]:
    report = space.volume_space(settings, reclaimable=False, projects=["vla"])
    plan = prune.plan_prune(settings, older_than="30d")
    return ({"kinds": report.projects["vla"].kinds, "runs": dict(report.by("run"))},
            {"runs": [r.as_dict() for r in plan.runs], "refused": [r.as_dict() for r in plan.refused]})


def _lie(value):
    """The cache's figures made wrong (a size, a run.json's time) where a reader would trust them."""
    if isinstance(value, dict):
        return {k: _lie(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) == 5 and all(isinstance(v, (int, float)) for v in value):  # a kept checkpoint
            return type(value)([*value[:3], value[3] + 10**6, value[4]])
        if len(value) == 4 and isinstance(value[3], tuple):  # a run.json's facts: changed just now
            facts = list(value[3])
            facts[1] = time.time()
            return (*value[:3], tuple(facts))
        return type(value)(_lie(v) for v in value)
    return value


class _Run:
    """A pickled call of ``os.system``: what a crafted cache file would make an unpickler run."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_damaged_or_crafted_cache_is_ignored_and_rebuilt(lab, tmp_path):
    settings, layout = lab
    dirs = [layout.root / d / "vla" for d in KIND_DIRS]
    first = _answers(settings, layout)
    fresh = prune.plan_prune(settings, older_than="30d", fresh=True)
    assert first[1] == {"runs": [r.as_dict() for r in fresh.runs], "refused": [r.as_dict() for r in fresh.refused]}
    assert list(first[0]["kinds"].values()) == du(*dirs)
    assert len(first[1]["runs"]) == 4
    files = sorted((tmp_path / "cache" / "det-lab").glob("*.pickle"))
    assert [f.name.split("-")[0] for f in files] == ["run", "space", "trees"]
    assert _answers(settings, layout) == first  # from the caches now
    marker = tmp_path / "ran"
    for f in files:
        good = f.read_bytes()
        body = pickle.loads(good[HEAD:])
        lied = pickle.dumps(_lie(body), protocol=5)
        assert lied != good[HEAD:]
        crafted = pickle.dumps({"x": _Run(f"touch {marker}")}, protocol=5)
        version = int.from_bytes(good[HEAD - 18:HEAD - 16], "big")
        for damaged in (good[:HEAD] + lied,  # the figures changed, the digest of the true ones
                        good[:HEAD - 16] + hashlib.blake2b(crafted, digest_size=16).digest() + crafted,  # code
                        good[: len(good) // 2],  # cut short
                        json.dumps({"identity": "x", "dirs": {}}).encode(),  # another format
                        good[:HEAD - 18] + (version - 1).to_bytes(2, "big") + good[HEAD - 16:]):  # an older version
            f.write_bytes(damaged)
            assert _answers(settings, layout) == first, f.name
            assert not marker.exists(), f.name
            assert cachefile.load(f, version) is not None  # rebuilt
        newer = good[:HEAD - 18] + (version + 1).to_bytes(2, "big") + good[HEAD - 16:]  # a newer det_lab's
        f.write_bytes(newer)
        assert _answers(settings, layout) == first, f.name  # answered without it
        assert f.read_bytes() == newer, f.name  # and left to the det_lab that wrote it
