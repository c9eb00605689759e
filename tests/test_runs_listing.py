"""What ``det-lab runs list`` shows of each run is what the run's files say, however they were
written: its fast readers (det_lab's own formats matched without parsing, an ended run's recorded
progress) against a plain JSON reading of the same bytes, on files det_lab wrote, files written
another way, and torn or cut-short files."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from det_lab.runs import listing, record
from det_lab.runs.listing import ListingCache, shown_state
from det_lab.runs.record import LocalRunRecord, parse_progress
from tests.conftest import VENV_BIN, Lab


def reference_progress(data: bytes) -> tuple[int, dict]:
    """Every complete line parsed as JSON: the highest training step, the last validation."""
    step, last = 0, {}
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and m.get("group") == "training" and isinstance(m.get("step"), int):
            step = max(step, m["step"])
        elif isinstance(m, dict) and m.get("group") == "validation" and isinstance(m.get("metrics"), dict):
            last = m["metrics"]
    return step, last


def metrics_file(rng: random.Random, odd: bool) -> bytes:
    """Reports as append_metrics writes them, every value its own; ``odd``: also lines written
    another way (keys reordered, nested metrics, not an object), torn lines followed by the next
    report, and a last line still being written."""
    lines: list[bytes] = []
    step = 0
    for _ in range(rng.randrange(0, 40)):
        step = max(step + rng.randrange(-3, 9), 0)  # a resumed trial may report a key first seen at an earlier step
        group = rng.choice(["training", "training", "validation"])
        metrics = {f"k{rng.randrange(5)}": rng.random() for _ in range(rng.randrange(1, 4))}
        line = json.dumps({"group": group, "step": step, "metrics": metrics}).encode()
        if odd and rng.random() < 0.3:
            line = rng.choice([
                json.dumps({"step": step + 1000, "group": group, "metrics": metrics}).encode(),
                json.dumps({"group": group, "step": step, "metrics": {"nested": metrics}}).encode(),
                json.dumps([group, step]).encode(),
                line[:rng.randrange(1, len(line))],  # torn: the next report follows on the same line
                b"",
            ])
            if not line.endswith(b"}") or rng.random() < 0.5:
                lines.append(line)
                continue
        lines.append(line + b"\n")
    data = b"".join(lines)
    if odd and rng.random() < 0.5:
        data += b'{"group": "training", "step": 99999, "met'  # being written
    return data


def test_progress_of_any_metrics_file_is_what_its_json_lines_say():
    rng = random.Random(7)
    own, fast = 0, 0
    for case in range(3000):
        odd = case % 2 == 1
        data = metrics_file(rng, odd)
        assert parse_progress(data) == reference_progress(data), data
        if not odd and data:
            own += 1
            fast += record._progress_as_written(data) is not None
    assert fast == own > 1400  # every file as det_lab writes it took the counting path (and agreed)


def test_a_metrics_line_torn_and_followed_by_the_next_report_is_not_read_as_a_step():
    data = (b'{"group": "training", "step": 7, "metrics": {"loss": 1.0}}\n'
            b'{"group": "training", "step": 40, "metr'  # torn: the trial died writing it
            b'{"group": "training", "step": 9, "metrics": {"loss": 0.5}}\n'  # the resumed trial's report
            b'{"step": 12, "group": "training", "metrics": {"loss": 0.1}}\n')
    assert parse_progress(data) == (12, {}) == reference_progress(data)


NASTY = ['plain', 'with "quotes"', 'back\\slash', 'a,\n  "status": "forged",', '}\n}', 'ünïcødé ✓', '', ' ,',
         '\n  }', '{"name": "x"}']


def random_state(rng: random.Random) -> dict:
    """A run.json state with the shown keys anywhere among others, nested keys of the same names,
    and strings that look like JSON lines."""
    state: dict = {"lineage": {"status": rng.choice(NASTY), "name": rng.choice(NASTY),
                               "config": {"slurm": {"job_id": "nested"}, "deep": [rng.random(), {"user": "x"}]}},
                   "exp_conf": {"hyperparameters": {"lr": rng.random()}, "notes": rng.choice(NASTY)},
                   "checkpoints": [{"uuid": f"u{rng.randrange(10**6)}", "step": rng.randrange(100)}]}
    for key in ("name", "template", "status", "max_length", "host", "user"):
        if key == "name" or rng.random() < 0.7:
            state[key] = rng.choice([rng.choice(NASTY), rng.randrange(10**6), None, {"an": ["object"]}]) if key != "name" else \
                f"run-{rng.randrange(10**6)}-{rng.choice(NASTY)}"
    if rng.random() < 0.5:
        state["slurm"] = {"job_id": str(rng.randrange(10**5)), "partition": rng.choice(NASTY),
                          "attempts": [{"node": f"n{rng.randrange(9)}", "started": rng.choice(NASTY)}
                                       for _ in range(rng.randrange(3))]}
    if rng.random() < 0.5:
        state[record.PROGRESS_KEY] = {"step": rng.randrange(10**4), "validation": {"v": rng.random()},
                                      "metrics_bytes": rng.randrange(10**5)}
    items = list(state.items())
    rng.shuffle(items)
    return dict(items)


def test_what_a_listing_shows_of_a_run_json_is_what_its_json_says():
    """run.json as det_lab writes it (indent 2), written another way (compact, other indents),
    and cut short: the shown keys equal the full parse's; a cut file is refused, never half-read."""
    rng = random.Random(11)
    for _ in range(1500):
        state = random_state(rng)
        expected = listing._shown(state)
        for text in (json.dumps(state, indent=2, default=str) + "\n", json.dumps(state), json.dumps(state, indent=4)):
            data = text.encode()
            assert shown_state(data, "run.json") == expected, text
            cut = data[:rng.randrange(1, len(data) - 2)]
            with pytest.raises(ValueError, match="damaged run record"):
                shown_state(cut, "run.json")


