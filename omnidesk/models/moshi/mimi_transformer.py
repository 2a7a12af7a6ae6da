"""Mimi's causal transformer (one on each side of the quantizer, on the 25 Hz latent), streaming with a
ring of the last ``context`` steps of keys and values; see :mod:`omnidesk.models.moshi.mimi` for how
that context is defined.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import rotate_interleaved
from .mimi_config import MimiTransformerConfig


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + scale * attn(norm(x)), then x + scale * ffn(norm(x)); GELU FFN, no biases."""

    def __init__(self, cfg: MimiTransformerConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.num_heads
        self.num_heads, self.head_dim = h, cfg.head_dim
        self.attn_norm = nn.LayerNorm(d, eps=1e-5)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ffn_norm = nn.LayerNorm(d, eps=1e-5)
        self.w1 = nn.Linear(d, cfg.dim_feedforward, bias=False)
        self.w2 = nn.Linear(cfg.dim_feedforward, d, bias=False)
        scale = cfg.layer_scale
        self.attn_scale = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        self.ffn_scale = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        # the keys/values (after RoPE) of the last `context` steps, slot = position % context
        self.register_buffer("k_ring", torch.zeros(1, h, cfg.context, cfg.head_dim), persistent=False)
        self.register_buffer("v_ring", torch.zeros(1, h, cfg.context, cfg.head_dim), persistent=False)

    def reset(self) -> None:
        # zeros, not just "invalid": a masked garbage value (NaN) would still poison attention's sum
        self.k_ring.zero_()
        self.v_ring.zero_()

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, visible: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate_interleaved(q, rotation), rotate_interleaved(k, rotation)
        keys = torch.cat([self.k_ring, k], dim=2)
        values = torch.cat([self.v_ring, v], dim=2)
        keep = slots.shape[0]  # the newest steps, at most the ring's capacity
        self.k_ring.index_copy_(2, slots, k[:, :, t - keep:])
        self.v_ring.index_copy_(2, slots, v[:, :, t - keep:])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        out = self.wo(out.transpose(1, 2).reshape(b, t, d))
        x = x + (out if self.attn_scale is None else self.attn_scale * out)
        out = self.w2(F.gelu(self.w1(self.ffn_norm(x))))
        return x + (out if self.ffn_scale is None else self.ffn_scale * out)


class MimiTransformer(nn.Module):
    """Causal transformer on the 25 Hz latent, [1, C, T] in and out, streaming with a ring KV cache.

    State: the absolute position of the next step (``offset``, which drives RoPE),
    and the positions held by the ring's slots (-1: empty), shared by all layers.
    Any chunk of whole frames can be fed; the result does not depend on the chunking.
    """

    def __init__(self, cfg: MimiTransformerConfig, steps_per_frame: int):
        super().__init__()
        self.cfg, self.steps_per_frame = cfg, steps_per_frame
        d = cfg.d_model
        self.input_proj = nn.Linear(cfg.input_dimension, d, bias=False) if cfg.input_dimension != d else None
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = nn.Linear(d, cfg.output_dimension, bias=False) if cfg.output_dimension != d else None
        self.register_buffer("offset", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("ring_positions", torch.full((cfg.context,), -1, dtype=torch.long), persistent=False)

    def reset(self) -> None:
        self.offset.zero_()
        self.ring_positions.fill_(-1)
        for layer in self.layers:
            layer.reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        if t % self.steps_per_frame:
            raise ValueError(f"transformer input of {t} steps is not whole frames of {self.steps_per_frame}")
        cfg, context = self.cfg, self.cfg.context
        positions = self.offset + torch.arange(t, device=x.device)
        # Which keys (the ring's past steps, then this chunk's) each step sees: the last `context`
        # steps up to the end of its own frame, never a later step.
        key_positions = torch.cat([self.ring_positions, positions])
        frame_end = positions - positions % self.steps_per_frame + (self.steps_per_frame - 1)
        visible = ((key_positions[None] >= 0) & (key_positions[None] <= positions[:, None])
                   & (key_positions[None] > frame_end[:, None] - context))
        half = cfg.head_dim // 2
        freqs = torch.exp(torch.arange(half, device=x.device, dtype=torch.float32)
                          * (-math.log(cfg.max_period) * 2 / cfg.head_dim))
        angles = positions.float()[:, None] * freqs
        rotation = torch.polar(torch.ones_like(angles), angles)
        newest = positions[max(0, t - context):]
        slots = newest % context

        x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        for layer in self.layers:
            x = layer(x, rotation, visible, slots)
        if self.output_proj is not None:
            x = self.output_proj(x)
        self.ring_positions.index_copy_(0, slots, newest)
        self.offset.add_(t)
        return x.transpose(1, 2)
