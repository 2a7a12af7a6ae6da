"""How much memory a Qwen2.5-Omni checkpoint needs for a dtype and context, and what to do when it does not fit.

:func:`estimate_memory` counts weights (our modules built on the meta device),
KV caches and the talker's thinker rows, plus a working margin;
:func:`check_fits` says what is missing and suggests a shorter context, ``--quantize int8``,
a 4-bit checkpoint, the 3B model, or the CPU.  With ``quantization`` ("int8", "int4") the thinker's
decoder linears count in 8 or 4 bits (see :func:`~omnidesk.models.memory.quantized_weight_bytes`).
"""

from __future__ import annotations

import torch

from ..memory import (MemoryEstimate, ModelShape, estimate_for_shape, gib, max_context, param_count, shape_per_config,
                      torch_dtype)
from .config import OmniConfig
from .model import OmniModel, decoder_linears

MIN_CONTEXT = 1024  # shorter contexts are not worth suggesting: a spoken turn alone takes hundreds of tokens
SMALLER_REPO = "Qwen/Qwen2.5-Omni-3B"
# The published 4-bit checkpoints (of the 7B only; thinker decoder linears in 4 bits, group 128)
FOUR_BIT_REPOS = ("Qwen/Qwen2.5-Omni-7B-GPTQ-Int4", "Qwen/Qwen2.5-Omni-7B-AWQ")
FOUR_BIT_GROUP = 128


# thinker decoder linears of the 3B: 36 layers x (2048 x (2048 + 2 * 256) qkv + 2048 x 2048 o + 3 x 2048 x 11008 mlp)
SMALLER_QUANTIZABLE = 36 * (2048 * (2048 + 2 * 256) + 2048 * 2048 + 3 * 2048 * 11008)
SMALLER_ROWS = 36 * ((2048 + 2 * 256) + 2048 + 2 * 11008 + 2048)
# Qwen/Qwen2.5-Omni-3B (tests/data/qwen2_5_omni_3b/config.json, checked in tests/test_inventory.py):
# used to tell a user whose 7B does not fit what the 3B would need.
SMALLER_SHAPE = ModelShape(llm_params=4_034_780_160 + 384_604_928, vocoder_params=449_051_264,
                           thinker_kv=(36, 2, 128), talker_kv=(24, 2, 64), talker_row_width=2048,
                           max_positions=32768, quantizable=SMALLER_QUANTIZABLE, quantizable_rows=SMALLER_ROWS)


def _shape(raw: dict) -> ModelShape:
    cfg = OmniConfig.from_dict(raw)
    with torch.device("meta"):
        model = OmniModel(cfg)
    t = cfg.thinker.text
    thinker = param_count(model.thinker)
    if cfg.thinker.tie_word_embeddings:  # lm_head shares the embedding's storage once loaded
        thinker -= model.thinker.lm_head.weight.numel()
    talker = None if cfg.talker is None else cfg.talker.decoder
    linears = decoder_linears("thinker.model", "thinker.decoder", t)
    return ModelShape(
        llm_params=thinker + param_count(model.talker),
        vocoder_params=param_count(model.vocoder),
        thinker_kv=(t.num_layers, t.num_kv_heads, t.head_dim),
        talker_kv=None if talker is None else (talker.num_layers, talker.num_kv_heads, talker.head_dim),
        talker_row_width=0 if talker is None else talker.embedding_size,
        max_positions=t.max_position_embeddings,
        quantizable=sum(lin.in_features * lin.out_features for lin in linears),
        quantizable_rows=sum(lin.out_features for lin in linears),
    )


model_shape = shape_per_config(_shape)


def estimate_memory(config: OmniConfig, dtype, context_tokens: int, talker_codes: int = 4096,
                    quantization: str | None = None, group_size: int = FOUR_BIT_GROUP) -> MemoryEstimate:
    """Memory (bytes) to run ``config`` in ``dtype`` (torch.dtype or name) with ``context_tokens`` of context.

    weights: thinker + audio encoder + talker in dtype (vision weights are not loaded), vocoder in
    fp32; with ``quantization`` ("int8": made on load, "int4": a GPTQ/AWQ checkpoint with ``group_size``)
    the thinker's decoder linears in 8 / 4 bits plus their scales; KV caches: thinker
    ``layers*2*kv_heads*head_dim*context*bytes``, talker the same for ``context + talker_codes``; talker
    rows ``context*hidden*bytes``; margin: see MARGIN_FRACTION.
    """
    return estimate_for_shape(model_shape(config), torch_dtype(dtype), context_tokens, talker_codes, quantization,
                              group_size)


