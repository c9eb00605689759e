"""``det-lab cluster ...``: render, start, stop and inspect the Determined cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

from det_lab.cli.cluster_common import META_KEY as _META_KEY
from det_lab.cli.cluster_common import load as _load
from det_lab.cli.common import console, err_console, fail, out_dir, print_dry_run, print_json

if TYPE_CHECKING:
    from det_lab.cluster import plan
    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings

app = typer.Typer(
    help="The Determined cluster: master + database on one machine, an agent on every GPU machine.",
    no_args_is_help=True,
)

T = TypeVar("T")


@app.callback()
def _cluster(
    ctx: typer.Context,
    cluster_config: Path | None = typer.Option(
        None, "--cluster-config", envvar="DET_LAB_CLUSTER_CONFIG",
        help="Cluster config file (default: <data_root>/.det-lab/cluster.yaml, else built-in defaults).",
    ),
) -> None:
    ctx.meta[_META_KEY] = cluster_config


def _agents(cluster: ClusterSettings, extra: list[str]) -> list[str]:
    listed = [a for p in cluster.pools for a in p.agents]
    return list(dict.fromkeys(listed + extra)) or [socket.gethostname()]


def _print_plan(p: plan.DeployPlan, as_json: bool) -> None:
    if as_json:
        print_json(p.to_dict())
    else:
        for line in p.lines():
            console.print(line, highlight=False, soft_wrap=True)


def _one_line_errors(errors: list[str], what: str) -> None:
    if errors:
        for e in errors[1:]:
            err_console.print(f"  also: {e}", highlight=False, soft_wrap=True)
        fail(errors[0] if len(errors) == 1 else f"{errors[0]} ({len(errors)} {what} problems)")


def _warn_tracking(lab: LabSettings) -> None:
    from det_lab.cluster.render import tracking_problems

    for problem in tracking_problems(lab):
        err_console.print(f"[bold yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)


def _deploying(action: Callable[[], T]) -> T:
    """Run a deploy step; every failure becomes the failing doctor lines plus one error line."""
    from det_lab.cluster import deploy

    try:
        return action()
    except deploy.PreflightFailed as exc:
        for c in exc.checks:
            err_console.print(f"fail  {c.name}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else ""),
                              highlight=False, soft_wrap=True)
        fail(str(exc))
    except OSError as exc:  # docker's socket, a file it writes
        fail(str(exc))


@app.command()
def config(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", "-o", help="Write master.yaml and agent-<id>.yaml into this "
                                    "directory (default: print them)."),
    agent: list[str] = typer.Option([], "--agent", help="Also render agent.yaml for this agent id."),
) -> None:
    """Render and validate master.yaml and agent.yaml (no secrets in them)."""
    import yaml

    from det_lab.cluster.render import publish_task_config, render_agent, render_master
    from det_lab.cluster.schema import agent_errors, master_errors

    if out is not None:
        out_dir(out, "master.yaml")
    lab, cluster = _load(ctx)
    master = render_master(lab, cluster)
    errors = [f"master.yaml: {e}" for e in master_errors(master)]
    agents: dict[str, dict] = {}
    for agent_id in _agents(cluster, agent):
        agents[agent_id] = render_agent(cluster, agent_id)
        errors += [f"agent-{agent_id}.yaml: {e}" for e in agent_errors(agents[agent_id], master)]
    _one_line_errors(errors, "config")
    _warn_tracking(lab)
    if cluster.default_task is None and not cluster.users:
        err_console.print("note: tasks of users not linked to a Unix identity run as root, which a root_squash "
                          "NFS export refuses; run 'det-lab cluster link-users' or set default_task",
                          highlight=False, soft_wrap=True)
    docs = {"master.yaml": master, **{f"agent-{a}.yaml": conf for a, conf in agents.items()}}
    if out is None:
        for name, conf in docs.items():
            typer.echo(f"# --- {name} ---")
            typer.echo(yaml.safe_dump(conf, sort_keys=False), nl=False)
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, conf in docs.items():
            (out / name).write_text(yaml.safe_dump(conf, sort_keys=False))
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")
    console.print(f"wrote {', '.join(docs)} to {out} (security.initial_user_password is added "
                  "only to the private copy 'cluster up' writes)", highlight=False, soft_wrap=True)
    # a master deployed from these files gives every task DET_LAB_CONFIG: the file it names must exist
    if lab.data_root.is_dir():
        console.print(f"tasks read the lab config {publish_task_config(lab)}", highlight=False, soft_wrap=True)
    else:
        err_console.print(f"warning: {lab.data_root} is not mounted here: run this again where it is, or tasks "
                          "started from these files find no lab config", highlight=False, soft_wrap=True)


@app.command()
def password() -> None:
    """Create the admin and database passwords if missing; the admin password is shown only then."""
    from det_lab.cluster.secrets import ensure_cluster_secrets, private_dir

    directory = private_dir()
    try:
        secrets = ensure_cluster_secrets(directory)
    except OSError as exc:
        fail(str(exc))
    _announce_password(secrets.admin)


def _announce_password(admin) -> None:
    if admin.created:
        console.print(f"admin password (shown this once; stored mode 0600 in {admin.path}): {admin.value}",
                      highlight=False, soft_wrap=True)
        console.print("log in with: det user login admin (the 'determined' user gets the same password)",
                      highlight=False)
    else:
        console.print(f"admin password already set; it is in {admin.path} (not shown)", highlight=False)


@app.command()
def up(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    agent_id: str = typer.Option(socket.gethostname(), "--agent-id", help="Id of the local agent."),
    password_file: Path | None = typer.Option(
        None, "--password-file", help="A 0600 file with the initial admin password (default: generate one)."),
) -> None:
    """Start database, master and a local agent on this machine (after det-lab doctor passes)."""
    from det_lab.cluster import deploy, plan
    from det_lab.cluster.secrets import private_dir

    lab, cluster = _load(ctx)
    private = private_dir()
    _one_line_errors(deploy.config_errors(lab, cluster, [agent_id]), "config")
    _warn_tracking(lab)
    if dry_run:
        _print_plan(plan.up_plan(lab, cluster, private, agent_id, password_file), as_json)
        return
    prepared = _deploying(lambda: deploy.up(lab, cluster, private, agent_id, admin_password_file=password_file,
                                            out=lambda s: console.print(s, highlight=False)))
    _announce_password(prepared.secrets.admin)
    console.print(f"cluster up: {cluster.master_url} (agent {agent_id} in pool {prepared.pool!r})", highlight=False)


@app.command("agent-up")
def agent_up(
    ctx: typer.Context,
    master: str = typer.Argument(..., help="The master machine: host or host:port."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    pool: str | None = typer.Option(None, "--pool", help="Resource pool (default: the pool listing this agent)."),
    agent_id: str = typer.Option(socket.gethostname(), "--agent-id", help="Id of this agent (unique)."),
) -> None:
    """Start an agent on this GPU machine that joins MASTER."""
    from det_lab.cluster import deploy, plan
    from det_lab.cluster.render import task_config_problem
    from det_lab.cluster.secrets import private_dir

    lab, cluster = _load(ctx, master)
    if pool is not None and pool not in cluster.pool_names():
        fail(f"--pool {pool!r}: the cluster config defines no such pool (pools: {', '.join(cluster.pool_names())})")
    private = private_dir()
    if dry_run:
        _print_plan(plan.agent_plan(cluster, private, agent_id, pool), as_json)
        return
    path = _deploying(lambda: deploy.agent_up(lab, cluster, private, agent_id, pool))
    console.print(f"agent {agent_id} started with {path}; it joins {cluster.master_url}", highlight=False)
    stale = task_config_problem(lab)  # left as the master machine wrote it: say so, change nothing
    if stale:
        err_console.print(f"warning: {stale} (written by the master machine; this machine's config is not used "
                          "by tasks: run 'det-lab cluster up' there to change it)", highlight=False, soft_wrap=True)


@app.command()
def down(
    ctx: typer.Context,
    delete_db: bool = typer.Option(False, "--delete-db", help="Also delete the database volume (all history!)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Name the containers, network and database volume it "
                                 "would remove; touch nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
) -> None:
    """Stop this machine's master, database and agents (the database volume is kept)."""
    from det_lab.cluster import deploy

    _lab, cluster = _load(ctx)
    if dry_run:
        plan = deploy.down_plan(cluster, delete_db=delete_db)
        if as_json:
            print_json(plan.as_dict())
            return
        print_dry_run(plan.lines(), f"dry run: nothing stopped or removed; 'det-lab cluster down"
                      f"{' --delete-db' if delete_db else ''}' does this")
        return
    deploy.down(cluster, delete_db=delete_db)
    console.print("cluster containers on this machine stopped", highlight=False)


