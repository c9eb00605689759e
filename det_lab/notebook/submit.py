"""Submitting a run from a notebook and watching it: a cluster when its master answers, else a
local run (:func:`choose_mode`); :func:`best_checkpoint` of the result.

``DET_LAB_NOTEBOOK_CONFIG`` names the experiment config :func:`submit` uses and
``DET_LAB_DET_TEMPLATE`` the config template registered with the master (``det-lab``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from det_lab.errors import UserError
from det_lab.cluster.schema import SHARED_FS_CONTAINER_PATH
from det_lab.net import http_answers
from det_lab.notebook.plots import output_dir
from det_lab.settings import LabSettings, load_settings
from det_lab.runs import local
from det_lab.runs.expconf import project_of, searcher_metric
from det_lab.runs.record import LocalRunRecord, open_record
from det_lab.volume import VolumeLayout

CONFIG_ENV = "DET_LAB_NOTEBOOK_CONFIG"
DET_TEMPLATE_ENV = "DET_LAB_DET_TEMPLATE"
DEFAULT_DET_TEMPLATE = "det-lab"

Mode = Literal["cluster", "local"]


def master_url(settings: LabSettings | None = None) -> str | None:
    """The lab's ``master_url`` (or ``DET_LAB_MASTER``); inside a Determined task, ``DET_MASTER``."""
    settings = settings or load_settings()
    url = settings.master_url or os.environ.get("DET_MASTER")
    if url and "://" not in url:
        url = f"http://{url}"
    return url.rstrip("/") if url else None


def master_reachable(settings: LabSettings | None = None, timeout: float = 3.0) -> bool:
    """Whether ``GET <master>/info`` answers; False when no master is configured."""
    url = master_url(settings)
    return bool(url) and http_answers(f"{url}/info", timeout)[0]


def choose_mode(settings: LabSettings | None = None, timeout: float = 3.0) -> Mode:
    """``cluster`` when the master answers, else ``local``; says which and why."""
    settings = settings or load_settings()
    url = master_url(settings)
    if url and master_reachable(settings, timeout):
        print(f"Determined master {url} is reachable: experiments go to the cluster.")
        return "cluster"
    why = (f"master {url} did not answer within {timeout:g} s" if url
           else "no master configured (master_url / DET_LAB_MASTER)")
    print(f"No Determined master reachable ({why}): LOCAL MODE, experiments train on this machine "
          f"with 'det-lab run --local' (data root {settings.data_root}).")
    return "local"



class SubmitError(UserError, RuntimeError):
    """A run that could not start or did not finish, with the reason in the message."""




@dataclass
class CheckpointInfo:
    """One checkpoint of a run: its id, step, directory (when on this machine) and metrics."""

    uuid: str
    step: int
    path: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # validation metrics at that step


@dataclass
class SubmitResult:
    """Where a submitted run is, what it reported and its checkpoints."""

    mode: Mode
    name: str
    template: str
    location: str  # local: the run directory; cluster: the trial's Web UI URL
    status: str  # COMPLETED, or what went wrong
    hparams: dict[str, Any]
    metrics: list[dict[str, Any]]  # {"group", "step", "metrics"} as in metrics.jsonl
    checkpoints: list[CheckpointInfo]
    searcher_metric: str | None = None
    smaller_is_better: bool = True
    experiment_id: int | None = None
    trial_id: int | None = None
    best: CheckpointInfo | None = None  # set on a cluster (the master's top checkpoint)

    def history(self, name: str, group: str = "validation") -> list[tuple[int, float]]:
        """``[(step, value)]`` of one metric."""
        return [(m["step"], m["metrics"][name]) for m in self.metrics
                if m["group"] == group and name in m["metrics"]]

    @property
    def final_metrics(self) -> dict[str, float]:
        """The last validation metrics reported."""
        val = [m for m in self.metrics if m["group"] == "validation"]
        return dict(val[-1]["metrics"]) if val else {}

    @property
    def latest_checkpoint(self) -> CheckpointInfo | None:
        return max(self.checkpoints, key=lambda c: c.step) if self.checkpoints else None


def submit(template: str = "vla", config: str | Path | dict[str, Any] | None = None, *,
           settings: LabSettings | None = None, mode: Mode | None = None, seed: int | None = None,
           det_template: str | None = None, poll: float = 2.0) -> SubmitResult:
    """Run ``template`` with lab defaults and wait for it.

    ``config`` is an experiment config (path or dict); default ``$DET_LAB_NOTEBOOK_CONFIG``, else
    the template's ``const.yaml``. ``mode`` defaults to :func:`choose_mode`: on a cluster the
    experiment is created through ``determined.experimental.client`` with the config template
    ``det_template`` (default ``$DET_LAB_DET_TEMPLATE`` or ``det-lab``; ``""`` for none);
    otherwise it is a ``det-lab run --local`` run on this machine. Interrupting the kernel
    stops a local run gracefully (it checkpoints first).
    """
    settings = settings or load_settings()
    mode = mode or choose_mode(settings)
    if config is None and os.environ.get(CONFIG_ENV):
        config = os.environ[CONFIG_ENV]
    if isinstance(config, dict):
        config = _write_config(config)
    config = Path(config).expanduser().resolve() if config is not None else None
    if mode == "cluster":
        if det_template is None:
            det_template = os.environ.get(DET_TEMPLATE_ENV, DEFAULT_DET_TEMPLATE)
        return _submit_cluster(settings, template, config, det_template or None)
    return _submit_local(settings, template, config, seed, poll)


