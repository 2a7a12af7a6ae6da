"""Weight-only quantized linear layers, family-neutral: 4-bit GPTQ / AWQ checkpoints, and int8 made on load.

One module, :class:`~omnidesk.models.quant_linear.QuantLinear`, replaces an ``nn.Linear`` wherever a
family wants it (the Qwen2.5-Omni thinker's decoder linears today; Qwen3-Omni community 4-bit
checkpoints and Moshi's int8 can use the same constructors).  It is built from

* :meth:`QuantLinear.from_gptq` / :meth:`QuantLinear.from_awq`: the packed tensors of one linear as
  a GPTQ v1 / AWQ GEMM checkpoint stores them;
* :meth:`QuantLinear.from_int4`: the unpacked integer form (:class:`IntWeights`), which is what
  fused projections are built from (q/k/v and gate/up are unpacked, checked and concatenated
  along the output dimension, then packed once for the kernel);
* :meth:`QuantLinear.from_float`: a float weight, quantized to int8 per output channel.

Where each part lives: the checkpoint formats and their unpacking in :mod:`omnidesk.models.quant_format`;
the layer, its matmul paths and the kernel probe in :mod:`omnidesk.models.quant_linear`; here, what a
family's loader calls: which linears a checkpoint stores 4-bit, the placeholders swapped into a meta
model, filling them from the checkpoint (4-bit parts unpacked, fused and packed once; int8 quantized
on the device as each float tensor is read), and the summary of the paths that run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint import CheckpointError
from .quant_format import (AWQ_ORDER, AWQ_REVERSE_ORDER, IntWeights, QuantConfig, read_quant_config, unpack,
                           unpack_awq, unpack_gptq)
from .quant_linear import PATH_NAMES, QuantLinear

QUANTIZE_CHOICES = ("none", "int8")  # what --quantize accepts (4-bit comes from the checkpoint)


# ---------------------------------------------------------------- loading a family's linears

@dataclass(frozen=True)
class LinearPart:
    """One checkpoint linear (its name prefix) filling output rows ``[lo, hi)`` of one of our linears."""

    prefix: str  # e.g. "thinker.model.layers.0.self_attn.q_proj"
    lo: int
    hi: int

    @property
    def out_features(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class FusedLinear:
    """One of our linears (``module``, e.g. "thinker.decoder.layers.0.self_attn.wqkv") and the checkpoint
    linears concatenated along its output dimension (one part where nothing is fused)."""

    module: str
    in_features: int
    parts: tuple[LinearPart, ...]

    @property
    def out_features(self) -> int:
        return self.parts[-1].hi


def quantized_in_checkpoint(linears: list[FusedLinear], names, cfg: QuantConfig | None) -> set[str]:
    """Our modules stored 4-bit in a checkpoint holding tensors ``names``: those with any quantized tensor
    (``<part>.qweight``, ``.qzeros``, ...) under any of their parts.  A fused linear whose other parts are
    stored in float then shows as missing quantized tensors and unexpected ``.weight`` ones, by name."""
    if cfg is None:
        return set()
    names = set(names)
    fields = cfg.tensor_names()
    return {f.module for f in linears
            if any(f"{p.prefix}.{field_}" in names for p in f.parts for field_ in fields)}


def quant_targets(linear: FusedLinear, cfg: QuantConfig):
    """Checkpoint name -> :class:`~omnidesk.models.checkpoint.Target` for the 4-bit tensors of ``linear``
    (shapes in ``cfg``'s format; ``param`` is ``<module>.<field>``, filled by :func:`load_linears`)."""
    from .checkpoint import Target

    out = {}
    for p in linear.parts:
        for field_, shape in cfg.expected_shapes(linear.in_features, p.out_features).items():
            out[f"{p.prefix}.{field_}"] = Target(f"{linear.module}.{field_}", shape, rows=(p.lo, p.hi))
    return out


def replace_linears(model: nn.Module, modules) -> dict[str, QuantLinear]:
    """Swap the ``nn.Linear`` submodules named ``modules`` of ``model`` (on any device, meta included) for
    unfilled :class:`QuantLinear` placeholders with the same sizes and bias; returns them by name."""
    out = {}
    for name in modules:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{name} is a {type(old).__name__}, not an nn.Linear")
        new = QuantLinear.placeholder(old)
        setattr(parent, attr, new)
        out[name] = new
    return out


def _read(handles: dict, files: dict, name: str) -> torch.Tensor:
    from safetensors import safe_open

    f = files[name]
    if f not in handles:
        try:
            handles[f] = handles["__stack__"].enter_context(safe_open(str(f), framework="pt", device="cpu"))
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{f}: cannot read tensors ({type(e).__name__}: {e})") from None
    try:
        return handles[f].get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"{f}: cannot read tensor '{name}' ({type(e).__name__}: {e})") from None


