"""``runs prune``'s plan from its caches (each run.json's facts, each directory's listing and
permission answer, a complete checkpoint's sizes) is the plan made from scratch, also after the
volume changed between two plans: a checkpoint grown, a directory chmod'ed by its owner, a new
checkpoint listed, one removed by hand. Planned by a second member of the group (real Unix users),
compared with the plan that reads every run.json and walks every tree, and with ``find``."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

from tests.test_shared_volume import team  # noqa: F401 (a fixture of two Unix users of one group)

PLAN = textwrap.dedent("""
    import json
    from det_lab.settings import load_settings
    from det_lab.lifecycle import prune, trees

    trees.SETTLED_S = 0.0  # a checkpoint written before this plan began counts as settled
    settings = load_settings()

    def shown(plan):
        return {"runs": [r.as_dict() for r in plan.runs], "refused": [r.as_dict() for r in plan.refused]}

    cached = shown(prune.plan_prune(settings, older_than="30d"))
    fresh = shown(prune.plan_prune(settings, older_than="30d", fresh=True))
    print(json.dumps({"cached": cached, "fresh": fresh}))
""")
OLD = time.time() - 40 * 86400


def _share(path: Path, uid: int, gid: int) -> None:
    """As the member's umask 002 and the volume's setgid directories leave them: group-writable."""
    for dirpath, dirnames, filenames in os.walk(path):
        os.chown(dirpath, uid, gid)
        os.chmod(dirpath, 0o2775)
        for f in filenames:
            os.chown(os.path.join(dirpath, f), uid, gid)
            os.chmod(os.path.join(dirpath, f), 0o664)


def _checkpoint(root: Path, uuid: str, complete: bool = True) -> Path:
    c = root / uuid
    (c / "code").mkdir(parents=True)
    (c / "code" / "model_def.py").write_text("# the trial's code\n" * 20)
    (c / "state_dict.pth").write_bytes(os.urandom(9000))
    if complete:
        (c / "metadata.json").write_text(json.dumps({"steps_completed": 10}))
    return c


def _run(runs: Path, ckpts: Path, name: str, uuids: list[str], old: bool = True) -> Path:
    d = runs / name
    (d / "logs").mkdir(parents=True)
    (d / "logs" / "train.log").write_text("trained\n" * 50)
    state = {"kind": "local", "name": name, "run_key": f"local-{name}", "status": "finished",
             "exp_conf": {"searcher": {"metric": "val_loss"}, "data": {"det_lab": {"project": "vla"}}},
             "checkpoints": [{"uuid": u, "step": 10} for u in uuids], "latest_checkpoint": uuids[-1]}
    (d / "run.json").write_text(json.dumps(state))
    if old:
        os.utime(d / "run.json", (OLD, OLD))
    return d


def _files_bytes(*trees: Path) -> int:
    """What GNU find says the files below weigh (apparent sizes, links not followed)."""
    out = subprocess.run(["find", *map(str, trees), "-type", "f", "-printf", "%s\\n"], check=True,
                         capture_output=True, text=True).stdout
    return sum(int(n) for n in out.split())


def _plan_as(team, user) -> dict:  # noqa: F811 (the fixture's type)
    env = {"PATH": f"{team.bin}:/usr/bin:/bin", "HOME": str(user.home), "USER": user.name, "LOGNAME": user.name,
           "DET_LAB_CONFIG": str(team.base / "lab.yaml")}
    proc = subprocess.run([str(team.bin / "python"), "-c", PLAN], user=user.uid, group=user.gid,
                          extra_groups=[team.gid], env=env, cwd=user.home, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_cached_plan_is_the_plan_from_scratch_after_the_volume_changed(team):  # noqa: F811
    assert team.det_lab(team.a, "init").returncode == 0
    runs, ckpts = team.data / "outputs/vla/local-runs", team.data / "checkpoints/vla"
    made = {name: [f"{name}-c{i}" for i in range(2)] for name in ("r0", "r1", "r2", "r3", "r4")}
    for name, uuids in made.items():
        for u in uuids:
            _checkpoint(ckpts, u, complete=not (name == "r1" and u.endswith("c1")))
        _run(runs, ckpts, name, uuids)
    _run(runs, ckpts, "young", ["r0-c0"], old=False)  # lists r0's first checkpoint
    _checkpoint(ckpts, "r5-c0")
    _run(runs, ckpts, "r5", ["r3-c0", "r5-c0"])  # started from r3's first checkpoint
    _share(runs, team.a.uid, team.gid)
    _share(ckpts, team.a.uid, team.gid)

    first = _plan_as(team, team.b)
    assert first["cached"] == first["fresh"]
    assert {r["name"] for r in first["cached"]["runs"]} == {*made, "r5"}  # "young" is not old
    assert {r["name"]: r for r in first["cached"]["runs"]}["r5"]["kept_checkpoints"] == {}  # r3 goes too
    again = _plan_as(team, team.b)  # now from the caches
    assert again == first

    # between two plans: ...
    grown = ckpts / "r1-c1"  # a checkpoint still being written grows in place
    with open(grown / "state_dict.pth", "ab") as f:
        f.write(os.urandom(50000))
    added = ckpts / "r2-c0" / "code" / "helpers.py"  # a complete checkpoint: a file deep inside (only code/ changes)
    added.write_bytes(os.urandom(30000))
    os.chown(added, team.a.uid, team.gid)
    # its owner takes the group's write rights off one directory deep in a run (only logs/ changes)
    subprocess.run(["chmod", "2755", str(runs / "r3" / "logs")], user=team.a.uid, group=team.a.gid, check=True)
    new = _checkpoint(ckpts, "r4-c2")  # a new checkpoint, listed in a rewritten run.json
    _share(new, team.a.uid, team.gid)
    state = json.loads((runs / "r4" / "run.json").read_text())
    state["checkpoints"].append({"uuid": "r4-c2", "step": 20})
    tmp = runs / "r4" / ".run.json.tmp"
    tmp.write_text(json.dumps(state))
    os.chown(tmp, team.a.uid, team.gid)
    os.utime(tmp, (OLD + 60, OLD + 60))
    os.replace(tmp, runs / "r4" / "run.json")
    subprocess.run(["rm", "-r", str(ckpts / "r0-c1")], check=True)  # one removed by hand

    after = _plan_as(team, team.b)
    assert after["cached"] == after["fresh"], json.dumps(after, indent=1)
    plan = {r["name"]: r for r in after["cached"]["runs"]}
    refused = {r["name"]: r for r in after["cached"]["refused"]}
    assert set(plan) == {"r0", "r1", "r2", "r4", "r5"} and set(refused) == {"r3"}
    assert plan["r5"]["kept_checkpoints"] == {"r3-c0": "r3"}  # r3 stays, and so does what it lists
    assert f"{runs / 'r3' / 'logs'} is not writable by {team.b.name}" in refused["r3"]["refused"]
    assert plan["r4"]["checkpoints"] == ["r4-c0", "r4-c1", "r4-c2"]
    assert plan["r0"]["checkpoints"] == [] and plan["r0"]["kept_checkpoints"] == {"r0-c0": "young"}
    assert plan["r1"]["bytes"] == _files_bytes(runs / "r1", ckpts / "r1-c0", ckpts / "r1-c1")
    assert plan["r2"]["bytes"] == _files_bytes(runs / "r2", ckpts / "r2-c0", ckpts / "r2-c1")
    assert plan["r2"]["bytes"] > {r["name"]: r for r in first["cached"]["runs"]}["r2"]["bytes"] + 29000
