#!/usr/bin/env python
"""Rebuild the tensor list of Qwen/Qwen3-Omni-30B-A3B-Instruct and check it against public facts.

This script:

* loads tests/data/qwen3_omni/config.json with ``Qwen3OmniMoeConfig`` (transformers 5.24);
* builds ``Qwen3OmniMoeForConditionalGeneration`` on the meta device (no memory, no weights);
* works out the names and shapes that ``save_pretrained`` writes. In memory transformers 5 nests
  the thinker as ``thinker.model.{audio_tower,visual,language_model}`` and fuses each MoE layer's
  experts into ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]. Its own
  ``revert_weight_conversion`` (the step save_pretrained runs before writing) undoes both, which
  gives the on-disk layout: ``thinker.model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` etc.,
  one tensor per expert;
* writes tests/data/qwen3_omni/tensors.json in a rule-compressed form (see ``compress`` /
  ``expand`` below; the full list is 28,010 names, about 2 MB as plain JSON);
* checks the result against public facts about the published checkpoint (tensor count,
  parameter count in total and per component, bytes; sources in tests/data/README.md).

With the tiny check (on by default) it also builds a tiny random model, really calls
``save_pretrained`` and reads the names back from the written safetensors file, so the naming is
checked against what the library writes, not only against its internal helper. It also loads that
directory back with ``from_pretrained`` and compares every tensor.

Usage:  python tests/data/qwen3_omni/dump_shapes.py [--check] [--no-tiny-save]
  --check   compare the stored tensors.json with a fresh rebuild instead of writing it
Exit status is non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "tensors.json"
REPO = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

# Top-level components in the on-disk naming, most specific prefix first.
COMPONENTS = (
    "thinker.audio_tower",
    "thinker.visual",
    "thinker.model",
    "thinker.lm_head",
    "talker.code_predictor",
    "talker",
    "code2wav",
)

# ---- public facts about the published checkpoint (sources: tests/data/README.md, "Qwen3-Omni")
PUBLIC = {
    # FACTS.md; weight report R1 ("权重张量数: 28,010").
    "tensor_count": 28_010,
    # R1 ("参数总量: 35,259,818,545") and R2 (MTEB ModelMeta n_parameters=35259818545).
    "params": 35_259_818_545,
    # R2: memory_usage_mb=67253.0 (= bf16 bytes / 2**20, rounded).
    "memory_usage_mb": 67_253,
    # R1: "文件总大小 65.68 GB" / "张量累计大小 65.68 GB" (GiB), 15 files, every tensor torch.bfloat16.
    "bytes_gib_2dp": 65.68,
    # R1: "压缩: 28010 → 617 行": its listing folds only layer and expert indices.
    "r1_rows": 617,
    "dtype": "BF16",
    # Tensor counts per component, counted from R1's per-tensor listing (its folded rows
    # expanded: e.g. "thinker.model.layers.0-47....experts.0-127..." = 48 x 128 tensors).
    "counts": {
        "thinker.audio_tower": 525,
        "thinker.visual": 351,
        "thinker.model": 18_866,
        "thinker.lm_head": 1,
        "talker.code_predictor": 86,
        "talker": 7_951,
        "code2wav": 230,
    },
}
# FACTS.md rounded figures (billions, as printed there): (value, digits after the point).
FACTS_B = {
    "total": (35.26, 2),
    "thinker": (31.7, 1),
    "thinker text (model + lm_head)": (30.5, 1),
    "thinker experts": (29.0, 0),
    "AuT (thinker.audio_tower)": (0.65, 2),
    "vision (thinker.visual)": (0.54, 2),
    "talker (without code predictor)": (3.18, 2),
    "code predictor": (0.14, 2),
    "code2wav": (0.22, 2),
}

# Container names whose numeric child index is folded by the compressed form.
_FOLD = re.compile(r"(?<=\.)(layers|blocks|experts|lm_head|codec_embedding)\.(\d+)(?=\.)")
_RANGE = re.compile(r"\{(\d+)-(\d+)\}")


def component_of(name: str) -> str:
    for comp in COMPONENTS:
        if name == comp or name.startswith(comp + "."):
            return comp
    return "other"


# ---------------------------------------------------------------------------- compressed form
def compress(tensors: dict[str, list[int]], fold: re.Pattern = _FOLD) -> dict[str, list[int]]:
    """Fold per-layer / per-block / per-expert indices into ``{a-b}`` ranges.

    A group of names that differ only in those indices and share a shape becomes one pattern,
    e.g. ``thinker.model.layers.{0-47}.mlp.experts.{0-127}.down_proj.weight: [2048, 768]``,
    but only when the group is exactly the product of contiguous ranges; anything else stays
    a plain name. ``expand`` is the inverse.
    """
    groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = collections.defaultdict(list)
    for name, shape in tensors.items():
        idx = tuple(int(m.group(2)) for m in fold.finditer(name))
        template = fold.sub(lambda m: m.group(1) + ".{}", name)
        groups[(template, tuple(shape))].append(idx)
    out: dict[str, list[int]] = {}
    for (template, shape), idxs in groups.items():
        if not idxs[0]:
            out[template] = list(shape)
            continue
        axes = [sorted({i[k] for i in idxs}) for k in range(len(idxs[0]))]
        contiguous = all(a == list(range(a[0], a[-1] + 1)) for a in axes)
        full = len(set(idxs)) == len(idxs) == len(list(itertools.product(*axes)))
        if contiguous and full:
            parts = [f"{{{a[0]}-{a[-1]}}}" if len(a) > 1 else str(a[0]) for a in axes]
            out[template.format(*parts)] = list(shape)
        else:  # not a clean product: keep the names
            for i in idxs:
                out[template.format(*i)] = list(shape)
    return dict(sorted(out.items()))


def expand(patterns: dict[str, list[int]]) -> dict[str, list[int]]:
    """Inverse of ``compress``: every on-disk name -> shape, names sorted."""
    out: dict[str, list[int]] = {}
    for pattern, shape in patterns.items():
        ranges = [range(int(a), int(b) + 1) for a, b in _RANGE.findall(pattern)]
        fmt = _RANGE.sub("{}", pattern)
        for idx in itertools.product(*ranges):
            name = fmt.format(*idx)
            if name in out:
                raise ValueError(f"duplicate name {name}")
            out[name] = list(shape)
    return dict(sorted(out.items()))


def load_tensors(path: Path = OUT) -> dict[str, list[int]]:
    """The full on-disk tensor list (name -> shape) stored in tensors.json."""
    return expand(json.loads(path.read_text())["patterns"])


# ---------------------------------------------------------------------------- model side
def build_meta(config_dir: Path = HERE):
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    return config, model


def saved_state(model: torch.nn.Module, state: dict | None = None) -> dict:
    """What save_pretrained writes: the same two steps as PreTrainedModel.save_pretrained."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(dict(model.state_dict() if state is None else state), model)
    return revert_weight_conversion(model, state)


