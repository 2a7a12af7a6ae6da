"""The Qwen3 decoder shared by the thinker, the talker and the code predictor.

One module, three shapes (each read from its config.json section):

* thinker text model: QK-norm attention + sparse MoE layers (128 experts, top 8),
  dense layers only where ``decoder_sparse_step`` / ``mlp_only_layers`` say so;
* talker: the same attention + MoE with one shared expert behind a sigmoid gate.
  The reference's talker layer always builds that block, whatever
  ``decoder_sparse_step`` / ``mlp_only_layers`` say, so a decoder with a shared
  expert is sparse in every layer;
* code predictor: dense (gated SiLU MLP) in every layer.

Positions.  Thinker and talker use interleaved multimodal RoPE: each rotary
frequency j takes its angle from one of three position axes (T for j % 3 == 0,
H for j % 3 == 1 below 3 * mrope_section[1], W for j % 3 == 2 below
3 * mrope_section[2], T elsewhere).  For text and audio the three axes carry the
same sequential position (the reference's ``get_rope_index`` gives audio tokens
consecutive positions; only images and video differ), so every frequency gets
angle ``position * inv_freq[j]``: plain RoPE.  The code predictor uses plain RoPE
anyway.  Positions are therefore the cache positions ``cache.length ..``
(checked against transformers in tests/test_qwen3_decoder.py).

Experts are stacked ([E, 2I, H] gate rows then up rows, and [E, H, I]); the
published checkpoint stores one tensor per expert and :func:`decoder_weight_map`
says where each goes.  Two ways to run them, same numbers:

* gather (a few tokens on an accelerator: decode): ``index_select`` the routed
  experts' weights and bmm; no host sync, no Python loop, so a CUDA graph can
  capture it;
* grouped (prefill, and every step on the CPU): sort the (token, expert) pairs by
  expert and run one matmul per expert that received tokens (one host sync).
  On the CPU the gather's weight copy costs more than the math: one token through
  8 of the thinker's experts took ~21 ms gathered vs ~4 ms grouped (bf16, 2 cores).

Two ways to run a step over a preallocated :class:`KVCache`:

* :meth:`Decoder.forward` (prefill, any T): positions follow ``cache.length``,
  attention reads the valid prefix, experts grouped;
* :meth:`Decoder.forward_static` (the decode steps of omnidesk.models.runner): writes
  with ``index_copy_`` at tensor positions ``input_pos`` and masks by position, so no
  shape or Python value depends on the step and nothing reads the device from the host.
  Its experts: on the CPU, eagerly, ``grouped_mm`` over the sorted pairs with device
  offsets (the grouped path's numbers without its host sync: one token through the
  thinker's 8 of 128 experts 3.9 ms in bf16 against 59 ms gathered, 2 cores); compiled,
  or on an accelerator, gathered (inductor has no fp32 ``grouped_mm`` on the CPU and its
  bf16 one took 44 ms; on CUDA ``bincount`` reads its result on the host, which a CUDA
  graph cannot capture, and the gather costs 0.17 ms per thinker layer per token on an
  H200, eager or replayed).

Both give the same numbers (tests/test_qwen3_decoder.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError, Target, config_field
from ..decoder_layers import (CachedAttention, CachedDecoder, DecoderShape, GatedMLP, PreNormLayer, RotaryTable,
                              chunk_mask)
from ..kv_cache import KVCache, KVSpan
from ..layers import RMSNorm, apply_rotary

# Steps of at most this many tokens on an accelerator run the experts by gathering their
# weights (a copy of top_k expert matrices per token); longer steps, and every CPU step,
# group tokens per expert.
GATHER_MAX_TOKENS = 2


# ---------------------------------------------------------------- config

def _int(d: dict, key: str, where: str, default: Any = ..., minimum: int = 1) -> int:
    value = config_field(d, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: field '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _float(d: dict, key: str, where: str, value: Any = ...) -> float:
    if value is ...:
        value = config_field(d, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}: field '{key}' must be a positive number, got {value!r}")
    return float(value)


def _rope(d: dict, where: str) -> tuple[float, tuple[int, ...], bool]:
    """rope theta, mrope_section (() for plain RoPE) and whether the sections are interleaved.

    Accepts the hub spelling (``rope_theta`` + ``rope_scaling``) and what current
    transformers writes (``rope_parameters``)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_parameters / rope_scaling must be objects")
    both = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", scaling.get("rope_theta")))
    if theta is None:
        raise ConfigError(f"{where}: missing field 'rope_theta' (or rope_parameters.rope_theta)")
    theta = _float(d, "rope_theta", where, theta)
    rope_type = both.get("rope_type", both.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{where}: rope type '{rope_type}' is not supported (only default/mrope)")
    section = both.get("mrope_section") or ()
    if not isinstance(section, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in section):
        raise ConfigError(f"{where}: field 'mrope_section' must be a list of integers, got {section!r}")
    interleaved = bool(both.get("interleaved", both.get("mrope_interleaved", False)))
    return theta, tuple(section), interleaved


@dataclass(frozen=True)
class DecoderConfig(DecoderShape):
    """One Qwen3(-MoE) decoder; ``num_experts == 0`` means every layer is dense.

    ``mrope_section`` is () for plain RoPE and only read to check the config (see the module
    docstring); ``intermediate_size``, the dense MLP width, serves the talker's projections,
    never its layers."""

    mrope_interleaved: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.mrope_section:
            self.check_mrope_section()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                              f"({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` runs the experts (the reference's rule, see the module docstring)."""
        if not self.num_experts:
            return False
        if self.shared_expert_intermediate_size:
            return True  # the talker: its layer class always builds the MoE + shared expert block
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "DecoderConfig":
        """A HF sub-config as config.json spells it (thinker_config.text_config,
        talker_config.text_config, talker_config.code_predictor_config).

        Every value comes from the file: transformers' class defaults differ from
        the checkpoint (norm_topk_prob, num_experts_per_tok, head_dim...).  A missing
        ``head_dim`` is hidden_size / num_attention_heads, as the reference computes it."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, found {type(d).__name__}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (Qwen3 uses silu)")
        if d.get("attention_bias"):
            raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3 has no attention biases)")
        if d.get("use_qk_norm") is False:
            raise ConfigError(f"{where}: use_qk_norm=false is not supported")
        if d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or ()):
            raise ConfigError(f"{where}: sliding-window attention is not supported")
        hidden = _int(d, "hidden_size", where)
        heads = _int(d, "num_attention_heads", where)
        theta, section, interleaved = _rope(d, where)
        # the hub file says num_experts; transformers 5 writes the talker's back as num_local_experts
        experts = _int(d, "num_experts" if d.get("num_experts") is not None else "num_local_experts",
                       where, 0, minimum=0)
        if not experts and d.get("moe_intermediate_size"):
            raise ConfigError(f"{where}: missing field 'num_experts' (moe_intermediate_size is set)")
        moe: dict[str, Any] = {}
        if experts:
            shared = _int(d, "shared_expert_intermediate_size", where, 0, minimum=0)
            norm_topk = config_field(d, "norm_topk_prob", where)
            if not isinstance(norm_topk, bool):
                raise ConfigError(f"{where}: field 'norm_topk_prob' must be true or false, got {norm_topk!r}")
            only = d.get("mlp_only_layers") or []
            if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) for i in only):
                raise ConfigError(f"{where}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=_int(d, "num_experts_per_tok", where),
                moe_intermediate_size=_int(d, "moe_intermediate_size", where),
                norm_topk_prob=norm_topk,
                shared_expert_intermediate_size=shared,
                # the talker (shared expert) ignores these two, as the reference does
                decoder_sparse_step=1 if shared else _int(d, "decoder_sparse_step", where),
                mlp_only_layers=() if shared else tuple(only),
            )
        try:
            return cls(
                vocab_size=_int(d, "vocab_size", where),
                hidden_size=hidden,
                num_layers=_int(d, "num_hidden_layers", where),
                num_heads=heads,
                num_kv_heads=_int(d, "num_key_value_heads", where),
                head_dim=_int(d, "head_dim", where, hidden // heads),
                rms_norm_eps=_float(d, "rms_norm_eps", where),
                rope_theta=theta,
                mrope_section=section,
                mrope_interleaved=interleaved,
                intermediate_size=_int(d, "intermediate_size", where),
                **moe,
            )
        except ConfigError as e:
            if str(e).startswith(where):
                raise
            raise ConfigError(f"{where}: {e}") from None


# ---------------------------------------------------------------- modules

class Rotary(RotaryTable):
    """cos/sin tables of plain RoPE (half-split layout), positions 0..n-1.

    Kept and grown by doubling (:class:`~omnidesk.models.decoder_layers.RotaryTable`).
    Angles in fp32, cast to the model dtype, as the reference does."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # made on the CPU explicitly, also when the module is built on the meta device; the loader moves it
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def reset_buffers(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        self._table = None

    def compute(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(CachedAttention):
    """GQA with per-head RMS norm on q and k (before RoPE); q/k/v fused into one matmul, no biases."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__(cfg, layer_idx, qkv_bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | KVSpan, start: int,
                mask: torch.Tensor | None, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] at positions [start, start + T), or at ``input_pos`` [T] (static form: the whole
        cache or span is attended, ``mask`` [group * T, span] hides what is not valid yet)."""
        t = x.shape[0]
        q, k, v = self.wqkv(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rotary(self.q_norm(q.view(t, self.n_heads, self.head_dim)).transpose(0, 1), cos, sin)
        k = apply_rotary(self.k_norm(k.view(t, self.n_kv, self.head_dim)).transpose(0, 1), cos, sin)
        v = v.view(t, self.n_kv, self.head_dim).transpose(0, 1)
        return self.attend(q, k, v, cache, start, mask, input_pos)


class MoE(nn.Module):
    """Top-k routed experts (softmax in fp32, then top-k, renormalised when
    ``norm_topk_prob``), plus an optional shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.num_experts, self.top_k, self.intermediate = e, cfg.num_experts_per_tok, i
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.experts_w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # per expert: gate rows, then up rows
        self.experts_w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k] (x's dtype) and expert ids [T, k]."""
        probs = F.linear(x, self.gate.weight).softmax(dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _gathered(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Expert outputs [T * k, H] for each (token, slot), from the routed experts' weights only."""
        flat = experts.reshape(-1)
        t, width = x.shape
        # [T*k, H, 1]: row i is token i // k (an expand, not repeat_interleave: nothing to capture but a copy)
        xs = x[:, None].expand(t, self.top_k, width).reshape(t * self.top_k, width, 1)
        h = torch.bmm(self.experts_w13.index_select(0, flat), xs).squeeze(-1)  # [T*k, 2I]
        gate, up = h.split(self.intermediate, dim=-1)
        act = (F.silu(gate) * up).unsqueeze(-1)
        return torch.bmm(self.experts_w2.index_select(0, flat), act).squeeze(-1)

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`_gathered`: (token, slot) pairs sorted by expert, one matmul per expert hit."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        hit = torch.nonzero(counts).flatten()
        sizes = counts[hit].tolist()  # the one host sync of a prefill layer
        xs = x.index_select(0, order // self.top_k)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in zip(hit.tolist(), sizes):
            seg = xs[start:start + n]
            gate, up = F.linear(seg, self.experts_w13[e]).split(self.intermediate, dim=-1)
            ys[start:start + n] = F.linear(F.silu(gate) * up, self.experts_w2[e])
            start += n
        return torch.empty_like(ys).index_copy_(0, order, ys)

    def _grouped_mm(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`_grouped` without its host sync: the sorted pairs through ``grouped_mm``,
        each expert's rows delimited by offsets computed on the device (experts no token chose
        get empty groups)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offsets = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)
        xs = x.index_select(0, order // self.top_k)
        # out_dtype spelled out: without it the CPU kernel takes a path ~10x slower in bf16
        h = F.grouped_mm(xs, self.experts_w13.transpose(1, 2), offs=offsets, out_dtype=x.dtype)
        gate, up = h.split(self.intermediate, dim=-1)
        ys = F.grouped_mm(F.silu(gate) * up, self.experts_w2.transpose(1, 2), offs=offsets, out_dtype=x.dtype)
        return torch.empty_like(ys).index_copy_(0, order, ys)

    def _combine(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        out = (y.view(t, self.top_k, h) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward(self, x: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H].  ``grouped`` picks the expert path (default: gather for at most
        GATHER_MAX_TOKENS tokens off the CPU, grouped otherwise)."""
        weights, experts = self.route(x)
        if grouped is None:
            grouped = x.device.type == "cpu" or x.shape[0] > GATHER_MAX_TOKENS
        return self._combine(x, self._grouped(x, experts) if grouped else self._gathered(x, experts), weights)

    def forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without a host sync, for a decode step (see the module docstring for
        which expert path runs where)."""
        weights, experts = self.route(x)
        if (x.device.type == "cpu" and not torch.compiler.is_compiling()
                and grouped_mm_works(x.dtype)):
            y = self._grouped_mm(x, experts)
        else:
            y = self._gathered(x, experts)
        return self._combine(x, y, weights)


@functools.lru_cache(maxsize=None)
def grouped_mm_works(dtype: torch.dtype) -> bool:
    """Whether this torch has a CPU ``grouped_mm`` for ``dtype`` that equals per-expert matmuls
    (torch < 2.10 has none; checked once on a small problem, like the quantized kernels)."""
    if not hasattr(F, "grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 16, generator=g).to(dtype)
    x = torch.randn(4, 16, generator=g).to(dtype)
    offsets = torch.tensor([1, 1, 4], dtype=torch.int32)  # an empty group in the middle
    try:
        with torch.inference_mode():
            got = F.grouped_mm(x, w.transpose(1, 2), offs=offsets, out_dtype=dtype)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    want = torch.cat([F.linear(x[:1], w[0]), F.linear(x[1:], w[2])])
    return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


class DecoderLayer(PreNormLayer):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__(cfg, Attention(cfg, layer_idx), MoE(cfg) if cfg.is_sparse(layer_idx)
                         else GatedMLP(cfg.hidden_size, cfg.intermediate_size))
        self.sparse = isinstance(self.mlp, MoE)

    def feed_forward(self, h: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        # a static (decode) step runs the experts without a host sync
        return self.mlp.forward_static(h) if input_pos is not None and self.sparse else self.mlp(h)


class Decoder(CachedDecoder):
    """Layers + final norm of a Qwen3 decoder; embeddings and heads belong to the caller."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_layers)),
                         Rotary(cfg.head_dim, cfg.rope_theta))

    def forward(self, embeds: torch.Tensor, cache: KVCache, hidden_layer: int | None = None):
        """Append embeds [T, H] at cache positions [length, length + T) -> final-normed hidden [T, H].

        With ``hidden_layer=k`` also returns the hidden state the reference's
        ``output_hidden_states[k]`` holds: k = 0 the input embeddings, 1..n-1 the
        output of layer k-1 (before the final norm), n the final-normed output
        (transformers replaces the last entry by it)."""
        n = len(self.layers)
        if hidden_layer is not None and not 0 <= hidden_layer <= n:
            raise ValueError(f"hidden_layer must be in 0..{n}, got {hidden_layer}")
        t = embeds.shape[0]
        start = cache.reserve(t)
        end = start + t
        mask = chunk_mask(start, end, self.group, embeds.device)
        cos, sin = self.rotary.span(start, end, embeds.dtype)
        x = embeds
        picked = embeds if hidden_layer == 0 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, start, mask)
            if hidden_layer == i + 1 and i + 1 < n:
                picked = x
        cache.length = end
        out = self.norm(x)
        if hidden_layer is None:
            return out
        return out, (out if hidden_layer == n else picked)

    def forward_static(self, embeds: torch.Tensor, cache: KVCache | KVSpan, input_pos: torch.Tensor) -> torch.Tensor:
        """Static-shape step: embeds [T, H] written at ``input_pos`` [T] (long, on the device) ->
        final-normed hidden [T, H], without a host sync (a compiled or captured decode step).

        Attends over the whole of ``cache`` (its capacity, or a :class:`KVSpan`'s first positions),
        masking every position after the query's own; ``cache.length`` is the caller's.  The rotary
        table must already cover ``cache.capacity`` (grow it before compiling: ``rotary.table``)."""
        mask = self.static_mask(cache, input_pos)
        cos, sin = self.rotary.at(input_pos, cache.capacity, embeds.dtype)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cache, 0, mask, input_pos)
        return self.norm(x)


# ---------------------------------------------------------------- checkpoint names

def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def decoder_weight_map(ckpt_prefix: str, ours_prefix: str, cfg: DecoderConfig) -> dict[str, Target]:
    """Published checkpoint name -> destination for one decoder's layers and final norm.

    ``ckpt_prefix`` is e.g. ``thinker.model`` / ``talker.model`` /
    ``talker.code_predictor.model``; ``ours_prefix`` the Decoder's name in our module
    ('' for the Decoder itself).  Experts are one tensor per expert on disk; q/k/v
    and gate/up land in row ranges of our fused weights."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {f"{ckpt_prefix}.norm.weight": Target(_join(ours_prefix, "norm.weight"), (h,))}

    def gated(c: str, o: str, inter: int) -> None:
        out[f"{c}.gate_proj.weight"] = Target(f"{o}.w13.weight", (inter, h), rows=(0, inter))
        out[f"{c}.up_proj.weight"] = Target(f"{o}.w13.weight", (inter, h), rows=(inter, 2 * inter))
        out[f"{c}.down_proj.weight"] = Target(f"{o}.down_proj.weight", (h, inter))

    for layer in range(cfg.num_layers):
        c, o = f"{ckpt_prefix}.layers.{layer}", _join(ours_prefix, f"layers.{layer}")
        qkv = f"{o}.self_attn.wqkv.weight"
        for name, (lo, hi) in {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}.items():
            out[f"{c}.self_attn.{name}.weight"] = Target(qkv, (hi - lo, h), rows=(lo, hi))
        out[f"{c}.self_attn.o_proj.weight"] = Target(f"{o}.self_attn.o_proj.weight", (h, q))
        for name in ("q_norm", "k_norm"):
            out[f"{c}.self_attn.{name}.weight"] = Target(f"{o}.self_attn.{name}.weight", (d,))
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{c}.{name}.weight"] = Target(f"{o}.{name}.weight", (h,))
        if not cfg.is_sparse(layer):
            gated(f"{c}.mlp", f"{o}.mlp", cfg.intermediate_size)
            continue
        i = cfg.moe_intermediate_size
        out[f"{c}.mlp.gate.weight"] = Target(f"{o}.mlp.gate.weight", (cfg.num_experts, h))
        for e in range(cfg.num_experts):
            ce = f"{c}.mlp.experts.{e}"
            out[f"{ce}.gate_proj.weight"] = Target(f"{o}.mlp.experts_w13", (i, h), index=e, rows=(0, i))
            out[f"{ce}.up_proj.weight"] = Target(f"{o}.mlp.experts_w13", (i, h), index=e, rows=(i, 2 * i))
            out[f"{ce}.down_proj.weight"] = Target(f"{o}.mlp.experts_w2", (h, i), index=e)
        if cfg.shared_expert_intermediate_size:
            gated(f"{c}.mlp.shared_expert", f"{o}.mlp.shared_expert", cfg.shared_expert_intermediate_size)
            out[f"{c}.mlp.shared_expert_gate.weight"] = Target(f"{o}.mlp.shared_expert_gate.weight", (1, h))
    return out


__all__ = ["Decoder", "DecoderConfig", "GATHER_MAX_TOKENS", "MoE", "decoder_weight_map", "grouped_mm_works"]
