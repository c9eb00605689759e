"""A LeRobot policy trained by a det_lab trial, built and stepped as ``lerobot-train`` does.

Build order (``lerobot/scripts/lerobot_train.py``): ``make_policy_config`` -> ``make_policy(cfg,
ds_meta=...)`` -> ``make_pre_post_processors(policy_cfg=cfg, dataset_stats=...)`` -> the policy's
optimizer and scheduler presets over ``policy.get_optim_params()``. A step (its
``update_policy``): preprocessor, ``loss, out = policy.forward(batch)``, backward, gradient
clipping to the optimizer preset's ``grad_clip_norm``, optimizer step, scheduler step,
``policy.update()`` where the policy has it. Two ways to scale it: ``accumulation`` micro-batches
per step (the gradients of k equal slices of the batch, each loss divided by k, add up to the whole
batch's for a policy whose loss is a mean over the batch, as ACT's, Diffusion's and SmolVLA's are)
and ``precision: bf16`` (the forward under ``torch.autocast(..., torch.bfloat16)``, weights and
optimizer fp32: lerobot-train under ``accelerate launch --mixed_precision=bf16``).
The caller supplies backward and the optimizer step
(Determined's ``context.backward`` and ``context.step_optimizer`` in a trial, plain PyTorch
elsewhere) and the wrappers of model, optimizer and scheduler, so exact resume stays Determined's.

LeRobot is imported here, when a LeRobot policy is built, never at det_lab's import.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from det_lab.policies.choice import PolicyChoice
from det_lab.policies.errors import PolicyError
from det_lab.policies.meta import DatasetMeta

#: where a checkpoint directory holds LeRobot's own files (``PolicyClass.from_pretrained`` reads it)
PRETRAINED_DIR = "pretrained_model"
Wrap = Callable[[Any], Any]


def _same(x: Any) -> Any:
    return x


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


@dataclasses.dataclass
class LeRobotTraining:
    """A LeRobot policy with its processors, optimizer and scheduler, and det_lab's step on them."""

    config: Any  # lerobot.configs.policies.PreTrainedConfig
    model: torch.nn.Module  # the policy as the caller wrapped it (forward goes through it)
    policy: Any  # the PreTrainedPolicy itself (save_pretrained, get_optim_params, update)
    preprocessor: Any
    postprocessor: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    grad_clip_norm: float
    delta_indices: dict[str, list[int]] | None
    grad_norm: torch.Tensor | None = None
    accumulation: int = 1  # micro-batches per optimizer step
    precision: str = "fp32"  # or bf16: autocast over the forward
    device_type: str = "cpu"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast on the policy's device when ``precision`` is bf16, else nothing."""
        if self.precision == "bf16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def drop_n_last_frames(self) -> int:
        """Frames LeRobot's ``EpisodeAwareSampler`` leaves out at each episode's end for this policy."""
        return int(getattr(self.config, "drop_n_last_frames", 0) or 0)

    def clip_gradients(self, _params: Any = None) -> None:
        """``update_policy``'s clipping: over all the policy's parameters, to ``grad_clip_norm``."""
        if self.grad_clip_norm > 0:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip_norm)
        else:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), float("inf"),
                                                           error_if_nonfinite=False)

    def _plain_step(self, optimizer: torch.optim.Optimizer, clip: Callable[[Any], None]) -> None:
        clip(None)
        optimizer.step()
        optimizer.zero_grad()

    def train_step(self, batch: dict[str, Any], backward: Callable[[torch.Tensor], None] | None = None,
                   step_optimizer: Callable[..., None] | None = None) -> dict[str, Any]:
        """One training step on a loader's batch; returns ``loss``, every scalar the policy's forward
        returns (``l1_loss``, ``kld_loss``, ...), ``grad_norm`` and ``lr``.

        ``backward(loss)`` and ``step_optimizer(optimizer, clip_grads)`` default to PyTorch's own
        (``step_optimizer`` must call ``clip_grads``, step and zero the gradients, as Determined's does).
        """
        self.policy.train()
        k = self.accumulation
        loss_sum: torch.Tensor | None = None
        out_sum: dict[str, Any] = {}
        for i, micro in enumerate(split_batch(batch, k)):
            # DDP: the gradients are exchanged once, after the last micro-batch's backward
            last = i == k - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast():
                    loss, out = self.model(self.preprocessor(micro))
                (backward or _backward)(loss / k if k > 1 else loss)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            for key, value in scalars(out).items():
                out_sum[key] = out_sum[key] + value if key in out_sum else value
        (step_optimizer or self._plain_step)(self.optimizer, self.clip_gradients)
        if self.scheduler is not None:
            self.scheduler.step()
        update = getattr(self.policy, "update", None)
        if callable(update):
            update()
        assert loss_sum is not None
        metrics: dict[str, Any] = {"loss": loss_sum / k}
        metrics.update({key: value / k for key, value in out_sum.items()})
        if self.grad_norm is not None:
            metrics["grad_norm"] = self.grad_norm.detach()
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def predict_chunk(self, batch: dict[str, Any]) -> torch.Tensor:
        """The policy's action chunk (normalised units) for a preprocessed batch, from its current
        frame on: ``predict_action_chunk``, or Diffusion's sampler over the batch's observation
        history (its ``predict_action_chunk`` reads the rollout queues instead)."""
        diffusion = getattr(self.policy, "diffusion", None)
        if diffusion is not None and hasattr(diffusion, "generate_actions"):
            obs = {k: v for k, v in batch.items() if k.startswith("observation.")}
            if self.config.image_features:
                obs["observation.images"] = torch.stack([obs[k] for k in self.config.image_features], dim=-4)
            return cast(torch.Tensor, diffusion.generate_actions(obs))
        return cast(torch.Tensor, self.policy.predict_action_chunk(batch))

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
        """Held-out metrics of a loader's batch, as the template's own model reports them:
        ``val_loss`` (L1 of the predicted chunk in normalised units), ``val_action_l1`` (in the
        robot's units) and ``val_action_l1_first`` (the chunk's first step), padded steps masked.

        Runs in eval mode under a forked RNG seeded with ``seed``: a sampling policy (Diffusion)
        gives the same numbers every time, and training's random stream is left as it was."""
        self.policy.eval()
        target, pad = batch["action"], batch.get("action_is_pad")
        if target.ndim == 2:  # a policy without an action chunk: one step
            target, pad = target[:, None], None if pad is None else pad.reshape(len(target), -1)[:, :1]
        device = next(self.policy.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            pre = self.preprocessor(batch)
            with self.autocast():
                pred_n = self.predict_chunk(pre).float()
        if pred_n.ndim == 2:
            pred_n = pred_n[:, None]
        deltas = list(self.config.action_delta_indices or [0])
        first = deltas.index(0) if 0 in deltas else 0  # the chunk starts at the current frame
        n = min(pred_n.shape[1], target.shape[1] - first)
        pred_n = pred_n[:, :n]
        target_n = pre["action"].reshape(target.shape)[:, first:first + n].to(pred_n)
        target = target[:, first:first + n].to(torch.float32)
        pred = self.postprocessor(pred_n).to(target)
        valid = torch.ones_like(target[..., :1]) if pad is None else (~pad[:, first:first + n]).to(target)[..., None]
        per = (valid.sum() * target.shape[-1]).clamp_min(1)
        err = (pred - target).abs() * valid
        return {"val_loss": ((pred_n - target_n).abs() * valid.to(pred_n)).sum().cpu() / per,
                "val_action_l1": err.sum() / per,
                "val_action_l1_first": err[:, 0].sum() / (valid[:, 0].sum() * target.shape[-1]).clamp_min(1)}

    def export(self, checkpoint_dir: str | Path) -> Path:
        """Write LeRobot's ``pretrained_model/`` (config.json, model.safetensors, the processors'
        files) into ``checkpoint_dir``, through the policy's and processors' own ``save_pretrained``."""
        out = Path(checkpoint_dir) / PRETRAINED_DIR
        self.policy.save_pretrained(out)
        self.preprocessor.save_pretrained(out)
        self.postprocessor.save_pretrained(out)
        return out


def split_batch(batch: dict[str, Any], parts: int) -> Iterator[dict[str, Any]]:
    """A loader's batch as ``parts`` equal micro-batches, in order (tensors and lists along their
    first axis); the batch itself when ``parts`` is 1.

    Raises:
        PolicyError: a batch that ``parts`` does not divide.
    """
    if parts == 1:
        yield batch
        return
    def cut(value: Any) -> bool:
        return isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.ndim > 0)

    sizes = {len(v) for v in batch.values() if cut(v)}
    if len(sizes) != 1 or next(iter(sizes)) % parts:
        raise PolicyError(f"a batch of {sorted(sizes)} samples cannot be cut into {parts} equal micro-batches "
                          "(hyperparameters.grad_accumulation)")
    step = sizes.pop() // parts
    for i in range(parts):
        yield {key: value[i * step:(i + 1) * step] if cut(value) else value for key, value in batch.items()}


