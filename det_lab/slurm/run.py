"""``det-lab run <template> --slurm``: a run recorded like a local one, trained inside a Slurm job."""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.settings import LabSettings
from det_lab.slurm import submit
from det_lab.slurm.images import apptainer_prefix, config_image, container_command
from det_lab.slurm.job import JobSpec, passed_env, render_script
from det_lab.slurm.record import SlurmRunRecord
from det_lab.slurm.search import SEARCHES_DIR, Search, array_spec, check_searcher
from det_lab.slurm.settings import SlurmSettings, check_time
from det_lab.runs.run_state import RunStatus


@dataclass(frozen=True)
class Placement:
    """Where a trial runs: partition, nodes and GPUs per node, as Slurm confirmed they exist."""

    partition: str
    nodes: int
    gpus_per_node: int
    time: str | None
    account: str | None = None  # the Slurm account charged (the run's project) when accounting is on


def place(slurm: SlurmSettings, exp_conf: dict[str, Any], partition: str | None, time: str | None,
          account: str | None = None) -> Placement:
    """Check the request against Slurm before anything is created (SlurmError: one line)."""
    if time is not None:
        try:
            check_time(time)
        except ValueError as exc:
            raise submit.SlurmError(f"--time {exc}") from None
    submit.require("sbatch")
    raw = (exp_conf.get("resources") or {}).get("slots_per_trial")
    slots = 1 if raw is None else int(raw)  # 0: a CPU trial, which asks Slurm for no GPU
    # a slurm.yaml names the lab's defaults; without one, Slurm's own defaults apply
    part = partition or (slurm.default if slurm.source else None)
    part, nodes, per_node = submit.plan_resources(part, slots)
    return Placement(part, nodes, per_node, time or (slurm.default_time if slurm.source else None), account)


def job_spec(run: SlurmRunRecord, where: Placement, signal_seconds: int) -> JobSpec:
    state = run.state()
    return JobSpec(name=f"det-lab-{state['name']}"[:60], output=f"{run.dir}/slurm-%j.out", partition=where.partition,
                   time=where.time, account=where.account, nodes=where.nodes, gpus_per_node=where.gpus_per_node,
                   signal_seconds=signal_seconds)


def container(settings: LabSettings, slurm: SlurmSettings, exp_conf: dict[str, Any], cwd: Path,
              command: list[str]) -> dict[str, Any]:
    """How the trial runs in an Apptainer image, when the Slurm config maps the config's image to one."""
    key = config_image(exp_conf)
    sif = slurm.images.get(key)
    if sif is None:
        return {}
    if not sif.is_file():
        raise submit.SlurmError(f"images.{key}: {sif} does not exist: render its definition with 'det-lab slurm "
                                f"image' and build it (apptainer build {sif} <file>.def)")
    return {"image": str(sif), "apptainer": apptainer_prefix(sif, settings, cwd, exp_conf, slurm.binds),
            "container_command": container_command(command, sys.executable)}


def submit_run(run: SlurmRunRecord, settings: LabSettings, slurm: SlurmSettings, where: Placement) -> str:
    """Write the run's job script and submit it; on a refusal the run directory is removed."""
    state = run.state()
    env = {**passed_env(), "DET_LAB_DATA_ROOT": str(settings.data_root)}
    if settings.source is not None:
        env["DET_LAB_CONFIG"] = str(settings.source)
    comment = [f"det-lab run {state['template']} --slurm: run {state['name']}, config {state['config']}",
               "The trial runs through Determined's harness off-cluster, as 'det-lab run --local' does.",
               f"Its record (run.json, train.log, metrics.jsonl): {run.dir}",
               f"Resubmit as is: sbatch {run.job_script}"]
    script = render_script(job_spec(run, where, slurm.signal_seconds), ["-m", "det_lab.slurm.job", str(run.dir)],
                           Path(state["cwd"]), env, comment)
    try:
        image = container(settings, slurm, state["exp_conf"], Path(state["cwd"]), state["command"])
        run.job_script.write_text(script)
        run.update(status=RunStatus.QUEUED.value, user=pwd.getpwuid(os.geteuid()).pw_name, slurm={
            "partition": where.partition, "account": where.account, "nodes": where.nodes,
            "gpus_per_node": where.gpus_per_node, "time": where.time, "script": str(run.job_script), **image})
        job_id = submit.sbatch(str(run.job_script))
    except submit.SlurmError:
        shutil.rmtree(run.dir, ignore_errors=True)
        raise
    run.set_job(job_id)
    return job_id


def submit_search(settings: LabSettings, slurm: SlurmSettings, template_dir: Path, conf: dict[str, Any],
                  source: str, where: Placement, seed: int | None) -> tuple[Search, str]:
    """Create the search's directory and Optuna study, and submit its job array.

    The directory appears whole or not at all, and is removed again if Slurm refuses the job."""
    import datetime as dt
    import json
    import uuid

    import yaml

    from det_lab.runs.expconf import lab_section
    from det_lab.volume import VolumeLayout, atomic_write_text

    from det_lab.runs.local import entry_command
    from det_lab.runs.validate import preflight

    preflight(conf, settings, source)  # what a single run refuses, before any array task fails on it
    searcher = check_searcher(conf, source)
    image = container(settings, slurm, conf, template_dir, entry_command(conf.get("entrypoint") or ""))
    project = lab_section(conf, source).project
    root = VolumeLayout.from_settings(settings).outputs(project) / SEARCHES_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"{template_dir.name}-search-{dt.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"
    staging = Search(root / f".{name}.tmp")
    staging.dir.mkdir()
    (staging.dir / "config.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
    search = Search(root / name)
    atomic_write_text(staging.state_file, json.dumps({
        "name": name, "template": template_dir.name, "template_dir": str(template_dir),
        "config": str(search.dir / "config.yaml"), "source": source, "exp_conf": conf, "searcher": searcher,
        "seed": seed if seed is not None else (conf.get("reproducibility") or {}).get("experiment_seed", 0),
        "array": array_spec(searcher),
        "slurm": {"partition": where.partition, "nodes": where.nodes, "gpus_per_node": where.gpus_per_node,
                  **image},
    }, indent=2) + "\n")
    staging.create_study()
    staging.dir.rename(search.dir)
    spec = JobSpec(name=f"det-lab-{name}"[:60], output=f"{search.dir}/slurm-%A_%a.out", partition=where.partition,
                   time=where.time, account=where.account, nodes=where.nodes, gpus_per_node=where.gpus_per_node,
                   signal_seconds=slurm.signal_seconds, array=array_spec(searcher))
    env = {**passed_env(), "DET_LAB_DATA_ROOT": str(settings.data_root)}
    if settings.source is not None:
        env["DET_LAB_CONFIG"] = str(settings.source)
    comment = [f"det-lab run {template_dir.name} --slurm: search {name} ({searcher['name']}, "
               f"{searcher['max_trials']} trials), config {source}",
               "Each array task asks the Optuna study for a trial and trains it as 'det-lab run --slurm' does.",
               f"Study: {search.dir / 'optuna.journal'} (optuna-dashboard {search.dir / 'optuna.journal'})",
               f"Resubmit as is: sbatch {search.job_script}"]
    search.job_script.write_text(render_script(spec, ["-m", "det_lab.slurm.search", str(search.dir)], template_dir,
                                               env, comment))
    try:
        job_id = submit.sbatch(str(search.job_script))
    except submit.SlurmError:
        shutil.rmtree(search.dir, ignore_errors=True)
        raise
    search.update(job_id=job_id)
    return search, job_id