def test_an_ended_run_is_listed_from_its_record_until_its_metrics_grow(tmp_path, monkeypatch):
    """The progress an ended run recorded stands in for its metrics exactly while they keep the size
    it was recorded at: a resumed run's new reports are listed, not the recorded end."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = LocalRunRecord(tmp_path / "r")
    run.dir.mkdir()
    run.save({"name": "r", "max_length": 50})
    for step in (5, 10):
        run.append_metrics("training", step, {"loss": 1.0 / step})
    run.append_metrics("validation", 10, {"val_loss": 0.25})
    run.record_end(status="stopped")
    reads: list[str] = []
    monkeypatch.setattr(listing, "read_signed", lambda path, read=listing.read_signed: reads.append(
        Path(path).name) or read(path))
    (listed,) = ListingCache(tmp_path).read_all([run])
    assert (listed.step, listed.validation, listed.state["status"]) == (10, {"val_loss": 0.25}, "stopped")
    assert reads == ["run.json"]  # its metrics were not read
    run.update(status="running")  # resumed: run.json rewritten, the recorded end kept
    run.append_metrics("training", 15, {"loss": 0.1})
    reads.clear()
    (listed,) = ListingCache(tmp_path).read_all([run])
    assert (listed.step, listed.validation, listed.state["status"]) == (15, {"val_loss": 0.25}, "running")
    assert reads == ["run.json", "metrics.jsonl"]


@pytest.fixture
def volume(lab: Lab, tmp_path) -> Lab:
    """conftest's lab, its volume initialised and a listing cache of its own."""
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    lab.env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    lab.write_config(tracking={"backend": "none"})
    init_volume(load_settings(lab.config, env={}))
    return lab