def tensor_list() -> dict:
    """What tensors.json holds."""
    import transformers

    _, model = build_meta()
    saved = saved_state(model)
    tensors = {k: list(v.shape) for k, v in sorted(saved.items())}
    counts = collections.Counter(component_of(n) for n in tensors)
    params = collections.Counter()
    for n, s in tensors.items():
        params[component_of(n)] += torch.Size(s).numel()
    patterns = compress(tensors)
    assert expand(patterns) == tensors, "compressed form does not round-trip"
    return {
        "repo": REPO,
        "source": (
            f"transformers {transformers.__version__}: Qwen3OmniMoeForConditionalGeneration(config.json) on the "
            "meta device, names as save_pretrained writes them (revert_weight_conversion: one tensor per expert)"
        ),
        "format": "patterns: name -> shape; '{a-b}' stands for every integer a..b (all combinations); "
                  "expand with dump_shapes.expand / load_tensors",
        "dtype": {c: PUBLIC["dtype"] for c in COMPONENTS},
        "tensor_count": len(tensors),
        "elements": sum(params.values()),
        "components": {c: {"tensors": counts[c], "params": params[c]} for c in COMPONENTS},
        "patterns": patterns,
    }


def write(data: dict) -> str:
    head = json.dumps({k: v for k, v in data.items() if k != "patterns"}, indent=1)[:-2]
    body = ",\n".join(f"  {json.dumps(n)}: {json.dumps(s)}" for n, s in data["patterns"].items())
    return f'{head},\n "patterns": {{\n{body}\n }}\n}}\n'


