"""Base models on the volume (det_lab.models): imported once and whole, versioned by content, in
huggingface_hub's own cache layout, so that huggingface_hub itself, offline, with HF_HOME at the
store, finds them; every run and cluster task pointed at the store; a missing model is one line.

huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so what it sees is checked in
a child process started with the environment det_lab gives a run; every path is under tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from det_lab import models
from det_lab.cluster.render import render_master
from det_lab.cluster.settings import ClusterSettings
from det_lab.models import ModelMissing, ModelStoreLayout
from det_lab.settings import LabSettings, load_settings
from det_lab.runs.lineage import models_lineage
from det_lab.volume import init_volume
from tests.conftest import Lab
from tests.test_bad_inputs import cli

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_download(path: Path, weight: float = 0.0) -> Path:
    """What ``huggingface-cli download org/name --local-dir path`` leaves: the files, and its
    ``.cache/huggingface`` bookkeeping (which is not part of the model)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden_size": 4}))
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}))
    (path / "vision").mkdir()
    save_file({"w": torch.full((4, 4), weight)}, path / "model.safetensors")
    save_file({"b": torch.arange(3.0)}, path / "vision" / "backbone.safetensors")
    meta = path / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(f"{HUB_COMMIT}\netag\n1700000000.0\n")
    return path


def write_cache_folder(hub: Path, name: str, source: Path, commit: str) -> Path:
    """``source``'s files as huggingface_hub's cache keeps them (``file_download.py``: blobs named by
    hash, ``snapshots/<commit>/`` links into them, ``refs/main`` the commit without a newline)."""
    repo = hub / f"models--{name.replace('/', '--')}"
    for f in sorted(p for p in source.rglob("*") if p.is_file() and ".cache" not in p.parts):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(f.read_bytes())
        link = repo / "snapshots" / commit / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo


