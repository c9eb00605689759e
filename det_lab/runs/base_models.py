"""The base models a run loads, checked on the volume before anything starts: one line naming the import.

A run loads, offline from the volume's model store (:mod:`det_lab.models`):

- each hub id in ``data.det_lab.base_model``;
- ``hyperparameters.policy.pretrained`` when it is a hub id (LeRobot's ``from_pretrained`` reads
  ``config.json`` and ``model.safetensors`` from the store's cache);
- the VLM (its config and tokenizer) a VLA policy names in ``vlm_model_name``, given as a policy key
  or in the pretrained model's ``config.json``, and pi0's hard-coded PaliGemma tokenizer;
- the torchvision backbone weights ``pretrained_backbone_weights`` names (``ResNet18_Weights.IMAGENET1K_V1``
  is ``$TORCH_HOME/hub/checkpoints/resnet18-f37072fd.pth``).

:func:`check_base_models` runs in det_lab's preflight (``det-lab run --local`` before a GPU is leased,
``--slurm`` on the login node before ``sbatch``) and at a trial's start (a cluster task, where no
preflight ran), before the dataset is pulled. :func:`check_sizes` refuses a dataset whose state or
action size differs from the pretrained model's. Both read the config as plain data: no LeRobot import.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.errors import UserError
from det_lab.models import ModelMissing, ModelStoreError, require_model, require_torch_weights
from det_lab.models.layout import check_name
from det_lab.settings import LabSettings
from det_lab.runs.expconf import base_models_of

#: what ``from_pretrained`` reads of a LeRobot policy, and of a VLM (AutoConfig, AutoProcessor)
POLICY_FILES = ("config.json", "model.safetensors")
VLM_FILES = ("config.json",)
#: tokenizers LeRobot's processors load by a fixed name (pi0/pi0.5: lerobot/policies/pi0/processor_pi0.py)
FIXED_TOKENIZERS = {"pi0": "google/paligemma-3b-pt-224", "pi05": "google/paligemma-3b-pt-224"}
#: torchvision's weight files of the backbones LeRobot's policies use (torchvision/models/resnet.py)
_KNOWN_WEIGHTS = {
    "ResNet18_Weights.IMAGENET1K_V1": "resnet18-f37072fd.pth",
    "ResNet34_Weights.IMAGENET1K_V1": "resnet34-b627a593.pth",
    "ResNet50_Weights.IMAGENET1K_V1": "resnet50-0676ba61.pth",
    "ResNet50_Weights.IMAGENET1K_V2": "resnet50-11ad3fa6.pth",
}


class SizeMismatch(UserError, ValueError):
    """A dataset's state or action size that the pretrained model cannot take."""


@dataclass(frozen=True)
class Need:
    """One thing a run loads from the store: a hub model (with files) or a torch weight file."""

    key: str  # the config key that names it
    name: str  # org/name, or the weight file's name
    files: tuple[str, ...] = ()
    torch: bool = False


def _values(spec: Any) -> Iterator[Any]:
    """The values a hyperparameter can take: a constant, a const or categorical space's values."""
    if isinstance(spec, Mapping) and spec.get("type") in ("const", "categorical"):
        yield from ([spec.get("val")] if spec["type"] == "const" else list(spec.get("vals") or []))
    elif not (isinstance(spec, Mapping) and spec.get("type") in ("int", "double", "log")):
        yield spec


