"""A tiny random SmolVLA base and the SmolVLM it names, written as the hub snapshots a user downloads.

SmolVLA loads its VLM's ``config.json``, processor and tokenizer by ``vlm_model_name`` even when it
does not load the VLM's weights (``load_vlm_weights: false``), and its preprocessor loads the
tokenizer by the same name. The real ones (``lerobot/smolvla_base``, 450 M parameters, and
``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``) need the hub; these are the same files at a few
thousand parameters, made here with transformers' and LeRobot's own ``save_pretrained``:

    vlm = write_tiny_vlm(tmp / "vlm")                      # config.json, tokenizer, processor files
    base = write_tiny_base(tmp / "base", vlm, VLM_ID, features)   # LeRobot's pretrained_model/ files
    det-lab models import <vlm> HuggingFaceTB/SmolVLM2-500M-Video-Instruct
    det-lab models import <base> lerobot/smolvla_base

The base is built against the VLM's directory, then its ``vlm_model_name`` (config.json) and the
tokenizer name of its preprocessor are set to the hub id, as they are in the real base.

``python -m tests.tiny_smolvla WORKDIR`` is tests/test_vla_smolvla.py's child process (LeRobot
reads ``HF_HOME`` once, at import: a child started with a run's environment sees the lab's model
store as a run does). It talks over stdin/stdout, one line each way per stage: writes the models
(``made``), waits for ``go`` (the models imported), steps det_lab and LeRobot side by side,
waits for a checkpoint directory, loads it with LeRobot; then saves what it saw to ``WORKDIR/seen.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BASE_ID = "lerobot/smolvla_base"
VLM_ID = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
#: the image tokens SmolVLM's processor and SmolVLA's prefix look up on the tokenizer
IMAGE_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
WORDS = "pick up the red green blue block put place on in to a and".split()
IMAGE_SIZE = 32
#: SmolVLA's keys for a base of this VLM: small chunks, 32x32 images, padded state and action of 6
BASE_KEYS: dict[str, Any] = dict(chunk_size=4, n_action_steps=4, max_state_dim=6, max_action_dim=6,
                                 resize_imgs_with_padding=(IMAGE_SIZE, IMAGE_SIZE), tokenizer_max_length=12,
                                 num_steps=2, num_vlm_layers=2, load_vlm_weights=False,
                                 scheduler_warmup_steps=2, scheduler_decay_steps=10)


def write_tiny_vlm(dest: Path) -> Path:
    """A random SmolVLM (2 text layers of width 32, a 1-layer vision tower on 32x32 images) as a hub
    snapshot: its ``config.json``, a word-level tokenizer with SmolVLM's image tokens, and the
    processor's files (``AutoConfig`` and ``AutoProcessor`` load it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    dest.mkdir(parents=True)
    special = ["<pad>", "<unk>", "<|im_start|>", *IMAGE_TOKENS.values()]
    vocab = {tok: i for i, tok in enumerate([*special, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<|im_start|>", extra_special_tokens=dict(IMAGE_TOKENS),
                                        model_max_length=64)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=len(vocab), max_position_embeddings=128,
                pad_token_id=vocab["<pad>"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8)
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                           image_token_id=vocab["<image>"], pad_token_id=vocab["<pad>"])
    config.save_pretrained(dest)
    image_processor = SmolVLMImageProcessor(size={"longest_edge": IMAGE_SIZE},
                                            max_image_size={"longest_edge": IMAGE_SIZE})
    processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=SmolVLMVideoProcessor(), image_seq_len=4)
    processor.save_pretrained(dest)
    return dest


