"""``det-lab slurm ...``: the Slurm cluster's configuration, images, searches and CI template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, out_dir, renamed_option, state

if TYPE_CHECKING:
    from det_lab.settings import LabSettings
    from det_lab.slurm.settings import SlurmSettings

app = typer.Typer(
    help="Slurm as the second scheduler: cluster config, Apptainer images, Optuna searches, GitLab CI.",
    no_args_is_help=True,
)

_META_KEY = "det_lab.slurm_config"


@app.callback()
def _slurm(
    ctx: typer.Context,
    slurm_config: Path | None = typer.Option(
        None, "--slurm-config", envvar="DET_LAB_SLURM_CONFIG",
        help="Slurm config file (default: <data_root>/.det-lab/slurm.yaml, else built-in defaults).",
    ),
) -> None:
    ctx.meta[_META_KEY] = slurm_config


def say(what: object) -> None:
    """Print a line (no rich markup read in it) or a rich renderable."""
    console.print(what, highlight=False)


def load(ctx: typer.Context) -> tuple[LabSettings, SlurmSettings]:
    """The lab settings and the Slurm section; a bad file is one error line."""
    from det_lab.slurm.settings import load_slurm_settings

    lab = state(ctx).settings
    return lab, load_slurm_settings(lab, ctx.meta.get(_META_KEY))


def _write(out: Path, files: dict[str, str]) -> None:
    out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")


@app.command()
def config(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", "-o", help=(
        "Write slurm.conf, gres.conf and cgroup.conf into this directory (with accounting: job_submit.lua and "
        "slurmdbd.conf, 0600; default: print them).")),
) -> None:
    """Render slurm.conf, gres.conf and cgroup.conf for the lab's machines (with accounting: slurmdbd.conf too)."""
    from det_lab.slurm.render_accounting import accounting_notes
    from det_lab.slurm.render import render_all, setup_notes

    lab, slurm = load(ctx)
    files = render_all(slurm, lab)
    notes = setup_notes(slurm, lab)
    if out is None:
        for name, text in files.items():
            typer.echo(f"# --- {name} ---")
            typer.echo(text, nl=False)
        if slurm.accounting is not None:
            notes.append("slurmdbd.conf holds the database password: it is written only with --out (mode 0600)")
        notes += accounting_notes(slurm, None)
    else:
        _write(out, files)
        written = list(files)
        if slurm.accounting is not None:
            pw_file, note = _write_slurmdbd(slurm, out)
            written.append("slurmdbd.conf")
            notes += [n for n in (note,) if n] + accounting_notes(slurm, pw_file)
        console.print(f"wrote {', '.join(written)} to {out}", highlight=False)
    for note in notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)


def _write_slurmdbd(slurm: SlurmSettings, out: Path) -> tuple[Path, str | None]:
    """slurmdbd.conf in ``out`` (0600, the Slurm user's), its password generated once: the password's file."""
    from det_lab.slurm.render_accounting import db_password, render_slurmdbd_conf, write_slurmdbd_conf

    try:
        pw_file, password, _ = db_password(slurm.accounting)
        note = write_slurmdbd_conf(out / "slurmdbd.conf", render_slurmdbd_conf(slurm, password), slurm.slurm_user)
    except OSError as exc:
        fail(f"cannot write {out / 'slurmdbd.conf'}: {exc.strerror or exc}")
    return pw_file, note


@app.command()
def search(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The search's name (printed when it was submitted)."),
    as_json: bool = typer.Option(False, "--json", help="The trials and the best one as JSON."),
) -> None:
    """A search's trials (state, value, hyperparameters, run) and the best one so far."""
    from det_lab.slurm.search import SEARCHES_DIR, Search
    from det_lab.volume import VolumeLayout

    settings = state(ctx).settings
    layout = VolumeLayout.from_settings(settings)
    found = [layout.outputs(p) / SEARCHES_DIR / name for p in sorted(settings.projects)]
    found = [d for d in found if (d / "search.json").is_file()]
    if not found:
        fail(f"no search named {name!r} on {settings.data_root} (its name is printed by 'det-lab run --slurm')")
    s = Search(found[0])
    if as_json:
        typer.echo(json.dumps({"trials": s.rows(), "best": s.best()}, default=str))
        return
    from det_lab.services.launch import show_search

    raise typer.Exit(show_search(s, say))


@app.command()
def image(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", "-o", help="Write det-lab-task.def and isaac-lab.def into this "
                                    "directory."),
) -> None:
    """Render Apptainer definition files: the lab's task image and Isaac Lab's."""
    from det_lab.slurm.images import render_images

    lab = state(ctx).settings
    files = render_images(lab)
    if out is None:
        for name, text in files.items():
            typer.echo(f"# --- {name} ---")
            typer.echo(text, nl=False)
        return
    _write(out, files)
    wheels = lab.data_root / ".det-lab" / "wheels"
    console.print(f"wrote {', '.join(files)} to {out}\nbuild (with the wheelhouse filled: pip wheel -w {wheels} "
                  f"det-lab): apptainer build det-lab-task.sif {out / 'det-lab-task.def'}", highlight=False)


@app.command()
def ci(
    out: Path | None = typer.Option(None, "--out", "-o", help="Write .gitlab-ci.yml into this directory (default: print it)."),
    template: str = typer.Option(".", help="The experiment directory (or template name) the pipeline trains."),
    config: str = typer.Option("const.yaml", "--exp-config", help="Its experiment config."),
    old_config: str | None = typer.Option(None, "--config", hidden=True, help="Old spelling of --exp-config."),
    lab_config: str = typer.Option("/etc/det-lab/lab.yaml", help="The lab config on the runner."),
) -> None:
    """Render a .gitlab-ci.yml for a training repository: tests, smoke run, Slurm (or Determined) run."""
    from det_lab.slurm.ci import render_text

    config = renamed_option(config, old_config, "--config", "--exp-config")
    if out is not None:
        out_dir(out, ".gitlab-ci.yml")
    text = render_text(template=template, config=config, lab_config=lab_config)
    if out is None:
        typer.echo(text, nl=False)
        return
    _write(out, {".gitlab-ci.yml": text})
    console.print(f"wrote {out / '.gitlab-ci.yml'}", highlight=False)


@app.command()
def accounts(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
) -> None:
    """Make Slurm's accounts, members and GPU limits match the lab config (sacctmgr): prints the plan
    (add / change / remove); removes only what it made, never root or accounts made by hand."""
    from det_lab.accounting.slurm_accounts import apply, plan, read_state, with_cluster_name

    _, slurm = load(ctx)
    if slurm.accounting is None:
        fail(f"{slurm.source or 'the Slurm config'} has no accounting: section (members, GPU limits): "
             "nothing to make")
    slurm = with_cluster_name(slurm)
    steps = plan(slurm, read_state(slurm.cluster_name))
    for warning in steps.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if not steps.steps:
        console.print(f"Slurm's accounts on cluster {slurm.cluster_name} already match the lab config: "
                      "nothing to change", highlight=False)
        return
    if dry_run:
        for step in steps.steps:
            console.print(f"would {step}", highlight=False, soft_wrap=True)
        console.print(f"{len(steps.steps)} change(s) planned; run without --dry-run to make them", highlight=False)
        return
    n = apply(steps, echo=lambda step: console.print(f"{step}", highlight=False, soft_wrap=True))
    console.print(f"{n} change(s) made on cluster {slurm.cluster_name}", highlight=False)
