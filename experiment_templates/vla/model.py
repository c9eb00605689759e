"""A vision-language-action policy in miniature; every size comes from the hyperparameters.

    camera image(s) --CNN or patch embedding--> image tokens ─┐
    instruction --hashed words--> nn.Embedding --> text tokens ├─ transformer encoder ─> action
    robot state --linear--> state token                         │   queries --linear--> action chunk
    H learned action queries ──────────────────────────────────┘   (H steps x action_dim)

The same structure as ACT / SmolVLA-style policies (tokens of every modality in one
transformer, a chunk of future actions read out of learned queries), small enough to train on
a CPU in a minute and big enough on GPUs by turning ``d_model``/``n_layers``/``patch_size`` up.
Inputs and targets are normalised with the dataset's ``meta/stats.json``, kept as buffers, so a
checkpoint alone reproduces the policy.

Speed switches (hyperparameters; none changes what is computed, ``tests/test_vla.py`` checks the
losses agree): ``model.attention: sdpa`` (PyTorch's fused scaled-dot-product attention; ``math``
is the same attention written out), ``fused_adamw`` (one kernel for the whole optimizer step on
CUDA), ``compile`` (``torch.compile`` of the policy in place: state-dict keys unchanged) and
``channels_last`` (the CNN encoder's convolutions in NHWC, which cuDNN runs faster in bf16).
Images may arrive as uint8 (the frame cache): they are scaled to [0, 1] on the device.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_WORD = re.compile(r"[a-z0-9]+")
PAD_ID = 0


def tokenize(text: str, vocab_size: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Words of ``text`` hashed into ``1 .. vocab_size-1`` (0 pads): no tokenizer download.

    Returns ``(ids, valid)`` of length ``max_tokens``; longer instructions are cut.
    """
    words = _WORD.findall(text.lower())[:max_tokens]
    ids = np.full(max_tokens, PAD_ID, dtype=np.int64)
    ids[: len(words)] = [1 + zlib.crc32(w.encode()) % (vocab_size - 1) for w in words]
    return ids, ids != PAD_ID