def best_checkpoint(result: SubmitResult) -> CheckpointInfo | None:
    """The checkpoint with the best searcher metric (the latest one when none was validated)."""
    if result.best is not None:
        return result.best
    metric = result.searcher_metric
    scored = [c for c in result.checkpoints if metric and metric in c.metrics]
    if not scored:
        return result.latest_checkpoint
    pick = min if result.smaller_is_better else max
    return pick(scored, key=lambda c: (c.metrics[metric], -c.step))


def _write_config(conf: dict[str, Any]) -> Path:
    fd, name = tempfile.mkstemp(prefix="config-", suffix=".yaml", dir=output_dir("configs"))
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(conf, f, sort_keys=False)
    return Path(name)


def _submit_local(settings: LabSettings, template: str, config: Path | None, seed: int | None,
                  poll: float) -> SubmitResult:
    try:
        run, cwd, command = local.prepare(settings, template, config, False, seed)
    except (local.RunError, ValueError) as exc:
        raise SubmitError(str(exc)) from None
    st = run.state()
    print(f"local run {st['name']} ({st['max_length']} {st['max_length_unit']})\n"
          f"  run directory: {run.dir}\n  hyperparameters: {json.dumps(st['hparams'])}")
    proc = local.launch(run, cwd, command, settings)
    code = _watch(proc, run, poll)
    if local.record_exit(run, code) == "busy":
        raise SubmitError(local.busy_error(run))
    result = local_result(run.dir, settings)
    if code != 0:
        raise SubmitError(f"run {st['name']} exited with {code}; last log lines:\n"
                          f"{local.tail(run.log_file)}\n"
                          f"(resume: det-lab run {st['template']} --local --resume)")
    print(f"finished: {result.status}; last validation {_fmt(result.final_metrics)}; "
          f"{len(result.checkpoints)} checkpoint(s)")
    return result


def _watch(proc: subprocess.Popen, run: LocalRunRecord, poll: float) -> int:
    """Print each validation as it arrives; Ctrl-C / kernel interrupt stops the run gracefully."""
    seen = 0
    try:
        while True:
            done = proc.poll() is not None
            val = [m for m in run.metrics() if m["group"] == "validation"]
            for m in val[seen:]:
                print(f"  step {m['step']}: {_fmt(m['metrics'])}", flush=True)
            seen = len(val)
            if done:
                return proc.returncode
            time.sleep(poll)
    except KeyboardInterrupt:
        print("interrupted: asking the run to checkpoint and stop")
        return local.stop_gracefully(proc)


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k not in ("batches", "epochs")) or "-"


def local_result(run_dir: Path, settings: LabSettings | None = None) -> SubmitResult:
    """A :class:`SubmitResult` for an existing local run directory."""
    settings = settings or load_settings()
    run = open_record(Path(run_dir))
    st = run.state()
    conf = st.get("exp_conf") or {}
    ckpt_root = VolumeLayout.from_settings(settings).experiment_checkpoints(project_of(conf), conf)
    metrics = run.metrics()
    val = [m for m in metrics if m["group"] == "validation"]
    checkpoints = []
    for c in st.get("checkpoints") or []:
        # Determined attaches to a checkpoint the validation at its step; the latest before it here
        at = [m for m in val if m["step"] <= c["step"]]
        path = ckpt_root / c["uuid"]
        checkpoints.append(CheckpointInfo(c["uuid"], int(c["step"]), path if path.is_dir() else None,
                                          dict(at[-1]["metrics"]) if at else {}))
    status = {"finished": "COMPLETED", "stopped": "STOPPED", "failed": "ERROR"}.get(st.get("status", ""), "RUNNING")
    metric, smaller = searcher_metric(conf)
    return SubmitResult("local", st["name"], st["template"], str(run.dir), status, st["hparams"], metrics,
                        checkpoints, metric, smaller)


