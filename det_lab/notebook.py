"""What the notebooks in ``notebooks/`` call, so that they stay short and the logic is tested code.

    from det_lab import notebook as nb
    result = nb.submit("vla")             # a cluster when its master answers, else a local run
    nb.best_checkpoint(result).path
    runs = nb.load_runs()                 # MLflow or Aim runs as a DataFrame, each linked to its trial
    nb.metric_histories(runs, ["training/loss"])

Three parts: submitting (:func:`master_reachable`, :func:`submit`, :func:`best_checkpoint`),
datasets on the volume (:func:`volume_table`, :func:`registry_table`, :func:`snapshots_table`,
:func:`dataset_revisions`) and tracked runs (:func:`load_runs`, :func:`metric_histories`), plus
:func:`save_figure`, which keeps each plot and the data drawn in it under :func:`output_dir`.

Parameters come from environment variables so a notebook can be pointed elsewhere without edits:
``DET_LAB_NOTEBOOK_OUT`` (where plots go), ``DET_LAB_NOTEBOOK_CONFIG`` (the experiment config
:func:`submit` uses), ``DET_LAB_NOTEBOOK_TRACKER`` (``mlflow`` or ``aim``), ``DET_LAB_DET_TEMPLATE``
(the config template registered with the master, ``det-lab``), and the lab's own variables
(``DET_LAB_CONFIG``, ``DET_LAB_DATA_ROOT``, ``MLFLOW_TRACKING_URI``, ``DET_LAB_MASTER``...).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from det_lab.settings import LabSettings, load_settings
from det_lab.trials import local
from det_lab.trials.session import tracker_experiment
from det_lab.volume import VolumeLayout, human_bytes

if TYPE_CHECKING:
    import pandas as pd

OUT_ENV = "DET_LAB_NOTEBOOK_OUT"
CONFIG_ENV = "DET_LAB_NOTEBOOK_CONFIG"
TRACKER_ENV = "DET_LAB_NOTEBOOK_TRACKER"
DET_TEMPLATE_ENV = "DET_LAB_DET_TEMPLATE"
DEFAULT_DET_TEMPLATE = "det-lab"
DEFAULT_OUT = "notebook-out"

Mode = Literal["cluster", "local"]


class SubmitError(RuntimeError):
    """A run that could not start or did not finish, with the reason in the message."""


def output_dir(*parts: str) -> Path:
    """``$DET_LAB_NOTEBOOK_OUT/<parts>`` (default ``./notebook-out``), created."""
    path = Path(os.environ.get(OUT_ENV) or DEFAULT_OUT).expanduser().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- where to run ----------------------------------------------------------------------------------


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
    if not url:
        return False
    try:
        with urllib.request.urlopen(f"{url}/info", timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except Exception:  # noqa: BLE001 (refused, timed out, DNS, TLS, HTTP error: all mean "not usable now")
        return False


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


# --- submit and watch ------------------------------------------------------------------------------


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


def _searcher(conf: dict[str, Any]) -> tuple[str | None, bool]:
    s = conf.get("searcher") or {}
    return s.get("metric"), bool(s.get("smaller_is_better", True))


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
    local.record_exit(run, code)
    result = local_result(run.dir, settings)
    if code != 0:
        raise SubmitError(f"run {st['name']} exited with {code}; last log lines:\n"
                          f"{local.tail(run.dir / 'train.log')}\n"
                          f"(resume: det-lab run {st['template']} --local --resume)")
    print(f"finished: {result.status}; last validation {_fmt(result.final_metrics)}; "
          f"{len(result.checkpoints)} checkpoint(s)")
    return result


def _watch(proc: subprocess.Popen, run: local.LocalRun, poll: float) -> int:
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
    run = local.LocalRun(Path(run_dir))
    st = run.state()
    conf = st.get("exp_conf") or {}
    project = ((conf.get("data") or {}).get("det_lab") or {}).get("project", "default")
    ckpt_root = VolumeLayout.from_settings(settings).project_checkpoints(project)
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
    metric, smaller = _searcher(conf)
    return SubmitResult("local", st["name"], st["template"], str(run.dir), status, st["hparams"], metrics,
                        checkpoints, metric, smaller)


def _submit_cluster(settings: LabSettings, template: str, config: Path | None,
                    det_template: str | None) -> SubmitResult:
    """The Determined SDK path (needs a master; not exercised by the tests here)."""
    from determined.experimental import client

    url = master_url(settings)
    # credentials: DET_USER/DET_PASS, a prior 'det user login', or the task's token in a Determined JupyterLab
    client.login(master=url)
    tdir = local.resolve_template(template)
    cfg_path, conf = local.load_config(tdir, config)
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
        # shared_fs: read straight from the volume when this machine mounts it
        path = Path(top.download(str(output_dir("checkpoints") / top.uuid)))
        val = (top.training.validation_metrics if top.training else None) or {}
        best = CheckpointInfo(top.uuid, int((top.metadata or {}).get("steps_completed", 0)), path,
                              dict(val.get("avgMetrics", val)))
        print(f"best checkpoint {top.uuid} -> {path}")
    trials = exp.list_trials()
    best_trial = top.training.trial_id if top is not None and top.training else None
    trial = next((t for t in trials if t.id == best_trial), trials[0] if trials else None)
    metrics = []
    if trial is not None:
        for group in ("training", "validation"):
            metrics += [{"group": group, "step": m.steps_completed, "metrics": dict(m.metrics)}
                        for m in trial.iter_metrics(group)]
    metric, smaller = _searcher(conf)
    where = f"{url}/det/experiments/{exp.id}" + (f"/trials/{trial.id}" if trial else "")
    return SubmitResult("cluster", conf.get("name") or f"experiment {exp.id}", tdir.name, where,
                        "COMPLETED", dict(trial.hparams or {}) if trial else {},
                        metrics, [best] if best else [], metric, smaller, exp.id,
                        trial.id if trial else None, best)


# --- the config template JupyterLab and experiments start from ------------------------------------


def det_template(lab: LabSettings | None = None, cluster: Any = None) -> dict[str, Any]:
    """The Determined config template ``det-lab`` (see ``det-lab cluster template``): the volume's
    bind mounts, det_lab's environment variables and the lab's task image, experiment-config keys
    only, so it serves ``det notebook start --template det-lab`` and experiments alike."""
    from det_lab.cluster.config import render_task_template
    from det_lab.cluster.settings import load_cluster_settings

    lab = lab or load_settings()
    return render_task_template(lab, cluster or load_cluster_settings(lab))


# --- datasets on the volume ------------------------------------------------------------------------


def volume_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """One row per project: bytes in its DVC remote, shared cache and snapshots, and its datasets."""
    import pandas as pd

    from det_lab import data

    rows = []
    for p in data.list_volume(settings or load_settings()):
        rows.append({
            "project": p.project, "datasets": ", ".join(sorted(p.registered)) or "-",
            "snapshots": len(p.snapshots), "remote": human_bytes(p.remote_bytes),
            "cache": human_bytes(p.cache_bytes), "snapshot_extra": human_bytes(p.snapshot_bytes),
            "remote_bytes": p.remote_bytes, "cache_bytes": p.cache_bytes, "snapshot_bytes": p.snapshot_bytes,
        })
    return pd.DataFrame(rows)


def registry_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """The registered datasets: name, project, git repo, DVC path, revision."""
    import pandas as pd

    from det_lab import data

    reg = data.load_registry(settings or load_settings())
    return pd.DataFrame([{"name": n, "project": s.project, "repo": s.repo, "path": s.path, "rev": s.rev}
                         for n, s in sorted(reg.items())], columns=["name", "project", "repo", "path", "rev"])


def snapshots_table(settings: LabSettings | None = None) -> pd.DataFrame:
    """Every verified snapshot on the volume with its identity (the lineage trials record)."""
    import pandas as pd

    from det_lab import data

    settings = settings or load_settings()
    layout = VolumeLayout.from_settings(settings)
    names = {(s.project, s.repo, s.path): n for n, s in data.load_registry(settings).items()}
    rows = []
    for p in data.list_volume(settings):
        for ident in p.snapshots:
            rows.append({"dataset": names.get((ident.project, ident.repo, ident.path), "-"),
                         "project": ident.project, "rev": ident.rev, "commit": ident.commit[:12],
                         "md5": ident.md5, "files": ident.nfiles, "size": human_bytes(ident.size),
                         "size_bytes": ident.size,
                         "dir": str(layout.snapshots(ident.project) / ident.md5.removesuffix(".dir"))})
    return pd.DataFrame(rows, columns=["dataset", "project", "rev", "commit", "md5", "files", "size",
                                       "size_bytes", "dir"])


def dataset_revisions(name: str, settings: LabSettings | None = None) -> pd.DataFrame:
    """The git history of a registered dataset's ``<path>.dvc``: one row per revision, with its
    DVC hash and size, its tags, and whether a snapshot of it is on the volume."""
    import pandas as pd

    from det_lab import data
    from det_lab.data.git import git

    settings = settings or load_settings()
    spec = data.load_registry(settings)[name]
    snap_root = VolumeLayout.from_settings(settings).snapshots(spec.project)
    rows = []
    with tempfile.TemporaryDirectory(prefix="det-lab-revs-") as tmp:
        bare = Path(tmp) / "repo.git"
        git("clone", "--quiet", "--bare", spec.repo, str(bare))  # .dvc files only: small
        log = git("log", "--all", "--format=%H%x09%aI%x09%s", "--", f"{spec.path}.dvc", cwd=bare)
        for line in log.splitlines():
            commit, date, subject = line.split("\t", 2)
            out = (yaml.safe_load(git("show", f"{commit}:{spec.path}.dvc", cwd=bare)) or {}).get("outs", [{}])[0]
            md5 = str(out.get("md5", ""))
            tags = git("tag", "--points-at", commit, cwd=bare).split()
            rows.append({"commit": commit[:12], "date": date, "subject": subject, "tags": ", ".join(tags),
                         "md5": md5, "files": out.get("nfiles", 1), "size": human_bytes(int(out.get("size", 0))),
                         "on_volume": (snap_root / md5.removesuffix(".dir")).is_dir()})
    return pd.DataFrame(rows, columns=["commit", "date", "subject", "tags", "md5", "files", "size", "on_volume"])


# --- tracked runs ----------------------------------------------------------------------------------


def tracker_name(settings: LabSettings | None = None) -> str:
    """``$DET_LAB_NOTEBOOK_TRACKER``, else the lab's backend (``both`` reads MLflow)."""
    choice = os.environ.get(TRACKER_ENV) or (settings or load_settings()).tracking.backend
    if choice == "both":
        return "mlflow"
    if choice not in ("mlflow", "aim"):
        raise ValueError(f"no tracker to read runs from (backend {choice!r}); set {TRACKER_ENV}=mlflow or aim")
    return choice


