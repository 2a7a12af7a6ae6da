"""Building blocks every family's transformers share: RMS norm, rotary embeddings, one-query attention.

Each family keeps the numerics of its reference (where a norm upcasts to fp32,
which rotary layout it uses); the choice is an argument here, not a copy of
the module.  The decoders themselves (Qwen2's, Moshi's temporal and depth
transformers, Mimi's) live in their family folders.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMS norm over the last dim.

    ``upcast`` says what runs in fp32 for a bf16/fp16 input, as each reference does it:
    ``"norm"`` (Qwen2 / transformers): normalise in fp32, scale by the weight in the model dtype;
    ``"all"`` (Moshi's ``rms_norm_f32``): normalise and scale in fp32, then cast;
    ``"none"`` (Moshi's ``rms_norm``): everything in the model dtype.
    fp32 inputs take no casts in any mode."""

    def __init__(self, dim: int, eps: float, upcast: Literal["norm", "all", "none"] = "norm"):
        super().__init__()
        if upcast not in ("norm", "all", "none"):
            raise ValueError(f"RMSNorm upcast must be 'norm', 'all' or 'none', got {upcast!r}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.upcast = eps, upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast == "norm":
            h = x if x.dtype == torch.float32 else x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.eps))
            return self.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))
        # One fused call and no no-op casts: a frame step on the CPU costs per op, not per flop.
        if x.dtype == torch.float32 or self.upcast == "none":
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with the two halves of the last dim as (real, imaginary) (Qwen2, the DiT)."""
    return x * cos + _rotate_half(x) * sin


def rotate_interleaved(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved (real, imaginary) pairs of the last dim, in fp32 as Moshi and Mimi do.

    ``rotation`` is the complex unit e^(i * angle) per pair [..., D / 2], broadcast against x:
    one complex product instead of the dozen real ops it stands for."""
    if x.dtype == torch.float32:
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotation).flatten(-2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """One query per head: q [H, 1, D] over keys/values [H, N, D] -> [1, H * D].

    Plain bmm-softmax-bmm: for a single query the fused CPU kernel's fixed cost is larger
    than the math (the same finding as the Qwen2 decoder's CPU decode step)."""
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)
    if bias is not None:
        scores.add_(bias)  # (baddbmm with a broadcast bias is several times slower on the CPU)
    if scores.dtype == torch.float32:
        probs = scores.softmax(dim=-1)
    else:
        probs = scores.float().softmax(dim=-1).to(values.dtype)
    return torch.bmm(probs, values).reshape(1, -1)


def sinusoid_table(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's positional table [length, channels]: sin on the first half, cos on the second (float32);
    the Qwen audio encoders add it to their conv outputs."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    half = channels // 2
    step = math.log(max_timescale) / (half - 1)
    inv = torch.exp(-step * torch.arange(half).float())
    angle = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class WindowAttention(nn.Module):
    """Whisper-style self-attention of an audio encoder: full (non-causal) attention inside each window
    of a batch [windows, T, D].  ``key_bias``: Whisper's k_proj has none (Qwen2.5-Omni keeps that);
    Qwen3-Omni's AuT has one.  Parameter names are the checkpoints' (q/k/v/out_proj)."""

    def __init__(self, dim: int, num_heads: int, key_bias: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"d_model {dim} is not a multiple of encoder_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=key_bias)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.num_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


def fill_placeholders(embeds: torch.Tensor, is_placeholder: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Input embeddings [T, H] with the placeholder positions (an audio token's) taking ``rows`` in
    order; ValueError when the counts differ."""
    n_placeholders = int(is_placeholder.sum())
    n_rows = 0 if rows is None else rows.shape[0]
    if n_placeholders != n_rows:
        raise ValueError(f"prompt has {n_placeholders} audio placeholders but {n_rows} audio tokens were given")
    if n_rows:
        embeds = embeds.masked_scatter(is_placeholder[:, None], rows.to(embeds.dtype))
    return embeds


__all__ = ["RMSNorm", "WindowAttention", "apply_rotary", "attend_one", "fill_placeholders", "rotate_interleaved",
           "sinusoid_table"]
