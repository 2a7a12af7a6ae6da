"""The 4-bit checkpoint formats: a checkpoint's ``quantization_config`` and the unpacking of one
linear's GPTQ / AWQ tensors into :class:`IntWeights`, the integer form a
:class:`~omnidesk.models.quant_linear.QuantLinear` is built from (every tensor checked, and named in errors).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import CheckpointError, ConfigError

SUPPORTED_BITS = (4,)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed AWQ column holds output column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column j sits in nibble AWQ_REVERSE_ORDER[j]


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