# ---------------------------------------------------------------------------- checks
def check_public(data: dict) -> list[str]:
    failures: list[str] = []
    comps = data["components"]
    p = {c: comps[c]["params"] for c in COMPONENTS}
    tensors = expand(data["patterns"])

    def check(label, got, want):
        ok = got == want
        print(f"  check {label}: got {got:,} want {want:,} -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{label}: {got} != {want}")

    print("\n=== checks against public facts")
    check("tensor count", data["tensor_count"], PUBLIC["tensor_count"])
    check("parameter count", data["elements"], PUBLIC["params"])
    for comp, want in PUBLIC["counts"].items():
        check(f"{comp} tensor count", comps[comp]["tensors"], want)
    nbytes = 2 * data["elements"]  # every tensor bf16
    check("bf16 bytes in MiB (MTEB memory_usage_mb)", round(nbytes / 2**20), PUBLIC["memory_usage_mb"])
    gib = round(nbytes / 2**30, 2)
    ok = gib == PUBLIC["bytes_gib_2dp"]
    print(f"  check bf16 bytes {nbytes:,} = {gib} GiB vs published {PUBLIC['bytes_gib_2dp']} -> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        failures.append(f"bytes {gib} GiB != {PUBLIC['bytes_gib_2dp']}")

    rows = len(compress(tensors, re.compile(r"(?<=\.)(layers|experts)\.(\d+)(?=\.)")))
    check("rows when only layer/expert indices are folded (R1's listing)", rows, PUBLIC["r1_rows"])

    experts = sum(torch.Size(s).numel() for n, s in tensors.items() if n.startswith("thinker.model.") and ".experts." in n)
    ours = {
        "total": data["elements"],
        "thinker": p["thinker.audio_tower"] + p["thinker.visual"] + p["thinker.model"] + p["thinker.lm_head"],
        "thinker text (model + lm_head)": p["thinker.model"] + p["thinker.lm_head"],
        "thinker experts": experts,
        "AuT (thinker.audio_tower)": p["thinker.audio_tower"],
        "vision (thinker.visual)": p["thinker.visual"],
        "talker (without code predictor)": p["talker"],
        "code predictor": p["talker.code_predictor"],
        "code2wav": p["code2wav"],
    }
    for label, (want, digits) in FACTS_B.items():
        got = round(ours[label] / 1e9, digits)
        ok = got == want
        print(f"  check {label}: {ours[label]:,} = {got}B, FACTS {want}B -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{label}: {got}B != {want}B")
    if any(component_of(n) == "other" for n in tensors):
        failures.append("tensors outside the known components")
    return failures


# FACTS.md values that live in config.json only (no shape depends on them); transformers' class
# defaults differ for several of them, so a config that fell back to a default is caught here.
CONFIG_FACTS = {
    "talker_config.accept_hidden_layer": 24,
    "talker_config.num_code_groups": 16,
    "talker_config.code_predictor_config.num_code_groups": 16,
    "talker_config.codec_pad_id": 2148,
    "talker_config.codec_bos_id": 2149,
    "talker_config.codec_eos_token_id": 2150,
    "talker_config.codec_nothink_id": 2155,
    "talker_config.codec_think_bos_id": 2156,
    "talker_config.codec_think_eos_id": 2157,
    "talker_config.speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    "talker_config.text_config.num_experts_per_tok": 6,
    "talker_config.text_config.norm_topk_prob": True,
    "thinker_config.text_config.num_experts_per_tok": 8,
    "thinker_config.text_config.norm_topk_prob": True,
    "thinker_config.text_config.rope_parameters.mrope_section": [24, 20, 20],
    "thinker_config.text_config.rope_parameters.rope_theta": 1000000,
    "thinker_config.text_config.tie_word_embeddings": False,
    "thinker_config.audio_token_id": 151675,
    "thinker_config.audio_start_token_id": 151669,
    "thinker_config.audio_end_token_id": 151670,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "code2wav_config.sliding_window": 72,
    "code2wav_config.upsample_rates": [8, 5, 4, 3],
    "code2wav_config.upsampling_ratios": [2, 2],
}


def check_config_facts() -> list[str]:
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig.from_pretrained(str(HERE))
    print("\n=== config.json values from FACTS.md (as loaded by transformers)")
    failures = []
    for path, want in CONFIG_FACTS.items():
        got = config
        for part in path.split("."):
            got = got.get(part) if isinstance(got, dict) else getattr(got, part)
        got = list(got) if isinstance(got, tuple) else got
        ok = got == want
        print(f"  {path} = {got!r} -> {'OK' if ok else 'MISMATCH, expected ' + repr(want)}")
        if not ok:
            failures.append(f"config {path}={got!r}, expected {want!r}")
    samples = config.code2wav_config.upsample_rates + config.code2wav_config.upsampling_ratios
    n = 1
    for r in samples:
        n *= r
    print(f"  samples per code frame = {n} (FACTS: 1920 at 24 kHz, 12.5 Hz) -> {'OK' if n == 1920 else 'MISMATCH'}")
    if n != 1920:
        failures.append(f"samples per frame {n} != 1920")
    return failures


def check_generate_defaults() -> list[str]:
    """FACTS.md talker sampling vs the reference's generate() defaults (no generation_config.json found)."""
    import inspect

    from transformers import Qwen3OmniMoeForConditionalGeneration

    sig = inspect.signature(Qwen3OmniMoeForConditionalGeneration.generate).parameters
    want = {"speaker": "Ethan", "thinker_max_new_tokens": 1024, "thinker_eos_token_id": 151645,
            "talker_max_new_tokens": 4096, "talker_do_sample": True, "talker_top_k": 50, "talker_top_p": 1.0,
            "talker_temperature": 0.9, "talker_repetition_penalty": 1.05}
    print("\n=== Qwen3OmniMoeForConditionalGeneration.generate defaults")
    failures = []
    for k, v in want.items():
        got = sig[k].default if k in sig else "<missing>"
        ok = got == v
        print(f"  {k} = {got!r} -> {'OK' if ok else 'MISMATCH, expected ' + repr(v)}")
        if not ok:
            failures.append(f"generate default {k}={got!r}, expected {v!r}")
    return failures


def tiny_config() -> dict:
    """A small full model with the real structure (MoE thinker and talker, shared expert, deepstack)."""
    H, T = 32, 24  # thinker hidden, talker hidden
    mrope = {"interleaved": True, "mrope_interleaved": True, "mrope_section": [2, 1, 1],
             "rope_type": "default", "type": "default"}
    return dict(
        enable_audio_output=True,
        thinker_config=dict(
            audio_config=dict(d_model=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                              num_mel_bins=16, output_dim=H, downsample_hidden_size=8, max_source_positions=100),
            vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H,
                               num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2]),
            text_config=dict(vocab_size=300, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=4, num_experts_per_tok=2, rope_scaling=mrope, rope_theta=1e6),
        ),
        talker_config=dict(
            accept_hidden_layer=2, thinker_hidden_size=H, num_code_groups=4, spatial_merge_size=2,
            codec_pad_id=90, codec_bos_id=91, codec_eos_token_id=92, codec_nothink_id=93,
            codec_think_bos_id=94, codec_think_eos_id=95, speaker_id={"ethan": 96},
            text_config=dict(vocab_size=100, hidden_size=T, intermediate_size=40, moe_intermediate_size=12,
                             shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                             rope_scaling={k: v for k, v in mrope.items() if k != "mrope_interleaved"}),
            code_predictor_config=dict(vocab_size=64, hidden_size=T, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4),
        ),
        code2wav_config=dict(codebook_size=64, num_quantizers=4, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, decoder_dim=32,
                             sliding_window=8),
    )


