"""MLflow backend: one MLflow run per trial, metrics sent with ``log_batch``.

Metric keys are ``<group>/<name>`` (``training/loss``, ``validation/val_loss``). Against a
tracking server (``http(s)://``) the backend speaks MLflow's REST API itself with ``requests``:
importing the MLflow client costs a sender process about 140 MB of memory and its entities about
25 µs of CPU a point; the plain JSON calls cost neither. Local stores (``sqlite:///``...),
artifacts and MLflow auth plugins (``MLFLOW_TRACKING_AUTH``) go through the MLflow client.
MLflow's own retries (7 tries, about 4 minutes of backoff per call by default) are turned down:
the sender retries by itself and must notice an outage in seconds.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from det_lab.tracking.backend import RunStatus, TrackerBackend
from det_lab.tracking.events import Artifact, Checkpoint, Event, Metrics, Params, RunInfo, Tags
from det_lab.tracking.targets import default_local_uri, default_mlflow_store

RUN_KEY_TAG = "det_lab.run_key"
MAX_METRICS, MAX_PARAMS_TAGS = 1000, 100
MAX_TAG_VALUE, MAX_PARAM_VALUE = 8000, 6000

# read by MLflow at each request (and by the REST store below); a user's explicit setting wins
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")


class MlflowError(Exception):
    """An error answer from an MLflow server, with its ``error_code``."""

    def __init__(self, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


def _json_double(value: float) -> float | str:
    """Protobuf's JSON form of a double: infinities as strings (bare ``Infinity`` is not JSON)."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


