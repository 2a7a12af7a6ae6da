"""4-bit GPTQ / AWQ checkpoints and int8 on load (omnidesk/models/quant.py through the Qwen2.5-Omni loader).

The 4-bit checkpoints are tests/quant_writer.py's: transformers' tiny checkpoints with the thinker's
decoder linears quantized and packed by an independent, element-by-element writer, whose packing
is itself checked on hand-made values here.  Tolerances (float32 on the CPU):

* unpacked weights: equal to the writer's dequantization exactly (``torch.equal``);
* thinker logits with the quantized linears vs the same model with the writer's dequantized float32
  weights in plain ``nn.Linear``: with the kernels in float32 (``kernel_dtype=torch.float32``) max
  |diff| <= 1e-4 (the int4pack kernel adds its float zero ``(8 - z) * s`` instead of subtracting the
  integer zero: float32 rounding, measured ~1e-6); as shipped (kernels in bfloat16: activations and
  scales rounded to bfloat16) max |diff| <= 0.03 (measured 0.004-0.008, the logits spanning about
  +-1; float32 kernels: 2e-7-7e-7);
  greedy ids equal over 20 decode steps either way;
* int8 on load vs the float32 model: max |logit diff| <= 0.05 (measured 0.010 / 0.015 on variants
  a / b); vs the bfloat16 model, the same bound (measured 0.012 / 0.019);
* memory estimate vs the bytes of the loaded weight tensors: within 5 %.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import quant_writer
from support import damageable_copy
from omnidesk.models.checkpoint import CheckpointError, ConfigError
from omnidesk.models.quant import (AWQ_ORDER, AWQ_REVERSE_ORDER, IntWeights, QuantConfig, QuantLinear, quant_linears,
                                   read_quant_config, unpack, unpack_awq, unpack_gptq)
from omnidesk.models.qwen2_5_omni.loading import checkpoint_quantization, load_stack, quantizable_linears

IDS = torch.tensor([1, 5, 42, 100, 300, 519])
LOGIT_TOL = 1e-4  # kernels in float32
BF16_KERNEL_TOL = 0.03  # kernels in bfloat16 (the default)
INT8_TOL = 0.05

# name -> (tiny variant, writer options)
KINDS = {
    "gptq": ("a", dict(method="gptq", group=32, sym=True)),  # as the published GPTQ-Int4: sym, no act-order
    "gptq-act-order": ("b", dict(method="gptq", group=32, sym=False, desc_act=True)),
    "awq": ("a", dict(method="awq", group=64)),
    "awq-b": ("b", dict(method="awq", group=32)),
    "gptq-group16": ("a", dict(method="gptq", group=16, sym=False)),  # no int4pack kernel: dequantize path
}


@pytest.fixture(scope="session")
def quantized(tiny_checkpoints, tmp_path_factory):
    """kind -> (checkpoint dir, {checkpoint linear prefix: reference dequantized weight}); written once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            variant, options = KINDS[kind]
            src, _ = tiny_checkpoints(variant)
            dst = tmp_path_factory.mktemp("quant") / kind
            cache[kind] = (dst, quant_writer.write_quantized(src, dst, **options))
        return cache[kind]

    return get


@pytest.fixture
def gptq_copy(quantized, tmp_path):
    """A private, damageable copy of the GPTQ checkpoint."""
    return damageable_copy(quantized("gptq")[0], tmp_path / "gptq")


@torch.inference_mode()
def thinker_logits(stack, ids=IDS) -> torch.Tensor:
    thinker = stack.thinker
    cache = thinker.new_cache(len(ids) + 4)
    return thinker.logits(thinker(thinker.embed(ids), cache))


@torch.inference_mode()
def greedy_ids(stack, steps: int = 20) -> list[int]:
    thinker = stack.thinker
    cache = thinker.new_cache(len(IDS) + steps + 1)
    tok = int(thinker.logits(thinker(thinker.embed(IDS), cache)[-1]).argmax())
    out = [tok]
    for _ in range(steps):
        tok = int(thinker.logits(thinker(thinker.embed(torch.tensor([tok])), cache)[-1]).argmax())
        out.append(tok)
    return out