def memory_by_mode(config: OmniConfig, dtype, context_tokens: int = 8192, four_bit: bool = False,
                   group_size: int = FOUR_BIT_GROUP) -> dict[str, MemoryEstimate]:
    """What ``models list`` shows: the estimate for each way this checkpoint can run; a 4-bit checkpoint
    runs as it is ("int4"), a float one in ``dtype`` (its name) or with ``--quantize int8``."""
    dtype = torch_dtype(dtype)
    if four_bit:
        return {"int4": estimate_memory(config, dtype, context_tokens, quantization="int4", group_size=group_size)}
    return {str(dtype).removeprefix("torch."): estimate_memory(config, dtype, context_tokens),
            "int8": estimate_memory(config, dtype, context_tokens, quantization="int8")}


def check_fits(estimate: MemoryEstimate, free_bytes: int) -> str | None:
    """None if ``estimate`` fits in ``free_bytes``; else what is missing and what to do instead."""
    if estimate.total <= free_bytes:
        return None
    dtype_name = str(estimate.dtype).removeprefix("torch.")
    ctx, codes, quant, group = estimate.context_tokens, estimate.talker_codes, estimate.quantization, estimate.group_size
    how = {None: "", "int8": " with int8 linears", "int4": " with 4-bit linears"}[quant]
    msg = (f"the model ({estimate.params / 1e9:.1f}B parameters) in {dtype_name}{how} with a context of {ctx} tokens "
           f"needs about {gib(estimate.total)} but only {gib(free_bytes)} is free.")
    tips = []
    shape = estimate.shape
    fit = max_context(shape, estimate.dtype, free_bytes, codes, quant, group)
    if fit >= MIN_CONTEXT:
        tips.append(f"a shorter context: at most {fit} tokens fit")
    if quant is None and shape.quantizable:
        e8 = estimate_for_shape(shape, estimate.dtype, ctx, codes, "int8")
        if e8.total <= free_bytes:
            tips.append(f"loading it with --quantize int8 (about {gib(e8.total)}: the thinker's linears in int8)")
    big = shape.llm_params > SMALLER_SHAPE.llm_params * 1.2
    if quant != "int4" and big and shape.quantizable:
        e4 = estimate_for_shape(shape, estimate.dtype, ctx, codes, "int4", FOUR_BIT_GROUP)
        if e4.total <= free_bytes:
            tips.append(f"a 4-bit checkpoint of it, {' or '.join(FOUR_BIT_REPOS)} (about {gib(e4.total)})")
    if big:
        small_quant = quant if quant == "int8" else None  # no 4-bit 3B is published
        small = estimate_for_shape(SMALLER_SHAPE, estimate.dtype, ctx, codes, small_quant)
        small_fit = max_context(SMALLER_SHAPE, estimate.dtype, free_bytes, codes, small_quant)
        if small.total <= free_bytes:
            tips.append(f"the smaller model {SMALLER_REPO} (about {gib(small.total)} with {ctx} tokens of context; "
                        f"up to {small_fit} tokens fit)")
        elif small_fit >= MIN_CONTEXT:
            tips.append(f"the smaller model {SMALLER_REPO} with a context of at most {small_fit} tokens")
    tips.append("running on the CPU (slower)")
    return msg[0].upper() + msg[1:] + " Try " + "; or ".join(tips) + "."


__all__ = ["FOUR_BIT_REPOS", "MemoryEstimate", "ModelShape", "SMALLER_REPO", "SMALLER_SHAPE", "check_fits",
           "estimate_memory", "max_context", "memory_by_mode", "model_shape"]  # MemoryEstimate, ModelShape, max_context: re-exported from ..memory