def tiny_save_check(full_patterns: dict[str, list[int]]) -> list[str]:
    from safetensors import safe_open
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    failures: list[str] = []
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**tiny_config())).eval()
    # transformers' init leaves some tensors (e.g. the talker's fused experts) as torch.empty
    # memory, which may hold NaNs and break the equality check: fill everything deterministically.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen))
    internal = model.state_dict()
    predicted = set(saved_state(model))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        written: dict[str, tuple[int, ...]] = {}
        for fn in sorted(os.listdir(d)):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(d, fn), "pt") as f:
                    for k in f.keys():
                        written[k] = tuple(f.get_slice(k).get_shape())
        reloaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(d).eval()
        got = reloaded.state_dict()
        bad = [k for k in internal if k not in got or not torch.equal(internal[k], got[k])]
    print("\n=== tiny model: real save_pretrained")
    print(f"internal state_dict {len(internal)} tensors (fused experts), written {len(written)} tensors")
    if set(written) != predicted:
        failures.append("tiny: revert_weight_conversion prediction differs from the written file")
        print("  MISMATCH predicted vs written:", sorted(set(written) ^ predicted)[:10])
    else:
        print("  written names == names predicted by revert_weight_conversion: OK")
    print(f"  reload with from_pretrained: {len(internal) - len(bad)}/{len(internal)} tensors identical"
          f" -> {'OK' if not bad else 'MISMATCH'}")
    if bad:
        failures.append(f"tiny: {len(bad)} tensors differ after reload, e.g. {bad[:3]}")
    # Same naming scheme as the full list: the tiny model's written names, with their indices
    # folded, use exactly the templates of the full checkpoint's list.
    def templates(names):
        return {_RANGE.sub("{}", _FOLD.sub(lambda m: m.group(1) + ".{}", n)) for n in names}

    tiny_t = templates(written)
    full_t = {_RANGE.sub("{}", p) for p in full_patterns}
    ok = tiny_t == full_t
    print(f"  name templates: tiny {len(tiny_t)}, full {len(full_t)} -> {'same' if ok else 'DIFFERENT'}")
    if not ok:
        failures.append("tiny: name templates differ from the full list: "
                        f"{sorted(tiny_t ^ full_t)[:6]}")
    ex = sorted(n for n in written if ".experts." in n)[:2] + sorted(n for n in internal if ".experts." in n)[:1]
    print(f"  e.g. written {ex[:2]}, in memory {ex[2:]}")
    return failures


