"""A tiny pi0 / pi0.5 for tests: LeRobot's own code at a size a 2-core CPU trains in a second.

LeRobot 0.6.1 builds pi0 and pi0.5 (``lerobot/policies/pi0/modeling_pi0.py``, ``pi05/modeling_pi05.py``)
from a variant table (``get_gemma_config``: ``gemma_300m``, ``gemma_2b``), a PaliGemma config it
fills in (``PaliGemmaWithExpertModel.__init__``: a 257,152-token vocabulary, a vision projection of
2048, PaliGemma's default 27-layer SigLIP) and LeRobot's Gemma classes (``lerobot/policies/pi_gemma.py``):
about 4 B parameters. :func:`install` makes, for this process only, the two variant names give
2-layer Gemmas 64 and 32 wide with 8 heads of 4 (the attention's reshape fixes 8 heads:
``modeling_pi05.py:121``), and shrinks the config LeRobot made as the two Gemma models are built
from it: a vocabulary of :data:`VOCAB`, a 1-layer 16-wide SigLIP projecting to the VLM's width.
Every line that builds, runs and saves the policy is LeRobot's and transformers' code, unchanged.

pi0/pi0.5's preprocessor loads the tokenizer ``google/paligemma-3b-pt-224`` by name (fixed in
``processor_pi05.py:141``): :func:`write_tiny_tokenizer` writes a word-level one with that repo's
files, for a lab's model store (``det-lab models import DIR google/paligemma-3b-pt-224``).

    python tests/tiny_pi.py train.py ARGS...   # a trial process: install, then run the script
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

TOKENIZER_ID = "google/paligemma-3b-pt-224"
WORDS = "pick up the red green blue block put place on in to a and".split()
#: the tokenizer's words: the tasks', the prompt's, and the 256 bins pi0.5 writes the state as
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *WORDS, "State:", "Action:", ";", ":", ",", "Task:",
          *(str(i) for i in range(256))]
VOCAB = len(TOKENS)
#: the variants' sizes (both experts share heads, head size and depth: joint attention)
TINY = {"gemma_2b": dict(width=64, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=4),
        "gemma_300m": dict(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=4)}
#: the vision tower (LeRobot sets its image size; its MLP width, 4304, is LeRobot's too)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
#: pi0/pi0.5 keys for the tiny sizes: 32x32 images, short chunks, a short prompt, fp32
KEYS: dict[str, Any] = dict(image_resolution=(32, 32), chunk_size=4, n_action_steps=4, max_state_dim=8,
                            max_action_dim=8, tokenizer_max_length=24, num_inference_steps=2, dtype="float32")


def install() -> None:
    """Make LeRobot's pi0 and pi0.5 build at the tiny sizes in this process (see the module doc)."""
    from lerobot.policies import pi_gemma
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05

    for module in (modeling_pi0, modeling_pi05):
        def tiny_variant(variant: str, _gemma: Any = module.GemmaConfig) -> Any:
            if variant not in TINY:
                raise ValueError(f"Unknown variant: {variant}")
            return _gemma(**TINY[variant])

        module.get_gemma_config = tiny_variant

    def shrunk(cls: Any, shrink: Any) -> None:
        build = cls.__init__
        if getattr(build, "tiny", False):
            return

        def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            shrink(config)
            build(self, config, *args, **kwargs)

        __init__.tiny = True  # type: ignore[attr-defined]
        cls.__init__ = __init__

    def vlm(config: Any) -> None:
        config._vocab_size = config.text_config.vocab_size = VOCAB
        config.image_token_index = VOCAB - 1
        for key, value in VISION.items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = config.text_config.hidden_size

    def expert(config: Any) -> None:
        config.vocab_size = VOCAB

    shrunk(pi_gemma.PaliGemmaForConditionalGenerationWithPiGemma, vlm)
    shrunk(pi_gemma.PiGemmaForCausalLM, expert)


def write_tiny_tokenizer(dest: Path) -> Path:
    """A word-level tokenizer saved as ``google/paligemma-3b-pt-224``'s tokenizer files, beside a
    tiny PaliGemma ``config.json`` (``AutoTokenizer`` reads the repo's config first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PaliGemmaConfig, PreTrainedTokenizerFast

    dest.mkdir(parents=True)
    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>", model_max_length=64)
    tokenizer.save_pretrained(dest)
    text = TINY["gemma_2b"]
    PaliGemmaConfig(vision_config=dict(VISION, image_size=32), text_config=dict(
        hidden_size=text["width"], num_hidden_layers=text["depth"], intermediate_size=text["mlp_dim"],
        num_attention_heads=text["num_heads"], num_key_value_heads=text["num_kv_heads"], head_dim=text["head_dim"],
        vocab_size=len(vocab))).save_pretrained(dest)
    return dest


def write_tiny_base(dest: Path, features: dict[str, tuple[int, ...]], seed: int = 0) -> Path:
    """A random tiny pi0.5 (:data:`KEYS`) saved with LeRobot's own ``save_pretrained`` (config.json,
    model.safetensors, the pre/post-processors with unit statistics), as ``lerobot/pi05_base``'s
    files are laid out; :func:`install` must have run. ``features``: key -> shape, ``action`` the
    output, ``observation.state`` the state, the rest cameras."""
    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    def kind(key: str) -> FeatureType:
        return {"action": FeatureType.ACTION, "observation.state": FeatureType.STATE}.get(key, FeatureType.VISUAL)

    torch.manual_seed(seed)
    cfg = PI05Config(device="cpu", **KEYS,
                     input_features={k: PolicyFeature(kind(k), tuple(s)) for k, s in features.items() if k != "action"},
                     output_features={"action": PolicyFeature(FeatureType.ACTION, tuple(features["action"]))})
    policy = PI05Policy(cfg)
    stats = {k: {"mean": torch.zeros(s), "std": torch.ones(s), "q01": -torch.ones(s), "q99": torch.ones(s)}
             for k, s in features.items() if kind(k) is not FeatureType.VISUAL}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    for part in (policy, pre, post):
        part.save_pretrained(dest)
    return dest


if __name__ == "__main__":
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
