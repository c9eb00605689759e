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

from det_lab.monitoring.dashboards import DASHBOARDS, Panel

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
POINTS = 240


class ReportError(RuntimeError):
    """Prometheus did not answer, or a bad period."""


def parse_duration(text: str) -> int:
    """``7d``, ``12h``, ``30m`` in seconds; ValueError for anything else."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{text!r} is not a period such as 7d, 12h or 30m")
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


def plot(panel: Panel, result: list[dict[str, Any]], path: Path, span_s: float = 86400.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    for series in result:
        xs = [datetime.fromtimestamp(float(t)) for t, _ in series["values"]]
        ys = [float(v) for _, v in series["values"]]
        ax.plot(xs, ys, label=legend(panel, series["metric"]), linewidth=1.5)
    ax.set_title(panel.title, fontsize=10, loc="left")
    if result:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no data" + (f" (needs {panel.needs})" if panel.needs else ""), ha="center",
                va="center", transform=ax.transAxes, color="grey")
    ax.xaxis.set_major_formatter(mdates.DateFormatter(
        "%m-%d %H:%M" if span_s > 86400 else "%H:%M" if span_s > 3600 else "%H:%M:%S"))
    ax.tick_params(labelsize=7)
    ax.set_ylabel(panel.unit, fontsize=7)
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
