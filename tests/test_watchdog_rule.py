"""The watchdog's rule on its own (no subprocess): sliding-window means, coverage, memory, per-partition
rules and exemptions that expire. The end-to-end behaviour is tests/test_watchdog.py's."""

from __future__ import annotations

import datetime as dt

import pytest

from det_lab.settings import LabConfigError, load_settings
from det_lab.watchdog.window import judge
from det_lab.watchdog_settings import IdleRule, WatchdogSettings

HOUR = 3600.0


def samples(*phases: tuple[float, float, float], start: float = 0.0, every: float = 30.0):
    """``(seconds, utilization %, memory %)`` phases as samples every ``every`` seconds."""
    out, t = [], start
    for length, util, mem in phases:
        end = t + length
        while t < end:
            out.append((t, util, mem))
            t += every
    return out, t


def test_used_for_a_minute_then_idle_is_idle_by_the_mean():
    """Busy 90 % for its first minute, then idle for 59: mean 1.5 %, idle under 5 % (job_defense_shield's
    "every sample 0" never calls it idle); with 5 busy minutes (7.5 %) it is not."""
    once, now = samples((60, 90, 20), (59 * 60, 0, 20))
    v = judge({0: once}, IdleRule(window=HOUR), now - 30, 30)
    assert v.covered and v.idle and v.mean_utilization == pytest.approx(1.5) and v.max_utilization == 90
    five, now = samples((300, 90, 20), (55 * 60, 0, 20))
    assert not judge({0: five}, IdleRule(window=HOUR), now - 30, 30).idle


def test_a_window_not_yet_covered_is_never_idle_and_every_gpu_must_be_idle():
    fresh, now = samples((40 * 60, 0, 0))
    assert not judge({0: fresh}, IdleRule(window=HOUR), now - 30, 30).covered
    idle, now = samples((HOUR, 0, 0))
    busy, _ = samples((HOUR, 80, 50))
    assert judge({0: idle}, IdleRule(window=HOUR), now - 30, 30).idle
    assert not judge({0: idle, 1: busy}, IdleRule(window=HOUR), now - 30, 30).idle


def test_memory_held_spares_a_gpu_only_where_the_rule_says():
    held, now = samples((HOUR, 0, 60))
    assert judge({0: held}, IdleRule(window=HOUR), now - 30, 30).idle  # memory_below 100: memory never spares
    assert not judge({0: held}, IdleRule(window=HOUR, memory_below=50), now - 30, 30).idle


def test_partition_rules_replace_only_their_keys_and_exemptions_expire():
    wd = WatchdogSettings.model_validate({
        "rule": {"window": "2h", "grace": "45m", "utilization_below": 3},
        "partitions": {"interactive": {"grace": "10m"}},
        "exemptions": [{"user": "alice", "until": "2026-12-01T12:00", "reason": "profiling"},
                       {"job_name": "bench-*", "partition": "gpu", "until": "2026-12-31"}]})
    rule = wd.rule_for("interactive")
    assert (rule.window, rule.grace, rule.utilization_below) == (7200, 600, 3)
    assert wd.rule_for("other") == wd.rule
    before, after = dt.datetime(2026, 12, 1, 11, 59), dt.datetime(2026, 12, 1, 12, 0)
    assert wd.exemption_for("alice", "gpu", "x", before).reason == "profiling"
    assert wd.exemption_for("alice", "gpu", "x", after) is None
    assert wd.exemption_for("bob", "gpu", "bench-7", after) is not None
    assert wd.exemption_for("bob", "cpu", "bench-7", after) is None


def test_a_bad_duration_in_the_lab_config_is_one_line(tmp_path):
    cfg = tmp_path / "lab.yaml"
    cfg.write_text("watchdog:\n  rule:\n    window: soon\n")
    with pytest.raises(LabConfigError) as exc:
        load_settings(cfg, env={})
    assert str(exc.value) == f"{cfg}: watchdog.rule.window: 'soon' is not a duration such as 90s, 60m, 2h or 1d"


def test_each_webhook_kind_gets_its_json_shape():
    """Slack's incoming webhook takes {text}; Mattermost's and matrix-hookshot's generic webhook also a username."""
    from det_lab.watchdog.notify import webhook_body
    from det_lab.watchdog_settings import WebhookSettings

    shapes = {kind: webhook_body(WebhookSettings(url="http://127.0.0.1/h", kind=kind), "idle GPU")
              for kind in ("slack", "mattermost", "matrix")}
    assert shapes == {"slack": {"text": "idle GPU"},
                      "mattermost": {"text": "idle GPU", "username": "det-lab watchdog"},
                      "matrix": {"text": "idle GPU", "username": "det-lab watchdog"}}
