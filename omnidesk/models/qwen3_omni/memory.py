"""How much memory a Qwen3-Omni checkpoint needs, and what to do when it does not fit.

Weights are counted from our modules built on the meta device (vision is not
loaded): for Qwen3-Omni-30B-A3B 34.72 B parameters (64.7 GiB were all of them
bf16): 64.3 GiB for the thinker and talker in bf16 plus 0.8 GiB for code2wav,
kept in fp32.  Every expert must be resident even though a token uses
8 of 128, so the weights dominate and a shorter context barely helps; the
refusal says so and suggests what exists today.
"""

from __future__ import annotations

import torch

from ..memory import (MemoryEstimate, ModelShape, estimate_for_shape, gib, max_context, param_count, shape_per_config,
                      torch_dtype)
from .config import Qwen3OmniConfig
from .model import Qwen3OmniModel

MIN_CONTEXT = 1024  # shorter contexts are not worth suggesting: a spoken turn alone takes hundreds of tokens
SMALLER_REPO = "Qwen/Qwen2.5-Omni-7B"


def _shape(raw: dict) -> ModelShape:
    cfg = Qwen3OmniConfig.from_dict(raw)
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    t = cfg.thinker.text
    talker = cfg.talker.text if cfg.talker is not None else None
    return ModelShape(llm_params=param_count(model.thinker) + param_count(model.talker),
                      vocoder_params=param_count(model.code2wav),
                      thinker_kv=(t.num_layers, t.num_kv_heads, t.head_dim),
                      talker_kv=(talker.num_layers, talker.num_kv_heads, talker.head_dim) if talker else None,
                      talker_row_width=talker.hidden_size if talker else 0,
                      max_positions=int(cfg.raw["thinker_config"]["text_config"].get("max_position_embeddings", 32768)))


model_shape = shape_per_config(_shape)


def estimate_memory(config: Qwen3OmniConfig, dtype, context_tokens: int, talker_codes: int = 1500) -> MemoryEstimate:
    """Memory (bytes) to run ``config`` in ``dtype`` with ``context_tokens`` of thinker context
    (see :func:`~omnidesk.models.memory.estimate_for_shape`; ``talker_codes``: speech frames of
    one reply, 1500 = 2 minutes)."""
    return estimate_for_shape(model_shape(config), torch_dtype(dtype), context_tokens, talker_codes)


def check_fits(estimate: MemoryEstimate, free_bytes: int) -> str | None:
    """None if ``estimate`` fits in ``free_bytes``; else what is missing and what to do instead."""
    if estimate.total <= free_bytes:
        return None
    dtype_name = str(estimate.dtype).removeprefix("torch.")
    msg = (f"Qwen3-Omni ({estimate.params / 1e9:.1f}B parameters, all 128 experts resident) in {dtype_name} with a "
           f"context of {estimate.context_tokens} tokens needs about {gib(estimate.total)} but only "
           f"{gib(free_bytes)} is free.")
    tips = []
    fit = max_context(estimate.shape, estimate.dtype, free_bytes, estimate.talker_codes)
    if fit >= MIN_CONTEXT:
        tips.append(f"a shorter context: at most {fit} tokens fit")
    else:
        tips.append(f"a GPU with at least {gib(estimate.total)} free (the weights alone take {gib(estimate.weights)}, "
                    f"so a shorter context does not help)")
    tips.append(f"the smaller {SMALLER_REPO} (about 25 GB in bf16)")
    return msg + " Try " + "; or ".join(tips) + "."


__all__ = ["SMALLER_REPO", "check_fits", "estimate_memory", "model_shape"]
