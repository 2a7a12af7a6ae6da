"""Weight-only quantized linear layers, family-neutral: 4-bit GPTQ / AWQ checkpoints, and int8 made on load.

One module, :class:`QuantLinear`, replaces an ``nn.Linear`` wherever a family wants it (the
Qwen2.5-Omni thinker's decoder linears today; Qwen3-Omni community 4-bit checkpoints and Moshi's
int8 can use the same constructors).  It is built from

* :meth:`QuantLinear.from_gptq` / :meth:`QuantLinear.from_awq`: the packed tensors of one linear as
  a GPTQ v1 / AWQ GEMM checkpoint stores them;
* :meth:`QuantLinear.from_int4`: the unpacked integer form (:class:`IntWeights`), which is what
  fused projections are built from (q/k/v and gate/up are unpacked, checked and concatenated
  along the output dimension, then packed once for the kernel);
* :meth:`QuantLinear.from_float`: a float weight, quantized to int8 per output channel.

The on-disk formats (checked against the public code that writes and reads them):

* GPTQ v1 (AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda.py`` ``pack``/``forward``, also what
  GPTQModel saves with ``checkpoint_format: gptq``): ``qweight`` int32 [K/8, N], eight 4-bit values
  of consecutive input channels per int32, lowest bits first (``qweight[r] |= w[8r+j] << 4j``);
  ``qzeros`` int32 [K/G, N/8], packed the same way along N and storing ``zero - 1`` (the reader adds
  1 back: ``zeros = (qzeros >> 4j) & 0xF; zeros = zeros + 1``); ``scales`` fp16 [K/G, N]; ``g_idx``
  int32 [K], the group of each input channel (a permutation of ``k // G`` with ``desc_act``);
  ``W[n, k] = scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n])``.  ``checkpoint_format:
  gptq_v2`` (GPTQModel's internal form) stores the zero without the -1.
* AWQ GEMM (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``; the readers'
  ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]`` in vLLM's awq tests and transformers' AWQ
  integration): ``qweight`` int32 [K, N/8], packed along N, nibble ``i`` of packed column ``c``
  holding output column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros`` int32 [K/G, N/8], same
  packing, the zero itself (no offset); ``scales`` fp16 [K/G, N]; ``W = scales * (q - zeros)``.

Matmul paths (:attr:`QuantLinear.path`, said in the load log and ``models list``):

* ``int4pack_cpu``: core torch's ``_convert_weight_to_int4pack_for_cpu`` (int32 [N, K] values
  0..15) + ``_weight_int4pack_mm_for_cpu``; group sizes 32/64/128/256, N a multiple of 16
  (measured on torch 2.13 CPU).
* ``int4pack_cuda``: ``_convert_weight_to_int4pack`` (uint8 [N, K/2], ``q[:, ::2] << 4 | q[:, 1::2]``,
  as pytorch's test_linalg ``_group_quantize_tensor`` packs it for CUDA) + ``_weight_int4pack_mm``
  with bfloat16 activations; group sizes 32/64/128/256, N % 8 == 0, K % 32 == 0.
* Both take ``scales_and_zeros`` [K/G, N, 2] and dequantize ``(q - 8) * scale + zero`` with the zero
  in the float domain (pytorch test_linalg ``_group_quantize_tensor``: ``zeros = min_val + scales *
  2**(n_bit - 1)``).  An integer zero point ``z`` is therefore ``zero = (8 - z) * scale``, since
  ``(q - z) * s = (q - 8) * s + (8 - z) * s``.
* ``desc_act`` (``g_idx`` not ``k // G``): the input channels are sorted by group (a stable argsort
  of ``g_idx``), the weight is packed in that order and every activation is permuted the same way
  (``index_select``) before the kernel; where sorting does not make the groups contiguous and
  equal-sized, the layer dequantizes instead.
* ``int8pack``: ``_weight_int8pack_mm`` (int8 [N, K], per-row scales in the activation dtype).
* The kernels run with bfloat16 activations (and keep their scales in bfloat16) whatever the model's
  dtype, the result cast back: the CUDA int4 kernel takes nothing else, and on the CPU (torch 2.13,
  AMD EPYC with AVX512-BF16, 2 threads, bench/decode.py --quant --size medium) the float32 variants
  are naive: a decode step took 44 ms (int4) / 20 ms (int8) with float32 activations against 2.4 /
  3.6 ms with bfloat16, and float32 11.7 ms; a 64-token prefill 2.7 s / 1.6 s against 33 / 38 ms.
  The rounding this adds (activations and scales to 8 mantissa bits) is small next to the 4-bit
  step; ``kernel_dtype=torch.float32`` keeps float32 (exact to float32 rounding, for checks).
* ``dequant`` / ``dequant_int8``: the fallback where a kernel is missing or the shapes do not fit
  it: the packed weight stays packed in memory and is dequantized for each matmul (slow, but the
  memory saving holds).

Which kernels this torch has on a device is probed once per (device, dtype) on a small matrix
whose result is compared with the dequantized matmul; a kernel that raises or disagrees is not used.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError, ConfigError

log = logging.getLogger("omnidesk.models.quant")

SUPPORTED_BITS = (4,)
INT4PACK_GROUPS = (32, 64, 128, 256)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed AWQ column holds output column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j sits in nibble AWQ_REVERSE_ORDER[j]
QUANTIZE_CHOICES = ("none", "int8")  # what --quantize accepts (4-bit comes from the checkpoint)

PATH_NAMES = {
    "int4pack_cpu": "torch int4pack (CPU kernel)",
    "int4pack_cuda": "torch int4pack (CUDA kernel)",
    "int8pack": "torch int8pack",
    "dequant": "dequantize-then-matmul (no fast kernel for these shapes/device)",
    "dequant_int8": "dequantize-then-matmul (no int8 kernel for these shapes/device)",
}


# ---------------------------------------------------------------- the checkpoint's quantization_config

@dataclass(frozen=True)
class QuantConfig:
    """A 4-bit checkpoint's ``quantization_config`` (what the loader needs of it)."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over all input channels
    desc_act: bool = False  # GPTQ act-order: g_idx is a permutation of k // group_size
    sym: bool = True  # GPTQ: symmetric (zero = 8); the format is the same either way
    zero_offset: int = 0  # added to the stored zero: 1 for GPTQ v1, 0 for GPTQ v2 and AWQ
    checkpoint_format: str = ""

    @property
    def label(self) -> str:
        """What a person calls it: "GPTQ int4", "AWQ int4"."""
        return f"{self.method.upper()} int{self.bits}"

    def group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0) else self.group_size

    def tensor_names(self) -> tuple[str, ...]:
        """The tensors one quantized linear stores (besides its bias)."""
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")

    def expected_shapes(self, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
        """Field -> shape of one linear [out_features, in_features] in this format."""
        k, n, g = in_features, out_features, self.group(in_features)
        per = 32 // self.bits
        groups = -(-k // g)
        if self.method == "gptq":
            return {"qweight": (k // per, n), "qzeros": (groups, n // per), "scales": (groups, n), "g_idx": (k,)}
        return {"qweight": (k, n // per), "qzeros": (groups, n // per), "scales": (groups, n)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "quantization_config") -> "QuantConfig":
        """ConfigError naming the field for anything but 4-bit GPTQ (v1/v2) or 4-bit AWQ GEMM with zero point."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(d).__name__}")
        method = str(d.get("quant_method") or "").lower()
        if not method:
            raise ConfigError(f"{where}: missing field 'quant_method' (expected 'gptq' or 'awq')")
        if method not in ("gptq", "awq"):
            raise ConfigError(f"{where}.quant_method is '{method}': not supported (OmniDesk reads 4-bit 'gptq' "
                              f"and 'awq' checkpoints; or load a bf16/fp16 checkpoint with --quantize int8)")
        bits_key = "bits" if "bits" in d or method == "gptq" else "w_bit"
        bits = d.get(bits_key, d.get("w_bit"))
        if bits is None:
            raise ConfigError(f"{where}: missing field 'bits'")
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
            raise ConfigError(f"{where}.{bits_key} is {bits!r}: only 4-bit {method.upper()} checkpoints are "
                              f"supported")
        group = d.get("group_size", d.get("q_group_size"))
        if group is None:
            raise ConfigError(f"{where}: missing field 'group_size'")
        if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
            raise ConfigError(f"{where}.group_size is {group!r}: expected a positive integer or -1")
        if method == "gptq":
            fmt = str(d.get("checkpoint_format") or "gptq").lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ConfigError(f"{where}.checkpoint_format is '{fmt}': not supported (only 'gptq', the v1 "
                                  f"format published checkpoints use, and 'gptq_v2')")
            if d.get("lm_head"):
                raise ConfigError(f"{where}.lm_head is true: a quantized lm_head is not supported")
            pack = str(d.get("pack_dtype") or "int32").removeprefix("torch.")
            if pack != "int32":
                raise ConfigError(f"{where}.pack_dtype is '{pack}': only int32 packing is supported")
            return cls("gptq", bits, group, desc_act=bool(d.get("desc_act", False)), sym=bool(d.get("sym", True)),
                       zero_offset=1 if fmt == "gptq" else 0, checkpoint_format=fmt)
        version = str(d.get("version") or "gemm").lower()
        if version != "gemm":
            raise ConfigError(f"{where}.version is '{version}': only AWQ 'gemm' checkpoints are supported")
        if not d.get("zero_point", True):
            raise ConfigError(f"{where}.zero_point is false: only AWQ with zero point is supported")
        return cls("awq", bits, group, sym=False, zero_offset=0, checkpoint_format="gemm")


def read_quant_config(raw: dict, where: str = "config.json", extra: dict | None = None,
                      extra_where: str = "quantize_config.json") -> QuantConfig | None:
    """The ``quantization_config`` of a config.json (top level, else inside ``thinker_config``), else
    ``extra`` (a separate quantize_config.json, named ``extra_where`` in errors); None for an unquantized
    checkpoint."""
    for d, path in ((raw.get("quantization_config"), "quantization_config"),
                    ((raw.get("thinker_config") or {}).get("quantization_config"), "thinker_config.quantization_config")):
        if d is not None:
            return QuantConfig.from_dict(d, f"{where}: {path}")
    if extra is not None:
        return QuantConfig.from_dict(extra, extra_where)
    return None


# ---------------------------------------------------------------- unpacking

def _unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R * 32/bits, C]: row ``r*per + j`` = bits ``[bits*j, bits*(j+1))`` of row r."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_along_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R, C * 32/bits]: column ``c*per + j`` = bits ``[bits*j, bits*(j+1))`` of column c."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def _awq_logical_order(unpacked: torch.Tensor) -> torch.Tensor:
    """Columns of an AWQ-packed tensor unpacked in nibble order -> output-column order."""
    cols = unpacked.shape[-1]
    idx = torch.arange(cols, device=unpacked.device).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    return unpacked[:, idx]


@dataclass
class IntWeights:
    """One linear's 4-bit weight, unpacked: ``W[n, k] = (q[n, k] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    zeros: torch.Tensor  # int16 [groups, N], the integer zero point (GPTQ v1's +1 already applied)
    scales: torch.Tensor  # float [groups, N], as stored (fp16 in the published files)
    g_idx: torch.Tensor  # int64 [K], the group of each input channel

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in ``dtype``: ``(q - z) * s`` with the integer difference exact, one rounding for the product."""
        g = self.g_idx.long()
        diff = self.q.to(torch.int16) - self.zeros[g].T
        return (diff.to(torch.float32) * self.scales[g].T.to(torch.float32)).to(dtype)

    @staticmethod
    def cat(parts: list["IntWeights"], names: list[str]) -> "IntWeights":
        """Concatenate along the output dimension (fused q/k/v, gate/up); the parts must share ``g_idx``."""
        if len(parts) == 1:
            return parts[0]
        for p, name in zip(parts[1:], names[1:]):
            if p.g_idx.shape != parts[0].g_idx.shape or not torch.equal(p.g_idx, parts[0].g_idx):
                raise CheckpointError(f"tensor '{name}.g_idx' differs from '{names[0]}.g_idx': these projections "
                                      f"are fused into one matmul, which needs the same input-channel groups")
            if p.scales.shape[0] != parts[0].scales.shape[0]:
                raise CheckpointError(f"tensor '{name}.scales' has {p.scales.shape[0]} groups, '{names[0]}.scales' "
                                      f"{parts[0].scales.shape[0]}")
        return IntWeights(torch.cat([p.q for p in parts], 0), torch.cat([p.zeros for p in parts], 1),
                          torch.cat([p.scales for p in parts], 1), parts[0].g_idx)


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        raise CheckpointError(f"tensor '{name}' has dtype {str(t.dtype).removeprefix('torch.')}, expected {what}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                cfg: QuantConfig, in_features: int, out_features: int, name: str = "") -> IntWeights:
    """GPTQ tensors of one linear -> :class:`IntWeights` (CheckpointError naming ``name.<field>``)."""
    shapes = cfg.expected_shapes(in_features, out_features)
    for field_, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
        _check_shape(f"{name}.{field_}", t, shapes[field_])
    _check_dtype(f"{name}.qweight", qweight, (torch.int32,), "int32 (I32)")
    _check_dtype(f"{name}.qzeros", qzeros, (torch.int32,), "int32 (I32)")
    _check_dtype(f"{name}.g_idx", g_idx, (torch.int32, torch.int64), "int32 (I32)")
    _check_dtype(f"{name}.scales", scales, (torch.float16, torch.bfloat16, torch.float32), "a float type")
    groups = scales.shape[0]
    g = g_idx.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise CheckpointError(f"tensor '{name}.g_idx' holds group {int(g.min()) if int(g.min()) < 0 else int(g.max())}"
                              f", outside 0..{groups - 1}")
    q = _unpack_along_rows(qweight, cfg.bits).T.to(torch.uint8).contiguous()  # [N, K]
    zeros = _unpack_along_cols(qzeros, cfg.bits).to(torch.int16) + cfg.zero_offset
    return IntWeights(q, zeros, scales, g)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, cfg: QuantConfig,
               in_features: int, out_features: int, name: str = "") -> IntWeights:
    """AWQ GEMM tensors of one linear -> :class:`IntWeights` (CheckpointError naming ``name.<field>``)."""
    shapes = cfg.expected_shapes(in_features, out_features)
    for field_, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        _check_shape(f"{name}.{field_}", t, shapes[field_])
    _check_dtype(f"{name}.qweight", qweight, (torch.int32,), "int32 (I32)")
    _check_dtype(f"{name}.qzeros", qzeros, (torch.int32,), "int32 (I32)")
    _check_dtype(f"{name}.scales", scales, (torch.float16, torch.bfloat16, torch.float32), "a float type")
    q = _awq_logical_order(_unpack_along_cols(qweight, cfg.bits)).T.to(torch.uint8).contiguous()  # [N, K]
    zeros = _awq_logical_order(_unpack_along_cols(qzeros, cfg.bits)).to(torch.int16) + cfg.zero_offset
    g = torch.arange(in_features, device=qweight.device) // cfg.group(in_features)
    return IntWeights(q, zeros, scales, g)


def unpack(tensors: dict[str, torch.Tensor], cfg: QuantConfig, in_features: int, out_features: int,
           name: str = "") -> IntWeights:
    """A linear's checkpoint tensors (field -> tensor) in ``cfg``'s format -> :class:`IntWeights`."""
    missing = [f for f in cfg.tensor_names() if f not in tensors]
    if missing:
        raise CheckpointError("missing weights: " + ", ".join(f"{name}.{f}" for f in missing))
    if cfg.method == "gptq":
        return unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], cfg,
                           in_features, out_features, name)
    return unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], cfg, in_features, out_features, name)


# ---------------------------------------------------------------- kernels available here

_PROBED: dict[tuple[str, str, str], str | None] = {}


def _int4pack_reason(device: torch.device, n: int, k: int, group: int | None) -> str | None:
    """Why the int4pack kernel cannot take a [n, k] weight with this group size here (None: it can)."""
    if device.type not in ("cpu", "cuda"):
        return f"no int4pack kernel on {device.type}"
    if group not in INT4PACK_GROUPS:
        return f"group size {group} (the kernel takes {', '.join(map(str, INT4PACK_GROUPS))})"
    if k % group:
        return f"in_features {k} is not a multiple of the group size {group}"
    if device.type == "cpu" and n % 16:
        return f"out_features {n} is not a multiple of 16"
    if device.type == "cuda" and (n % 8 or k % 32):
        return f"out_features {n} not a multiple of 8 or in_features {k} not a multiple of 32"
    return None


def _int8pack_reason(k: int) -> str | None:
    """Why the int8pack kernel cannot take in_features ``k`` (None: it can).  On torch 2.13's CPU the bfloat16
    kernel returns garbage (M = 1) or crashes (M > 1) when K is not a multiple of 16 (measured: K = 328, 344,
    360 fail; 16, 48, 336, 352 are right); the same guard is kept on CUDA, where it was not measured."""
    return None if k % 16 == 0 else f"in_features {k} is not a multiple of 16"


def _inner_k_tiles(k: int) -> int:
    return 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2


def _pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> the kernel's packed weight on ``device``."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device=device, dtype=torch.int32).contiguous(),
                                                                  _inner_k_tiles(q.shape[1]))
    q = q.to(device)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(packed, _inner_k_tiles(q.shape[1]))


KERNEL_DTYPE = torch.bfloat16  # see the module doc: the CUDA int4 kernel's only dtype, the CPU kernels' fast one


def _kernel_dtype(device: torch.device, override: torch.dtype | None = None) -> torch.dtype:
    """The activation (and scale) dtype the int4pack / int8pack kernels run in: bfloat16 unless overridden
    (on the CPU only: the CUDA int4 kernel takes nothing else)."""
    return override if override is not None and device.type == "cpu" else KERNEL_DTYPE


def _scales_and_zeros(w: IntWeights, dtype: torch.dtype, device: torch.device, bits: int = 4) -> torch.Tensor:
    """[groups, N, 2]: (scale, float zero) with ``zero = (2**(bits-1) - z) * scale`` (see the module doc)."""
    s = w.scales.to(device=device, dtype=torch.float32)
    z = w.zeros.to(device=device, dtype=torch.float32)
    return torch.stack([s, (float(1 << (bits - 1)) - z) * s], dim=2).to(dtype).contiguous()


def _probe(kind: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when this torch's ``kind`` kernel ("int4pack", "int8pack") works on ``device`` for ``dtype``
    activations (the kernel dtype) and agrees with the dequantized matmul on a small matrix; else why not."""
    key = (kind, str(device), str(dtype))
    if key in _PROBED:
        return _PROBED[key]
    g = torch.Generator().manual_seed(0)
    n, k = 64, 256
    x = torch.randn(3, k, generator=g)
    reason = None
    try:
        if kind == "int4pack":
            w = IntWeights(torch.randint(0, 16, (n, k), generator=g).to(torch.uint8),
                           torch.randint(0, 16, (k // 32, n), generator=g).to(torch.int16),
                           (torch.rand(k // 32, n, generator=g) * 0.02 + 0.005).half(), torch.arange(k) // 32)
            packed = _pack_int4(w.q, device)
            sz = _scales_and_zeros(w, dtype, device)
            op = torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu" else torch.ops.aten._weight_int4pack_mm
            y = op(x.to(device=device, dtype=dtype), packed, 32, sz).float().cpu()
            ref = x.to(dtype).float() @ w.dequantize().T
        else:
            w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            s = (torch.rand(n, generator=g) * 0.01 + 0.001).to(dtype)
            y = torch.ops.aten._weight_int8pack_mm(x.to(device=device, dtype=dtype), w8.to(device),
                                                   s.to(device)).float().cpu()
            ref = x.to(dtype).float() @ (w8.float() * s.float()[:, None]).T
        err = (y - ref).abs().max().item()
        scale = ref.abs().max().item()
        if not err <= 0.05 * scale:
            reason = f"the {kind} kernel disagrees with the dequantized matmul (max error {err:.3g} of {scale:.3g})"
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        reason = f"the {kind} kernel is not available here ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    _PROBED[key] = reason
    if reason:
        log.info("%s on %s/%s: %s", kind, device, dtype, reason)
    return reason


# ---------------------------------------------------------------- the layer

class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W stored weight-only quantized (4-bit or int8); see the module doc.

    Built empty (:meth:`placeholder`, so a meta model can hold it) and filled by :meth:`set_int4` or
    :meth:`alloc_int8` + :meth:`fill_int8_rows`, or directly by the ``from_*`` constructors.  ``bias`` is an ordinary float
    parameter, so the loaders fill it like any other tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) \
            if bias else None
        self.kind: str | None = None  # "int4" or "int8" once filled
        self.path: str | None = None  # see PATH_NAMES
        self.reason: str | None = None  # why a dequant path runs
        self.group_size: int | None = None
        self.dtype: torch.dtype = dtype or torch.float32  # activations' dtype (the run dtype)
        self.kernel_dtype: torch.dtype | None = None  # what the int4pack / int8pack kernel computes in
        self._regular = False  # dequant path: g_idx is k // group_size (broadcast, no gather)

    @classmethod
    def placeholder(cls, linear: nn.Linear) -> "QuantLinear":
        """An unfilled QuantLinear with ``linear``'s sizes and bias (on ``linear``'s device, e.g. meta)."""
        w = linear.weight
        return cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device, dtype=w.dtype)

    # -------------------------------------------------------------- filling

    def _reset(self) -> None:
        for name in ("qweight", "scales_and_zeros", "perm", "q_packed", "scales", "zeros", "g_idx", "weight_int8",
                     "weight_scales"):
            if name in self._buffers:
                del self._buffers[name]

    @torch.no_grad()
    def set_int4(self, w: IntWeights, device: torch.device | str, dtype: torch.dtype, bits: int = 4,
                 force_dequant: bool = False, kernel_dtype: torch.dtype | None = None) -> "QuantLinear":
        """Store ``w`` for the fastest 4-bit path this device and these shapes allow (``kernel_dtype``: see
        the module doc; ``force_dequant``: the dequantize path whatever the kernels)."""
        device = torch.device(device)
        kd = _kernel_dtype(device, kernel_dtype)
        n, k = w.q.shape
        if (n, k) != (self.out_features, self.in_features):
            raise CheckpointError(f"4-bit weight of shape [{n}, {k}] for a linear [{self.out_features}, "
                                  f"{self.in_features}]")
        self._reset()
        self.kind, self.dtype = "int4", dtype
        groups = w.scales.shape[0]
        group = k // groups if k % groups == 0 else None
        g = w.g_idx.to(torch.int64).cpu()
        perm = None
        regular = torch.arange(k) // group if group else None
        reason = None
        if regular is None:
            reason = f"{groups} groups do not divide in_features {k}"
        elif not torch.equal(g, regular):
            perm = torch.argsort(g, stable=True)
            if not torch.equal(g[perm], regular):
                reason = "input-channel groups of unequal sizes (g_idx)"
        if reason is None and force_dequant:
            reason = "asked for"
        if reason is None:
            reason = _int4pack_reason(device, n, k, group) or _probe("int4pack", device, kd)
        self.group_size = group
        if reason is None:
            q = w.q if perm is None else w.q[:, perm.to(w.q.device)]
            self.register_buffer("qweight", _pack_int4(q, device))
            self.register_buffer("scales_and_zeros", _scales_and_zeros(w, kd, device, bits))
            self.register_buffer("perm", None if perm is None else perm.to(device))
            self.path, self.reason, self.kernel_dtype = f"int4pack_{device.type}", None, kd
        else:
            q = w.q.to(device)
            if k % 2:
                q = F.pad(q, (0, 1))
            self.register_buffer("q_packed", ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous())
            self.register_buffer("scales", w.scales.to(device=device, dtype=dtype).contiguous())
            self.register_buffer("zeros", w.zeros.to(device=device, dtype=dtype).contiguous())
            self.register_buffer("g_idx", g.to(device=device, dtype=torch.int32))
            self._regular = regular is not None and torch.equal(g, regular)
            self.path, self.reason, self.kernel_dtype = "dequant", reason, None
        return self

    @torch.no_grad()
    def alloc_int8(self, device: torch.device | str, dtype: torch.dtype,
                   kernel_dtype: torch.dtype | None = None) -> "QuantLinear":
        """Empty int8 storage, to be filled row block by row block (:meth:`fill_int8_rows`); the scales are
        kept in the kernel's dtype (see the module doc)."""
        device = torch.device(device)
        self._reset()
        kd = _kernel_dtype(device, kernel_dtype)
        self.kind, self.dtype, self.group_size, self.kernel_dtype = "int8", dtype, None, kd
        self.register_buffer("weight_int8", torch.zeros(self.out_features, self.in_features, dtype=torch.int8,
                                                        device=device))
        self.register_buffer("weight_scales", torch.ones(self.out_features, dtype=kd, device=device))
        reason = _int8pack_reason(self.in_features) or _probe("int8pack", device, kd)
        self.path, self.reason = ("int8pack", None) if reason is None else ("dequant_int8", reason)
        return self

    @torch.no_grad()
    def fill_int8_rows(self, lo: int, hi: int, weight: torch.Tensor, chunk_rows: int = 4096) -> None:
        """Quantize float rows ``[lo, hi)`` of W (per output channel, symmetric) into the int8 storage.

        The work happens on the storage's device in float32, ``chunk_rows`` rows at a time, so at most
        one chunk of full precision exists there at once."""
        dest, scales = self.weight_int8, self.weight_scales
        if tuple(weight.shape) != (hi - lo, self.in_features):
            raise CheckpointError(f"weight of shape {list(weight.shape)} for rows {lo}..{hi} of a linear "
                                  f"[{self.out_features}, {self.in_features}]")
        for a in range(0, hi - lo, chunk_rows):
            b = min(a + chunk_rows, hi - lo)
            q, s = quantize_int8(weight[a:b].to(device=dest.device), scales.dtype)
            dest[lo + a:lo + b].copy_(q)
            scales[lo + a:lo + b].copy_(s)

    # -------------------------------------------------------------- constructors

    @classmethod
    def from_int4(cls, w: IntWeights, bias: torch.Tensor | None, device, dtype: torch.dtype,
                  force_dequant: bool = False, kernel_dtype: torch.dtype | None = None) -> "QuantLinear":
        m = cls(w.in_features, w.out_features, bias is not None, device=device, dtype=dtype)
        if bias is not None:
            m.bias.copy_(bias)
        return m.set_int4(w, device, dtype, force_dequant=force_dequant, kernel_dtype=kernel_dtype)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx, cfg: QuantConfig, bias=None, device="cpu",
                  dtype: torch.dtype = torch.float32, name: str = "") -> "QuantLinear":
        n = qweight.shape[1]
        k = g_idx.shape[0]
        return cls.from_int4(unpack_gptq(qweight, qzeros, scales, g_idx, cfg, k, n, name), bias, device, dtype)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, cfg: QuantConfig, bias=None, device="cpu",
                 dtype: torch.dtype = torch.float32, name: str = "") -> "QuantLinear":
        k, n = qweight.shape[0], qweight.shape[1] * (32 // cfg.bits)
        return cls.from_int4(unpack_awq(qweight, qzeros, scales, cfg, k, n, name), bias, device, dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, device=None,
                   dtype: torch.dtype | None = None, mode: str = "int8",
                   kernel_dtype: torch.dtype | None = None) -> "QuantLinear":
        """int8 per output channel of a float weight [N, K] (``mode`` "int8"; 4-bit needs a GPTQ/AWQ checkpoint)."""
        if mode != "int8":
            raise ValueError(f"quantize mode '{mode}': only 'int8' is made from float weights")
        device = torch.device(device or weight.device)
        dtype = dtype or weight.dtype
        n, k = weight.shape
        m = cls(k, n, bias is not None, device=device, dtype=dtype)
        if bias is not None:
            m.bias.copy_(bias)
        m.alloc_int8(device, dtype, kernel_dtype)
        m.fill_int8_rows(0, n, weight)
        return m

    # -------------------------------------------------------------- use

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] as the matmul sees it (for checks; the int4pack path is read back through the kernel)."""
        if self.path in ("int8pack", "dequant_int8"):
            return (self.weight_int8.float() * self.weight_scales.float()[:, None]).to(dtype)
        if self.path == "dequant":
            return self._dequant4(torch.float32).to(dtype)
        eye = torch.eye(self.in_features, device=self.qweight.device, dtype=self.dtype)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).T.to(dtype).contiguous()
        finally:
            self.bias = bias

    def _dequant4(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = torch.stack([self.q_packed >> 4, self.q_packed & 0xF], dim=-1).reshape(n, -1)[:, :k].to(dtype)
        groups = self.scales.shape[0]
        if self.group_size is not None and self.group_size * groups == k and self._regular:
            # groups are contiguous runs of group_size channels: broadcast instead of gathering per channel
            q = q.view(n, groups, self.group_size)
            return ((q - self.zeros.T.to(dtype)[:, :, None]) * self.scales.T.to(dtype)[:, :, None]).view(n, k)
        g = self.g_idx.long()
        return (q - self.zeros[g].T.to(dtype)) * self.scales[g].T.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        path = self.path
        if path == "int4pack_cpu" or path == "int4pack_cuda":
            if self.perm is not None:
                x2 = x2.index_select(1, self.perm)
            op = torch.ops.aten._weight_int4pack_mm_for_cpu if path == "int4pack_cpu" else \
                torch.ops.aten._weight_int4pack_mm
            y = op(x2.to(self.kernel_dtype).contiguous(), self.qweight, self.group_size,
                   self.scales_and_zeros).to(x.dtype)
        elif path == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(self.kernel_dtype).contiguous(), self.weight_int8,
                                                   self.weight_scales).to(x.dtype)
        elif path == "dequant":
            y = F.linear(x2, self._dequant4(x.dtype))
        elif path == "dequant_int8":
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * self.weight_scales.to(x.dtype)
        else:
            raise RuntimeError("QuantLinear used before its weights were loaded")
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kind={self.kind}, path={self.path}" + (f", group_size={self.group_size}" if self.group_size else "")
                + (f", kernel_dtype={str(self.kernel_dtype).removeprefix('torch.')}" if self.kernel_dtype else ""))


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a float [R, K]: (int8 [R, K], scales [R] in ``scale_dtype``).

    The scale is rounded to ``scale_dtype`` first and the weight quantized with the rounded scale, so
    ``q * scale`` is the weight the matmul uses, within half a step."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1)
    s = (amax / 127.0).to(scale_dtype).to(torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, s.to(scale_dtype)


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


__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "FusedLinear", "INT4PACK_GROUPS", "IntWeights", "LinearPart",
           "PATH_NAMES", "QUANTIZE_CHOICES", "QuantConfig", "QuantLinear", "describe_paths", "load_linears",
           "path_summary", "quant_linears", "quant_targets", "quantize_int8", "quantized_in_checkpoint",
           "read_quant_config", "replace_linears", "unpack", "unpack_awq", "unpack_gptq"]
