"""AimBackend against real Aim: a local repo and a real ``aim server``, read back by the SDK.

Every read-back runs in a fresh process, with no reindexing, as a user's notebook would: it
proves that what the backend wrote is in the repo's index, not only in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from det_lab.tracking.aim_backend import AimBackend, coerce_param, derive_run_hash, merge_dotted
from det_lab.tracking.events import Checkpoint, Metrics, Params, RunInfo, Tags
from tests.aim_fixtures import AimServer, free_port

T0 = 1_700_000_000.0

READER = r"""
import json, sys
from aim import Repo, Run

repo_path, run_hash = sys.argv[1], sys.argv[2]
repo = Repo(repo_path)
run = Run(run_hash, repo=repo, read_only=True)
metrics = {}
for m in run.metrics():
    steps, (values, _epochs, times) = m.data.items_list()
    metrics[f"{m.name}|{m.context['subset']}"] = {"steps": steps, "values": values, "times": times}
queried = sorted(f"{m.name}|{m.context['subset']}" for m in repo.query_metrics(f"run.hash == '{run_hash}'"))
print(json.dumps({
    "runs": sorted(repo.list_all_runs()), "name": run.name, "experiment": run.experiment,
    "active": run.active, "hparams": run.get("hparams"), "det_lab": run.get("det_lab"),
    "checkpoints": run.get("checkpoints"), "metrics": metrics, "queried": queried,
}))
"""


def read_run(repo: Path, run_hash: str) -> dict:
    """The run as the Aim SDK sees it from a fresh process."""
    proc = subprocess.run([sys.executable, "-c", READER, str(repo), run_hash],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def losses(steps: range) -> list[Metrics]:
    return [Metrics("training", s, {"loss": 1.0 / s, "acc": s / 10}, timestamp=T0 + s) for s in steps]


def assert_points(data: dict, series: str, steps: list[int]) -> None:
    """Exactly one point per step, with the event's value and timestamp."""
    points = data["metrics"][series]
    assert points["steps"] == steps
    name = series.split("|")[0]
    expected = [1.0 / s if name == "loss" else s / 10 for s in steps]
    assert points["values"] == pytest.approx(expected)
    assert points["times"] == pytest.approx([T0 + s for s in steps])


INFO = RunInfo(key="det-test-e1-t1", name="trial 1", experiment="exp-1",
               tags={"det.experiment_id": "1", "det.trial_id": "1", "det.url": "http://master:8080/det/trials/1"})

FIRST_BATCH = [
    Params({"optimizer.lr": "0.001", "optimizer.name": "adam", "batch_size": "32", "seed": "007", "amp": "True"}),
    *losses(range(1, 4)),
    Metrics("validation", 3, {"loss": 0.5, "bleu": math.nan}, timestamp=T0 + 3),
    Tags({"lineage": "data@abc123"}),
    Checkpoint("ckpt-3", 3, {"size": 123, "files": ["model.pt"]}, timestamp=T0 + 3.5),
]


# --- pure functions --------------------------------------------------------------------------------


def test_run_hash_is_deterministic_and_aim_shaped() -> None:
    h = derive_run_hash(INFO.key)
    assert h == derive_run_hash(INFO.key) and len(h) == 24 and int(h, 16) >= 0
    assert derive_run_hash("det-test-e1-t2") != h


@pytest.mark.parametrize("raw, value", [
    ("32", 32), ("-1", -1), ("0.001", 0.001), ("1e-05", 1e-05), ("True", True), ("None", None),
    ("007", "007"), ("1e-3", "1e-3"), ("nan", "nan"), ("inf", "inf"), ("adam", "adam"), ("", ""),
])
def test_coerce_param_only_converts_exact_round_trips(raw: str, value: object) -> None:
    assert coerce_param(raw) == value and type(coerce_param(raw)) is type(value)


def test_merge_dotted_nests_and_keeps_conflicts_flat() -> None:
    merged = merge_dotted({"optimizer": {"lr": 0.1}, "x": 1}, {"optimizer.lr": "0.01", "optimizer.b.c": "2",
                                                                "x.y": "3", "a..b": "4"})
    assert merged == {"optimizer": {"lr": 0.01, "b": {"c": 2}}, "x": 1, "x.y": 3, "a..b": 4}


# --- local repo ------------------------------------------------------------------------------------


