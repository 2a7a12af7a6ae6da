"""The Qwen2 decoder shared by the thinker and the talker.

What is Qwen2's own: q/k/v biases, q and k rotated together, and TMRoPE
(:class:`MultimodalRotary`).  The rest (attention over a preallocated
:class:`KVCache`, the fused MLP, the layer, the two step forms and their masks)
is :mod:`omnidesk.models.decoder_layers`, shared with Qwen3-Omni:

* eager (``input_pos=None``): positions follow ``cache.length``; attention
  reads only the valid prefix ``[:length]``.  Fastest on the CPU, any T.
* static (``input_pos`` given, T fixed): writes with ``index_copy_`` at tensor
  positions and attends over the whole capacity with a position mask, so no
  shape or Python value depends on the step: this is the form a CUDA graph can
  capture.  The caller owns ``cache.length`` in this mode.

Both give the same numbers (tested).  q/k/v and gate/up projections are fused
at load time (``wqkv``, ``w13``), one matmul each instead of three / two.
"""

from __future__ import annotations

import torch

from ..decoder_layers import CachedAttention, CachedDecoder, GatedMLP, PreNormLayer, RotaryTable, chunk_mask
from ..kv_cache import KVCache
from ..layers import apply_rotary
from .config import DecoderConfig


class MultimodalRotary(RotaryTable):
    """TMRoPE: rotary angles from three position axes (time, height, width).

    The rotary frequencies are split into ``mrope_section`` groups and group i
    takes its angle from axis i % 3.  For text and audio all three axes carry
    the same (sequential) position, which makes this equal to plain RoPE; video
    would give them different values.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        dim = cfg.head_dim
        # Computed tables are made on the CPU explicitly, also when the module is
        # built on the meta device for loading; the loader moves them.
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=cpu) / dim))
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long, device=cpu)
                          for i, n in enumerate(cfg.mrope_section)])
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def compute(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of positions 0..n-1 equal on all three axes (text and audio)."""
        pos = torch.arange(n, device=self.inv_freq.device).unsqueeze(0).expand(3, -1)
        return self(pos, dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] long -> cos, sin: [T, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        index = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        freqs = freqs.gather(0, index).squeeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(CachedAttention):
    """Qwen2 attention: q/k/v with biases, q and k rotated together (one call for all their heads)."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__(cfg, layer_idx, qkv_bias=True)

    def forward(self, x, cos, sin, cache: KVCache, start: int, mask: torch.Tensor | None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, T, H] at positions [start, start + T), or at ``input_pos`` (static form)."""
        _, t, _ = x.shape
        qk, v = self.wqkv(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads rotated in one go
        qk = apply_rotary(qk.view(1, t, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        v = v.view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        return self.attend(q, k, v, cache, start, mask, input_pos)


def decoder_layer(cfg: DecoderConfig, layer_idx: int) -> PreNormLayer:
    return PreNormLayer(cfg, Attention(cfg, layer_idx), GatedMLP(cfg.hidden_size, cfg.intermediate_size))


class Decoder(CachedDecoder):
    """Layers + final norm of a Qwen2 decoder; embeddings and heads belong to the caller."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg, (decoder_layer(cfg, i) for i in range(cfg.num_layers)), MultimodalRotary(cfg))

    def forward(self, x: torch.Tensor, cache: KVCache, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Eager step: x [1, T, H] at cache positions [length, length+T); returns normed hidden [1, T, H].

        ``rope_positions`` [3, T] overrides the rotary positions (TMRoPE for
        video); by default they equal the cache positions on all three axes.
        """
        t = x.shape[1]
        start = cache.reserve(t)
        end = start + t
        mask = chunk_mask(start, end, self.group, x.device)
        if rope_positions is None:
            cos, sin = self.rotary.span(start, end, x.dtype)
        else:
            cos, sin = self.rotary(rope_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, start, mask)
        cache.length = end
        return self.norm(x)

    def forward_static(self, x: torch.Tensor, cache: KVCache, input_pos: torch.Tensor,
                       rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Static-shape step: x [1, T, H] written at ``input_pos`` [T]; ``cache.length`` is left to the caller."""
        mask = self.static_mask(cache, input_pos)  # over the capacity, or a shorter view of the cache (KVCache.span)
        if rope_positions is None:
            cos, sin = self.rotary.at(input_pos, cache.capacity, x.dtype)
        else:
            cos, sin = self.rotary(rope_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, 0, mask, input_pos)
        return self.norm(x)