def main() -> int:
    sys.path.insert(0, str(HERE.parent))
    from shape_checks import verdict  # tests/data/shape_checks.py

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare tensors.json with a fresh rebuild, do not write")
    ap.add_argument("--no-tiny-save", action="store_true", help="skip the real save_pretrained round on a tiny model")
    args = ap.parse_args()

    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    data = tensor_list()
    text = write(data)
    assert json.loads(text) == data
    failures: list[str] = []
    if args.check:
        same = OUT.exists() and json.loads(OUT.read_text())["patterns"] == data["patterns"]
        print(f"stored {OUT.name} {'matches' if same else 'DIFFERS FROM'} the rebuild")
        if not same:
            failures.append(f"{OUT.name} differs from the rebuild")
    else:
        OUT.write_text(text)
        print(f"wrote {OUT} ({len(text):,} bytes, {len(data['patterns'])} patterns)")
    print(f"{data['tensor_count']:,} tensors, {data['elements']:,} parameters")
    print(f"{'component':24s} {'tensors':>8s} {'params':>16s}")
    for c, v in data["components"].items():
        print(f"{c:24s} {v['tensors']:8d} {v['params']:16,d}")
    failures += check_public(data)
    failures += check_config_facts()
    failures += check_generate_defaults()
    if not args.no_tiny_save:
        failures += tiny_save_check(data["patterns"])
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