def check_precision(cfg: Any, precision: str, device_type: str) -> None:
    """Refuse bf16 autocast where it cannot run as asked: a device without it (LeRobot's
    ``is_amp_available``: not MPS; CUDA without bf16) or a policy whose own ``dtype`` keeps its
    weights in bf16 (pi0, pi0.5: autocast needs fp32 master weights)."""
    if precision != "bf16":
        return
    if device_type == "mps" or (device_type == "cuda" and not torch.cuda.is_bf16_supported()):
        raise PolicyError(f"hyperparameters.policy.precision bf16: this {device_type} device has no bf16 autocast; "
                          "set policy.precision: fp32")
    if str(getattr(cfg, "dtype", "float32")) == "bfloat16":
        raise PolicyError(f"hyperparameters.policy.precision bf16 autocasts over fp32 weights, but {cfg.type}'s "
                          "dtype: bfloat16 keeps them in bf16; set policy.dtype: float32 (or drop policy.precision)")


def scalars(out: Any) -> dict[str, Any]:
    """The scalar entries of a policy's forward output (floats and one-element tensors)."""
    found: dict[str, Any] = {}
    for key, value in (out or {}).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            found[key] = float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            found[key] = value.detach().reshape(())
    return found


#: where LeRobot keeps the dataset helpers det_lab calls: 0.5+ split ``lerobot.datasets.utils``
#: (0.4) into ``lerobot.datasets.feature_utils`` and ``lerobot.utils.feature_utils``
_HELPER_MODULES = ("lerobot.datasets.feature_utils", "lerobot.utils.feature_utils", "lerobot.datasets.utils")


