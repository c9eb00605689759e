"""``det-lab monitor report``: the dashboards' panels as PNGs in one HTML page, for a team without Grafana.

Each panel's expression is sent to Prometheus' ``/api/v1/query_range`` over the period asked for;
each returned series becomes a line named by the panel's legend. A panel with no data says so on
its picture (with what it needs, e.g. a GPU driver), rather than being left out.
"""

from __future__ import annotations

import html
import json
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.monitoring.dashboards import DASHBOARDS, Panel

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
POINTS = 240


class ReportError(UserError, RuntimeError):
    """Prometheus did not answer, or a bad period."""


def parse_duration(text: str) -> int:
    """``7d``, ``12h``, ``30m`` in seconds; :class:`ReportError` for anything else."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ReportError(f"{text!r} is not a period such as 7d, 12h or 30m")
    return int(m.group(1)) * _SECONDS[m.group(2)]


def query_range(url: str, expr: str, start: float, end: float, step: float, timeout: float = 30.0) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout) as resp:  # noqa: S310
            body = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise ReportError(f"Prometheus at {url} did not answer: {getattr(exc, 'reason', exc)}") from None
    if body.get("status") != "success":
        raise ReportError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def legend(panel: Panel, labels: dict[str, str]) -> str:
    if not panel.legend:
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or panel.title
    return re.sub(r"{{\s*(\w+)\s*}}", lambda m: labels.get(m.group(1), ""), panel.legend)


@dataclass
class PanelImage:
    dashboard: str
    panel: Panel
    file: str
    series: int


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DURATIONS = ((86400.0, "days"), (3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))


def value_axis(unit: str, peak: float) -> tuple[float, str, bool]:
    """How to draw a panel's values: ``(divide by, axis label, whole numbers)`` for its Grafana ``unit``
    and the largest value shown. Counts get a whole-number axis; bytes and seconds the largest unit
    under the peak."""
    if unit.startswith("count:"):
        return 1.0, unit.removeprefix("count:"), True
    if unit == "bytes":
        power = 0
        while power < len(_BINARY) - 1 and peak >= 1024 ** (power + 1):
            power += 1
        return float(1024 ** power), _BINARY[power], False
    if unit == "s":
        scale, name = next(((f, n) for f, n in _DURATIONS if peak >= 2 * f), (1.0, "seconds"))
        return scale, name, False
    if unit == "percentunit":
        return 0.01, "%", False
    if unit == "percent":
        return 1.0, "%", False
    if unit == "bool_yes_no":
        return 1.0, "", True
    return 1.0, "", False


def plot(panel: Panel, result: list[dict[str, Any]], path: Path, span_s: float = 86400.0) -> None:
    """Draw one panel's series over ``span_s`` seconds into the PNG ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(panel, result, span_s)
    fig.savefig(path)
    plt.close(fig)


def figure(panel: Panel, result: list[dict[str, Any]], span_s: float = 86400.0):
    """The matplotlib figure of one panel: its unit on the value axis (whole numbers from 0 for a
    count, stacked; bytes and durations in the largest unit that fits; no/yes for a 0/1 state)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime
    from matplotlib.ticker import MaxNLocator

    stacked = panel.stacked
    totals: dict[float, float] = {}
    for series in result:  # per time: the sum of the bands when stacked, else the highest line
        for t, v in series["values"]:
            seen = totals.get(float(t), 0.0)
            totals[float(t)] = seen + abs(float(v)) if stacked else max(seen, abs(float(v)))
    peak = max(totals.values(), default=0.0)
    scale, label, whole = value_axis(panel.unit, peak)
    fig, ax = plt.subplots(figsize=(7.5, 3.4), dpi=80)
    if stacked and result:  # a count of disjoint things (GPUs per user): the bands add up to the whole
        times = sorted(totals)
        rows = [[dict((float(t), float(v)) for t, v in series["values"]).get(t, 0.0) / scale for t in times]
                for series in result]
        ax.stackplot([datetime.fromtimestamp(t) for t in times], rows, step="post", alpha=0.85,
                     labels=[legend(panel, series["metric"]) for series in result])
    for series in result if not stacked else ():
        xs = [datetime.fromtimestamp(float(t)) for t, _ in series["values"]]
        ys = [float(v) / scale for _, v in series["values"]]
        ax.plot(xs, ys, label=legend(panel, series["metric"]), linewidth=1.5, drawstyle="steps-post" if whole else "default")
    ax.set_title(panel.title, fontsize=11, loc="left")
    if result:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no data" + (f" (needs {panel.needs})" if panel.needs else ""), ha="center",
                va="center", transform=ax.transAxes, color="grey")
    ax.xaxis.set_major_formatter(mdates.DateFormatter(
        "%m-%d %H:%M" if span_s > 86400 else "%H:%M" if span_s > 3600 else "%H:%M:%S"))
    if panel.unit == "bool_yes_no":
        ax.set_ylim(-0.1, 1.1)
        ax.set_yticks([0, 1], ["no", "yes"])
    elif whole:  # a count: whole numbers from 0, never 0.96 ... 1.04 around a constant
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, max(peak / scale * 1.1, 1))
    elif result and panel.unit in ("percentunit", "percent", "bytes", "s"):
        ax.set_ylim(bottom=0)
    ax.tick_params(labelsize=8)
    ax.set_ylabel(label, fontsize=9)
    ax.set_xlabel("local time", fontsize=8)
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    return fig


def build_report(url: str, since_s: int, out: Path, end: float | None = None) -> Path:
    """Query every panel over the last ``since_s`` seconds, plot each, write ``out/index.html``."""
    end = end or time.time()
    start = end - since_s
    step = max(since_s / POINTS, 1.0)
    out.mkdir(parents=True, exist_ok=True)
    images: list[PanelImage] = []
    for d in DASHBOARDS:
        for i, panel in enumerate(d.panels):
            result = query_range(url, panel.expr, start, end, step)
            name = f"{d.uid}-{i + 1}.png"
            plot(panel, result, out / name, since_s)
            images.append(PanelImage(d.title, panel, name, len(result)))
    page = ["<!doctype html><meta charset='utf-8'><title>det-lab monitoring report</title>",
            f"<h1>det-lab monitoring report</h1><p>{html.escape(time.strftime('%Y-%m-%d %H:%M', time.localtime(start)))}"
            f" to {html.escape(time.strftime('%Y-%m-%d %H:%M', time.localtime(end)))}, from {html.escape(url)}</p>"]
    for title in dict.fromkeys(img.dashboard for img in images):
        page.append(f"<h2>{html.escape(title)}</h2>")
        for img in (i for i in images if i.dashboard == title):
            page.append(f"<figure><img src='{img.file}' alt='{html.escape(img.panel.title)}'>"
                        f"<figcaption><code>{html.escape(img.panel.expr)}</code> ({img.series} series)</figcaption></figure>")
    index = out / "index.html"
    index.write_text("\n".join(page) + "\n")
    return index
