"""``det-lab gpus``: this machine's GPUs, who holds each (a run's lease or a process outside det-lab), the
leases of every other machine on the volume, and the line."""

from __future__ import annotations

import datetime as dt
import time

import typer

from det_lab.cli.common import console, print_json, state


def _since(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M")


def _clock(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch).strftime("%H:%M:%S")


def gpus(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="GPUs, holders and the line as one JSON object."),
) -> None:
    """Each GPU of this machine: holder (user and run, or a process outside det-lab), since, memory,
    utilisation; the leases every other machine writing to the volume holds (and those whose holder
    stopped beating: killed, or its machine down); and the runs waiting in line (det-lab run --local --queue)."""
    from det_lab.gpus import gpus_status

    status = gpus_status(state(ctx).settings)
    if as_json:
        print_json(status)
        return
    from rich.table import Table

    if not status["gpus"]:
        console.print(f"{status['host']}: no GPU that NVML sees (runs here train on the CPU)", highlight=False)
    table = Table("GPU", "model", "holder", "since", "memory", "util", title=f"GPUs of {status['host']}",
                  title_justify="left")
    for g in status["gpus"]:
        h = g["holder"]
        if h is None:
            who, since = "free", ""
        elif h["kind"] == "lease":
            who, since = f"{h['user']}: run {h['run']} (pid {h['pid']})", _since(h["since"])
        else:
            who = "outside det-lab: " + ", ".join(f"{p['user'] or '?'} pid {p['pid']} {p['command'] or '?'} "
                                                  f"({p['memory'] / 2**20:,.0f} MiB)" for p in h["processes"])
            since = ""
        util = "" if g["utilization"] is None else f"{g['utilization']:.0f}%"
        table.add_row(str(g["index"]), g["name"], who, since,
                      f"{g['memory_used'] / 2**30:.1f} / {g['memory_total'] / 2**30:.1f} GiB", util)
    if status["gpus"]:
        console.print(table)
    now = time.time()
    for o in status["other_hosts"]:
        how = (f"heartbeat {max(now - o['heartbeat'], 0):.0f} s ago" if "heartbeat" in o
               else "as its journal says; not checked from here")
        console.print(f"{o['host']}: GPU {','.join(map(str, o['gpus']))} held by {o['user']} run {o['run']} since "
                      f"{_since(o['since'])} ({how})", highlight=False)
    for o in status.get("silent", []):
        console.print(f"{o['host']}: GPU {','.join(map(str, o['gpus']))} of {o['user']} run {o['run']} (since "
                      f"{_since(o['since'])}): no heartbeat since {_clock(o['silent_since'])}: its holder died, or "
                      f"{o['host']} is down or cut off; not counted as held", highlight=False)
    if status["queue"]:
        line = Table("#", "run", "user", "GPUs", "waiting since", "why", title="waiting in line", title_justify="left")
        for q in status["queue"]:
            line.add_row(str(q["position"]), q["run"], q["user"],
                         ",".join(map(str, q["picks"])) if q["picks"] else str(q["gpus"]), _since(q["since"]), q["waiting"])
        console.print(line)
    else:
        console.print("no run waiting for GPUs", highlight=False)