def hf_child(settings: LabSettings, code: str, tmp_path: Path) -> dict:
    """Run ``code`` (which sets ``out``) in a child with the environment a det_lab run gets; ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in models.SHADOWING}
    env.update(models.run_environment(settings.data_root), HOME=str(tmp_path / "home"))
    script = "import json, sys\n" + textwrap.dedent(code) + "\njson.dump(out, sys.stdout)\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def settings(tmp_path) -> LabSettings:
    return LabSettings(data_root=tmp_path / "data")


def test_a_download_and_a_cache_folder_resolve_offline_through_huggingface_hub_byte_equal(settings, tmp_path):
    download = write_download(tmp_path / "download")
    models.import_model(settings, download, "org/tiny")
    # a whole cache folder of another model, as another machine's ~/.cache/huggingface/hub holds it
    other = write_cache_folder(tmp_path / "hf-cache", "org/other", write_download(tmp_path / "o", 2.0), HUB_COMMIT)
    done = models.import_model(settings, other, "org/other")
    assert done.hub_commit == HUB_COMMIT and done.new

    # torch hub weights, by file name under TORCH_HOME
    import torch
    weights = tmp_path / "resnet-1234abcd.pth"
    torch.save({"fc.weight": torch.ones(2)}, weights)
    assert models.import_model(settings, weights).kind == "torch"

    out = hf_child(settings, """
        import os, huggingface_hub as hub
        from huggingface_hub import constants
        from safetensors.torch import load_file
        out = {"offline": constants.HF_HUB_OFFLINE, "cache": constants.HF_HUB_CACHE}
        out["tiny"] = hub.snapshot_download("org/tiny", local_files_only=True)
        out["online_call"] = hub.snapshot_download("org/tiny")  # HF_HUB_OFFLINE=1: no network, same answer
        out["tokenizer"] = hub.hf_hub_download("org/tiny", "tokenizer.json")
        out["w"] = load_file(hub.hf_hub_download("org/tiny", "model.safetensors"))["w"].tolist()
        out["other_by_commit"] = hub.snapshot_download("org/other", revision=%r)
        scan = hub.scan_cache_dir()
        out["scan"] = sorted((r.repo_id, len(r.revisions)) for r in scan.repos)
        out["warnings"] = [str(w) for w in scan.warnings]
        import torch.hub
        out["torch"] = torch.hub.load_state_dict_from_url("https://download.pytorch.org/models/resnet-1234abcd.pth",
                                                          progress=False)["fc.weight"].tolist()
    """ % HUB_COMMIT, tmp_path)
    store = ModelStoreLayout.from_settings(settings)
    assert out["offline"] is True and out["cache"] == str(store.hub)
    snap = Path(out["tiny"])
    assert out["online_call"] == out["tiny"] and snap.parent == store.repo("org/tiny") / "snapshots"
    for rel in ("config.json", "tokenizer.json", "model.safetensors", "vision/backbone.safetensors"):
        assert (snap / rel).read_bytes() == (download / rel).read_bytes(), rel
    assert sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()) == [
        "config.json", "model.safetensors", "tokenizer.json", "vision/backbone.safetensors"]  # no .cache/
    assert Path(out["tokenizer"]).read_bytes() == (download / "tokenizer.json").read_bytes()
    assert out["w"] == [[0.0] * 4] * 4
    assert Path(out["other_by_commit"]).resolve().name == done.revision
    # each with its hub commit's alias (the download recorded it in .cache/huggingface), a revision to the scan too
    assert out["scan"] == [["org/other", 2], ["org/tiny", 2]] and out["warnings"] == []
    assert out["torch"] == [1.0, 1.0]


def test_the_same_files_are_one_revision_a_changed_file_another(settings, tmp_path, lab):
    first = models.import_model(settings, write_download(tmp_path / "a"), "org/tiny")
    again = models.import_model(settings, write_download(tmp_path / "b"), "org/tiny")  # same bytes elsewhere
    assert first.new and not again.new and again.revision == first.revision and again.copy_bytes == 0
    plan = models.import_model(settings, write_download(tmp_path / "c", 1.0), "org/tiny", dry_run=True)
    assert plan.new and plan.revision != first.revision and plan.dry_run
    assert plan.copy_bytes == (tmp_path / "c" / "model.safetensors").stat().st_size  # only the changed file
    assert models.show_model(settings, "org/tiny").main == first.revision  # the dry run wrote nothing
    changed = models.import_model(settings, tmp_path / "c", "org/tiny")
    assert changed.revision == plan.revision and changed.copy_bytes == plan.copy_bytes

    lab.write_config(data_root=str(settings.data_root))
    shown = json.loads(cli(lab, "models", "show", "org/tiny", "--json").stdout)
    assert [r["revision"] for r in shown["revisions"]] == [first.revision, changed.revision]
    assert shown["main"] == changed.revision and all(r["imported_by"] and r["imported_at"] for r in shown["revisions"])
    listed = json.loads(cli(lab, "models", "list", "--json").stdout)
    assert [(m["name"], len(m["revisions"])) for m in listed["models"]] == [("org/tiny", 2)]
    dry = cli(lab, "models", "import", str(tmp_path / "a"), "org/tiny", "--dry-run")
    assert dry.returncode == 0 and first.revision in dry.stdout and "nothing written" in dry.stdout
    assert models.show_model(settings, "org/tiny").main == changed.revision


_IMPORT_CHILD = """
import os, signal, sys
from pathlib import Path
from det_lab import models
from det_lab.models import store
from det_lab.settings import LabSettings
if sys.argv[3] == "before-rename":  # killed between the last blob and the rename that makes the revision
    real = os.rename
    os.rename = lambda a, b: os.kill(os.getpid(), signal.SIGKILL) if "snapshots" in str(b) else real(a, b)