def _lerobot(name: str) -> Callable[..., Any]:
    """LeRobot's dataset helper ``name``, from the module the installed release keeps it in."""
    import importlib

    for module in _HELPER_MODULES:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return cast("Callable[..., Any]", found)
    raise ImportError(f"LeRobot has no {name} in {', '.join(_HELPER_MODULES)}")


def known_types() -> list[str]:
    """The policy types LeRobot's factory knows (its config registry), sorted."""
    from lerobot.configs.policies import PreTrainedConfig

    return sorted(PreTrainedConfig.get_known_choices())


def make_config(choice: PolicyChoice, device: str) -> Any:
    """LeRobot's policy config for ``choice``: ``make_policy_config(type, **keys)``, or the
    pretrained model's ``config.json`` with the keys applied, its ``pretrained_path`` set."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_policy_config

    types = known_types()
    if choice.type not in types:
        raise PolicyError(f"hyperparameters.policy.name: unknown policy type {choice.type!r}; "
                          f"choose det_lab or one of LeRobot's: {', '.join(types)}")
    cls = PreTrainedConfig.get_choice_class(choice.type)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(choice.overrides) - names)
    if unknown:
        raise PolicyError(f"hyperparameters.policy: {cls.__name__} has no keys {unknown}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    # YAML has lists where the configs declare tuples (down_dims, crop_shape): keep the declared kind
    keys = {k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple) else v
            for k, v in choice.overrides.items()}
    keys.setdefault("device", device)
    try:
        if choice.pretrained is None:
            return make_policy_config(choice.type, **keys)
        cfg = PreTrainedConfig.from_pretrained(choice.pretrained)
        if cfg.type != choice.type:
            raise PolicyError(f"hyperparameters.policy.pretrained: {choice.pretrained} holds a {cfg.type} "
                              f"policy, not {choice.type}")
        cfg = dataclasses.replace(cfg, **keys)
        cfg.pretrained_path = choice.pretrained
        return cfg
    except (TypeError, ValueError, NotImplementedError) as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"hyperparameters.policy ({choice.type}): {_one_line(exc)}") from None


def delta_indices(cfg: Any, meta: DatasetMeta) -> dict[str, list[int]] | None:
    """The frame offsets per feature the policy config asks for (``resolve_delta_timestamps`` in
    frames, as ``LeRobotDataset`` turns them into indices); ``None`` for the current frame only."""
    from lerobot.datasets.factory import resolve_delta_timestamps

    check_delta_timestamps = _lerobot("check_delta_timestamps")
    get_delta_indices = _lerobot("get_delta_indices")
    timestamps = resolve_delta_timestamps(cfg, meta)
    if timestamps is None:
        return None
    check_delta_timestamps(timestamps, meta.fps, 1e-4)
    return cast("dict[str, list[int]]", get_delta_indices(timestamps, meta.fps))


def check_features(cfg: Any, meta: DatasetMeta, rename_map: dict[str, str] | None = None) -> None:
    """Refuse a dataset without what the policy needs (``validate_features`` on the dataset's
    features, as ``make_policy`` sets them), or, without ``rename_map``, with cameras that are
    neither a subset nor a superset of the policy's (``make_policy``'s own rule), before anything is built."""
    from lerobot.configs.types import FeatureType

    features = _lerobot("dataset_to_policy_features")(meta.features)
    probe = dataclasses.replace(cfg)
    probe.output_features = {k: ft for k, ft in features.items() if ft.type is FeatureType.ACTION}
    if not probe.input_features:
        probe.input_features = {k: ft for k, ft in features.items() if k not in probe.output_features}
    has = ", ".join(sorted(features)) or "none"
    if not probe.output_features:
        raise PolicyError(f"{meta.root}: the dataset has no action feature, which policy {cfg.type} predicts")
    try:
        probe.validate_features()
    except (ValueError, KeyError) as exc:
        raise PolicyError(f"{meta.root}: policy {cfg.type} cannot train on this dataset: {_one_line(exc)} "
                          f"(its features: {has})") from None
    theirs = {k for k, ft in probe.input_features.items() if ft.type is FeatureType.VISUAL}
    ours = {k for k, ft in features.items() if ft.type is FeatureType.VISUAL}
    if not rename_map and not (theirs <= ours or ours <= theirs):
        raise PolicyError(f"{meta.root}: the dataset's cameras {sorted(ours)} are not the policy's {sorted(theirs)}; "
                          "map them with hyperparameters.policy.rename_map: {dataset key: policy key}")


#: the statistics LeRobot's normaliser reads per mode (``lerobot/processor/normalize_processor.py``,
#: ``_apply_transform``: it raises at the first batch when one is missing)
NORMALISER_STATS = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
                    "QUANTILE10": ("q10", "q90")}


def check_stats(cfg: Any, meta: DatasetMeta) -> None:
    """Refuse a dataset whose ``meta/stats.json`` lacks a statistic the policy normalises a feature by
    (pi0.5's quantiles, say), before anything is built; LeRobot would fail at the first batch."""
    from lerobot.configs.types import FeatureType

    modes = {str(getattr(k, "value", k)): str(getattr(v, "value", v)) for k, v in cfg.normalization_mapping.items()}
    for key, feature in _lerobot("dataset_to_policy_features")(meta.features).items():
        stats = meta.stats.get(key)
        mode = modes.get(feature.type.value if isinstance(feature.type, FeatureType) else str(feature.type), "")
        missing = [name for name in NORMALISER_STATS.get(mode, ()) if stats is not None and name not in stats]
        if missing:
            raise PolicyError(f"{meta.root}: policy {cfg.type} normalises {key} by {mode}, and the dataset's "
                              f"meta/stats.json has no {' or '.join(missing)} for it; add them with LeRobot's "
                              "augment_dataset_quantile_stats.py (or set policy.normalization_mapping)")


def check_pretrained_sizes(cfg: Any, meta: DatasetMeta) -> None:
    """Refuse a dataset whose state or action size the pretrained model was not trained with
    (:func:`det_lab.runs.base_models.check_sizes`), before its weights are loaded."""
    from det_lab.runs.base_models import SizeMismatch, check_sizes

    base = {"input_features": cfg.input_features, "output_features": cfg.output_features,
            "max_state_dim": getattr(cfg, "max_state_dim", None), "max_action_dim": getattr(cfg, "max_action_dim", None)}
    try:
        check_sizes(base, meta.features, str(cfg.pretrained_path), str(meta.root))
    except SizeMismatch as exc:
        raise PolicyError(str(exc)) from None


def build_training(choice: PolicyChoice, meta: DatasetMeta, *, device: str | torch.device = "cpu",
                   total_steps: int, wrap_model: Wrap = _same, wrap_optimizer: Wrap = _same,
                   wrap_scheduler: Wrap = _same, accumulation: int = 1) -> LeRobotTraining:
    """Build ``choice`` on the dataset ``meta`` in ``lerobot-train``'s order (see the module doc).

    ``total_steps`` is the run's length in optimizer steps (the scheduler preset's horizon);
    ``wrap_*`` receive the policy, optimizer and scheduler as they are made (Determined's
    ``context.wrap_model`` and friends in a trial); ``accumulation`` micro-batches make one step
    (``total_steps`` counts steps, not micro-batches), ``choice.precision`` the forward's autocast.

    Raises:
        PolicyError: an unknown type or key, a bad value, or a dataset the policy cannot train on.
    """
    from lerobot.policies.factory import make_policy, make_pre_post_processors

    device_type = torch.device(device).type
    cfg = make_config(choice, device_type)
    check_precision(cfg, choice.precision, device_type)
    check_features(cfg, meta, choice.rename_map)
    check_stats(cfg, meta)
    if cfg.pretrained_path is not None:
        check_pretrained_sizes(cfg, meta)
    policy = make_policy(cfg, ds_meta=meta, rename_map=choice.rename_map or None)
    model = wrap_model(policy)
    processor_kwargs: dict[str, Any] = {"dataset_stats": meta.stats}
    if cfg.pretrained_path is not None:  # the pretrained processors, renormalised to this dataset
        features = {**cfg.input_features, **cfg.output_features}
        processor_kwargs["preprocessor_overrides"] = {
            "device_processor": {"device": device_type},
            "normalizer_processor": {"stats": meta.stats, "features": features,
                                     "norm_map": cfg.normalization_mapping},
            "rename_observations_processor": {"rename_map": dict(choice.rename_map)},
        }
        processor_kwargs["postprocessor_overrides"] = {
            "unnormalizer_processor": {"stats": meta.stats, "features": cfg.output_features,
                                       "norm_map": cfg.normalization_mapping},
        }
    preprocessor, postprocessor = make_pre_post_processors(policy_cfg=cfg, pretrained_path=cfg.pretrained_path,
                                                           **processor_kwargs)
    optimizer_cfg, scheduler_cfg = cfg.get_optimizer_preset(), cfg.get_scheduler_preset()
    optimizer = wrap_optimizer(optimizer_cfg.build(policy.get_optim_params()))
    scheduler = scheduler_cfg.build(optimizer, total_steps) if scheduler_cfg is not None else None
    if scheduler is not None:
        scheduler = wrap_scheduler(scheduler)
    return LeRobotTraining(cfg, model, policy, preprocessor, postprocessor, optimizer, scheduler,
                           float(optimizer_cfg.grad_clip_norm), delta_indices(cfg, meta),
                           accumulation=accumulation, precision=choice.precision, device_type=device_type)