def write_tiny_base(dest: Path, vlm_dir: Path, vlm_id: str, features: dict[str, tuple[int, ...]],
                    seed: int = 0) -> Path:
    """A random SmolVLA policy on ``vlm_dir`` (:data:`BASE_KEYS`), saved with LeRobot's own
    ``save_pretrained`` (config.json, model.safetensors, the pre/post-processors with unit stats),
    naming ``vlm_id`` where the real base names its VLM. ``features``: key -> shape; ``action``
    is the output, the rest inputs (a camera key has a ``(3, H, W)`` shape)."""
    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    def kind(key: str) -> FeatureType:
        return {"action": FeatureType.ACTION, "observation.state": FeatureType.STATE}.get(key, FeatureType.VISUAL)

    def feature(key: str) -> PolicyFeature:
        return PolicyFeature(type=kind(key), shape=tuple(features[key]))

    torch.manual_seed(seed)
    cfg = SmolVLAConfig(vlm_model_name=str(vlm_dir), device="cpu", **BASE_KEYS,
                        input_features={k: feature(k) for k in features if k != "action"},
                        output_features={"action": feature("action")})
    policy = SmolVLAPolicy(cfg)
    stats = {k: {"mean": torch.zeros(shape), "std": torch.ones(shape)}
             for k, shape in features.items() if kind(k) is not FeatureType.VISUAL}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    policy.save_pretrained(dest)
    pre.save_pretrained(dest)
    post.save_pretrained(dest)
    _rename(dest / "config.json", str(vlm_dir), vlm_id)
    _rename(dest / "policy_preprocessor.json", str(vlm_dir), vlm_id)
    return dest


