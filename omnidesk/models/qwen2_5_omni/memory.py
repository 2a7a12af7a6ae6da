"""How much memory a Qwen2.5-Omni checkpoint needs for a dtype and context, and what to do when it does not fit.

:func:`estimate_memory` counts weights (our modules built on the meta device),
KV caches and the talker's thinker rows, plus a working margin;
:func:`check_fits` says what is missing and suggests a shorter context, the 3B
model, or the CPU.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import torch

from ..memory import gib, torch_dtype
from .config import OmniConfig
from .loading import OmniModel

# Working margin of the memory estimate: 10% on top of weights + caches (allocator rounding and
# fragmentation, temporary copies while loading), plus a fixed 512 MiB for activations (prefill
# chunk activations, logits over the ~152k vocabulary, vocoder activations, CUDA context).
MARGIN_FRACTION = 0.10
ACTIVATION_BYTES = 512 * 2**20
MIN_CONTEXT = 1024  # shorter contexts are not worth suggesting: a spoken turn alone takes hundreds of tokens
SMALLER_REPO = "Qwen/Qwen2.5-Omni-3B"


@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory estimate needs from a config."""

    llm_params: int  # thinker (with audio encoder, without vision) + talker, stored in the run dtype
    vocoder_params: int  # token2wav, always fp32
    thinker_kv: tuple[int, int, int]  # layers, kv heads, head dim
    talker_kv: tuple[int, int, int] | None
    talker_row_width: int  # width of the thinker hidden rows the talker reads (0 without talker)
    max_positions: int  # the thinker's max_position_embeddings: no longer context is suggested


# Qwen/Qwen2.5-Omni-3B (tests/data/qwen2_5_omni_3b/config.json, checked in tests/test_inventory.py):
# used to tell a user whose 7B does not fit what the 3B would need.
SMALLER_SHAPE = ModelShape(llm_params=4_034_780_160 + 384_604_928, vocoder_params=449_051_264,
                           thinker_kv=(36, 2, 128), talker_kv=(24, 2, 64), talker_row_width=2048,
                           max_positions=32768)


@functools.lru_cache(maxsize=8)
def _shape_from_json(raw_json: str) -> ModelShape:
    cfg = OmniConfig.from_dict(json.loads(raw_json))
    with torch.device("meta"):
        model = OmniModel(cfg)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    t = cfg.thinker.text
    thinker = count(model.thinker)
    if cfg.thinker.tie_word_embeddings:  # lm_head shares the embedding's storage once loaded
        thinker -= model.thinker.lm_head.weight.numel()
    talker = None if cfg.talker is None else cfg.talker.decoder
    return ModelShape(
        llm_params=thinker + count(model.talker),
        vocoder_params=count(model.vocoder),
        thinker_kv=(t.num_layers, t.num_kv_heads, t.head_dim),
        talker_kv=None if talker is None else (talker.num_layers, talker.num_kv_heads, talker.head_dim),
        talker_row_width=0 if talker is None else talker.embedding_size,
        max_positions=t.max_position_embeddings,
    )


