"""`det-lab cluster status --json` and `cluster down [--delete-db] --dry-run`, against a stand-in
for the Docker daemon that keeps state (containers, networks, volumes), with Determined's own
`cluster_down` (determined/deploy/local/cluster_utils.py, 0.38.1) running unchanged on top of it:
the dry run must name exactly what that code then removes."""

from __future__ import annotations

import json

import docker.errors
import pytest
import yaml
from typer.testing import CliRunner

from det_lab.cli.app import app
from det_lab.cluster import deploy
from det_lab.compat import import_deploy
from tests.test_cluster_deploy import master_info  # noqa: F401  (fixture: a master answering /info)


class _Image:
    def __init__(self, tag: str):
        self.tags, self.short_id = [tag], "sha256:0123456789"


class _Container:
    def __init__(self, daemon: Daemon, name: str, image: str, labels: dict[str, str]):
        self.daemon, self.name, self.image, self.labels, self.status = daemon, name, _Image(image), labels, "running"
        self.lines = [f"{name} line {i}" for i in range(1, 8)]

    def logs(self, tail: int = 50) -> bytes:  # docker-py's Container.logs(tail=N): the last N lines, bytes
        return "".join(line + "\n" for line in self.lines[-tail:]).encode()

    def stop(self, timeout: int = 10) -> None:
        self.status = "exited"

    def remove(self) -> None:
        del self.daemon.containers[self.name]


class _Named:
    def __init__(self, store: dict, name: str):
        self.store, self.name = store, name

    def remove(self) -> None:
        del self.store[self.name]


class Daemon:
    """Answers what cluster_utils' ``_kill_containers`` (cluster_utils.py:590: ``containers.list(all=True,
    filters={"name"|"label": ...})``, a name filter matching substrings as Docker's does, hence its exact
    check), ``db_down`` (:417, ``volumes.get`` raising ``docker.errors.NotFound``) and
    ``remove_network`` (:430, ``networks.list(names=...)``) call, and keeps what is left."""

    def __init__(self) -> None:
        self.containers: dict[str, _Container] = {}
        self.volumes: dict[str, _Named] = {}
        self.networks: dict[str, _Named] = {}
        daemon = self

        class Containers:
            def list(self, all: bool = False, filters: dict | None = None):  # noqa: A002 (docker's name)
                found = list(daemon.containers.values())
                for name in (filters or {}).get("name", []):
                    found = [c for c in found if name in c.name]
                for label in (filters or {}).get("label", []):
                    key, _, value = label.partition("=")
                    found = [c for c in found if c.labels.get(key) == value]
                return found

            def get(self, name: str):
                if name not in daemon.containers:
                    raise docker.errors.NotFound(f"No such container: {name}")
                return daemon.containers[name]

        class Volumes:
            def get(self, name: str):
                if name not in daemon.volumes:
                    raise docker.errors.NotFound(f"get volume {name}: no such volume")
                return daemon.volumes[name]

        class Networks:
            def list(self, names: list[str] | None = None):
                return [n for n in daemon.networks.values() if names is None or n.name in names]

        self.containers_api, self.volumes_api, self.networks_api = Containers(), Volumes(), Networks()

    def run(self, name: str, image: str, **labels: str) -> None:
        self.containers[name] = _Container(self, name, image, labels)

    def add_volume(self, name: str) -> None:
        self.volumes[name] = _Named(self.volumes, name)

    def add_network(self, name: str) -> None:
        self.networks[name] = _Named(self.networks, name)

    def state(self) -> tuple:
        return (sorted((c.name, c.status) for c in self.containers.values()), sorted(self.volumes), sorted(self.networks))


class Client:
    """The daemon behind docker.DockerClient's ``containers``, ``volumes`` and ``networks``."""

    def __init__(self, daemon: Daemon):
        self.containers, self.volumes, self.networks = daemon.containers_api, daemon.volumes_api, daemon.networks_api

    def ping(self) -> bool:
        return True