def test_runs_list_names_a_damaged_run_json_and_lists_every_other_run(volume):
    lab = volume
    runs = lab.root / "outputs" / "vla" / "local-runs"
    for i in range(3):
        run = LocalRunRecord(runs / f"r{i}")
        run.dir.mkdir(parents=True)
        run.save({"name": f"r{i}", "status": "finished", "max_length": 10, "template": "vla"})
        run.append_metrics("training", i + 3, {"loss": 1.0})
    (runs / "r1" / "run.json").write_bytes((runs / "r1" / "run.json").read_bytes()[:30])  # cut short
    (runs / "no-record").mkdir()  # a directory without run.json: not a run
    proc = subprocess.run([str(VENV_BIN / "det-lab"), "runs", "list", "--json"], env=lab.env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: (r["status"], r["step"]) for r in map(json.loads, proc.stdout.splitlines())}
    assert rows == {"r0": ("finished", 3), "r1": ("damaged", 0), "r2": ("finished", 5)}
    (warning,) = proc.stderr.strip().splitlines()
    assert str(runs / "r1" / "run.json") in warning and "damaged run record" in warning
    table = subprocess.run([str(VENV_BIN / "det-lab"), "runs", "list"], env=lab.env, capture_output=True, text=True)
    assert [line.split()[:4] for line in table.stdout.splitlines()[1:]] == [
        ["r0", "local", "finished", "3/10"], ["r2", "local", "finished", "5/10"], ["r1", "local", "damaged", "0/?"]]
    # (oldest run.json first: r1's was cut last)
    for command in ("show", "cancel"):  # the run itself: one line naming the file, no traceback
        one = subprocess.run([str(VENV_BIN / "det-lab"), "runs", command, "r1"], env=lab.env, capture_output=True,
                             text=True)
        assert one.returncode == 1 and one.stderr.count("\n") == 1, one.stderr
        assert one.stderr.startswith("error: ") and str(runs / "r1" / "run.json") in one.stderr


def _many_runs(root: Path, n: int) -> list[Path]:
    """``n`` runs, every one its own (name, step, validation, status), written as det_lab writes them;
    every 97th run.json cut short, every 89th ended with its progress recorded."""
    dirs = []
    for i in range(n):
        run = LocalRunRecord(root / f"run-{i:05d}")
        run.dir.mkdir(parents=True)
        run.save({"name": run.dir.name, "template": f"t{i % 7}", "max_length": 1000 + i, "host": f"h{i % 3}"})
        run.append_metrics("training", i + 1, {"loss": 1.0 / (i + 1)})
        run.append_metrics("validation", i + 1, {"val_loss": 0.5 / (i + 1)})
        if i % 89 == 0:
            run.record_end(status="finished")
        if i % 97 == 0:
            run.run_file.write_bytes(run.run_file.read_bytes()[:40])
        dirs.append(run.dir)
    return dirs


def test_runs_read_by_worker_processes_are_the_runs_read_alone(tmp_path, monkeypatch):
    dirs = [str(d) for d in _many_runs(tmp_path / "runs", listing.PARALLEL_MIN + 50)]
    alone = [listing._entry_or_error(d) for d in dirs]
    read = listing.read_entry
    monkeypatch.setattr(listing, "read_entry", lambda d: {**read(d), "pid": os.getpid()})
    monkeypatch.setenv("DET_LAB_LIST_WORKERS", "2")
    side_by_side = listing._read_entries(dirs)
    pids = {e.pop("pid") for e in side_by_side if isinstance(e, dict)}
    assert len(pids) == 2 and os.getpid() not in pids  # read by two workers, not by this process
    assert side_by_side == alone
    assert sum(isinstance(e, tuple) and e[0] == "damaged" and "damaged run record" in e[1] for e in alone) == \
        len(range(0, len(dirs), 97))


