"""The ``hyperparameters.policy`` section of an experiment config, read without importing LeRobot.

    policy:
      name: act                 # det_lab (the template's own transformer) or a LeRobot policy type
      pretrained: null          # or a hub id in the volume's model store (lerobot/smolvla_base),
                                # or a local directory holding a LeRobot ``pretrained_model/``
      rename_map: {}            # dataset key -> the pretrained model's key (lerobot-train's --rename_map)
      precision: fp32           # or bf16: the forward under bf16 autocast, fp32 weights and optimizer
                                # (lerobot-train under accelerate's mixed_precision=bf16)
      dim_model: 64             # any other key: a field of LeRobot's policy config (ACTConfig, ...)

The policy type is ``name`` (as LeRobot's policy classes name themselves: ``ACTPolicy.name``), not
``type``: in Determined's hyperparameters a mapping with a ``type`` key is a search space
(``{type: int, minval: ...}``), so ``policy: {type: act}`` is refused by the master and by
``det-lab run`` alike. A whole section given as a constant (``policy: {type: const, val: {type:
act, ...}}``) arrives as a plain mapping, where ``type`` is read as ``name``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from det_lab.policies.errors import PolicyError

#: the template's own model (experiment_templates/vla/model.py): no LeRobot import at all
DEFAULT_TYPE = "det_lab"
_RESERVED = ("name", "type", "pretrained", "rename_map", "precision")
#: ``policy.precision``: fp32, or bf16 autocast over fp32 weights (fp16 would need a gradient scaler)
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class PolicyChoice:
    """Which policy a trial trains: its type, the pretrained model it starts from, its config keys."""

    type: str = DEFAULT_TYPE
    pretrained: Path | str | None = None  # a directory, or a hub id the volume's model store serves
    overrides: dict[str, Any] = field(default_factory=dict)
    rename_map: dict[str, str] = field(default_factory=dict)  # dataset key -> the policy's (cameras)
    precision: str = "fp32"  # one of PRECISIONS

    @property
    def is_lerobot(self) -> bool:
        """True when LeRobot's factory builds the policy (anything but :data:`DEFAULT_TYPE`)."""
        return self.type != DEFAULT_TYPE


def parse_policy(section: Mapping[str, Any] | None) -> PolicyChoice:
    """The :class:`PolicyChoice` of a ``policy`` hyperparameter section (``None``: the default).

    Raises:
        PolicyError: a section that is not a mapping, a non-string ``name``, a
            ``pretrained`` that is neither a hub id nor a local directory holding ``config.json``, or config keys
            given to the default policy (whose sizes live under ``hyperparameters.model``), a
            ``precision`` other than fp32 or bf16.
    """
    if section is None:
        return PolicyChoice()
    if not isinstance(section, Mapping):
        raise PolicyError(f"hyperparameters.policy must be a mapping such as {{name: act}}, got {section!r}")
    if "name" in section and "type" in section:
        raise PolicyError("hyperparameters.policy: give the policy type once, as name (not also as type)")
    kind = section.get("name", section.get("type", DEFAULT_TYPE))
    if not isinstance(kind, str) or not kind:
        raise PolicyError(f"hyperparameters.policy.name must be a policy type such as act, got {kind!r}")
    overrides = {str(k): v for k, v in section.items() if k not in _RESERVED}
    precision = section.get("precision") or "fp32"
    if precision not in PRECISIONS:
        raise PolicyError(f"hyperparameters.policy.precision must be fp32 or bf16 (bf16 autocast over fp32 weights; "
                          f"fp16 is not supported: it needs a gradient scaler), got {precision!r}")
    if kind == DEFAULT_TYPE and precision != "fp32":
        raise PolicyError(f"hyperparameters.policy.precision is for LeRobot policies; the {DEFAULT_TYPE} model's "
                          "switch is hyperparameters.bf16 (CUDA only)")
    if kind == DEFAULT_TYPE and overrides:
        raise PolicyError(f"hyperparameters.policy: {sorted(overrides)} are LeRobot policy keys, but the policy is "
                          f"{DEFAULT_TYPE} (its sizes are under hyperparameters.model); set policy.name")
    renames = section.get("rename_map") or {}
    if not isinstance(renames, Mapping) or not all(isinstance(v, str) for v in renames.values()):
        raise PolicyError("hyperparameters.policy.rename_map must map dataset keys to the policy's, such as "
                          f"{{observation.images.front: observation.images.camera1}}, got {renames!r}")
    return PolicyChoice(kind, _pretrained(section.get("pretrained"), kind), overrides,
                        {str(k): v for k, v in renames.items()}, precision)


def _pretrained(value: Any, kind: str) -> Path | str | None:
    if value is None or value == "":
        return None
    if kind == DEFAULT_TYPE:
        raise PolicyError("hyperparameters.policy.pretrained needs a LeRobot policy type (policy.name)")
    if not isinstance(value, str):
        raise PolicyError(f"hyperparameters.policy.pretrained must be a hub id or a directory path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_dir():
        if is_hub_id(value):  # served offline from the volume's model store (checked before a run starts)
            return value
        raise PolicyError(f"hyperparameters.policy.pretrained: {value} is not a local directory nor a hub id "
                          "(org/name); pass a model of the volume's store (det-lab models list) or the directory "
                          "of a LeRobot pretrained_model/ (config.json, model.safetensors)")
    if not (path / "config.json").is_file():
        raise PolicyError(f"hyperparameters.policy.pretrained: {path} has no config.json; pass the directory "
                          "of a LeRobot pretrained_model/ (a det_lab checkpoint's pretrained_model/ is one)")
    return path.resolve()


def is_hub_id(value: str) -> bool:
    """Whether ``value`` reads as a hub model id ``org/name`` rather than a path."""
    from det_lab.models import ModelStoreError
    from det_lab.models.layout import check_name

    if value.startswith(("/", ".", "~")):
        return False
    try:
        check_name(value)
    except ModelStoreError:
        return False
    return True