@torch.no_grad()
def load_linears(files: dict, linears: list[FusedLinear], modules: dict[str, QuantLinear], device, dtype: torch.dtype,
                 cfg: QuantConfig | None = None, four_bit: set[str] = frozenset(), int8: set[str] = frozenset(),
                 force_dequant: bool = False, kernel_dtype: torch.dtype | None = None) -> None:
    """Fill the :class:`QuantLinear` placeholders ``modules`` from the checkpoint (``files``: name -> file):
    ``four_bit`` modules from their GPTQ/AWQ tensors (unpacked part by part, checked, fused, packed once),
    ``int8`` modules from their float ``.weight`` tensors, quantized row block by row block on ``device``
    as each tensor is read (the full-precision weight is never whole on the device).  Biases are not
    touched (they are ordinary parameters).  CheckpointError names the tensor."""
    from contextlib import ExitStack

    device = torch.device(device)
    with ExitStack() as stack:
        handles: dict = {"__stack__": stack}
        for lin in linears:
            m = modules.get(lin.module)
            if m is None or (lin.module not in four_bit and lin.module not in int8):
                continue
            if lin.module in four_bit:
                parts = []
                for p in lin.parts:
                    tensors = {f: _read(handles, files, f"{p.prefix}.{f}") for f in cfg.tensor_names()}
                    parts.append(unpack(tensors, cfg, lin.in_features, p.out_features, p.prefix))
                w = IntWeights.cat(parts, [p.prefix for p in lin.parts])
                m.set_int4(w, device, dtype, bits=cfg.bits, force_dequant=force_dequant, kernel_dtype=kernel_dtype)
            else:
                m.alloc_int8(device, dtype, kernel_dtype)
                for p in lin.parts:
                    name = f"{p.prefix}.weight"
                    t = _read(handles, files, name)
                    if not t.is_floating_point():
                        raise CheckpointError(f"tensor '{name}' has dtype {str(t.dtype).removeprefix('torch.')}, "
                                              f"expected a float type to quantize to int8")
                    m.fill_int8_rows(p.lo, p.hi, t.view(p.out_features, lin.in_features))


# ---------------------------------------------------------------- summaries

def quant_linears(module: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, QuantLinear)}


def path_summary(module: nn.Module) -> dict[str, int]:
    """Path -> number of QuantLinear layers in ``module`` that run it."""
    return dict(Counter(m.path for m in quant_linears(module).values()))


def describe_paths(paths: dict[str, int]) -> str:
    """"56 linears on torch int4pack (CPU kernel)" and so on, one clause per path."""
    return "; ".join(f"{n} linear{'s' if n != 1 else ''} on {PATH_NAMES.get(p, p)}" for p, n in sorted(paths.items()))


__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "FusedLinear", "IntWeights", "LinearPart", "QUANTIZE_CHOICES",
           "QuantConfig", "QuantLinear", "describe_paths", "load_linears", "path_summary", "quant_linears",
           "quant_targets", "quantized_in_checkpoint", "read_quant_config", "replace_linears", "unpack", "unpack_awq",
           "unpack_gptq"]