def _submit_cluster(settings: LabSettings, template: str, config: Path | None,
                    det_template: str | None) -> SubmitResult:
    """The Determined SDK path (tests/test_determined_templates.py runs it against the master stand-in)."""
    from determined.experimental import client

    from det_lab.runs.validate import check_config

    tdir = local.resolve_template(template)
    cfg_path, conf = local.load_config(tdir, config)
    lab = check_config(conf, str(cfg_path))  # what the master or det_lab would refuse, said before submitting
    storage = conf.get("checkpoint_storage") or {}
    if storage.get("type", "shared_fs") == "shared_fs" and not storage.get("storage_path"):
        # where a local run of it keeps them: checkpoints/<project>, not the master's checkpoints/
        layout = VolumeLayout.from_settings(settings)
        path = layout.project_checkpoints(lab.project).relative_to(layout.root)
        conf = {**conf, "checkpoint_storage": {**storage, "type": "shared_fs", "storage_path": str(path)}}
    url = master_url(settings)
    # credentials: DET_USER/DET_PASS, a prior 'det user login', or the task's token in a Determined JupyterLab
    client.login(master=url)
    exp = client.create_experiment(conf, model_dir=str(tdir), template=det_template)
    print(f"experiment {exp.id} created from {cfg_path} (template {det_template or 'none'}): "
          f"{url}/det/experiments/{exp.id}/overview")
    state = exp.wait(interval=10)
    if getattr(state, "name", str(state)) != "COMPLETED":
        raise SubmitError(f"experiment {exp.id} ended {getattr(state, 'name', state)}: {url}/det/experiments/{exp.id}")
    try:
        top = exp.top_checkpoint()
    except Exception:  # noqa: BLE001 (no checkpoint: failed early, or checkpoint_policy none)
        top = None
    best = None
    if top is not None:
        path = shared_fs_dir(top)
        how = "read in place on the shared volume"
        if path is None:  # not on a volume this machine mounts: Determined's download copies it here
            path, how = Path(top.download(str(output_dir("checkpoints") / top.uuid))), "downloaded"
        val = (top.training.validation_metrics if top.training else None) or {}
        best = CheckpointInfo(top.uuid, int((top.metadata or {}).get("steps_completed", 0)), path,
                              dict(val.get("avgMetrics", val)))
        print(f"best checkpoint {top.uuid} -> {path} ({how})")
    trials = exp.list_trials()
    best_trial = top.training.trial_id if top is not None and top.training else None
    trial = next((t for t in trials if t.id == best_trial), trials[0] if trials else None)
    metrics = []
    if trial is not None:
        for group in ("training", "validation"):
            metrics += [{"group": group, "step": m.steps_completed, "metrics": dict(m.metrics)}
                        for m in trial.iter_metrics(group)]
    metric, smaller = searcher_metric(conf)
    where = f"{url}/det/experiments/{exp.id}" + (f"/trials/{trial.id}" if trial else "")
    return SubmitResult("cluster", conf.get("name") or f"experiment {exp.id}", tdir.name, where,
                        "COMPLETED", dict(trial.hparams or {}) if trial else {},
                        metrics, [best] if best else [], metric, smaller, exp.id,
                        trial.id if trial else None, best)


def shared_fs_dir(checkpoint: Any) -> Path | None:
    """A Determined checkpoint's own directory when its experiment stored it on shared_fs and this
    machine mounts that storage; None otherwise.

    ``Checkpoint.download`` copies a shared_fs checkpoint tree (Determined 0.38.1
    ``harness/determined/common/experimental/checkpoint/_checkpoint.py`` l.278-283, ``copytree``),
    which for a multi-GB checkpoint on the volume is slow and doubles it on disk; this reads it
    where it is. The places looked at are Determined's own (``_find_shared_fs_path`` l.163-188):
    ``host_path``/``storage_path``, then the same under ``/determined_shared_fs`` (inside a task).
    """
    training = getattr(checkpoint, "training", None)
    conf = (getattr(training, "experiment_config", None) or {}) if training is not None else {}
    storage = conf.get("checkpoint_storage") or {}
    host = storage.get("host_path")
    if storage.get("type") != "shared_fs" or not host or not os.path.isabs(host):
        return None
    full = os.path.normpath(os.path.join(host, storage.get("storage_path") or "."))
    rel = os.path.relpath(full, host)
    if rel == ".." or rel.startswith("../"):
        return None
    for base in (host, SHARED_FS_CONTAINER_PATH):
        found = Path(base, rel, checkpoint.uuid)
        if found.is_dir():
            return found
    return None


# --- the config template JupyterLab and experiments start from ------------------------------------


def det_template(lab: LabSettings | None = None, cluster: Any = None) -> dict[str, Any]:
    """The Determined config template ``det-lab`` (see ``det-lab cluster template``): the volume's
    bind mounts, det_lab's environment variables and the lab's task image, experiment-config keys
    only, so it serves ``det notebook start --template det-lab`` and experiments alike."""
    from det_lab.cluster.render import render_task_template
    from det_lab.cluster.settings import load_cluster_settings

    lab = lab or load_settings()
    return render_task_template(lab, cluster or load_cluster_settings(lab))


