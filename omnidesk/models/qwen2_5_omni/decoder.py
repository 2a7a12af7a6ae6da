"""The Qwen2 decoder shared by the thinker and the talker.

Two ways to run a step over a preallocated :class:`KVCache`:

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
import torch.nn.functional as F
from torch import nn

from ..kv_cache import KVCache
from ..layers import RMSNorm, apply_rotary
from .config import DecoderConfig


class MultimodalRotary(nn.Module):
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

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] for positions 0..length-1 equal on all three axes (text and audio).

        Kept and grown by doubling, so a decode step slices it instead of computing angles."""
        cached = getattr(self, "_table", None)
        if (cached is None or cached[0].shape[0] < length or cached[0].dtype != dtype
                or cached[0].device != self.inv_freq.device):
            n = max(length, 2 * cached[0].shape[0] if cached is not None else 256)
            pos = torch.arange(n, device=self.inv_freq.device).unsqueeze(0).expand(3, -1)
            self._table = self(pos, dtype)
        return self._table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] long -> cos, sin: [T, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        index = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        freqs = freqs.gather(0, index).squeeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, cache: KVCache, start: int, kv_len: int | None,
                input_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        _, t, _ = x.shape
        qk, v = self.wqkv(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads rotated in one go
        qk = apply_rotary(qk.view(1, t, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        v = v.view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        ck, cv = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if input_pos is None:
            ck[:, :, start:start + t] = k
            cv[:, :, start:start + t] = v
            keys, values = ck[:, :, :kv_len], cv[:, :, :kv_len]
        else:
            ck.index_copy_(2, input_pos, k)
            cv.index_copy_(2, input_pos, v)
            keys, values = ck, cv
        # Grouped-query attention without repeating K/V: the query heads that
        # share a KV head become extra query rows of that head.
        qg = q.reshape(1, self.n_kv, self.group * t, self.head_dim)
        if t == 1 and x.device.type == "cpu":
            # A one-token decode step: plain matmul-softmax-matmul.  The fused CPU
            # kernel costs ~1 ms of fixed overhead here, far more than the math.
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale
            if mask is not None:  # static shape: the positions after input_pos are not valid yet
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype), values)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(1, self.n_heads, t, self.head_dim).transpose(1, 2).reshape(1, t, self.q_size)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, start, kv_len, input_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start, kv_len, input_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Layers + final norm of a Qwen2 decoder; embeddings and heads belong to the caller."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MultimodalRotary(cfg)
        self.group = cfg.num_heads // cfg.num_kv_heads

    def new_cache(self, capacity: int, device=None, dtype=None) -> KVCache:
        p = self.norm.weight
        return KVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, capacity,
                       dtype=dtype or p.dtype, device=device or p.device)

    def forward(self, x: torch.Tensor, cache: KVCache, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Eager step: x [1, T, H] at cache positions [length, length+T); returns normed hidden [1, T, H].

        ``rope_positions`` [3, T] overrides the rotary positions (TMRoPE for
        video); by default they equal the cache positions on all three axes.
        """
        t = x.shape[1]
        start = cache.reserve(t)
        kv_len = start + t
        mask = None
        if t > 1:
            pos = torch.arange(start, kv_len, device=x.device)
            # causal inside the new chunk, everything before it visible
            causal = torch.arange(kv_len, device=x.device)[None, :] <= pos[:, None]
            mask = causal.repeat(self.group, 1)
        if rope_positions is None:
            cos, sin = self.rotary.table(kv_len, x.dtype)
            cos, sin = cos[start:kv_len], sin[start:kv_len]
        else:
            cos, sin = self.rotary(rope_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, start, kv_len, None, mask)
        cache.length = kv_len
        return self.norm(x)

    def forward_static(self, x: torch.Tensor, cache: KVCache, input_pos: torch.Tensor,
                       rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Static-shape step: x [1, T, H] written at ``input_pos`` [T]; ``cache.length`` is left to the caller."""
        span = cache.k[0].shape[2]  # the capacity, or a shorter view of the cache (KVCache.span)
        valid = torch.arange(span, device=x.device)[None, :] <= input_pos[:, None]
        mask = valid.repeat(self.group, 1)
        if rope_positions is None:
            cos, sin = self.rotary.table(cache.capacity, x.dtype)
            cos, sin = cos.index_select(0, input_pos), sin.index_select(0, input_pos)
        else:
            cos, sin = self.rotary(rope_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, 0, None, input_pos, mask)
        return self.norm(x)