def _rename(path: Path, old: str, new: str) -> None:
    data = json.loads(path.read_text())

    def swap(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return new if node == old else node

    path.write_text(json.dumps(swap(data), indent=4))


# --- the child process ---------------------------------------------------------------------------

CAMERA = "observation.images.front"
#: the base's camera: named otherwise than the datasets', as the real base's cameras are named otherwise than a lab's
BASE_CAMERA = "observation.images.top"
LENGTHS = (9, 12, 7, 10)  # episodes of different lengths: chunks padded at each end
#: three batches by dataset index, each touching episode starts and ends
BATCHES = ([0, 8, 9, 20, 21, 27, 30, 37], [1, 2, 10, 15, 22, 28, 33, 36], [3, 5, 11, 19, 23, 29, 31, 35])
SEED = 7
#: the fine-tune's keys (policy.* in an experiment config): a short schedule, so its LR moves each step
FINE_TUNE = {"name": "smolvla", "pretrained": BASE_ID, "rename_map": {CAMERA: BASE_CAMERA}, "optimizer_lr": 1e-3,
             "scheduler_warmup_steps": 1, "scheduler_decay_steps": 6}


def write_dataset(root: Path, state: int = 3, action: int = 2) -> Path:
    """A LeRobot v3.0 dataset written by LeRobot itself (its ``create``/``add_frame``/``save_episode``):
    a 24x32 camera, two task strings, episodes of :data:`LENGTHS` frames."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotWriter

    features = {"observation.state": {"dtype": "float32", "shape": (state,), "names": None},
                "action": {"dtype": "float32", "shape": (action,), "names": None},
                CAMERA: {"dtype": "image", "shape": (24, 32, 3), "names": ["height", "width", "channels"]}}
    ds = LeRobotWriter.create("local/smolvla", fps=10, features=features, root=root, use_videos=False)
    rng = np.random.default_rng(0)
    for ep, length in enumerate(LENGTHS):
        for _ in range(length):
            ds.add_frame({"observation.state": rng.normal(size=state).astype(np.float32),
                          "action": rng.normal(size=action).astype(np.float32),
                          CAMERA: rng.integers(0, 256, (24, 32, 3), dtype=np.uint8),
                          "task": f"pick up the {('red', 'blue')[ep % 2]} block"})
        ds.save_episode()
    ds.finalize()
    return root


def _lerobot_steps(root: Path) -> tuple[list[float], dict[str, Any]]:
    """LeRobot's own fine-tune, written out from its functions in ``lerobot-train``'s order
    (``lerobot/scripts/lerobot_train.py``: a ``policy.path`` config, ``make_policy`` with the
    dataset's metadata, the pretrained processors renormalised to the dataset, presets,
    ``accelerator.prepare``, ``update_policy``) on LeRobot's reader."""
    import dataclasses

    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_policy, make_pre_post_processors
    from lerobot.utils.random_utils import set_seed

    from tests.lerobot_loop import collate, lerobot_reader, lerobot_steps

    set_seed(SEED)
    keys = {k: v for k, v in FINE_TUNE.items() if k not in ("name", "pretrained", "rename_map")}
    rename_map = dict(FINE_TUNE["rename_map"])  # lerobot-train's --rename_map
    cfg = dataclasses.replace(PreTrainedConfig.from_pretrained(BASE_ID), device="cpu", **keys)
    cfg.pretrained_path = BASE_ID
    dataset = lerobot_reader(root, "local/smolvla", cfg)
    policy = make_policy(cfg=cfg, ds_meta=dataset.meta, rename_map=rename_map)
    stats = dataset.meta.stats
    preprocessor, _ = make_pre_post_processors(
        policy_cfg=cfg, pretrained_path=cfg.pretrained_path, dataset_stats=stats,
        preprocessor_overrides={
            "device_processor": {"device": "cpu"},
            "normalizer_processor": {"stats": stats, "features": {**policy.config.input_features,
                                                                  **policy.config.output_features},
                                     "norm_map": policy.config.normalization_mapping},
            "rename_observations_processor": {"rename_map": rename_map}},
        postprocessor_overrides={"unnormalizer_processor": {
            "stats": stats, "features": policy.config.output_features,
            "norm_map": policy.config.normalization_mapping}})
    return lerobot_steps(policy, cfg, preprocessor, dataset, BATCHES, collate, 10)


def _det_lab_steps(root: Path) -> dict[str, Any]:
    """det_lab's fine-tune of :data:`FINE_TUNE` on det_lab's reader, seeded as LeRobot's loop is;
    then the same choice on the dataset with wider state and action (one line expected)."""
    import dataclasses

    from lerobot.utils.random_utils import set_seed

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PolicyError, PolicyFrames, build_training, dataset_meta, parse_policy

    from tests.lerobot_loop import collate

    frames = LeRobotDataset(root)
    set_seed(SEED)
    training = build_training(parse_policy(FINE_TUNE), dataset_meta(frames), total_steps=10)
    initial = {k: v.detach().clone() for k, v in training.policy.state_dict().items()}
    items = PolicyFrames(frames, training.delta_indices)  # every frame: index i is dataset index i
    losses, keys = [], set()
    for indices in BATCHES:
        metrics = training.train_step(collate([items[i] for i in indices]))
        losses.append(float(metrics["loss"]))
        keys |= set(metrics)
    meta = dataset_meta(frames)
    wide = {**meta.features, "observation.state": {**meta.features["observation.state"], "shape": (9,)},
            "action": {**meta.features["action"], "shape": (9,)}}
    refused = {}
    for case, choice, case_meta in (("wide", FINE_TUNE, dataclasses.replace(meta, features=wide)),
                                    ("cameras", {k: v for k, v in FINE_TUNE.items() if k != "rename_map"}, meta)):
        try:
            build_training(parse_policy(choice), case_meta, total_steps=1)
            refused[case] = ""
        except PolicyError as exc:
            refused[case] = str(exc)
    return {"losses": losses, "metric_keys": sorted(keys), "initial": initial, "refused": refused,
            "params": {k: v.detach().clone() for k, v in training.policy.state_dict().items()}}


def _from_checkpoint(checkpoint: Path, hparams: dict[str, Any], dataset: Path) -> dict[str, Any]:
    """The action chunks, on three observations of ``dataset``, of the checkpoint's
    ``pretrained_model/`` through ``SmolVLAPolicy.from_pretrained`` and LeRobot's processor loader,
    of the trial's own weights (Determined's ``state_dict.pth``) through det_lab, and of the base."""
    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    from det_lab.formats import LeRobotDataset
    from det_lab.policies import PRETRAINED_DIR, PolicyFrames, build_training, dataset_meta, parse_policy

    from tests.lerobot_loop import collate

    pretrained = checkpoint / PRETRAINED_DIR
    policy = SmolVLAPolicy.from_pretrained(pretrained)
    preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=str(pretrained))
    frames = LeRobotDataset(dataset)
    training = build_training(parse_policy(hparams["policy"]), dataset_meta(frames), total_steps=1)
    batch = collate([PolicyFrames(frames, training.delta_indices)[i] for i in (0, 45, 77)])
    observation = {k: v for k, v in batch.items() if k.startswith("observation.") or k == "task"}

    def chunk(pre: Any, model: Any, post: Any) -> torch.Tensor:
        model.eval()
        torch.manual_seed(0)  # the flow's starting noise
        with torch.no_grad():
            return post(model.predict_action_chunk(pre(dict(observation))))

    base = chunk(training.preprocessor, training.policy, training.postprocessor)
    weights = torch.load(checkpoint / "state_dict.pth", map_location="cpu", weights_only=False)["models_state_dict"][0]
    training.policy.load_state_dict(weights)
    return {"loaded": chunk(preprocessor, policy, postprocessor), "base": base,
            "trial": chunk(training.preprocessor, training.policy, training.postprocessor)}