def with_reference_linears(stack, reference: dict[str, torch.Tensor]):
    """``stack`` with every QuantLinear replaced by an nn.Linear holding the writer's dequantized weights
    (fused as our modules fuse them) and the same bias."""
    linears = {lin.module: lin for lin in quantizable_linears(stack.config)}
    for name, m in quant_linears(stack.model).items():
        w = torch.cat([reference[p.prefix] for p in linears[name].parts], 0)
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(w)
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        parent, _, attr = name.rpartition(".")
        setattr(stack.model.get_submodule(parent), attr, lin)
    return stack


def _rewrite(root: Path, edit) -> None:
    tensors = load_file(root / "model.safetensors")
    edit(tensors)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})


def _edit_config(root: Path, edit) -> None:
    cfg = json.loads((root / "config.json").read_text())
    edit(cfg["quantization_config"])
    (root / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------- the packing, on hand-made values

# A 16 x 8 matrix of known 4-bit values: input channel k, output column n holds (k + 1 + n) % 16.
HAND = torch.tensor([[(k + 1 + n) % 16 for n in range(8)] for k in range(16)])  # [K=16, N=8]


def test_gptq_packing_of_hand_made_values():
    packed = quant_writer.pack_gptq_qweight(HAND)
    assert packed.shape == (2, 8) and packed.dtype == torch.int32
    # column 0: channels 0..7 hold 1..8, lowest bits first -> 0x87654321; channels 8..15 hold 9..15, 0
    assert packed[0, 0].item() == 0x87654321 - 2**32
    assert packed[1, 0].item() == 0x0FEDCBA9
    assert packed[0, 1].item() == 0x98765432 - 2**32  # column 1: 2..9
    zeros = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])  # stored as zero - 1, lowest bits first
    qzeros = quant_writer.pack_gptq_qzeros(zeros)
    assert qzeros.tolist() == [[0x76543210]]
    # ours unpacks both back (the +1 of GPTQ v1 restored)
    cfg = QuantConfig("gptq", 4, 16, zero_offset=1)
    w = unpack_gptq(packed, qzeros, torch.ones(1, 8, dtype=torch.float16), torch.zeros(16, dtype=torch.int32), cfg,
                    16, 8, "hand")
    assert torch.equal(w.q.long(), HAND.T) and torch.equal(w.zeros.long(), zeros)


def test_awq_packing_of_hand_made_values():
    assert list(AWQ_ORDER) == quant_writer.AWQ_PACK_ORDER
    assert [AWQ_ORDER.index(j) for j in range(8)] == list(AWQ_REVERSE_ORDER)
    packed = quant_writer.pack_awq(HAND)
    assert packed.shape == (16, 1)
    # row 0 holds columns 0..7 = 1..8; nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]: 1,3,5,7,2,4,6,8
    assert packed[0, 0].item() == 0x86427531 - 2**32
    # row 15 holds 0..7 for columns 0..7 -> nibbles 0,2,4,6,1,3,5,7
    assert packed[15, 0].item() == 0x75316420
    zeros = torch.tensor([[8, 9, 10, 11, 12, 13, 14, 15]])
    qzeros = quant_writer.pack_awq(zeros)
    assert qzeros.tolist() == [[0xFDB9ECA8 - 2**32]]  # no offset: nibbles 8,10,12,14,9,11,13,15
    cfg = QuantConfig("awq", 4, 16)
    w = unpack_awq(packed, qzeros, torch.ones(1, 8, dtype=torch.float16), cfg, 16, 8, "hand")
    assert torch.equal(w.q.long(), HAND.T) and torch.equal(w.zeros.long(), zeros)


def test_vectorized_packers_equal_the_written_out_ones():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (64, 24), generator=g)
    z = torch.randint(0, 16, (3, 24), generator=g)
    assert torch.equal(quant_writer.pack_gptq_qweight_fast(q), quant_writer.pack_gptq_qweight(q))
    assert torch.equal(quant_writer.pack_gptq_qzeros_fast(z), quant_writer.pack_gptq_qzeros(z))
    assert torch.equal(quant_writer.pack_awq_fast(q), quant_writer.pack_awq(q))


def test_gptq_zero_of_zero_reads_as_autogptq_reads_it():
    # z = 0 is stored as (0 - 1) & 0xF = 15; AutoGPTQ's reader adds 1 without masking: 16, and so do we
    qzeros = quant_writer.pack_gptq_qzeros(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]]))
    w = unpack_gptq(torch.zeros(2, 8, dtype=torch.int32), qzeros, torch.ones(1, 8, dtype=torch.float16),
                    torch.zeros(16, dtype=torch.int32), QuantConfig("gptq", 4, 16, zero_offset=1), 16, 8)
    assert w.zeros.tolist() == [[16, 1, 2, 3, 4, 5, 6, 7]]