def test_runs_list_with_workers_prints_what_it_prints_without(volume):
    lab = volume
    n = listing.PARALLEL_MIN + 20
    _many_runs(lab.root / "outputs" / "vla" / "local-runs", n)
    out = {}
    for workers in ("1", "2"):
        env = {**lab.env, "DET_LAB_LIST_WORKERS": workers, "XDG_CACHE_HOME": str(lab.config.parent / f"cache-{workers}")}
        proc = subprocess.run([str(VENV_BIN / "det-lab"), "runs", "list", "--json"], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out[workers] = (proc.stdout, sorted(proc.stderr.splitlines()))
    assert out["1"] == out["2"]
    rows = [json.loads(line) for line in out["1"][0].splitlines()]
    assert len(rows) == n and len(out["1"][1]) == len(range(0, n, 97))  # each run.json cut short named once
    assert {r["name"]: r["step"] for r in rows}["run-00500"] == 501


def test_a_diverged_validation_loss_is_listed_as_nan_from_the_files_and_from_the_cache(tmp_path, monkeypatch):
    import math

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runs = []
    for name, loss in (("diverged", float("nan")), ("fine", 0.125)):
        run = LocalRunRecord(tmp_path / name)
        run.dir.mkdir()
        run.save({"name": name, "max_length": 10})
        run.append_metrics("validation", 4, {"val_loss": loss})
        run.record_end(status="failed")
        runs.append(run)
    first = ListingCache(tmp_path)
    assert first.read_all(runs)[0].validation["val_loss"] != first.read_all(runs)[0].validation["val_loss"]  # NaN
    first.save(complete=True)
    again = ListingCache(tmp_path)
    listed = again.read_all(runs)
    assert again.read_again == 0  # both from the cache
    assert math.isnan(listed[0].validation["val_loss"]) and listed[1].validation == {"val_loss": 0.125}


def _as_nobody(work):
    """``work()`` in a child process that has dropped to the user nobody (forked: this interpreter
    lives under /root, which nobody may not enter), its result pickled back."""
    import pickle
    import pwd

    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            with os.fdopen(write, "wb") as out:
                try:
                    pickle.dump(("ok", work()), out)
                except BaseException as exc:  # noqa: BLE001 - said in the parent
                    pickle.dump(("raised", repr(exc)), out)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    how, result = pickle.loads(data)
    assert how == "ok", f"as nobody: {result}"
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming the user nobody needs root")
def test_another_members_unreadable_run_is_listed_as_such_and_the_rest_as_they_are(tmp_path):
    """A second Unix user lists a volume where one run.json is private to its owner: that run says
    unreadable (runs list) and is counted so (the exporter, with no scrape error); the rest read."""
    import shutil
    import tempfile

    from det_lab.monitoring.source_runs import RunsSource
    from det_lab.settings import load_settings
    from det_lab.volume import init_volume

    shared = Path(tempfile.mkdtemp(prefix="det-lab-shared-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        config = shared / "lab.yaml"
        config.write_text(f"data_root: {shared / 'data'}\ntracking: {{backend: none}}\n")
        settings = load_settings(config, env={})
        init_volume(settings)
        runs = []
        for name, step in (("open-a", 11), ("private", 22), ("open-b", 33)):
            run = LocalRunRecord(shared / "data" / "outputs" / "vla" / "local-runs" / name)
            run.dir.mkdir(parents=True)
            run.save({"name": name, "template": "vla", "max_length": 40})
            run.append_metrics("training", step, {"loss": 1.0})
            run.record_end(status="finished")
            for path in [*shared.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            runs.append(run)
        runs[1].run_file.chmod(0o600)

        def listed() -> list:
            cache = ListingCache(settings.data_root)
            cache.path = shared / "nobody-cache.json"
            return [(x.status, str(x)) if isinstance(x, listing.Unlisted) else (x.state["status"], x.step)
                    for x in cache.read_all(runs)]

        def exported() -> dict:
            (source,) = [RunsSource(settings)]
            families = {m.name: m for m in source.collect()}
            return {s.labels["status"]: s.value for s in families["det_lab_runs"].samples}

        shared.chmod(0o777)  # where nobody may write its cache
        rows = _as_nobody(listed)
        assert rows[0] == ("finished", 11) and rows[2] == ("finished", 33)
        assert rows[1][0] == "unreadable" and str(runs[1].run_file) in rows[1][1]
        assert _as_nobody(exported) == {"finished": 2, "unreadable": 1}
        assert [r[0] for r in listed()] == ["finished"] * 3  # its owner reads it
    finally:
        shutil.rmtree(shared, ignore_errors=True)
