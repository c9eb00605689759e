"""Where base models live on the volume, and the environment that points Hugging Face and torch at them.

::

    <data root>/models/
      hf/                                HF_HOME
        hub/                             HF_HUB_CACHE, huggingface_hub's own cache layout:
          models--org--name/
            blobs/<sha256>               each file's content once (read-only)
            snapshots/<revision>/...     one directory per import, links into blobs/
            snapshots/<hub commit>       an alias of the revision imported from that hub commit
            refs/main                    the revision imported last
      torch/                             TORCH_HOME
        hub/checkpoints/<file>.pth       torchvision / torch.hub weights, by file name
      .det-lab/
        revisions/org--name/<revision>.json   who imported it, when, from where, its files
        staging/                         imports in progress (renamed into hub/ when whole)

Pure path arithmetic and string checks: nothing here touches the disk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from det_lab.models.errors import ModelStoreError

if TYPE_CHECKING:
    from det_lab.settings import LabSettings

STORE_DIR = "models"
#: a revision: 40 hex digits, so huggingface_hub takes it as a commit hash (``revision=...``)
REVISION = re.compile(r"^[0-9a-f]{40}$")
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_NAME = re.compile(rf"^{_PART}/{_PART}$")
#: variables that would send huggingface_hub or transformers to another cache than HF_HOME's
SHADOWING = ("HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "PYTORCH_TRANSFORMERS_CACHE",
             "PYTORCH_PRETRAINED_BERT_CACHE")


def check_name(name: str) -> str:
    """``name`` if it is a hub model id ``org/name`` as huggingface_hub accepts it; else one error line."""
    if not _NAME.match(name) or "--" in name or ".." in name or name.endswith(".git"):
        raise ModelStoreError(f"model name {name!r} is not a hub id org/name (letters, digits, '-', '_', '.'; "
                              "as on huggingface.co, e.g. lerobot/smolvla_base)")
    return name


@dataclass(frozen=True)
class ModelStoreLayout:
    """Paths of the model store under ``root`` (``<data root>/models``)."""

    root: Path

    @classmethod
    def from_settings(cls, settings: LabSettings) -> ModelStoreLayout:
        return cls(settings.data_root / STORE_DIR)

    @property
    def hf_home(self) -> Path:
        return self.root / "hf"

    @property
    def hub(self) -> Path:
        return self.hf_home / "hub"

    @property
    def torch_home(self) -> Path:
        return self.root / "torch"

    @property
    def torch_checkpoints(self) -> Path:
        return self.torch_home / "hub" / "checkpoints"

    @property
    def state(self) -> Path:
        return self.root / ".det-lab"

    @property
    def staging(self) -> Path:
        return self.state / "staging"

    def repo(self, name: str) -> Path:
        """The model's folder in the hub cache, named as huggingface_hub names it."""
        return self.hub / f"models--{check_name(name).replace('/', '--')}"

    def records(self, name: str) -> Path:
        return self.state / "revisions" / check_name(name).replace("/", "--")

    def record(self, name: str, revision: str) -> Path:
        return self.records(name) / f"{revision}.json"


def run_environment(data_root: Path, writable_cache: Path | None = None,
                    env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every det_lab run and task gets: HF_HOME, HF_HUB_CACHE and TORCH_HOME at the volume's
    store, HF_HUB_OFFLINE=1, and HF_DATASETS_CACHE somewhere writable.

    The store is read-only in cluster tasks, and ``datasets`` writes its cache under HF_HOME unless
    told otherwise: under ``writable_cache`` when given (an agent's local disk), else where it would
    have gone in ``env`` before HF_HOME moved (huggingface_hub's own default)."""
    env = os.environ if env is None else env
    store = ModelStoreLayout(Path(data_root) / STORE_DIR)
    if writable_cache is not None:
        datasets = str(Path(writable_cache) / "huggingface" / "datasets")
    else:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                  "huggingface")
        datasets = env.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    return {"HF_HOME": str(store.hf_home), "HF_HUB_CACHE": str(store.hub), "TORCH_HOME": str(store.torch_home),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": datasets}
