"""``det-lab monitor report``'s pictures read as the panels mean them: a count on a whole-number axis
from 0, bytes and durations in a unit a person reads, no panel in Grafana's unitless ``short``."""

from __future__ import annotations

import pytest

from det_lab.monitoring.dashboards import DASHBOARDS, grafana_json
from det_lab.monitoring.report import figure, value_axis

PANELS = {p.title: p for d in DASHBOARDS for p in d.panels}
GRAFANA_UNITS = {"bytes", "s", "percent", "percentunit", "bool_yes_no", "none"}


def _series(values, **labels):
    return {"metric": labels, "values": [[1_700_000_000 + 10 * i, str(v)] for i, v in enumerate(values)]}


@pytest.mark.parametrize("title", sorted(PANELS))
def test_every_panel_has_a_unit(title):
    unit = PANELS[title].unit
    assert unit != "short" and (unit in GRAFANA_UNITS or unit.startswith("count:")), unit


def test_a_constant_count_is_drawn_on_whole_numbers_from_zero():
    """Three users holding one GPU each: stacked to 3, ticks 0, 1, 2, 3 (was 0.96 ... 1.04 around 1)."""
    panel = PANELS["GPUs allocated per user and partition (Slurm)"]
    result = [_series([1] * 12, user=u, partition="fake") for u in ("alice", "bob", "root")]
    ax = figure(panel, result, 120).axes[0]
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ax.get_ylim()[0] == 0 and all(float(t).is_integer() for t in ticks) and 3 in ticks
    assert ax.get_ylabel() == "GPUs"
    assert grafana_json(next(d for d in DASHBOARDS if panel in d.panels))["panels"][0]["fieldConfig"]["defaults"][
        "decimals"] == 0


def test_bytes_and_seconds_are_scaled_to_a_unit_a_person_reads():
    assert value_axis("bytes", 3 * 2**20) == (2.0**20, "MiB", False)
    assert value_axis("bytes", 900) == (1.0, "B", False)
    assert value_axis("s", 7200) == (3600.0, "hours", False)
    assert value_axis("s", 90) == (1.0, "seconds", False)
    ax = figure(PANELS["Pending jobs' wait so far"], [_series([0, 60, 120, 180], user="root", job_id="3",
                                                               reason="Resources")], 40).axes[0]
    assert ax.get_ylabel() == "minutes" and max(line.get_ydata().max() for line in ax.get_lines()) == 3.0


def test_a_yes_no_state_reads_yes_and_no():
    ax = figure(PANELS["Tracker servers answering"], [_series([1, 1, 0], backend="mlflow", target="x")], 30).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["no", "yes"]