def _shipped_configs() -> dict[str, Any]:
    """Each shipped VLA config's policy section through LeRobot's config factory (``make_policy_config``:
    the dataclass, no model built) and, where its base is in the store, det_lab's ``make_config``
    (the base's config.json from the store with the section's keys applied)."""
    import dataclasses

    import yaml
    from lerobot.policies.factory import make_policy_config

    from det_lab.policies import parse_policy
    from det_lab.policies.training import make_config

    out: dict[str, Any] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "experiment_templates" / "vla").glob("*.yaml")):
        section = (yaml.safe_load(path.read_text()).get("hyperparameters") or {}).get("policy")
        choice = parse_policy(section)
        if choice.type not in ("smolvla", "pi05"):
            continue
        keys = {k: tuple(v) if isinstance(v, list) else v for k, v in choice.overrides.items()}
        factory = make_policy_config(choice.type, device="cpu", **keys)
        seen = {"type": factory.type, "keys": {k: getattr(factory, k) for k in keys}}
        if choice.pretrained == BASE_ID:
            cfg = make_config(choice, "cpu")
            seen["from_store"] = {"vlm_model_name": cfg.vlm_model_name, "pretrained_path": str(cfg.pretrained_path),
                                  **{k: getattr(cfg, k) for k in keys}}
        out[path.name] = {**seen, "fields": sorted(f.name for f in dataclasses.fields(factory))}
    return out


def _child(workdir: Path) -> None:
    import torch

    from tests import torchvision_shim

    talk, sys.stdout = sys.stdout, sys.stderr  # LeRobot prints; stdout carries this protocol only

    def say(word: str) -> None:
        print(word, file=talk, flush=True)

    torchvision_shim.install()
    vlm = write_tiny_vlm(workdir / "vlm")
    write_tiny_base(workdir / "base", vlm, VLM_ID, {"observation.state": (6,), BASE_CAMERA: (3, IMAGE_SIZE, IMAGE_SIZE),
                                                     "action": (6,)})
    dataset = write_dataset(workdir / "dataset")
    say("made")
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")
    seen: dict[str, Any] = {"det_lab": _det_lab_steps(dataset)}
    seen["lerobot_losses"], seen["lerobot_params"] = _lerobot_steps(dataset)
    say("stepped")
    seen["configs"] = _shipped_configs()
    line = sys.stdin.readline().strip()
    if line:
        request = json.loads(line)
        seen["checkpoint"] = _from_checkpoint(Path(request["checkpoint"]), request["hparams"],
                                              Path(request["dataset"]))
    torch.save(seen, workdir / "seen.pt")
    say("done")


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