def policy_sections(hparams: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Each ``policy`` section the hyperparameters can give (a search's categorical values each), flat."""
    sections: list[dict[str, Any]] = []
    for section in _values((hparams or {}).get("policy")):
        if not isinstance(section, Mapping):
            continue
        choices: list[dict[str, Any]] = [{}]
        for key, spec in section.items():
            choices = [{**c, key: v} for c in choices for v in _values(spec)]
        sections.extend(choices)
    return sections


def _hub_id(value: Any) -> str | None:
    if not isinstance(value, str) or value.startswith(("/", ".", "~")) or Path(value).expanduser().exists():
        return None
    try:
        return check_name(value)
    except ModelStoreError:
        return None


def weight_file(weights: str) -> str | None:
    """The torch hub file torchvision downloads for ``weights`` (``ResNet18_Weights.IMAGENET1K_V1``),
    read from torchvision's source without importing it (it may not import where the check runs)."""
    if weights in _KNOWN_WEIGHTS:
        return _KNOWN_WEIGHTS[weights]
    enum, _, member = weights.partition(".")
    spec = importlib.util.find_spec("torchvision")
    if not member or spec is None or not spec.submodule_search_locations:
        return None
    for source in sorted((Path(spec.submodule_search_locations[0]) / "models").rglob("*.py")):
        text = source.read_text(errors="replace")
        if f"class {enum}(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == enum:
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == member for t in stmt.targets):
                        for kw in getattr(stmt.value, "keywords", []):
                            if kw.arg == "url" and isinstance(kw.value, ast.Constant):
                                return str(kw.value.value).rsplit("/", 1)[-1]
    return None


def needs_of(exp_conf: Mapping[str, Any], hparams: Mapping[str, Any] | None = None,
             settings: LabSettings | None = None) -> list[Need]:
    """What a run of ``exp_conf`` (with ``hparams``, else the config's hyperparameters) loads from the
    store. With ``settings``, the pretrained model's own ``config.json`` in the store adds the VLM and
    backbone it names."""
    needs = [Need("data.det_lab.base_model", name) for name in base_models_of(dict(exp_conf))]
    hparams = exp_conf.get("hyperparameters") if hparams is None else hparams
    for section in policy_sections(hparams):
        keys = dict(section)
        kind = keys.get("name", keys.get("type"))
        pretrained = _hub_id(keys.get("pretrained"))
        if pretrained:
            needs.append(Need("hyperparameters.policy.pretrained", pretrained, POLICY_FILES))
            if settings is not None:
                base = _stored_config(settings, pretrained)
                kind = kind or base.get("type")
                keys = {**{k: base[k] for k in ("vlm_model_name", "pretrained_backbone_weights") if k in base}, **keys}
        vlm = _hub_id(keys.get("vlm_model_name"))
        if vlm:
            needs.append(Need("hyperparameters.policy.vlm_model_name", vlm, VLM_FILES))
        if isinstance(kind, str) and kind in FIXED_TOKENIZERS:
            needs.append(Need(f"hyperparameters.policy.name ({kind}'s tokenizer)", FIXED_TOKENIZERS[kind],
                              ("tokenizer_config.json",)))
        weights = keys.get("pretrained_backbone_weights")
        if isinstance(weights, str) and weights:
            file = weight_file(weights)
            if file:
                needs.append(Need("hyperparameters.policy.pretrained_backbone_weights", file, torch=True))
    unique: dict[tuple[str, bool], Need] = {}
    for need in needs:
        unique.setdefault((need.name, need.torch), need)
    return list(unique.values())


def _stored_config(settings: LabSettings, hub_id: str) -> dict[str, Any]:
    try:
        path = require_model(settings, hub_id).path / "config.json"
        data = json.loads(path.read_text())
    except (ModelMissing, OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_base_models(settings: LabSettings, exp_conf: Mapping[str, Any], hparams: Mapping[str, Any] | None = None,
                      source: str = "experiment config") -> list[Need]:
    """Raise :class:`~det_lab.models.ModelMissing` (one line: the config key and the ``det-lab models
    import`` to run) for the first base model, tokenizer or backbone file the volume lacks."""
    needs = needs_of(exp_conf, hparams, settings)
    for need in needs:
        try:
            if need.torch:
                require_torch_weights(settings, need.name)
            else:
                require_model(settings, need.name, need.files)
        except ModelMissing as exc:
            raise ModelMissing(f"{source}: {need.key}: {exc}") from None
    return needs


def pretrained_config(settings: LabSettings, pretrained: Any) -> dict[str, Any] | None:
    """The ``config.json`` of ``policy.pretrained`` (a directory, or a hub id in the store), if readable."""
    if not isinstance(pretrained, str) or not pretrained:
        return None
    hub = _hub_id(pretrained)
    path = (require_model(settings, hub).path if hub else Path(pretrained).expanduser()) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _shape(feature: Any) -> tuple[int, ...] | None:
    shape = feature.get("shape") if isinstance(feature, Mapping) else getattr(feature, "shape", None)
    return tuple(int(n) for n in shape) if shape is not None else None


def check_sizes(base: Mapping[str, Any], data_features: Mapping[str, Any], name: str, where: str) -> None:
    """Refuse a dataset whose ``observation.state`` or ``action`` size differs from the pretrained
    model's config ``base`` (its ``input_features``/``output_features``); a policy that pads to
    ``max_state_dim``/``max_action_dim`` (SmolVLA, pi0) takes any size up to those.

    ``data_features``: the dataset's features (``meta/info.json``'s, or LeRobot's metadata)."""
    declared = {**(base.get("input_features") or {}), **(base.get("output_features") or {})}
    for key, pad in (("observation.state", "max_state_dim"), ("action", "max_action_dim")):
        theirs, ours = _shape(declared.get(key)), _shape(data_features.get(key))
        if theirs is None or ours is None or theirs == ours:
            continue
        limit = base.get(pad)
        if isinstance(limit, int) and len(ours) == 1 and ours[0] <= limit:
            continue
        what = "state" if key == "observation.state" else "action"
        most = f" (it pads to at most {limit})" if isinstance(limit, int) else ""
        raise SizeMismatch(f"{where}: the dataset's {key} has size {list(ours)}, but the pretrained model {name} "
                           f"was trained with {what} size {list(theirs)}{most}; choose a dataset of the same robot, "
                           "or train from scratch (policy.pretrained: null)")
