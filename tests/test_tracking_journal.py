"""The tracking journal: durable, ordered, crash-tolerant, compacted once delivered."""

from __future__ import annotations

import json

from det_lab.tracking import journal as journal_mod
from det_lab.tracking.events import Checkpoint, Metrics, Params, RunInfo, flatten
from det_lab.tracking.journal import Cursor, Journal


def metrics(n: int, start: int = 1) -> list[Metrics]:
    return [Metrics("training", s, {"loss": float(s)}, timestamp=float(s)) for s in range(start, start + n)]


def test_append_read_and_reopen_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "SEGMENT_EVENTS", 10)
    j = Journal(tmp_path)
    assert j.append(metrics(25)) == 25
    j.append([Params({"lr": "0.1"}), Checkpoint("uuid-1", 25, {"k": "v"}, timestamp=1.0)])
    assert len(list(tmp_path.glob("seg-*.jsonl"))) == 3
    again = Journal(tmp_path)  # a restarted process
    assert again.last_seq == 27
    events = again.read_after(0, 1000)
    assert [q for q, _ in events] == list(range(1, 28))
    assert events[24][1] == Metrics("training", 25, {"loss": 25.0}, timestamp=25.0)
    assert events[26][1] == Checkpoint("uuid-1", 25, {"k": "v"}, timestamp=1.0)
    assert [q for q, _ in again.read_after(12, 5)] == [13, 14, 15, 16, 17]
    assert again.append(metrics(1, 26)) == 28


def test_torn_last_line_is_dropped(tmp_path):
    j = Journal(tmp_path)
    j.append(metrics(3))
    seg = next(tmp_path.glob("seg-*.jsonl"))
    with open(seg, "a") as f:
        f.write('{"seq": 4, "kind": "metr')  # a crash in the middle of a write
    again = Journal(tmp_path)
    assert again.last_seq == 3
    assert again.append(metrics(1, 4)) == 4
    assert [json.loads(line)["seq"] for line in seg.read_text().splitlines()] == [1, 2, 3, 4]


def test_cursors_and_compaction(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "SEGMENT_EVENTS", 10)
    j = Journal(tmp_path)
    j.append(metrics(35))
    j.advance("mlflow", Cursor(22, "run-a"))
    j.advance("aim", Cursor(9, "hash-b"))
    j.compact(["mlflow", "aim"])
    assert len(list(tmp_path.glob("seg-*.jsonl"))) == 4  # aim still needs seq 10 onwards
    j.advance("aim", Cursor(31, "hash-b"))
    j.compact(["mlflow", "aim"])
    # segments 1-10 and 11-20 gone; 21-30 still holds 22..30 for mlflow
    assert sorted(p.name for p in tmp_path.glob("seg-*.jsonl")) == ["seg-000000000021.jsonl", "seg-000000000031.jsonl"]
    assert Journal(tmp_path).cursor("aim") == Cursor(31, "hash-b")
    assert [q for q, _ in Journal(tmp_path).read_after(22, 100)] == list(range(23, 36))
    assert j.pending("mlflow") == 13


def test_flatten_nested_hyperparameters():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": {"e": "x"}}}) == {"a": "1", "b.c": "2.5", "b.d.e": "x"}


def test_a_cursor_written_from_an_attempt_a_newer_one_revoked_never_lands(tmp_path, monkeypatch):
    """A fenced trial's sender renames its cursor from the attempt's directory (det_lab.runs.fence):
    once the next attempt removed that directory, a write the cut-off volume held up (its checks read
    before the takeover) is refused, the newer cursor stays, and the sender knows it was handed over
    (seen on the sshfs bed: an old sender set the cursor from 22 back to 8 after the heal)."""
    from det_lab.tracking.delivery import Sender

    journal_dir = tmp_path / "tracking-journal"
    j = Journal(journal_dir)
    j.describe_run(RunInfo(key="vla-r1", name="r1"), {"mlflow": "http://127.0.0.1:1"})
    j.claim("old-trial")
    stage = tmp_path / ".attempt-1"
    stage.mkdir()
    sender = Sender(journal_dir, "mlflow")
    sender.writer, sender.stage, sender.cursor = "old-trial", stage, Cursor(8, "run-1")
    # what it read before the partition: still its trial's journal, nothing delivered further
    monkeypatch.setattr(sender.journal, "writer", lambda: "old-trial")
    monkeypatch.setattr(sender.journal, "cursor", lambda backend: Cursor(0))
    j.advance("mlflow", Cursor(22, "run-1"))  # the requeued copy's sender delivered to 22
    stage.rmdir()  # attempt 2 began: attempt 1's directory is gone
    sender._advance()
    assert Journal(journal_dir).cursor("mlflow").seq == 22 and sender.handed_over
    assert not list(tmp_path.glob(".attempt-1*"))