def model_shape(config: OmniConfig) -> ModelShape:
    """Parameter counts (from our modules built on the meta device) and cache dimensions."""
    return _shape_from_json(json.dumps(config.raw, sort_keys=True))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to run a model; ``total`` includes the working margin."""

    shape: ModelShape = field(repr=False)
    dtype: torch.dtype
    context_tokens: int
    talker_codes: int
    weights: int  # thinker (+ audio encoder) and talker, in dtype
    vocoder: int  # fp32
    thinker_kv: int
    talker_kv: int
    talker_rows: int  # thinker hidden rows kept for the talker
    margin: int
    total: int

    @property
    def params(self) -> int:
        return self.shape.llm_params + self.shape.vocoder_params


def _estimate(shape: ModelShape, dtype: torch.dtype, context_tokens: int, talker_codes: int) -> MemoryEstimate:
    b = dtype.itemsize
    weights = shape.llm_params * b
    vocoder = shape.vocoder_params * 4
    layers, heads, dim = shape.thinker_kv
    thinker_kv = layers * 2 * heads * dim * context_tokens * b
    talker_kv = talker_rows = 0
    if shape.talker_kv is not None:
        layers, heads, dim = shape.talker_kv
        talker_kv = layers * 2 * heads * dim * (context_tokens + talker_codes) * b
        talker_rows = context_tokens * shape.talker_row_width * b
    base = weights + vocoder + thinker_kv + talker_kv + talker_rows
    margin = math.ceil(base * MARGIN_FRACTION) + ACTIVATION_BYTES
    return MemoryEstimate(shape, dtype, context_tokens, talker_codes, weights, vocoder, thinker_kv, talker_kv,
                          talker_rows, margin, base + margin)


def estimate_memory(config: OmniConfig, dtype, context_tokens: int, talker_codes: int = 4096) -> MemoryEstimate:
    """Memory (bytes) to run ``config`` in ``dtype`` (torch.dtype or name) with ``context_tokens`` of context.

    weights: thinker + audio encoder + talker in dtype (vision weights are not loaded), vocoder in
    fp32; KV caches: thinker ``layers*2*kv_heads*head_dim*context*bytes``, talker the same for
    ``context + talker_codes``; talker rows ``context*hidden*bytes``; margin: see MARGIN_FRACTION.
    """
    return _estimate(model_shape(config), torch_dtype(dtype), context_tokens, talker_codes)


def max_context(shape: ModelShape, dtype, free_bytes: int, talker_codes: int = 4096) -> int:
    """The largest context (a multiple of 256 tokens, at most the model's maximum) that fits in
    ``free_bytes``; 0 if none does."""
    dtype = torch_dtype(dtype)
    at0 = _estimate(shape, dtype, 0, talker_codes)
    per_token = _estimate(shape, dtype, 1, talker_codes).total - at0.total + 1  # +1: ceil rounding
    if at0.total > free_bytes:
        return 0
    n = min((free_bytes - at0.total) // per_token, shape.max_positions) // 256 * 256
    while n > 0 and _estimate(shape, dtype, n, talker_codes).total > free_bytes:
        n -= 256
    return n


def check_fits(estimate: MemoryEstimate, free_bytes: int) -> str | None:
    """None if ``estimate`` fits in ``free_bytes``; else what is missing and what to do instead."""
    if estimate.total <= free_bytes:
        return None
    dtype_name = str(estimate.dtype).removeprefix("torch.")
    ctx, codes = estimate.context_tokens, estimate.talker_codes
    msg = (f"the model ({estimate.params / 1e9:.1f}B parameters) in {dtype_name} with a context of {ctx} tokens "
           f"needs about {gib(estimate.total)} but only {gib(free_bytes)} is free.")
    tips = []
    fit = max_context(estimate.shape, estimate.dtype, free_bytes, codes)
    if fit >= MIN_CONTEXT:
        tips.append(f"a shorter context: at most {fit} tokens fit")
    if estimate.shape.llm_params > SMALLER_SHAPE.llm_params * 1.2:
        small = _estimate(SMALLER_SHAPE, estimate.dtype, ctx, codes)
        small_fit = max_context(SMALLER_SHAPE, estimate.dtype, free_bytes, codes)
        if small.total <= free_bytes:
            tips.append(f"the smaller model {SMALLER_REPO} (about {gib(small.total)} with {ctx} tokens of context; "
                        f"up to {small_fit} tokens fit)")
        elif small_fit >= MIN_CONTEXT:
            tips.append(f"the smaller model {SMALLER_REPO} with a context of at most {small_fit} tokens")
    tips.append("running on the CPU (slower)")
    return msg[0].upper() + msg[1:] + " Try " + "; or ".join(tips) + "."


__all__ = ["MemoryEstimate", "ModelShape", "SMALLER_REPO", "SMALLER_SHAPE", "check_fits", "estimate_memory",
           "max_context", "model_shape"]