class _RestStore:
    """The calls the backend makes, as MLflow REST requests to a tracking server."""

    def __init__(self, uri: str) -> None:
        import requests

        self.base = uri.rstrip("/") + "/api/2.0/mlflow/"
        self.session = requests.Session()
        self.timeout = float(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"])
        env = os.environ
        if env.get("MLFLOW_TRACKING_TOKEN"):
            self.session.headers["Authorization"] = f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
        elif env.get("MLFLOW_TRACKING_USERNAME"):
            self.session.auth = (env["MLFLOW_TRACKING_USERNAME"], env.get("MLFLOW_TRACKING_PASSWORD", ""))
        if env.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            self.session.verify = False
        elif env.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            self.session.verify = env["MLFLOW_TRACKING_SERVER_CERT_PATH"]
        if env.get("MLFLOW_TRACKING_CLIENT_CERT_PATH"):
            self.session.cert = env["MLFLOW_TRACKING_CLIENT_CERT_PATH"]

    def call(self, method: str, endpoint: str, **kwargs: Any) -> dict[str, Any]:
        response = self.session.request(method, self.base + endpoint, timeout=self.timeout, **kwargs)
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {}
        if response.status_code != 200:
            raise MlflowError(f"{method} {endpoint}: HTTP {response.status_code}: "
                              f"{body.get('message') or response.text[:200]}", body.get("error_code"))
        return body

    def experiment_id(self, name: str) -> str | None:
        try:
            return self.call("GET", "experiments/get-by-name", params={"experiment_name": name})["experiment"]["experiment_id"]
        except MlflowError as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def create_experiment(self, name: str, artifact_location: str | None) -> str:
        body = {"name": name, **({"artifact_location": artifact_location} if artifact_location else {})}
        return self.call("POST", "experiments/create", json=body)["experiment_id"]

    def run_exists(self, run_id: str) -> bool:
        try:
            self.call("GET", "runs/get", params={"run_id": run_id})
            return True
        except MlflowError as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def find_run(self, exp_id: str, key: str) -> str | None:
        body = {"experiment_ids": [exp_id], "filter": f"tags.`{RUN_KEY_TAG}` = '{key}'", "max_results": 1}
        runs = self.call("POST", "runs/search", json=body).get("runs", [])
        return runs[0]["info"]["run_id"] if runs else None

    def create_run(self, exp_id: str, name: str, tags: dict[str, str]) -> str:
        body = {"experiment_id": exp_id, "run_name": name, "start_time": int(time.time() * 1000),
                "tags": [{"key": k, "value": v} for k, v in tags.items()]}
        return self.call("POST", "runs/create", json=body)["run"]["info"]["run_id"]

    def set_status(self, run_id: str, status: str) -> None:
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if status != "RUNNING":
            body["end_time"] = int(time.time() * 1000)
        self.call("POST", "runs/update", json=body)

    def params(self, run_id: str) -> dict[str, str]:
        data = self.call("GET", "runs/get", params={"run_id": run_id})["run"].get("data", {})
        return {p["key"]: p["value"] for p in data.get("params", [])}

    def log_batch(self, run_id: str, metrics: list[tuple[str, float, int, int]],
                  params: list[tuple[str, str]], tags: list[tuple[str, str]]) -> None:
        self.call("POST", "runs/log-batch", json={
            "run_id": run_id,
            "metrics": [{"key": k, "value": _json_double(v), "timestamp": ts, "step": s} for k, v, ts, s in metrics],
            "params": [{"key": k, "value": v} for k, v in params],
            "tags": [{"key": k, "value": v} for k, v in tags]})


class _ClientStore:
    """The same calls through the MLflow client (local stores, auth plugins)."""

    def __init__(self, uri: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str) -> str | None:
        exp = self.client.get_experiment_by_name(name)
        return exp.experiment_id if exp else None

    def create_experiment(self, name: str, artifact_location: str | None) -> str:
        return self.client.create_experiment(name, artifact_location=artifact_location)

    def run_exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def find_run(self, exp_id: str, key: str) -> str | None:
        runs = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def create_run(self, exp_id: str, name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id

    def set_status(self, run_id: str, status: str) -> None:
        if status == "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.client.set_terminated(run_id, status=status)

    def params(self, run_id: str) -> dict[str, str]:
        return dict(self.client.get_run(run_id).data.params)

    def log_batch(self, run_id: str, metrics: list[tuple[str, float, int, int]],
                  params: list[tuple[str, str]], tags: list[tuple[str, str]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        self.client.log_batch(run_id, metrics=[Metric(*m) for m in metrics], params=[Param(*p) for p in params],
                              tags=[RunTag(*t) for t in tags], synchronous=True)


class MlflowBackend(TrackerBackend):
    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.uri = tracking_uri or default_local_uri()
        rest = self.uri.startswith(("http://", "https://")) and not os.environ.get("MLFLOW_TRACKING_AUTH")
        self._store: _RestStore | _ClientStore = _RestStore(self.uri) if rest else _ClientStore(self.uri)
        self._artifacts: Any = None  # an MlflowClient, made for the first artifact
        self._run_id: str | None = None
        self._params: dict[str, str] = {}

    def describe(self) -> str:
        return f"MLflow {self.uri}"

    def open(self, run: RunInfo, resume_id: str | None) -> str:
        store = self._store
        exp_id = store.experiment_id(run.experiment)
        if exp_id is None:
            # with a local store, MLflow would put artifacts in ./mlruns of the trial's working
            # directory (the template, which Determined copies into every checkpoint)
            location = None if self.uri.startswith("http") else (default_mlflow_store() / "mlflow-artifacts").as_uri()
            try:
                exp_id = store.create_experiment(run.experiment, location)
            except Exception:  # another trial created it meanwhile
                exp_id = store.experiment_id(run.experiment)
                if exp_id is None:
                    raise
        run_id = resume_id if resume_id and store.run_exists(resume_id) else store.find_run(exp_id, run.key)
        if run_id is None:
            tags = {RUN_KEY_TAG: run.key, **{k: v[:MAX_TAG_VALUE] for k, v in run.tags.items()}}
            run_id = store.create_run(exp_id, run.name, tags)
        else:
            store.set_status(run_id, "RUNNING")
        self._params = store.params(run_id)
        self._run_id = run_id
        return run_id

    def deliver(self, events: Sequence[Event]) -> None:
        metrics: list[tuple[str, float, int, int]] = []
        params: dict[str, str] = {}
        tags: dict[str, str] = {}
        artifacts: list[Artifact] = []
        for e in events:
            if isinstance(e, Metrics):
                ts = int(e.timestamp * 1000)
                metrics += [(f"{e.group}/{k}", v, ts, e.step) for k, v in e.values.items()]
            elif isinstance(e, Params):
                # MLflow params are immutable: a resumed trial re-sends them; send only new keys
                params.update({k: v[:MAX_PARAM_VALUE] for k, v in e.values.items() if k not in self._params})
            elif isinstance(e, Tags):
                tags.update({k: v[:MAX_TAG_VALUE] for k, v in e.values.items()})
            elif isinstance(e, Checkpoint):
                tags["det_lab.checkpoint.latest"] = e.uuid
                tags[f"det_lab.checkpoint.{e.uuid}"] = json.dumps({"step": e.step, **e.metadata}, default=str)[:MAX_TAG_VALUE]
            elif isinstance(e, Artifact):
                artifacts.append(e)
        assert self._run_id is not None, "open() first"
        for i in range(0, len(metrics), MAX_METRICS):
            self._store.log_batch(self._run_id, metrics[i:i + MAX_METRICS], [], [])
        p, t = list(params.items()), list(tags.items())
        for i in range(0, max(len(p), len(t)), MAX_PARAMS_TAGS):
            self._store.log_batch(self._run_id, [], p[i:i + MAX_PARAMS_TAGS], t[i:i + MAX_PARAMS_TAGS])
        self._params.update(params)
        for a in artifacts:
            if Path(a.path).exists():  # a file deleted before delivery is skipped, not retried forever
                self._artifact_client().log_artifact(self._run_id, a.path, artifact_path=f"{a.name}/step_{a.step:08d}")

    def _artifact_client(self) -> Any:
        if self._artifacts is None:
            from mlflow.tracking import MlflowClient

            self._artifacts = MlflowClient(tracking_uri=self.uri)
        return self._artifacts

    def close(self, status: RunStatus) -> None:
        if self._run_id is not None:
            self._store.set_status(self._run_id, status)