@app.command()
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="The containers and whether the master answers as JSON."),
) -> None:
    """The cluster's containers on this machine and whether the master answers."""
    from det_lab.cluster import deploy

    _lab, cluster = _load(ctx)
    client = deploy.docker_client()
    rows = deploy.cluster_containers(cluster, client)
    ok, detail = deploy.master_answers(cluster.master_url)
    if as_json:
        print_json({"containers": [r.as_dict() for r in rows],
                    "master": {"url": cluster.master_url, "answers": ok, "detail": detail}})
        raise typer.Exit(0 if ok else 1)
    for r in rows:
        console.print(f"{r.role:<9} {r.name:<32} {r.status:<10} {r.image}", highlight=False)
    if not rows:
        console.print("no cluster containers on this machine", highlight=False)
    console.print(f"master    {cluster.master_url}: {'answers' if ok else 'unreachable'} ({detail})", highlight=False)
    if not ok:
        raise typer.Exit(1)


@app.command()
def logs(
    ctx: typer.Context,
    tail: int = typer.Option(50, "--tail", "-n", help="Lines per container."),
    as_json: bool = typer.Option(False, "--json", help="Each container's lines as one JSON object."),
) -> None:
    """The last lines of each cluster container's log (follow one with: docker logs -f NAME)."""
    from det_lab.cluster import deploy

    _lab, cluster = _load(ctx)
    by_container: dict[str, list[str]] = {}
    client = deploy.docker_client()
    for name, line in deploy.container_logs(cluster, client, tail):
        if as_json:
            by_container.setdefault(name, []).append(line)
        else:
            console.print(f"{name} | {line}", highlight=False, markup=False, soft_wrap=True)
    if as_json:
        print_json({"containers": by_container})