@pytest.fixture
def docker_here(lab, monkeypatch):
    """A daemon holding a running cluster 'determined', another cluster's agent and a container of
    someone else's, reached by both det_lab and Determined's cluster_utils."""
    daemon = Daemon()
    daemon.run("determined_determined-db_1", "postgres:14")
    daemon.run("determined_determined-master_1", "determinedai/determined-master:0.38.1")
    daemon.run("gpu-a", "determinedai/determined-agent:0.38.1", **{"determined.cluster": "determined"})
    daemon.run("gpu-other", "determinedai/determined-agent:0.38.1", **{"determined.cluster": "other"})
    daemon.run("determined_determined-master_1-backup", "busybox")  # a name the master's contains
    daemon.run("jupyter", "jupyter/base-notebook")
    daemon.add_volume("determined_determined-db-volume")
    daemon.add_volume("other_determined-db-volume")
    daemon.add_network("determined_default")
    daemon.add_network("bridge")
    client = Client(daemon)
    monkeypatch.setattr(deploy, "docker_client", lambda timeout=10: client)
    monkeypatch.setattr(import_deploy(), "_docker_client", None)  # deploy.down shares the client
    return daemon


def invoke(lab, *args: str):
    return CliRunner().invoke(app, list(args), env=lab.env)


def test_status_json_lists_this_clusters_containers_and_the_master(lab, docker_here, master_info):  # noqa: F811
    cfg = lab.root / ".det-lab" / "cluster.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(yaml.safe_dump({"master_host": "127.0.0.1", "master_port": master_info}))
    docker_here.containers["gpu-a"].status = "exited"
    proc = invoke(lab, "cluster", "status", "--json")
    assert proc.exit_code == 0, proc.output
    out = json.loads(proc.stdout)
    assert out["containers"] == [
        {"name": "determined_determined-db_1", "role": "database", "image": "postgres:14", "status": "running"},
        {"name": "determined_determined-master_1", "role": "master",
         "image": "determinedai/determined-master:0.38.1", "status": "running"},
        {"name": "gpu-a", "role": "agent", "image": "determinedai/determined-agent:0.38.1", "status": "exited"}]
    assert out["master"] == {"url": f"http://127.0.0.1:{master_info}", "answers": True,
                             "detail": out["master"]["detail"]}
    text = invoke(lab, "cluster", "status").stdout
    assert all(c["name"] in text for c in out["containers"]) and "gpu-other" not in text

    cfg.write_text(yaml.safe_dump({"master_host": "127.0.0.1", "master_port": 9}))  # nothing listens
    proc = invoke(lab, "cluster", "status", "--json")
    assert proc.exit_code == 1 and json.loads(proc.stdout)["master"]["answers"] is False


def test_logs_json_holds_each_cluster_containers_last_lines(lab, docker_here):
    proc = invoke(lab, "cluster", "logs", "--tail", "3", "--json")
    assert proc.exit_code == 0, proc.output
    out = json.loads(proc.stdout)["containers"]
    names = ["determined_determined-db_1", "determined_determined-master_1", "gpu-a"]
    assert out == {n: docker_here.containers[n].lines[-3:] for n in names}
    text = invoke(lab, "cluster", "logs", "--tail", "3").stdout.splitlines()
    assert text == [f"{n} | {line}" for n in names for line in out[n]]


@pytest.mark.parametrize("delete_db", [True, False], ids=["delete-db", "keep-db"])
def test_down_dry_run_names_what_down_then_removes_and_removes_nothing(lab, docker_here, delete_db):
    flag = ["--delete-db"] if delete_db else []
    before = docker_here.state()
    proc = invoke(lab, "cluster", "down", *flag, "--dry-run", "--json")
    assert proc.exit_code == 0, proc.output
    plan = json.loads(proc.stdout)
    assert plan == {"containers": ["determined_determined-master_1", "determined_determined-db_1", "gpu-a"],
                    "networks": ["determined_default"], "db_volume": "determined_determined-db-volume",
                    "db_volume_exists": True, "deletes_db_volume": delete_db}
    text = invoke(lab, "cluster", "down", *flag, "--dry-run").stdout
    assert ("would DELETE the database volume determined_determined-db-volume" in text) is delete_db
    assert "would stop and remove container gpu-a" in text and "gpu-other" not in text
    assert docker_here.state() == before  # nothing stopped, nothing removed

    proc = invoke(lab, "cluster", "down", *flag)
    assert proc.exit_code == 0, proc.output
    containers, volumes, networks = before
    gone = set(plan["containers"]) | set(plan["networks"]) | ({plan["db_volume"]} if delete_db else set())
    assert docker_here.state() == ([c for c in containers if c[0] not in gone], [v for v in volumes if v not in gone],
                                   [n for n in networks if n not in gone])