@dataclass
class VLAConfig:
    """Shapes from the dataset, sizes from the ``model`` hyperparameters."""

    state_dim: int
    action_dim: int
    horizon: int
    image_shape: tuple[int, int, int]  # (C, H, W) after any resize
    n_cameras: int = 1
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    ff_mult: int = 4
    dropout: float = 0.0
    image_encoder: str = "cnn"  # "cnn" (strided convs) or "patch" (ViT patch embedding)
    patch_size: int = 8  # image tokens: (H / patch_size) x (W / patch_size) per camera
    vocab_size: int = 1024
    max_text_tokens: int = 16
    attention: str = "sdpa"  # "sdpa" (fused kernels) or "math" (the same, written out)

    @classmethod
    def from_hparams(cls, model_hparams: Mapping[str, Any], **shapes: Any) -> VLAConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(model_hparams) - known)
        if unknown:
            raise ValueError(f"hyperparameters.model: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**shapes, **model_hparams)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Normalize(nn.Module):
    """``(x - mean) / std`` and back, with the statistics as buffers (saved in checkpoints)."""

    def __init__(self, mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).clamp_min(1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def images(self, x: torch.Tensor) -> torch.Tensor:
        """Like :meth:`forward` for images given in [0, 1] or as uint8 (0..255)."""
        if x.dtype == torch.uint8:
            x = x.float().mul_(1.0 / 255.0)
        return self(x)

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean


class ImageEncoder(nn.Module):
    """An image to ``(H/p)*(W/p)`` tokens of width ``d_model``, with learned 2D positions."""

    def __init__(self, cfg: VLAConfig) -> None:
        super().__init__()
        c, h, w = cfg.image_shape
        p = cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"image {h}x{w} is not divisible by patch_size {p}")
        d = cfg.d_model
        if cfg.image_encoder == "patch":
            self.net: nn.Module = nn.Conv2d(c, d, kernel_size=p, stride=p)
        elif cfg.image_encoder == "cnn":
            stages = int(math.log2(p))
            if 2**stages != p:
                raise ValueError(f"image_encoder cnn needs a power-of-two patch_size, got {p}")
            widths = [c] + [max(16, d // 2 ** (stages - 1 - i)) for i in range(stages)]
            layers: list[nn.Module] = []
            for i in range(stages):
                layers += [nn.Conv2d(widths[i], widths[i + 1], 3, stride=2, padding=1), nn.GroupNorm(1, widths[i + 1]), nn.GELU()]
            layers.append(nn.Conv2d(widths[-1], d, 1))
            self.net = nn.Sequential(*layers)
        else:
            raise ValueError(f"image_encoder must be 'cnn' or 'patch', got {cfg.image_encoder!r}")
        self.pos = nn.Parameter(torch.randn(1, (h // p) * (w // p), d) * 0.02)
        self.channels_last = False  # set by apply_speed_switches

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return self.net(image).flatten(2).transpose(1, 2) + self.pos


class Block(nn.Module):
    """A pre-norm transformer encoder layer (as ``nn.TransformerEncoderLayer(norm_first=True)``)
    with one fused QKV projection and attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int, n_heads: int, ff: int, dropout: float, attention: str) -> None:
        super().__init__()
        if d % n_heads:
            raise ValueError(f"d_model {d} is not divisible by n_heads {n_heads}")
        if attention not in ("sdpa", "math"):
            raise ValueError(f"model.attention must be 'sdpa' or 'math', got {attention!r}")
        self.n_heads, self.dropout, self.attention = n_heads, dropout, attention
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """``x`` (B, L, d); ``attend`` (B, 1, 1, L) bool, False for keys to ignore (padding)."""
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p)
        else:
            scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
            weights = F.dropout(scores.masked_fill(~attend, float("-inf")).softmax(-1), p)
            a = weights @ v
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, n, d)))
        return x + self.drop(self.ff(self.norm2(x)))


class VLAPolicy(nn.Module):
    """Predicts a chunk of ``horizon`` actions; ``forward`` also computes the loss when given targets."""

    def __init__(self, cfg: VLAConfig, stats: Mapping[str, Mapping[str, np.ndarray]], cameras: Sequence[str]) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.norm_state = Normalize(stats["observation.state"]["mean"], stats["observation.state"]["std"])
        self.norm_action = Normalize(stats["action"]["mean"], stats["action"]["std"])
        self.norm_images = nn.ModuleList(
            Normalize(stats[k]["mean"], stats[k]["std"]) if k in stats else Normalize(np.full((3, 1, 1), 0.5), np.full((3, 1, 1), 0.25))
            for k in cameras
        )
        self.image_encoders = nn.ModuleList(ImageEncoder(cfg) for _ in cameras)
        self.text_embed = nn.Embedding(cfg.vocab_size, d, padding_idx=PAD_ID)
        self.text_pos = nn.Parameter(torch.randn(1, cfg.max_text_tokens, d) * 0.02)
        self.state_proj = nn.Linear(cfg.state_dim, d)
        self.action_queries = nn.Parameter(torch.randn(1, cfg.horizon, d) * 0.02)
        self.modality = nn.Parameter(torch.zeros(4, d))  # image, text, state, action-query
        self.blocks = nn.ModuleList(Block(d, cfg.n_heads, cfg.ff_mult * d, cfg.dropout, cfg.attention)
                                    for _ in range(cfg.n_layers))
        self.out_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.action_dim)

    def forward(self, images: Sequence[torch.Tensor] | torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor,
                text_valid: torch.Tensor, action: torch.Tensor | None = None,
                action_is_pad: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Images: one (B,C,H,W) per camera in [0,1] or uint8, or all cameras as (B,cams,C,H,W);
        state (B,S), text (B,T) -> ``{"action": (B,H,A)}`` in robot units.

        With ``action`` (B,H,A) and ``action_is_pad`` (B,H) it adds ``loss`` (L1 in normalised
        units, padded steps masked), ``action_l1`` (in robot units) and ``action_l1_first``
        (the first step of the chunk only).
        """
        b = state.shape[0]
        if isinstance(images, torch.Tensor):
            images = images.unbind(1)
        tokens = [enc(norm.images(img)) + self.modality[0]
                  for enc, norm, img in zip(self.image_encoders, self.norm_images, images)]
        tokens.append(self.text_embed(text_ids) + self.text_pos + self.modality[1])
        tokens.append((self.state_proj(self.norm_state(state)) + self.modality[2]).unsqueeze(1))
        tokens.append(self.action_queries.expand(b, -1, -1) + self.modality[3])
        x = torch.cat(tokens, dim=1)
        n_img = x.shape[1] - text_ids.shape[1] - 1 - self.cfg.horizon
        attend = torch.ones(b, x.shape[1], dtype=torch.bool, device=x.device)
        attend[:, n_img : n_img + text_ids.shape[1]] = text_valid
        attend = attend[:, None, None, :]
        for block in self.blocks:
            x = block(x, attend)
        pred_n = self.head(self.out_norm(x[:, -self.cfg.horizon :])).float()
        out = {"action": self.norm_action.inverse(pred_n)}
        if action is not None:
            valid = (~action_is_pad).unsqueeze(-1).float() if action_is_pad is not None else torch.ones_like(action[..., :1])
            per = valid.sum() * action.shape[-1]
            out["loss"] = ((pred_n - self.norm_action(action)).abs() * valid).sum() / per
            err = (out["action"] - action).abs() * valid
            out["action_l1"] = err.sum() / per
            out["action_l1_first"] = err[:, 0].sum() / (valid[:, 0].sum() * action.shape[-1])
        return out


def build_optimizer(model: nn.Module, hp: Mapping[str, Any]) -> torch.optim.AdamW:
    """AdamW from ``lr``/``weight_decay``; ``fused_adamw`` (default on) uses the fused CUDA kernel
    when the parameters are on a GPU (same update, one launch instead of one per tensor group)."""
    on_cuda = next(model.parameters()).is_cuda
    fused = bool(hp.get("fused_adamw", True)) and on_cuda
    return torch.optim.AdamW(model.parameters(), lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"]),
                             fused=fused or None)


def apply_speed_switches(policy: VLAPolicy, hp: Mapping[str, Any]) -> VLAPolicy:
    """``channels_last`` and ``compile`` from the hyperparameters, in place (parameters and
    state-dict keys unchanged, so checkpoints load either way)."""
    if hp.get("channels_last") and policy.cfg.image_encoder == "cnn":
        policy.image_encoders.to(memory_format=torch.channels_last)
        for encoder in policy.image_encoders:
            encoder.channels_last = True
    if hp.get("compile"):
        # torch 2.11's inductor fails an assertion in its memory-coalescing analysis (which only
        # picks tile shapes) on the patch-encoder model (InductorError in
        # tiling_utils.get_pw_red_splits, seen on an H200); the CNN model compiles with it and
        # ran at 22 instead of 16 ms a batch without it, so it is off for this compile only
        patch = policy.cfg.image_encoder == "patch"
        policy.compile(options={"triton.coalesce_tiling_analysis": False} if patch else None)
    return policy