# ---------------------------------------------------------------- unpacking the written checkpoints

@pytest.mark.parametrize("kind", list(KINDS))
def test_unpacked_weights_equal_the_reference_dequantization(quantized, kind):
    root, reference = quantized(kind)
    cfg = checkpoint_quantization(root, json.loads((root / "config.json").read_text()))
    tensors = load_file(root / "model.safetensors")
    from omnidesk.models.qwen2_5_omni.config import OmniConfig

    linears = [lin for lin in quantizable_linears(OmniConfig.from_file(root / "config.json"))
               if lin.module.startswith("thinker.")]
    assert len(linears) == 4 * {"a": 2, "b": 3}[KINDS[kind][0]]
    for lin in linears:
        parts = [unpack({f: tensors[f"{p.prefix}.{f}"] for f in cfg.tensor_names()}, cfg, lin.in_features,
                        p.out_features, p.prefix) for p in lin.parts]
        fused = IntWeights.cat(parts, [p.prefix for p in lin.parts])
        expected = torch.cat([reference[p.prefix] for p in lin.parts], 0)
        assert torch.equal(fused.dequantize(), expected), lin.module


# ---------------------------------------------------------------- the loaded model

@pytest.mark.parametrize("kernel", ["bf16", "fp32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_thinker_matches_the_dequantized_float_model(quantized, kind, kernel):
    root, reference = quantized(kind)
    stack = load_stack(root, kernel_dtype=torch.float32 if kernel == "fp32" else None)
    q = stack.quantization
    method = KINDS[kind][1]["method"]
    assert q["format"] == f"{method}-int4" and q["label"] == f"{method.upper()} int4"
    expected_path = "dequant" if kind == "gptq-group16" else "int4pack_cpu"
    assert q["paths"] == {expected_path: q["linears"]} and q["linears"] == 4 * stack.config.thinker.text.num_layers
    assert "on torch int4pack (CPU kernel)" in q["summary"] or expected_path == "dequant"
    modules = quant_linears(stack.model)
    assert all(name.startswith("thinker.decoder.") for name in modules)  # the talker stays float
    if kind == "gptq-act-order":  # act-order: activations permuted so groups are contiguous
        assert all(m.perm is not None for m in modules.values())
    if kind == "gptq-group16":
        assert all("group size 16" in m.reason for m in modules.values())
    if expected_path != "dequant":
        assert {m.kernel_dtype for m in modules.values()} == {torch.float32 if kernel == "fp32" else torch.bfloat16}
    ref = with_reference_linears(load_stack(root), reference)
    diff = (thinker_logits(stack) - thinker_logits(ref)).abs().max().item()
    assert diff <= (LOGIT_TOL if kernel == "fp32" or expected_path == "dequant" else BF16_KERNEL_TOL), diff
    assert greedy_ids(stack) == greedy_ids(ref)


def test_quantized_layers_read_back_to_the_reference_weights(quantized):
    # through the kernel itself (the identity matrix as input): the int4pack layout holds the writer's weights
    root, reference = quantized("gptq-act-order")
    stack = load_stack(root, kernel_dtype=torch.float32)
    linears = {lin.module: lin for lin in quantizable_linears(stack.config)}
    for name, m in quant_linears(stack.model).items():
        expected = torch.cat([reference[p.prefix] for p in linears[name].parts], 0)
        with torch.inference_mode():
            assert (m.dequantized_weight() - expected).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("kind", ["awq", "gptq-act-order"])
def test_forced_dequantize_path_gives_the_same_logits(quantized, kind):
    root, _ = quantized(kind)
    fast, slow = load_stack(root, kernel_dtype=torch.float32), load_stack(root, force_dequant=True)
    assert set(slow.quantization["paths"]) == {"dequant"}
    assert (thinker_logits(fast) - thinker_logits(slow)).abs().max().item() <= LOGIT_TOL


def test_bfloat16_4bit_stays_close_to_float32(quantized):
    root, _ = quantized("gptq")
    bf16 = load_stack(root, dtype=torch.bfloat16)
    assert bf16.quantization["paths"] == {"int4pack_cpu": 8}
    assert {m.scales_and_zeros.dtype for m in quant_linears(bf16.model).values()} == {torch.bfloat16}
    assert (thinker_logits(bf16) - thinker_logits(load_stack(root))).abs().max().item() < 0.05


# ---------------------------------------------------------------- int8 on load

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_on_load_stays_close_to_the_float_model(tiny_checkpoints, dtype):
    path, _ = tiny_checkpoints("a")
    full = load_stack(path, dtype=dtype)
    int8 = load_stack(path, dtype=dtype, quantize="int8")
    q = int8.quantization
    assert q["format"] == "int8" and q["paths"] == {"int8pack": 8}
    modules = quant_linears(int8.model)
    assert set(modules) == {lin.module for lin in quantizable_linears(int8.config) if lin.module.startswith("thinker.")}
    assert {m.weight_int8.dtype for m in modules.values()} == {torch.int8}
    assert {m.weight_scales.dtype for m in modules.values()} == {torch.bfloat16}  # the kernel's dtype
    # no float copy of a quantized weight is kept anywhere
    assert not any(n.endswith(("wqkv.weight", "w13.weight")) and n.startswith("thinker.")
                   for n, _ in int8.model.named_parameters())
    # each weight within half a quantization step of the checkpoint's (float32) one
    floats = dict((full if dtype == torch.float32 else load_stack(path)).model.named_parameters())
    for name, m in modules.items():
        w = floats[f"{name}.weight"].float()
        step = m.weight_scales.float()[:, None]
        assert ((m.dequantized_weight() - w).abs() <= step / 2 + 1e-6).all(), name
    diff = (thinker_logits(int8) - thinker_logits(full)).abs().max().item()
    assert diff <= INT8_TOL, diff
    assert (thinker_logits(int8) - thinker_logits(full)).abs().max().item() > 0  # it did quantize


def test_int8_of_a_4bit_checkpoint_is_ignored(quantized, caplog):
    root, _ = quantized("gptq")
    with caplog.at_level("INFO", logger="omnidesk.models.qwen2_5_omni"):
        stack = load_stack(root, quantize="int8")
    assert stack.quantization["format"] == "gptq-int4"
    assert "already GPTQ int4: --quantize int8 ignored" in caplog.text


def test_unknown_quantize_mode_is_refused(tiny_checkpoints):
    with pytest.raises(ConfigError, match="--quantize 'int4': expected one of none, int8"):
        load_stack(tiny_checkpoints("a")[0], quantize="int4")


def test_int8_kernel_is_not_given_shapes_it_gets_wrong():
    # torch 2.13's CPU bfloat16 int8 kernel returns garbage or crashes for K % 16 != 0: those layers dequantize
    g = torch.Generator().manual_seed(1)
    for k, path in ((344, "dequant_int8"), (352, "int8pack")):
        w, x = torch.randn(32, k, generator=g), torch.randn(7, k, generator=g)
        m = QuantLinear.from_float(w)
        assert m.path == path and (path == "int8pack" or "not a multiple of 16" in m.reason)
        ref = x @ w.T
        assert (m(x) - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_quantlinear_from_float_and_irregular_groups():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(32, 64, generator=g), torch.randn(32, generator=g), torch.randn(5, 64, generator=g)
    m = QuantLinear.from_float(w, b)
    assert m.path == "int8pack"
    ref = x @ w.T + b
    assert (m(x) - ref).abs().max().item() < 0.01 * ref.abs().max().item()
    # groups of unequal size cannot be made contiguous: the layer dequantizes instead, and says why
    q = torch.randint(0, 16, (32, 64), generator=g).to(torch.uint8)
    g_idx = torch.cat([torch.zeros(40), torch.ones(24)]).long()
    iw = IntWeights(q, torch.full((2, 32), 8, dtype=torch.int16), torch.rand(2, 32, generator=g).half(), g_idx)
    m4 = QuantLinear.from_int4(iw, None, "cpu", torch.float32)
    assert m4.path == "dequant" and "unequal" in m4.reason
    assert (m4(x) - x @ iw.dequantize().T).abs().max().item() < 1e-4


# ---------------------------------------------------------------- memory

def _weight_bytes(module: nn.Module) -> int:
    """Parameters (shared storage once) + the quantized layers' buffers: what the estimate's weights count
    (computed tables such as rotary frequencies and positional embeddings are not weights)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + [b for m in quant_linears(module).values() for b in m.buffers()]:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("kind,mode,dtype", [("float", None, torch.float32), ("float", "int8", torch.float32),
                                             ("float", "int8", torch.bfloat16), ("gptq", "int4", torch.float32),
                                             ("gptq-act-order", "int4", torch.float32), ("awq", "int4", torch.bfloat16)])
def test_memory_estimate_matches_the_loaded_tensors(tiny_checkpoints, quantized, kind, mode, dtype):
    from omnidesk.models.qwen2_5_omni.memory import estimate_memory

    root = tiny_checkpoints("a")[0] if kind == "float" else quantized(kind)[0]
    stack = load_stack(root, dtype=dtype, quantize=mode if mode == "int8" else None)
    group = KINDS[kind][1]["group"] if mode == "int4" else 128
    estimate = estimate_memory(stack.config, dtype, 16, quantization=mode, group_size=group)
    measured = _weight_bytes(stack.thinker) + _weight_bytes(stack.talker)
    assert abs(measured - estimate.weights) <= 0.05 * estimate.weights, (measured, estimate.weights)
    assert estimate.quantization == mode


def test_memory_of_the_7b_per_mode_and_the_refusal_suggests_them():
    from omnidesk.models.qwen2_5_omni.config import OmniConfig
    from omnidesk.models.qwen2_5_omni.memory import check_fits, estimate_memory, model_shape

    cfg = OmniConfig.from_file(Path(__file__).parent / "data" / "qwen2_5_omni_7b" / "config.json")
    shape = model_shape(cfg)
    # 28 layers x (3584 x 4608 qkv + 3584 x 3584 o + 3 x 3584 x 18944 mlp)
    assert shape.quantizable == 28 * (3584 * 4608 + 3584 * 3584 + 3 * 3584 * 18944) == 6_525_288_448
    bf16 = estimate_memory(cfg, torch.bfloat16, 8192)
    int8 = estimate_memory(cfg, torch.bfloat16, 8192, quantization="int8")
    int4 = estimate_memory(cfg, torch.bfloat16, 8192, quantization="int4")
    rest = (shape.llm_params - shape.quantizable) * 2
    assert int8.weights == rest + shape.quantizable + shape.quantizable_rows * 2
    assert int4.weights == rest + shape.quantizable // 2 + 2 * (shape.quantizable // 128) * 2
    assert bf16.total > int8.total > int4.total
    GiB = 2**30
    assert 12.5 * GiB < int4.total < 13.5 * GiB and 15.5 * GiB < int8.total < 17 * GiB
    msg = check_fits(bf16, 18 * GiB)
    assert "loading it with --quantize int8 (about 16." in msg
    assert "a 4-bit checkpoint of it, Qwen/Qwen2.5-Omni-7B-GPTQ-Int4 or Qwen/Qwen2.5-Omni-7B-AWQ (about 13." in msg
    small = check_fits(bf16, 14 * GiB)
    assert "--quantize int8" not in small and "4-bit checkpoint" in small
    assert check_fits(int4, 14 * GiB) is None
    refused = check_fits(int4, 12 * GiB)
    assert refused.startswith("The model (10.1B parameters) in bfloat16 with 4-bit linears with a context of 8192")
    assert "4-bit checkpoint" not in refused and "--quantize int8" not in refused
    assert "Try the smaller model Qwen/Qwen2.5-Omni-3B" in refused


# ---------------------------------------------------------------- errors name the tensor or field

def test_corrupt_qweight_shape_names_the_tensor(gptq_copy):
    name = "thinker.model.layers.1.self_attn.k_proj.qweight"
    _rewrite(gptq_copy, lambda t: t.__setitem__(name, t[name][:, :-8].contiguous()))
    with pytest.raises(CheckpointError) as e:
        load_stack(gptq_copy)
    assert str(e.value) == f"{gptq_copy}: tensor '{name}' has shape [8, 24], expected [8, 32]"


def test_missing_scales_names_the_tensor(gptq_copy):
    name = "thinker.model.layers.0.mlp.up_proj.scales"
    _rewrite(gptq_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        load_stack(gptq_copy)
    assert str(e.value) == f"{gptq_copy}: missing weights: {name}"


def test_missing_qzeros_names_the_tensor(gptq_copy):
    name = "thinker.model.layers.0.self_attn.o_proj.qzeros"
    _rewrite(gptq_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing weights: {name}$"):
        load_stack(gptq_copy)


def test_a_fused_part_left_in_float_is_named(gptq_copy):
    prefix = "thinker.model.layers.0.self_attn.v_proj"

    def edit(t):
        for f in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{prefix}.{f}")
        t[f"{prefix}.weight"] = torch.zeros(32, 64)

    _rewrite(gptq_copy, edit)
    with pytest.raises(CheckpointError) as e:
        load_stack(gptq_copy)
    msg = str(e.value)
    assert f"missing weights: {prefix}.qweight, {prefix}.qzeros, {prefix}.scales, {prefix}.g_idx" in msg
    assert f"unexpected weights: {prefix}.weight" in msg


def test_wrong_qweight_dtype_names_the_tensor(gptq_copy):
    name = "thinker.model.layers.0.mlp.down_proj.qweight"
    _rewrite(gptq_copy, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype float32, expected int32"):
        load_stack(gptq_copy)


def test_unequal_g_idx_of_fused_parts_is_named(gptq_copy):
    name = "thinker.model.layers.1.mlp.up_proj.g_idx"
    _rewrite(gptq_copy, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' differs from "
                                              f"'thinker.model.layers.1.mlp.gate_proj.g_idx'"):
        load_stack(gptq_copy)


def test_g_idx_out_of_range_is_named(gptq_copy):
    name = "thinker.model.layers.0.self_attn.o_proj.g_idx"
    _rewrite(gptq_copy, lambda t: t.__setitem__(name, torch.full_like(t[name], 7)))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds group 7, outside 0..1"):
        load_stack(gptq_copy)


@pytest.mark.parametrize("field,value,message", [
    ("bits", 3, "quantization_config.bits is 3: only 4-bit GPTQ checkpoints are supported"),
    ("bits", 8, "quantization_config.bits is 8: only 4-bit GPTQ checkpoints are supported"),
    ("quant_method", "bitsandbytes", "quantization_config.quant_method is 'bitsandbytes': not supported"),
    ("checkpoint_format", "marlin", "quantization_config.checkpoint_format is 'marlin': not supported"),
    ("group_size", "big", "quantization_config.group_size is 'big': expected a positive integer or -1"),
])
def test_unsupported_quantization_config_names_the_field(gptq_copy, field, value, message):
    _edit_config(gptq_copy, lambda q: q.__setitem__(field, value))
    with pytest.raises(ConfigError) as e:
        load_stack(gptq_copy)
    assert str(e.value).startswith(f"{gptq_copy / 'config.json'}: {message}"), str(e.value)


def test_awq_version_and_zero_point_are_checked():
    with pytest.raises(ConfigError, match=r"quantization_config.version is 'gemv': only AWQ 'gemm'"):
        read_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                   "version": "gemv"}})
    with pytest.raises(ConfigError, match="zero_point is false"):
        read_quant_config({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                                   "zero_point": False}})
    cfg = read_quant_config({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                                     "zero_point": True, "version": "GEMM"}})
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.zero_offset) == ("awq", 4, 128, 0)
    v2 = read_quant_config({}, extra={"quant_method": "gptq", "bits": 4, "group_size": 128,
                                      "checkpoint_format": "gptq_v2", "desc_act": True})
    assert (v2.zero_offset, v2.desc_act) == (0, True)


# ---------------------------------------------------------------- models verify / list

def test_models_verify_and_describe_a_4bit_checkpoint(quantized, tiny_checkpoints):
    from omnidesk.models.families import QWEN, verify
    from omnidesk.models.inventory import describe

    root, _ = quantized("gptq")
    report = verify(str(root))
    assert report.ok, report.problems
    assert any(line.startswith("tensor names and shapes") for line in report.checked)
    info = describe(str(root), root, QWEN)
    assert info.quantization == "GPTQ int4 (group 32)"
    assert list(info.memory) == ["int4"]
    plain = describe("a", tiny_checkpoints("a")[0], QWEN)
    assert plain.quantization is None and list(plain.memory) == ["bfloat16", "int8"]
    assert plain.memory["int8"] < plain.memory["bfloat16"]
