"""How much memory a Qwen2.5-Omni checkpoint needs for a dtype and context, and what to do when it does not fit.

:func:`estimate_memory` counts weights (our modules built on the meta device),
KV caches and the talker's thinker rows, plus a working margin;
:func:`check_fits` says what is missing and suggests a shorter context, the 3B
model, or the CPU.
"""

from __future__ import annotations

import functools
import json

import torch

from ..memory import MemoryEstimate, ModelShape, estimate_for_shape, gib, max_context, torch_dtype
from .config import OmniConfig
from .loading import OmniModel

MIN_CONTEXT = 1024  # shorter contexts are not worth suggesting: a spoken turn alone takes hundreds of tokens
SMALLER_REPO = "Qwen/Qwen2.5-Omni-3B"


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


def estimate_memory(config: OmniConfig, dtype, context_tokens: int, talker_codes: int = 4096) -> MemoryEstimate:
    """Memory (bytes) to run ``config`` in ``dtype`` (torch.dtype or name) with ``context_tokens`` of context.

    weights: thinker + audio encoder + talker in dtype (vision weights are not loaded), vocoder in
    fp32; KV caches: thinker ``layers*2*kv_heads*head_dim*context*bytes``, talker the same for
    ``context + talker_codes``; talker rows ``context*hidden*bytes``; margin: see MARGIN_FRACTION.
    """
    return estimate_for_shape(model_shape(config), torch_dtype(dtype), context_tokens, talker_codes)


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
        small = estimate_for_shape(SMALLER_SHAPE, estimate.dtype, ctx, codes)
        small_fit = max_context(SMALLER_SHAPE, estimate.dtype, free_bytes, codes)
        if small.total <= free_bytes:
            tips.append(f"the smaller model {SMALLER_REPO} (about {gib(small.total)} with {ctx} tokens of context; "
                        f"up to {small_fit} tokens fit)")
        elif small_fit >= MIN_CONTEXT:
            tips.append(f"the smaller model {SMALLER_REPO} with a context of at most {small_fit} tokens")
    tips.append("running on the CPU (slower)")
    return msg[0].upper() + msg[1:] + " Try " + "; or ".join(tips) + "."


__all__ = ["MemoryEstimate", "ModelShape", "SMALLER_REPO", "SMALLER_SHAPE", "check_fits", "estimate_memory",
           "max_context", "model_shape"]  # MemoryEstimate, ModelShape, max_context: re-exported from ..memory