def _det_as_admin(what: str) -> tuple[str, dict[str, str]]:
    """The ``det`` CLI and an environment that logs it in as the cluster's admin."""
    from det_lab.cluster.secrets import ADMIN_PASSWORD_FILE, SecretError, private_dir, read_private

    det = shutil.which("det", path=str(Path(sys.executable).parent)) or shutil.which("det")
    if det is None:
        fail("the 'det' CLI is not installed: pip install determined==0.38.1")
    try:
        admin_pw = read_private(private_dir() / ADMIN_PASSWORD_FILE)
    except SecretError as exc:
        fail(f"{exc} ({what} as the admin who ran 'det-lab cluster up')")
    return det, {**os.environ, "DET_USER": "admin", "DET_PASS": admin_pw}


@app.command("link-users")
def link_users(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the det commands; run nothing."),
) -> None:
    """Link Determined users to Unix uid/gid (tasks then never run as root on the NFS volume)."""
    from det_lab.cluster.users import user_links

    lab, cluster = _load(ctx)
    links = user_links(lab, cluster)
    master = lab.master_url or cluster.master_url
    if dry_run:
        for link in links:
            typer.echo(link.command(master=master))
        return
    det, env = _det_as_admin("run link-users")
    for link in links:
        proc = subprocess.run(link.argv(det, master), env=env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            reason = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
            fail(f"linking {link.det_user}: {reason} (create the user first: det user create {link.det_user})")
        console.print(f"linked {link.det_user} -> uid {link.identity.uid} ({link.identity.user}), "
                      f"gid {link.identity.gid} ({link.identity.group})", highlight=False)


@app.command()
def template(
    ctx: typer.Context,
    name: str | None = typer.Option(None, help="Template name in Determined (default: det-lab, det-lab-notebook)."),
    out: Path | None = typer.Option(None, "--out", help="Write <name>-template.yaml into this directory "
                                    "(default: print it)."),
    apply: bool = typer.Option(False, "--apply", help="Register it with the master: created, or updated when it exists."),
    notebook: bool = typer.Option(False, "--notebook", help="The JupyterLab template: also the lab's idle "
                                  "timeout (notebooks.idle_timeout; lengthen one with --config idle_timeout=8h)."),
) -> None:
    """Render det_lab's config template (volume mounts, variables) and optionally register it.

    JupyterLab, commands and experiments started with '--template det-lab' (or picked in the
    Web UI) then see the NFS volume at its host paths.
    """
    import yaml

    from det_lab.cluster.render import render_notebook_template, render_task_template
    from det_lab.cluster.config_template import apply_template
    from det_lab.cluster.secrets import private_dir

    name = name or ("det-lab-notebook" if notebook else "det-lab")
    path = None if out is None else out_dir(out, f"{name}-template.yaml") / f"{name}-template.yaml"
    lab, cluster = _load(ctx)
    _warn_tracking(lab)
    render = render_notebook_template if notebook else render_task_template
    text = yaml.safe_dump(render(lab, cluster), sort_keys=False)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as exc:
            fail(f"cannot write to {out}: {exc.strerror or exc}")
        console.print(f"wrote {path}", highlight=False)
    elif not apply:
        typer.echo(text, nl=False)
    if not apply:
        return
    det, env = _det_as_admin("register the template")
    master = lab.master_url or cluster.master_url
    if path is None:
        path = private_dir() / f"{name}-template.yaml"
        path.write_text(text)
    done = apply_template(det, master, name, path, env, lab)
    console.print(f"{done} template {name!r} on {master}", highlight=False)
