"""Write GPTQ v1 / AWQ GEMM checkpoints from a float Qwen2.5-Omni checkpoint, independently of omnidesk.

The thinker's decoder linears (q/k/v/o, gate/up/down) are quantized round-to-nearest in groups of
input channels (the format, not GPTQ's or AWQ's search, is what the loader must read) and packed
with the formulas below, written out element by element from the published packers rather than
taken from omnidesk.models.quant:

* GPTQ v1 (AutoGPTQ ``QuantLinear.pack``): ``qweight[r, n] = sum_j q[8r + j, n] << 4j`` (int32
  [K/8, N], input channels packed, lowest bits first); ``qzeros[g, c] = sum_j (z[g, 8c + j] - 1) << 4j``
  (int32 [K/G, N/8]); ``scales`` fp16 [K/G, N]; ``g_idx`` int32 [K].  With ``desc_act`` the input
  channels are visited in a permuted order and ``g_idx[perm[j]] = j // G``.
* AWQ GEMM (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight[k, c] = sum_i q[k, 8c + ORDER[i]] << 4i``
  with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (int32 [K, N/8]); ``qzeros`` the same over the zeros
  [K/G, N] (no offset); ``scales`` fp16 [K/G, N].

Everything else is copied as transformers wrote it; q/k/v biases are stored fp16, as the quantizers
store them.  :func:`write_quantized` also returns the reference dequantization of every linear,
``(q - z) * s`` in float32 from the integers it packed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# which input each linear reads (linears reading the same input share GPTQ's act-order permutation)
INPUT_OF = {"self_attn.q_proj": "attention", "self_attn.k_proj": "attention", "self_attn.v_proj": "attention",
            "self_attn.o_proj": "o_proj", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down_proj"}


def to_int32(values: list[int]) -> torch.Tensor:
    """Unsigned 32-bit words -> int32 (two's complement), as the packers' uint32 -> int32 cast does."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q: ints [K, N] (input channel first, as GPTQ's intweight) -> int32 [K/8, N]."""
    k, n = q.shape
    words = []
    for r in range(k // 8):
        for col in range(n):
            word = 0
            for j in range(8):
                word |= int(q[8 * r + j, col]) << (4 * j)
            words.append(word)
    return to_int32(words).view(k // 8, n)


def _pack_rows(values: torch.Tensor, order=range(8), nibble=lambda v: v) -> torch.Tensor:
    """ints [R, N] -> int32 [R, N/8] along each row: word c holds ``nibble`` of value ``8c + order[i]`` at
    bits 4i..4i+3."""
    r, n = values.shape
    words = []
    for row in range(r):
        for c in range(n // 8):
            word = 0
            for i in range(8):
                word |= nibble(int(values[row, 8 * c + order[i]])) << (4 * i)
            words.append(word)
    return to_int32(words).view(r, n // 8)


def pack_gptq_qzeros(z: torch.Tensor) -> torch.Tensor:
    """z: integer zero points [G, N] -> int32 [G, N/8] storing z - 1 (masked to 4 bits: a zero of 0 is
    stored as 15, which AutoGPTQ's reader turns into 16, exactly as it reads its own files)."""
    return _pack_rows(z, nibble=lambda v: (v - 1) & 0xF)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values: ints [R, N] (rows = input channels for qweight, groups for qzeros) -> int32 [R, N/8]."""
    return _pack_rows(values, AWQ_PACK_ORDER)


def _words_to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_gptq_qweight_fast(q: torch.Tensor) -> torch.Tensor:
    """:func:`pack_gptq_qweight` vectorized (for benchmark-sized checkpoints; tested equal to the loop)."""
    k, n = q.shape
    v = q.long().view(k // 8, 8, n)
    return _words_to_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def _pack_rows_fast(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """:func:`_pack_rows` vectorized, of values already made nibbles."""
    r, n = values.shape
    v = values.view(r, n // 8, 8)
    return _words_to_int32(sum(v[:, :, order[i]] << (4 * i) for i in range(8)))


def pack_gptq_qzeros_fast(z: torch.Tensor) -> torch.Tensor:
    return _pack_rows_fast((z.long() - 1) & 0xF)


def pack_awq_fast(values: torch.Tensor) -> torch.Tensor:
    return _pack_rows_fast(values.long(), AWQ_PACK_ORDER)


def quantize_rtn(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None):
    """Round-to-nearest 4-bit of a float W [N, K] in groups of ``group`` input channels (taken in ``perm``
    order when given).  Returns q [N, K] (0..15), zeros [K/G, N], scales fp16 [K/G, N], g_idx [K]."""
    n, k = w.shape
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    groups = k // group
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    q = torch.empty(n, k, dtype=torch.int64)
    for gi in range(groups):
        cols = order[gi * group:(gi + 1) * group]
        x = w[:, cols].double()
        # GPTQ's quantizer: the range always contains 0
        xmin = torch.minimum(x.min(dim=1).values, torch.zeros(n, dtype=torch.double))
        xmax = torch.maximum(x.max(dim=1).values, torch.zeros(n, dtype=torch.double))
        if sym:
            amax = torch.maximum(xmin.abs(), xmax)
            s = (2 * amax / 15).clamp(min=1e-8)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            s = ((xmax - xmin) / 15).clamp(min=1e-8)
            z = torch.round(-xmin / s.half().double()).clamp(0, 15).long()
        s16 = s.half()
        scales[gi], zeros[gi] = s16, z
        q[:, cols] = (torch.round(x / s16.double()[:, None]) + z[:, None]).clamp(0, 15).long()
    return q, zeros, scales, g_idx


def reference_dequant(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32: ``(q - z[g]) * s[g]``, the integer difference exact, one rounding."""
    diff = (q - zeros[g_idx].T).to(torch.float32)
    return diff * scales[g_idx].T.to(torch.float32)


def write_quantized(src: Path, dst: Path, method: str, group: int = 32, sym: bool = False, desc_act: bool = False,
                    seed: int = 0, layers: list[int] | None = None, fast: bool = False) -> dict[str, torch.Tensor]:
    """Copy checkpoint ``src`` to ``dst`` with the thinker's decoder linears in ``method`` ("gptq", "awq").
    ``fast``: the vectorized packers (benchmark sizes), else the element-by-element ones.

    Returns checkpoint linear prefix -> reference dequantized weight [N, K] (float32)."""
    gptq_qweight, gptq_qzeros, awq = ((pack_gptq_qweight_fast, pack_gptq_qzeros_fast, pack_awq_fast) if fast
                                      else (pack_gptq_qweight, pack_gptq_qzeros, pack_awq))
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    n_layers = cfg["thinker_config"]["text_config"]["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    reference = {}
    for i in range(n_layers) if layers is None else layers:
        perms = {}  # act-order comes from the layer input's Hessian: q/k/v (and gate/up) read the same input
        for lin in LINEARS:
            prefix = f"thinker.model.layers.{i}.{lin}"
            w = tensors.pop(f"{prefix}.weight").float()
            k = w.shape[1]
            shared = INPUT_OF[lin]
            if desc_act and method == "gptq" and shared not in perms:
                perms[shared] = torch.randperm(k, generator=g)
            perm = perms.get(shared)
            q, z, s, g_idx = quantize_rtn(w, group, sym and method == "gptq", perm)
            reference[prefix] = reference_dequant(q, z, s, g_idx)
            if method == "gptq":
                tensors[f"{prefix}.qweight"] = gptq_qweight(q.T.contiguous())
                tensors[f"{prefix}.qzeros"] = gptq_qzeros(z)
                tensors[f"{prefix}.scales"] = s
                tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
            else:
                tensors[f"{prefix}.qweight"] = awq(q.T.contiguous())
                tensors[f"{prefix}.qzeros"] = awq(z)
                tensors[f"{prefix}.scales"] = s
            if f"{prefix}.bias" in tensors:
                tensors[f"{prefix}.bias"] = tensors[f"{prefix}.bias"].half()
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq", "lm_head": False, "true_sequential": True}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["visual", "audio_tower", "talker", "token2wav"]}
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return reference


__all__ = ["AWQ_PACK_ORDER", "LINEARS", "pack_awq", "pack_awq_fast", "pack_gptq_qweight", "pack_gptq_qweight_fast",
           "pack_gptq_qzeros", "pack_gptq_qzeros_fast", "quantize_rtn", "reference_dequant", "to_int32",
           "write_quantized"]