def test_local_run_is_readable_by_the_sdk_while_open_and_after_close(tmp_path: Path) -> None:
    repo = tmp_path / "aim"
    backend = AimBackend(str(repo), index_interval_s=0)
    assert backend.describe() == f"Aim {repo}"

    run_hash = backend.open(INFO, None)
    assert run_hash == derive_run_hash(INFO.key)
    backend.deliver(FIRST_BATCH)

    live = read_run(repo, run_hash)
    assert live["active"] and live["hparams"]["optimizer"] == {"lr": 0.001, "name": "adam"}
    assert_points(live, "loss|training", [1, 2, 3])

    backend.deliver(FIRST_BATCH)  # re-delivered after a lost acknowledgement
    backend.close("FINISHED")

    data = read_run(repo, run_hash)
    assert data["runs"] == [run_hash]
    assert (data["name"], data["experiment"], data["active"]) == ("trial 1", "exp-1", False)
    assert data["hparams"] == {"optimizer": {"lr": 0.001, "name": "adam"}, "batch_size": 32, "seed": "007",
                               "amp": True}
    assert data["det_lab"] == {**INFO.tags, "run_key": INFO.key, "lineage": "data@abc123",
                               "latest_checkpoint": "ckpt-3", "status": "FINISHED"}
    assert data["checkpoints"] == {"ckpt-3": {"step": 3, "timestamp": T0 + 3.5, "size": 123, "files": ["model.pt"]}}
    assert data["queried"] == ["acc|training", "bleu|validation", "loss|training", "loss|validation"]
    for series in ("loss|training", "acc|training"):
        assert_points(data, series, [1, 2, 3])
    assert data["metrics"]["loss|validation"]["values"] == [0.5]
    assert math.isnan(data["metrics"]["bleu|validation"]["values"][0])


RESUME_PHASE_ONE = textwrap.dedent("""
    import os, sys
    from det_lab.tracking.aim_backend import AimBackend
    from tests.test_tracking_aim import FIRST_BATCH, INFO
    backend = AimBackend(sys.argv[1], index_interval_s=0)
    print(backend.open(INFO, None), flush=True)
    backend.deliver(FIRST_BATCH)
    os._exit(0)  # the container dies: no close, the run's lock is left behind
""")


def test_restarted_trial_continues_the_same_run_without_duplicates(tmp_path: Path) -> None:
    repo = tmp_path / "aim"
    first = subprocess.run([sys.executable, "-c", RESUME_PHASE_ONE, str(repo)], capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).parent.parent)
    assert first.returncode == 0, first.stderr[-3000:]
    first_hash = first.stdout.split()[0]

    backend = AimBackend(str(repo))  # another machine: no journal, no run id
    assert backend.open(INFO, None) == first_hash
    backend.deliver(FIRST_BATCH + losses(range(4, 6)) + [Checkpoint("ckpt-5", 5, {"size": 1}, timestamp=T0 + 5)])
    backend.close("FINISHED")

    data = read_run(repo, first_hash)
    assert data["runs"] == [first_hash]
    for series in ("loss|training", "acc|training"):
        assert_points(data, series, [1, 2, 3, 4, 5])
    assert data["metrics"]["loss|validation"]["steps"] == [3]
    assert set(data["checkpoints"]) == {"ckpt-3", "ckpt-5"}
    assert data["det_lab"]["latest_checkpoint"] == "ckpt-5" and data["det_lab"]["status"] == "FINISHED"


# --- remote server ---------------------------------------------------------------------------------


def test_remote_run_is_indexed_on_the_server(aim_server: AimServer) -> None:
    backend = AimBackend(aim_server.uri)
    assert backend.describe() == f"Aim {aim_server.uri}"
    run_hash = backend.open(INFO, None)
    assert run_hash == derive_run_hash(INFO.key)
    backend.deliver(FIRST_BATCH)
    backend.deliver(FIRST_BATCH + losses(range(4, 5)))
    backend.close("FINISHED")

    data = read_run(aim_server.repo, run_hash)  # the server is still running
    assert (data["name"], data["experiment"], data["active"]) == ("trial 1", "exp-1", False)
    assert data["hparams"]["optimizer"] == {"lr": 0.001, "name": "adam"}
    assert data["det_lab"]["status"] == "FINISHED" and data["det_lab"]["latest_checkpoint"] == "ckpt-3"
    assert data["checkpoints"]["ckpt-3"]["files"] == ["model.pt"]
    assert data["queried"] == ["acc|training", "bleu|validation", "loss|training", "loss|validation"]
    for series in ("loss|training", "acc|training"):
        assert_points(data, series, [1, 2, 3, 4])


def test_unreachable_server_fails_fast() -> None:
    backend = AimBackend(f"aim://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable"):
        backend.open(INFO, None)
    assert time.monotonic() - started < 3
    backend.close("FAILED")  # never opened: nothing to do


EXIT_WITH_OPEN_RUN = textwrap.dedent("""
    import sys
    from det_lab.tracking.aim_backend import AimBackend
    from det_lab.tracking.events import Metrics, RunInfo
    backend = AimBackend(sys.argv[1])
    backend.open(RunInfo(key="det-test-exit", name="exit"), None)
    backend.deliver([Metrics("training", 1, {"loss": 1.0})])
    backend.flush_timeout_s = 1
    print("ready", flush=True)
    sys.stdin.readline()
    backend._run.track(2.0, name="loss", step=2)  # queued, never sent: the server is gone
""")