def load_runs(settings: LabSettings | None = None, project: str = "vla", tracker: str | None = None) -> pd.DataFrame:
    """det_lab runs of ``project`` from MLflow or Aim, newest first.

    Columns: ``run_id``, ``name``, ``status``, ``start_time``, ``link`` (the Determined trial's
    URL on a cluster, the local run directory otherwise), ``link_kind`` (``trial`` /
    ``local run``), ``run_key``, ``params.<name>`` (dotted, numbers as numbers) and
    ``metrics.<group>/<name>`` (the last value). ``df.attrs["tracker"]`` says where they came from.
    """
    import pandas as pd

    settings = settings or load_settings()
    tracker = tracker or tracker_name(settings)
    rows = _mlflow_runs(settings, project) if tracker == "mlflow" else _aim_runs(settings, project)
    df = pd.DataFrame(rows, columns=None if rows else ["run_id", "name", "status", "start_time", "link",
                                                       "link_kind", "run_key"])
    for col in [c for c in df.columns if c.startswith("params.")]:
        try:
            df[col] = pd.to_numeric(df[col])
        except (ValueError, TypeError):
            pass
    if rows:
        df = df.sort_values("start_time", ascending=False, ignore_index=True)
    df.attrs["tracker"] = tracker
    return df


def metric_histories(runs: pd.DataFrame, keys: list[str], settings: LabSettings | None = None) -> pd.DataFrame:
    """Long-form ``run_id, name, key, step, value`` for ``keys`` (``"<group>/<name>"``) of ``runs``."""
    import pandas as pd

    settings = settings or load_settings()
    tracker = runs.attrs.get("tracker") or tracker_name(settings)
    reader = _mlflow_history if tracker == "mlflow" else _aim_history
    rows = []
    for run_id, name in zip(runs["run_id"], runs["name"]):
        for key, points in reader(settings, run_id, keys).items():
            rows += [{"run_id": run_id, "name": name, "key": key, "step": s, "value": v} for s, v in points]
    df = pd.DataFrame(rows, columns=["run_id", "name", "key", "step", "value"])
    return df.sort_values(["run_id", "key", "step"], ignore_index=True)


