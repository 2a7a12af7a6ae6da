"""The quantized linear layer and the torch kernels it runs: :class:`QuantLinear` stores one linear's
weight 4-bit (from :class:`~omnidesk.models.quant_format.IntWeights`) or int8 (quantized from a float
weight, row block by row block) and multiplies by it on the fastest path this torch and device allow.

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

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError
from .quant_format import IntWeights, QuantConfig, unpack_awq, unpack_gptq

log = logging.getLogger("omnidesk.models.quant")

INT4PACK_GROUPS = (32, 64, 128, 256)

PATH_NAMES = {
    "int4pack_cpu": "torch int4pack (CPU kernel)",
    "int4pack_cuda": "torch int4pack (CUDA kernel)",
    "int8pack": "torch int8pack",
    "dequant": "dequantize-then-matmul (no fast kernel for these shapes/device)",
    "dequant_int8": "dequantize-then-matmul (no int8 kernel for these shapes/device)",
}


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
