"""``det-lab slurm ...``: the Slurm cluster's configuration, images, searches and CI template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import console, err_console, fail, state

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


def load(ctx: typer.Context) -> tuple[LabSettings, SlurmSettings]:
    """The lab settings and the Slurm section; a bad file is one error line."""
    from det_lab.slurm.settings import SlurmConfigError, load_slurm_settings

    lab = state(ctx).settings
    try:
        return lab, load_slurm_settings(lab, ctx.meta.get(_META_KEY))
    except SlurmConfigError as exc:
        fail(str(exc))  # a member's key reads accounting.members[alice].gpu_limit


def _write(out: Path, files: dict[str, str]) -> None:
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
        "Write slurm.conf, gres.conf and cgroup.conf here (with accounting: job_submit.lua and slurmdbd.conf, 0600).")),
) -> None:
    """Render slurm.conf, gres.conf and cgroup.conf for the lab's machines (with accounting: slurmdbd.conf too)."""
    from det_lab.slurm.accounting_conf import accounting_notes
    from det_lab.slurm.conf import render_all, setup_notes

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
    from det_lab.cluster.secrets import SecretError
    from det_lab.slurm.accounting_conf import db_password, render_slurmdbd_conf, write_slurmdbd_conf

    try:
        pw_file, password, _ = db_password(slurm.accounting)
        note = write_slurmdbd_conf(out / "slurmdbd.conf", render_slurmdbd_conf(slurm, password), slurm.slurm_user)
    except SecretError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out / 'slurmdbd.conf'}: {exc.strerror or exc}")
    return pw_file, note


def run_slurm(ctx: typer.Context, template: str, config: Path | None, sets: list[str], partition: str | None,
              time_limit: str | None, wait: bool, seed: int | None) -> None:
    """``det-lab run T --slurm``: the run recorded on the volume, its trial submitted as a Slurm job."""
    from det_lab.slurm import run as slurm_run
    from det_lab.slurm import submit
    from det_lab.slurm.record import SlurmRunRecord
    from det_lab.slurm.search import is_search
    from det_lab.trials import local

    settings, slurm = load(ctx)
    try:
        tdir = local.resolve_template(template)
        _, conf = local.load_config(tdir, config)
        conf = apply_sets(conf, sets)
        where = slurm_run.place(slurm, conf, partition, time_limit, charged_account(slurm, conf, str(config or tdir)))
        if is_search(conf):
            search, job_id = slurm_run.submit_search(settings, slurm, tdir, conf, str(config or tdir), where, seed)
        else:
            run_, _, _ = local.prepare(settings, template, config, False, seed, record_cls=SlurmRunRecord,
                                       overrides=list(sets))
            job_id = slurm_run.submit_run(run_, settings, slurm, where)
    except (local.RunError, submit.SlurmError, ValueError) as exc:
        fail(str(exc))
    if is_search(conf):
        st = search.state()
        n, _, c = st["array"].removeprefix("0-").partition("%")
        console.print(f"search {st['name']}: Slurm job array {job_id} ({int(n) + 1} trials, at most {c} at a time)\n"
                      f"  job script: {search.job_script}\n  study: {search.dir / 'optuna.journal'}\n"
                      f"  table: det-lab slurm search {st['name']}\n"
                      f"  dashboard: optuna-dashboard {search.dir / 'optuna.journal'}", highlight=False)
        if wait:
            submit.wait_array(job_id)
            raise typer.Exit(_search_table(search))
        return
    st = run_.state()
    gpus = f", {where.nodes} node(s) x {where.gpus_per_node} GPU(s)" if where.gpus_per_node else ""
    console.print(f"run {st['name']}: Slurm job {job_id} (partition {where.partition}{gpus})\n"
                  f"  hyperparameters: {json.dumps(st['hparams'])}\n  job script: {run_.job_script}\n"
                  f"  log: {run_.log_file}\n  follow: det-lab runs tail -f {st['name']}", highlight=False)
    if wait:
        raise typer.Exit(wait_for(run_, job_id))


def charged_account(slurm: SlurmSettings, conf: dict, source: str) -> str | None:
    """With accounting, the run's project: the Slurm account it charges, after checking that Slurm's
    limits can ever admit its GPUs (one line naming the limit when they cannot)."""
    if slurm.accounting is None:
        return None
    import os
    import pwd

    from det_lab.accounting.limits import limits_for, refusal
    from det_lab.accounting.sync import AccountingError
    from det_lab.trials.expconf import lab_section

    project = lab_section(conf, source).project
    raw = (conf.get("resources") or {}).get("slots_per_trial")
    gpus = 1 if raw is None else int(raw)
    user = pwd.getpwuid(os.geteuid()).pw_name
    try:
        why = refusal(limits_for(slurm.cluster_name, user, project), gpus, str(slurm.source or "slurm.yaml"))
    except AccountingError as exc:
        raise ValueError(str(exc)) from None
    if why:
        raise ValueError(why)
    return project


