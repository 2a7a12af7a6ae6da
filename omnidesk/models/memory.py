"""Memory arithmetic every family's estimate shares (each family computes its own needs)."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def available_ram() -> int:
    """Bytes of physical memory available now; 0 where unknown.

    Linux's MemAvailable counts the page cache the kernel gives back on demand: right after a
    multi-GB download most RAM is page cache and "free" pages (sysconf's AVPHYS) are few, which
    would refuse a model that fits."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, ValueError, KeyError, IndexError):  # not Linux, or a kernel without MemAvailable
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0


def cpu_ram_problem(need: int, dtype: torch.dtype, smaller: str = "") -> str | None:
    """Why loading ``need`` bytes on the CPU would not fit the RAM available now (None when it fits or
    the RAM is unknown): said before any weight is read, instead of swapping the machine to a halt
    or being killed halfway.  ``smaller`` names a lighter way to run it, when the family has one."""
    free = available_ram()
    if not free or need <= free:
        return None
    return (f"on the CPU in {str(dtype).removeprefix('torch.')} this model needs about {gib(need)} of RAM but only "
            f"{gib(free)} is available; {smaller}run it on a GPU with enough memory (--device cuda)")


def ram_too_small(need: int) -> str | None:
    """Why a CPU load test of ``need`` bytes is skipped (too little RAM available now), else None."""
    free = available_ram()
    if need <= free:
        return None
    return f"load test skipped: the checkpoint needs about {gib(need)} in float32 but only {gib(free)} of RAM is available"


def torch_dtype(dtype) -> torch.dtype:
    """A torch.dtype from itself or its name ("bfloat16", "torch.float16")."""
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(d, torch.dtype):
            raise ValueError(f"unknown dtype '{dtype}'")
        return d
    return dtype


# Working margin of the memory estimate: 10% on top of weights + caches (allocator rounding and
# fragmentation, temporary copies while loading), plus a fixed 512 MiB for activations (prefill
# chunk activations, logits over the ~152k vocabulary, vocoder activations, CUDA context).
MARGIN_FRACTION = 0.10
ACTIVATION_BYTES = 512 * 2**20
@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory estimate needs from a config."""

    llm_params: int  # thinker (with audio encoder, without vision) + talker, stored in the run dtype
    vocoder_params: int  # token2wav, always fp32
    thinker_kv: tuple[int, int, int]  # layers, kv heads, head dim
    talker_kv: tuple[int, int, int] | None
    talker_row_width: int  # width of the thinker hidden rows the talker reads (0 without talker)
    max_positions: int  # the thinker's max_position_embeddings: no longer context is suggested
    # weight-only quantization (omnidesk/models/quant.py): the weight elements of the linears a quantized
    # run stores in 4 or 8 bits (part of llm_params), and the sum of their output widths (one int8 scale each)
    quantizable: int = 0
    quantizable_rows: int = 0


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
    quantization: str | None = None  # None (weights in dtype), "int8" or "int4"
    group_size: int = 128  # int4: input channels per scale/zero

    @property
    def params(self) -> int:
        return self.shape.llm_params + self.shape.vocoder_params


def param_count(module: nn.Module | None) -> int:
    """Parameters of ``module`` (built on the meta device: nothing allocated); 0 for a part the config lacks."""
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def shape_per_config(shape_of: Callable[[dict], ModelShape]) -> Callable[[Any], ModelShape]:
    """A family's ``model_shape(config)`` from ``shape_of(config.json as a dict)``, computed once per
    distinct config.json: building the real model on the meta device takes seconds, and the picker
    and every estimate ask again."""
    @functools.lru_cache(maxsize=8)
    def from_json(raw_json: str) -> ModelShape:
        return shape_of(json.loads(raw_json))

    def model_shape(config) -> ModelShape:
        """Parameter counts (from our modules built on the meta device) and cache dimensions."""
        return from_json(json.dumps(config.raw, sort_keys=True))

    return model_shape


QUANT_SCALE_BYTES = 2  # the int4pack / int8pack kernels keep their scales (and int4 zeros) in bfloat16


def quantized_weight_bytes(shape: ModelShape, dtype: torch.dtype, quantization: str | None,
                           group_size: int = 128) -> int:
    """Bytes of the LLM weights with ``shape.quantizable`` of them stored ``quantization``: "int8" (one
    byte each + one bfloat16 scale per output row), "int4" (half a byte each + a bfloat16 scale and
    float zero per group of ``group_size`` input channels, as the int4pack kernel keeps them), None (all
    in ``dtype``); the rest of the weights in ``dtype``."""
    b = dtype.itemsize
    if quantization is None or not shape.quantizable:
        return shape.llm_params * b
    rest = (shape.llm_params - shape.quantizable) * b
    if quantization == "int8":
        return rest + shape.quantizable + shape.quantizable_rows * QUANT_SCALE_BYTES
    if quantization == "int4":
        return rest + shape.quantizable // 2 + 2 * math.ceil(shape.quantizable / group_size) * QUANT_SCALE_BYTES
    raise ValueError(f"unknown quantization '{quantization}'")


def estimate_for_shape(shape: ModelShape, dtype: torch.dtype, context_tokens: int, talker_codes: int,
                       quantization: str | None = None, group_size: int = 128) -> MemoryEstimate:
    """Bytes to run a model of ``shape``: weights in ``dtype`` (the vocoder in fp32; with ``quantization``
    the quantizable linears in int8/int4, :func:`quantized_weight_bytes`), KV caches for
    ``context_tokens`` (the talker's for ``context_tokens + talker_codes``), the talker's rows,
    and the working margin (:data:`MARGIN_FRACTION` + :data:`ACTIVATION_BYTES`)."""
    b = dtype.itemsize
    weights = quantized_weight_bytes(shape, dtype, quantization, group_size)
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
                          talker_rows, margin, base + margin, quantization if shape.quantizable else None, group_size)


def max_context(shape: ModelShape, dtype, free_bytes: int, talker_codes: int = 4096, quantization: str | None = None,
                group_size: int = 128) -> int:
    """The largest context (a multiple of 256 tokens, at most the model's maximum) that fits in
    ``free_bytes``; 0 if none does."""
    dtype = torch_dtype(dtype)

    def est(n: int) -> MemoryEstimate:
        return estimate_for_shape(shape, dtype, n, talker_codes, quantization, group_size)

    at0 = est(0)
    per_token = est(1).total - at0.total + 1  # +1: ceil rounding
    if at0.total > free_bytes:
        return 0
    n = min((free_bytes - at0.total) // per_token, shape.max_positions) // 256 * 256
    while n > 0 and est(n).total > free_bytes:
        n -= 256
    return n


__all__ = ["ACTIVATION_BYTES", "cpu_ram_problem", "MARGIN_FRACTION", "MemoryEstimate", "ModelShape", "available_ram", "estimate_for_shape",
           "gib", "max_context", "param_count", "QUANT_SCALE_BYTES", "quantized_weight_bytes", "ram_too_small",
           "shape_per_config", "torch_dtype"]