models.import_model(LabSettings(data_root=Path(sys.argv[1])), Path(sys.argv[2]), "org/big")
"""


@pytest.mark.parametrize("when", ["mid-copy", "before-rename"])
def test_a_kill_mid_import_leaves_no_half_revision(settings, tmp_path, lab, when):
    src = write_download(tmp_path / "big")
    with open(src / "model-00002.safetensors", "wb") as f:  # read and copied in 4 MiB chunks: a while
        f.truncate(256 << 20)
    child = subprocess.Popen([sys.executable, "-c", _IMPORT_CHILD, str(settings.data_root), str(src), when])
    staging = ModelStoreLayout.from_settings(settings).staging
    if when == "mid-copy":
        deadline = time.monotonic() + 60
        while not any(staging.glob("*/blobs/*.part")) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert any(staging.iterdir())  # it was killed inside the import, not before or after it

    lab.write_config(data_root=str(settings.data_root))
    assert json.loads(cli(lab, "models", "list", "--json").stdout)["models"] == []
    with pytest.raises(ModelMissing):
        models.require_model(settings, "org/big")
    out = hf_child(settings, """
        import os
        import huggingface_hub as hub
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.errors import LocalEntryNotFoundError
        try:
            out = hub.snapshot_download("org/big")
        except LocalEntryNotFoundError:
            out = None
        out = [out, [r.repo_id for r in hub.scan_cache_dir().repos] if os.path.isdir(HF_HUB_CACHE) else []]
    """, tmp_path)
    assert out == [None, []] or out[0] is None and out[1] == ["org/big"] and when == "before-rename"
    done = models.import_model(settings, src, "org/big")  # the next import finishes the job
    assert done.new and models.require_model(settings, "org/big", files=["model-00002.safetensors"]).main


def test_require_model_names_the_import_for_a_missing_model_or_file(settings, tmp_path):
    with pytest.raises(ModelMissing) as missing:
        models.require_model(settings, "lerobot/smolvla_base")
    line = str(missing.value)
    assert "\n" not in line and "lerobot/smolvla_base" in line
    assert "det-lab models import DIR lerobot/smolvla_base" in line
    models.import_model(settings, write_download(tmp_path / "d"), "org/tiny")
    found = models.require_model(settings, "org/tiny", files=["tokenizer.json", "vision/backbone.safetensors"])
    assert found.main and (found.path / "config.json").is_file()
    with pytest.raises(ModelMissing, match=r"org/tiny \(revision [0-9a-f]{12}\) has no tokenizer.model; .*"
                                           r"det-lab models import DIR org/tiny"):
        models.require_model(settings, "org/tiny", files=["tokenizer.model"])
    with pytest.raises(ModelMissing, match="det-lab models import ~/.cache/torch/hub/checkpoints/resnet18-f37072fd"):
        models.require_torch_weights(settings, "resnet18-f37072fd.pth")
    # a run's lineage names the revision; a config naming a missing model stops there, in one line
    conf = {"data": {"det_lab": {"project": "vla", "base_model": ["org/tiny"]}}}
    assert models_lineage(conf, settings) == [{"name": "org/tiny", "revision": found.revision, "hub_commit": HUB_COMMIT}]
    conf["data"]["det_lab"]["base_model"] = "org/absent"
    with pytest.raises(ModelMissing, match="det-lab models import DIR org/absent"):
        models_lineage(conf, settings)


def test_the_rendered_master_config_gives_tasks_the_store_read_only_and_offline(tmp_path):
    lab = LabSettings(data_root=tmp_path / "data")
    cluster = ClusterSettings(master_host="gpu-a")
    tcd = render_master(lab, cluster)["task_container_defaults"]
    env = dict(e.split("=", 1) for e in tcd["environment_variables"])
    store = ModelStoreLayout.from_settings(lab)
    assert env["HF_HOME"] == str(store.hf_home) and env["HF_HUB_CACHE"] == str(store.hub)
    assert env["TORCH_HOME"] == str(store.torch_home) and env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_DATASETS_CACHE"].startswith(str(cluster.tasks.local_cache))  # written by tasks: not the store
    # the mount that holds the store in a task (the deepest one above it) is read-only and follows NFS mounts
    for path in (store.hub / "models--org--tiny" / "snapshots", store.torch_checkpoints):
        holder = max((m for m in tcd["bind_mounts"] if str(path).startswith(m["container_path"].rstrip("/") + "/")),
                     key=lambda m: len(m["container_path"]))
        assert holder["read_only"] is True and holder["propagation"] == "rslave", holder
        assert holder["host_path"] == holder["container_path"]


_LOOP = '''
import json, os
import huggingface_hub as hub
import det_lab.core
from det_lab import models

KEYS = ("HF_HOME", "HF_HUB_CACHE", "TORCH_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE")
with det_lab.core.init() as ctx:
    models.require_model(ctx.session.settings, "org/tiny", files=["tokenizer.json"])
    seen = {k: os.environ.get(k) for k in KEYS}
    seen["snapshot"] = hub.snapshot_download("org/tiny")
    (ctx.outputs_dir / "seen.json").parent.mkdir(parents=True, exist_ok=True)
    (ctx.outputs_dir / "seen.json").write_text(json.dumps(seen))
    ctx.train.report_training_metrics(1, {"loss": 1.0})
    with ctx.checkpoint.store_path({"steps_completed": 1}) as (path, _):
        (path / "state.json").write_text("{}")
'''


def test_a_local_run_sees_the_store_and_its_lineage_names_the_base_model_revision(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp_path / "lab.yaml"), XDG_CONFIG_HOME=str(tmp_path / "xdg"), COLUMNS="200",
               HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "my-hf"), TRANSFORMERS_CACHE=str(tmp_path / "tc"))
    env.pop("HF_DATASETS_CACHE", None)
    lab = Lab(root=tmp_path / "data", config=tmp_path / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "none"})
    settings = load_settings(lab.config, env={})
    init_volume(settings)
    done = models.import_model(settings, write_download(tmp_path / "d"), "org/tiny")
    template = tmp_path / "template"
    template.mkdir()
    (template / "loop.py").write_text(_LOOP)
    (template / "const.yaml").write_text(yaml.safe_dump({
        "name": "models", "entrypoint": "python3 loop.py", "max_restarts": 0,
        "searcher": {"name": "single", "metric": "loss", "smaller_is_better": True},
        "hyperparameters": {"lr": 0.1},
        "data": {"det_lab": {"project": "vla", "base_model": "org/tiny", "max_length": {"batches": 1}}}}))
    proc = lab.cli("run", str(template), "--local", "--run", "m")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = lab.root / "outputs" / "vla" / "local-runs" / "m"
    store = ModelStoreLayout.from_settings(settings)
    seen = json.loads(next(lab.root.glob("outputs/vla/**/seen.json")).read_text())
    assert seen == {"HF_HOME": str(store.hf_home), "HF_HUB_CACHE": str(store.hub),
                    "TORCH_HOME": str(store.torch_home), "HF_HUB_OFFLINE": "1",
                    "HF_DATASETS_CACHE": str(tmp_path / "my-hf" / "datasets"),  # where it was: writable, not the store
                    "TRANSFORMERS_CACHE": None, "snapshot": str(done.path)}
    lineage = json.loads((run / "run.json").read_text())["lineage"]
    assert lineage["models"] == [{"name": "org/tiny", "revision": done.revision, "hub_commit": HUB_COMMIT}]


@pytest.mark.parametrize("args, needle", [
    (("models", "import", "{tmp}/notes", "org/tiny"), "is not a Hugging Face snapshot"),
    (("models", "import", "{tmp}/nowhere", "org/tiny"), "no such directory"),
    (("models", "import", "{tmp}/d", "tiny"), "is not a hub id org/name"),
    (("models", "import", "{tmp}/d", "org/../x"), "is not a hub id org/name"),
    (("models", "import", "{tmp}/d"), "give the hub id"),
    (("models", "import", "{tmp}/w.pth", "org/w"), "imported by its file name"),
    (("models", "show", "org/unknown"), "no model org/unknown on the volume"),
    (("models", "show", "org/unknown", "--json"), "det-lab models import DIR org/unknown"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(lab, tmp_path, args, needle):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    write_download(tmp_path / "d")
    (tmp_path / "w.pth").write_bytes(b"x")
    proc = cli(lab, *(a.format(tmp=tmp_path) for a in args))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
        proc.stderr)
    assert not (lab.root / "models").exists() and proc.stdout == ""