def _link(tags: dict[str, Any]) -> tuple[str, str]:
    if tags.get("det.trial_url"):
        return str(tags["det.trial_url"]), "trial"
    if tags.get("det.local_run_dir"):
        return str(tags["det.local_run_dir"]), "local run"
    return "", ""


def _mlflow_client(settings: LabSettings) -> Any:
    from mlflow.tracking import MlflowClient

    from det_lab.tracking.mlflow_backend import default_local_uri

    return MlflowClient(tracking_uri=settings.tracking.mlflow_uri or default_local_uri())


def _mlflow_runs(settings: LabSettings, project: str) -> list[dict[str, Any]]:
    from det_lab.tracking.mlflow_backend import RUN_KEY_TAG

    client = _mlflow_client(settings)
    exp = client.get_experiment_by_name(tracker_experiment(project))
    if exp is None:
        return []
    rows = []
    for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` != ''", max_results=1000):
        tags = r.data.tags
        link, kind = _link(tags)
        rows.append({
            "run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
            "start_time": _timestamp(r.info.start_time / 1000), "link": link, "link_kind": kind,
            "run_key": tags.get(RUN_KEY_TAG, ""),
            **{f"params.{k}": v for k, v in r.data.params.items()},
            **{f"metrics.{k}": v for k, v in r.data.metrics.items()},
        })
    return rows


def _mlflow_history(settings: LabSettings, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    client = _mlflow_client(settings)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _aim_repo(settings: LabSettings) -> Any:
    from aim import Repo

    from det_lab.tracking.aim_backend import default_local_repo

    return Repo(settings.tracking.aim_repo or default_local_repo())


def _aim_series(run: Any) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for m in run.metrics():
        steps, (values, *_rest) = m.data.items_list()
        out[f"{m.context.to_dict().get('subset', '')}/{m.name}"] = sorted(zip((int(s) for s in steps), values))
    return out


def _aim_runs(settings: LabSettings, project: str) -> list[dict[str, Any]]:
    repo = _aim_repo(settings)
    rows = []
    for run in repo.iter_runs():
        meta = run.get("det_lab") or {}
        if run.experiment != tracker_experiment(project) or not meta.get("run_key"):
            continue
        link, kind = _link(meta)
        rows.append({
            "run_id": run.hash, "name": run.name, "status": meta.get("status", "RUNNING"),
            "start_time": _timestamp(run.creation_time), "link": link, "link_kind": kind,
            "run_key": meta["run_key"],
            **{f"params.{k}": v for k, v in _flatten(run.get("hparams") or {}).items()},
            **{f"metrics.{k}": pts[-1][1] for k, pts in _aim_series(run).items() if pts},
        })
    return rows


def _aim_history(settings: LabSettings, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    from aim import Run

    series = _aim_series(Run(run_id, repo=_aim_repo(settings), read_only=True))
    return {k: series.get(k, []) for k in keys}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _timestamp(seconds: float) -> Any:
    import pandas as pd

    return pd.Timestamp(seconds, unit="s", tz="UTC")


# --- plots -----------------------------------------------------------------------------------------


def save_figure(fig: Any, name: str, data: dict[str, Any]) -> Path:
    """Save ``fig`` as ``<output_dir>/<name>.png`` and the data drawn in it as ``<name>.json``."""
    out = output_dir()
    png = out / f"{name}.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"saved {png} (+ {name}.json)")
    return png
