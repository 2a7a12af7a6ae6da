"""The pieces both Qwen decoders (Qwen2.5-Omni's Qwen2, Qwen3-Omni's Qwen3-MoE) are built of.

* :class:`DecoderShape`: the sizes every Qwen decoder config has, which the pieces below read;
* :class:`CachedAttention`: grouped-query attention over one layer of a preallocated
  :class:`~omnidesk.models.kv_cache.KVCache`, q/k/v fused into one matmul (``wqkv``); a family
  projects and rotates q and k its own way and hands them to :meth:`CachedAttention.attend`;
* :class:`GatedMLP`: the gated SiLU MLP with gate and up fused (``w13``);
* :class:`PreNormLayer`: norm -> attention -> residual, norm -> MLP -> residual;
* :class:`RotaryTable`: cos/sin tables kept and grown by doubling, so a decode step slices them;
* :class:`CachedDecoder`: layers + final norm over one cache, the two step forms' masks and angles.

Two ways to run a step over the cache, same numbers:

* eager (``input_pos=None``): positions follow ``cache.length``; attention reads only the
  valid prefix.  Any number of tokens;
* static (``input_pos`` given): writes with ``index_copy_`` at tensor positions and attends
  over the whole cache (or a :class:`~omnidesk.models.kv_cache.KVSpan`) with a position mask,
  so no shape or Python value depends on the step: the form a compiled or captured decode step
  takes.  The caller owns ``cache.length`` in this mode.

The families' tensors keep their own layouts: Qwen2.5-Omni runs batched ``[1, T, H]`` inputs,
Qwen3-Omni unbatched ``[T, H]``; attention works on whichever leading dims it is given, so each
family's kernels (and numbers) stay those of its reference checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import ConfigError
from .kv_cache import KVCache, KVSpan
from .layers import RMSNorm


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of one Qwen decoder (a family's DecoderConfig adds its own fields after these)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    intermediate_size: int  # dense MLP width

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")

    def check_mrope_section(self) -> None:
        """The multimodal rotary sections split the head's rotary frequencies: they must cover them."""
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = "
                              f"{self.head_dim // 2}")


class CachedAttention(nn.Module):
    """Grouped-query attention writing into and reading from layer ``layer_idx`` of a KVCache.

    The family's ``forward`` computes ``wqkv``, rotates q and k and calls :meth:`attend`;
    ``qkv_bias``: Qwen2 has q/k/v biases, Qwen3 none."""

    def __init__(self, cfg: DecoderShape, layer_idx: int, qkv_bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | KVSpan, start: int,
               mask: torch.Tensor | None, input_pos: torch.Tensor | None) -> torch.Tensor:
        """q [..., n_heads, T, D], k and v [..., n_kv, T, D] (the leading dims: none or one batch of 1)
        at positions [start, start + T), or at ``input_pos`` [T] (static form: the whole cache or
        span is attended, ``mask`` [group * T, span] hides what is not valid yet) -> o_proj's
        output [..., T, hidden]."""
        lead, t = q.shape[:-3], q.shape[-2]
        ck, cv = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [1, n_kv, capacity or span, D]
        if not lead:
            ck, cv = ck[0], cv[0]
        if input_pos is None:
            end = start + t
            ck[..., start:end, :] = k
            cv[..., start:end, :] = v
            keys, values = ck[..., :end, :], cv[..., :end, :]
        else:
            ck.index_copy_(ck.dim() - 2, input_pos, k)
            cv.index_copy_(cv.dim() - 2, input_pos, v)
            keys, values = ck, cv
        # Grouped-query attention without repeating K/V: the query heads that
        # share a KV head become extra query rows of that head.
        qg = q.reshape(*lead, self.n_kv, self.group * t, self.head_dim)
        if t == 1 and q.device.type == "cpu":
            # A one-token decode step: plain matmul-softmax-matmul.  The fused CPU
            # kernel costs ~1 ms of fixed overhead here, far more than the math.
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale
            if mask is not None:  # static form: the positions after input_pos are not written yet
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype), values)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(*lead, self.n_heads, t, self.head_dim).transpose(-3, -2).reshape(*lead, t, self.q_size)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """Gated SiLU MLP with gate and up fused (``w13``: gate rows, then up rows)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.w13 = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PreNormLayer(nn.Module):
    """One decoder layer: RMS norm, attention, residual; RMS norm, MLP, residual (parameter names
    are the checkpoints')."""

    def __init__(self, cfg: DecoderShape, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def feed_forward(self, h: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        """The MLP on the normed ``h``; a family whose MLP has a static form of its own overrides this."""
        return self.mlp(h)

    def forward(self, x, cos, sin, cache, start, mask, input_pos=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start, mask, input_pos)
        return x + self.feed_forward(self.post_attention_layernorm(x), input_pos)


class RotaryTable(nn.Module):
    """cos/sin tables [n, head_dim] for positions 0..n-1, kept and grown by doubling, so a decode step
    slices them instead of computing angles.  Subclasses hold ``inv_freq`` and say how a table is
    computed (:meth:`compute`)."""

    _table: tuple[torch.Tensor, torch.Tensor] | None = None

    def compute(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= length, head_dim]."""
        t = self._table
        if t is None or t[0].shape[0] < length or t[0].dtype != dtype or t[0].device != self.inv_freq.device:
            n = max(length, 2 * t[0].shape[0] if t is not None else 256)
            self._table = t = self.compute(n, dtype)
        return t

    def span(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions [start, end) (an eager step)."""
        cos, sin = self.table(end, dtype)
        return cos[start:end], sin[start:end]

    def at(self, input_pos: torch.Tensor, capacity: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the tensor positions ``input_pos`` of a cache of ``capacity`` (a static step:
        the table must already cover the capacity when the step is compiled)."""
        cos, sin = self.table(capacity, dtype)
        return cos.index_select(0, input_pos), sin.index_select(0, input_pos)


def chunk_mask(start: int, end: int, group: int, device) -> torch.Tensor | None:
    """The eager step's mask [group * T, end] for new positions [start, end): causal inside the new
    chunk, everything before it visible (None for one token, which sees everything)."""
    if end - start <= 1:
        return None
    pos = torch.arange(start, end, device=device)
    return (torch.arange(end, device=device)[None, :] <= pos[:, None]).repeat(group, 1)


def position_mask(span: int, input_pos: torch.Tensor, group: int) -> torch.Tensor:
    """The static step's mask [group * T, span]: each query sees the positions up to its own."""
    return (torch.arange(span, device=input_pos.device)[None, :] <= input_pos[:, None]).repeat(group, 1)


class CachedDecoder(nn.Module):
    """Layers + final norm of a Qwen decoder over one KVCache; embeddings and heads belong to the caller."""

    def __init__(self, cfg: DecoderShape, layers, rotary: RotaryTable):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary
        self.group = cfg.num_heads // cfg.num_kv_heads

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        p = self.norm.weight
        return KVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, capacity,
                       dtype=dtype or p.dtype, device=device or p.device)

    def static_mask(self, cache: KVCache | KVSpan, input_pos: torch.Tensor) -> torch.Tensor:
        """:func:`position_mask` over the whole of ``cache`` (its capacity, or a span's first positions)."""
        return position_mask(cache.k[0].shape[2], input_pos, self.group)


__all__ = ["CachedAttention", "CachedDecoder", "DecoderShape", "GatedMLP", "PreNormLayer", "RotaryTable",
           "chunk_mask", "position_mask"]
