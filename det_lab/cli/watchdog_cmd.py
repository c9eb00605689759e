"""``det-lab watchdog [--dry-run] [--once]``, ``det-lab watchdog snooze JOB 2h``, ``det-lab watchdog status``."""

from __future__ import annotations


import typer

from det_lab.cli.common import console, print_json, state

app = typer.Typer(help="The idle-GPU watchdog: warn the holder of a GPU held and idle, then stop it "
                       "(see docs/admin/watchdog.md). Without a command: run the service.",
                  invoke_without_command=True)


@app.callback()
def watchdog(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Judge and say what would be done; write, send and "
                                 "stop nothing."),
    once: bool = typer.Option(False, "--once", help="One pass, then exit (the window needs earlier passes: "
                              "run it from a timer no slower than watchdog.interval)."),
    passes: int | None = typer.Option(None, "--passes", help="Stop after this many passes."),
    node: str | None = typer.Option(None, "--node", help="This machine's Slurm node name (default: its host name)."),
) -> None:
    """Sample this machine's GPUs every watchdog.interval and act on idle holders (a systemd service,
    rendered by det-lab monitor config)."""
    if ctx.invoked_subcommand is not None:
        return
    import logging

    from det_lab.watchdog import Watchdog

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    dog = Watchdog(state(ctx).settings, node=node, dry_run=dry_run,
                   say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    try:
        dog.serve(passes=1 if once else passes)
    except KeyboardInterrupt:
        pass


@app.command()
def snooze(
    ctx: typer.Context,
    job: str = typer.Argument(..., help="A Slurm job id, det_lab run name or Determined task id."),
    duration: str = typer.Argument(..., help="How long: 30m, 2h ... (at most watchdog.snooze_limit)."),
) -> None:
    """Keep your idle job from being warned or stopped for a while."""
    from det_lab.watchdog import snooze as do_snooze

    entry = do_snooze(state(ctx).settings, job, duration)
    console.print(f"snoozed {job} until {entry['until_time']}", highlight=False)


@app.command()
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="As one JSON object."),
) -> None:
    """What the watchdog last did to each holder, the snoozes in force and the exemptions."""
    from det_lab.watchdog import status as read_status

    result = read_status(state(ctx).settings)
    if as_json:
        print_json(result)
        return
    for e in result["holders"]:
        console.print(f"{e['time']}  {e['event']:<8} {e['message']}", highlight=False, soft_wrap=True)
    for s in result["snoozes"]:
        console.print(f"snoozed  {s['target']} until {s['until_time']} (by {s['by']})", highlight=False)
    for x in result["exemptions"]:
        who = ", ".join(f"{k}={x[k]}" for k in ("user", "partition", "job_name") if x.get(k))
        console.print(f"exempt   {who} until {x['until']}{' (expired)' if x['expired'] else ''} {x['reason']}",
                      highlight=False)
    if not any(result[k] for k in ("holders", "snoozes", "exemptions")):
        console.print(f"nothing yet ({result['journal']})", highlight=False)