def test_server_outage_raises_and_a_reopen_replays_without_duplicates(aim_server: AimServer) -> None:
    info = dataclasses.replace(INFO, key="det-test-e1-outage")  # the server also holds the remote test's run
    other = subprocess.Popen([sys.executable, "-c", EXIT_WITH_OPEN_RUN, aim_server.uri], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parent.parent)
    try:
        backend = AimBackend(aim_server.uri)
        run_hash = backend.open(info, None)
        backend.deliver(FIRST_BATCH)
        assert other.stdout.readline().strip() == "ready"

        aim_server.stop()
        backend.flush_timeout_s = 1
        started = time.monotonic()
        with pytest.raises((TimeoutError, ConnectionError)):
            backend.deliver(losses(range(4, 6)))
        assert time.monotonic() - started < 5
        with pytest.raises(ConnectionError):
            backend.open(info, run_hash)

        # A process that exits with an open run and unsent writes must not hang in Aim's exit cleanup.
        started = time.monotonic()
        _, err = other.communicate("exit\n", timeout=30)
        assert other.returncode == 0, err[-3000:]
        assert time.monotonic() - started < 15
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()

    aim_server.start()
    assert backend.open(info, run_hash) == run_hash
    backend.deliver(FIRST_BATCH + losses(range(4, 6)))
    backend.close("FINISHED")

    data = read_run(aim_server.repo, run_hash)
    for series in ("loss|training", "acc|training"):
        assert_points(data, series, [1, 2, 3, 4, 5])
    assert data["det_lab"]["status"] == "FINISHED"


IMAGE_READER = r"""
import json, sys
from aim import Repo, Run
from aim.storage.context import Context
repo, run_hash = Repo(sys.argv[1]), sys.argv[2]
run = Run(run_hash, repo=repo, read_only=True)
seq = run.get_image_sequence("renders/view0", Context({}))
steps, (values, *_rest) = seq.data.items_list()
images = {seq.name: {"steps": steps, "sizes": [list(v.to_pil_image().size) for v in values]}}
print(json.dumps({"images": images, "artifacts": run.get("artifacts")}))
"""


def test_mirror_sends_renders_as_aim_images(tmp_path: Path) -> None:
    """What a 3DGS trial does: metrics plus a rendered view per validation, through the mirror."""
    from PIL import Image as PILImage

    from det_lab.tracking.mirror import Mirror

    repo = tmp_path / "aim"
    mirror = Mirror(RunInfo(key="renders", name="renders", experiment="det_lab/3dgs"), {"aim": str(repo)},
                    tmp_path / "journal", interval=0.2)
    for step in (100, 200):
        render = tmp_path / f"view0-{step}.png"
        PILImage.new("RGB", (32, 24), (step % 256, 0, 0)).save(render)
        mirror.log_metrics("validation", step, {"psnr": step / 10})
        mirror.log_artifact(render, "renders/view0", step, media="image")
    summary = mirror.close()
    assert summary.complete, str(summary)
    run_hash = summary.backends[0].run_id
    proc = subprocess.run([sys.executable, "-c", IMAGE_READER, str(repo), run_hash], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["images"]["renders/view0"] == {"steps": [100, 200], "sizes": [[32, 24], [32, 24]]}
    assert set(data["artifacts"]["renders/view0"]) == {"100", "200"}
    assert read_run(repo, run_hash)["metrics"]["psnr|validation"]["steps"] == [100, 200]


# --- through det-lab run ---------------------------------------------------------------------------


def test_run_summary_names_the_aim_repo_and_the_command_that_opens_it(lab, tmp_path: Path) -> None:
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume
    from tests.conftest import publish_tiny_data

    # a path longer than a terminal is wide: a summary cut to 80 columns would lose its end
    repo = tmp_path / ("team-aim-repository-" * 5) / "aim"
    lab.write_config(tracking={"backend": "aim", "aim_repo": str(repo)})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    publish_tiny_data(settings, tmp_path)
    lab.env.pop("COLUMNS")  # stdout is a pipe, and nothing says how wide to print
    proc = lab.cli("run", str(Path(__file__).parent / "fixtures" / "tiny"), "--local",
                   "--set", "data.det_lab.max_length.batches=20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("│")[1:3] for line in proc.stdout.splitlines() if line.count("│") == 3]
    start = [name.strip() for name, _ in rows].index("aim")
    ends = [i for i in range(start + 1, len(rows)) if rows[i][0].strip()]
    aim = [cell.strip() for _, cell in rows[start:ends[0] if ends else None]]  # its row and continuation lines
    assert aim[0].startswith("run ") and aim[0].endswith(" events delivered"), proc.stdout
    assert f"store: {repo}" in aim and f"open it: aim up --repo {repo}" in aim, proc.stdout
    run_hash = aim[0].split()[1].rstrip(":")
    assert read_run(repo, run_hash)["metrics"]["loss|training"]["steps"][-1] == 20