def wait_for(run_, job_id: str) -> int:
    """Follow the job until it has ended for good; the trial's outcome as an exit code."""
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from det_lab.slurm import submit

    st = run_.state()
    total = st["max_length"] if st.get("max_length_unit") == "batches" else None
    show = sys.stderr.isatty() or sys.stdout.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task(f"job {job_id}", total=total)

        def changed(job: dict[str, str]) -> None:
            where = f" on {job['NodeList']}" if job.get("NodeList") not in (None, "", "(null)") else ""
            restarts = f" (restart {job['Restarts']})" if job.get("Restarts", "0") != "0" else ""
            bar.console.print(f"job {job_id}: {job.get('JobState')}{where}{restarts}", highlight=False)

        def tick() -> None:
            step, _ = run_.progress()
            bar.update(task, completed=step)

        try:
            job = submit.wait(job_id, on_change=changed, tick=tick)
        except KeyboardInterrupt:
            console.print(f"stopped waiting; job {job_id} goes on (cancel it with: det-lab runs cancel {st['name']})",
                          highlight=False)
            return 130
        tick()
    st = run_.state()
    step, val = run_.progress()
    status = st.get("status")
    if status not in ("finished", "stopped", "failed"):
        status = (job or {}).get("JobState", "gone").lower()  # the job ended before the trial could say
    metrics = ", ".join(f"{k}={v:.5g}" for k, v in val.items() if k not in ("batches", "epochs"))
    console.print(f"{st['name']}: {status} at step {step} of {st['max_length']}; latest checkpoint "
                  f"{st.get('latest_checkpoint')}" + (f"; last validation {metrics}" if metrics else ""),
                  highlight=False)
    if status == "finished":
        return 0
    from det_lab.trials import local

    console.print(local.tail(run_.log_file), highlight=False)
    return int(st.get("exit_code") or 0) or 1


def apply_sets(conf: dict, sets: list[str]) -> dict:
    """``--set KEY=VALUE`` overrides applied to an experiment config (ValueError: one line)."""
    if not sets:
        return conf
    from det_lab.templates import TemplateError, apply_overrides

    try:
        return apply_overrides(conf, list(sets))
    except TemplateError as exc:
        raise ValueError(str(exc)) from None


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
    raise typer.Exit(_search_table(s))


def _search_table(s) -> int:
    """Print the search's table; 0 when there is a best trial."""
    from rich.table import Table

    st = s.state()
    metric = st["searcher"]["metric"]
    table = Table("trial", "task", "state", f"{metric}", "step", "hyperparameters", "run",
                  title=f"search {st['name']} ({st['searcher']['name']}, {st['array']})", title_justify="left")
    for r in s.rows():
        value = f"{r['value']:.5g}" if r["value"] is not None else ""
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        table.add_row(str(r["number"]), str(r["array_task"]), r["state"], value, str(r["step"] or ""), params,
                      str(r["run"]))
    console.print(table)
    best = s.best()
    if best is None:
        console.print("best: none yet (no trial has finished)", highlight=False)
        return 1
    console.print(f"best: trial {best['number']} {metric}={best['value']:.5g} run {best['run']} "
                  f"params {json.dumps(best['params'])}", highlight=False)
    console.print(f"dashboard: optuna-dashboard {s.dir / 'optuna.journal'}", highlight=False)
    return 0


@app.command()
def image(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", "-o", help="Write det-lab-task.def and isaac-lab.def here."),
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
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the pipeline to this file."),
    template: str = typer.Option(".", help="The experiment directory (or template name) the pipeline trains."),
    config: str = typer.Option("const.yaml", help="Its experiment config."),
    lab_config: str = typer.Option("/etc/det-lab/lab.yaml", help="The lab config on the runner."),
) -> None:
    """Render a .gitlab-ci.yml for a training repository: tests, smoke run, Slurm (or Determined) run."""
    from det_lab.slurm.ci import render_text

    text = render_text(template=template, config=config, lab_config=lab_config)
    if out is None:
        typer.echo(text, nl=False)
        return
    _write(out.parent, {out.name: text})
    console.print(f"wrote {out}", highlight=False)


@app.command()
def accounts(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
) -> None:
    """Make Slurm's accounts, members and GPU limits match the lab config (sacctmgr): prints the plan
    (add / change / remove); removes only what it made, never root or accounts made by hand."""
    from det_lab.accounting.sync import AccountingError, apply, plan, read_state, with_cluster_name

    _, slurm = load(ctx)
    if slurm.accounting is None:
        fail(f"{slurm.source or 'the Slurm config'} has no accounting: section (members, GPU limits): "
             "nothing to make")
    try:
        slurm = with_cluster_name(slurm)
        steps = plan(slurm, read_state(slurm.cluster_name))
    except AccountingError as exc:
        fail(str(exc))
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
    try:
        n = apply(steps, echo=lambda step: console.print(f"{step}", highlight=False, soft_wrap=True))
    except AccountingError as exc:
        fail(str(exc))
    console.print(f"{n} change(s) made on cluster {slurm.cluster_name}", highlight=False)
