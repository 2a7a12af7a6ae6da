#!/usr/bin/env python
"""Check the reconstructed Qwen2.5-Omni config.json files against the real checkpoints.

For each of tests/data/qwen2_5_omni_{3b,7b}/config.json this script:

* loads the config with ``Qwen2_5OmniConfig.from_pretrained``;
* builds ``Qwen2_5OmniForConditionalGeneration`` on the meta device (no memory, no weights);
* works out the tensor names that ``save_pretrained`` would write (transformers' own
  ``revert_weight_conversion``, the step save_pretrained runs before writing);
* prints the tensor count and the parameter count per top-level component;
* compares those numbers with what is publicly known about the hub checkpoints
  (see tests/data/README.md for where each number comes from).

With ``--tiny-save`` (on by default) it also builds a tiny random model, really calls
``save_pretrained`` and lists the names found in the written safetensors file, so the naming
claim is checked against the files the library writes, not only against its internal helper.

Usage:  python tests/data/dump_real_shapes.py [--no-tiny-save] [--list-names N]
Exit status is non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

HERE = Path(__file__).resolve().parent

# Top-level components, in the hub (= save_pretrained) naming.
COMPONENTS = (
    "thinker.audio_tower",
    "thinker.visual",
    "thinker.model",
    "thinker.lm_head",
    "talker",
    "token2wav",
)

# Publicly known facts about the hub checkpoints (sources in README.md).
HUB = {
    "7b": {
        # Qwen/Qwen2.5-Omni-7B model.safetensors.index.json: 2448 tensors in 5 shards,
        # metadata.total_size = 22_366_403_936 bytes.
        "tensor_count": 2448,
        "total_size": 22_366_403_936,
        "shard_file_bytes": (4_985_055_504, 4_991_496_800, 4_991_496_904, 4_969_489_824, 2_425_322_160),
        # thinker-only fine-tune of the 7B (same thinker shapes): per-prefix tensor counts and
        # total_size of the thinker alone (bf16).
        "thinker_counts": {"thinker.visual": 518, "thinker.audio_tower": 489, "thinker.model": 338, "thinker.lm_head": 1},
        "thinker_total_size": 17_863_627_776,
        # 2448 - 1346 thinker tensors = 1102 = 293 talker + 809 token2wav (same split as the 3B).
        "talker_count": 293,
        "token2wav_count": 809,  # 360 DiT (incl. rotary_embed.inv_freq) + 449 BigVGAN
        "params_approx": 10.7e9,  # rough figure from the task brief; the shard-byte check is the exact one
    },
    "3b": {
        # Qwen/Qwen2.5-Omni-3B: talker 293 tensors, token2wav 809 (DiT 360 + BigVGAN 449, all F32),
        # BigVGAN = 115_443_504 floats (nntrainer port notes, see README).
        "talker_count": 293,
        "token2wav_count": 809,
        "bigvgan_params": 115_443_504,
        "params_approx": 5.5e9,
    },
}

# Buffers that the hub checkpoint stores but transformers >= 5 registers as non-persistent,
# so neither state_dict() nor save_pretrained() contains them.
HUB_ONLY_BUFFERS = {"token2wav.code2wav_dit_model.rotary_embed.inv_freq": (32, torch.float32)}


def _header_estimate(saved: dict) -> int:
    import json

    ents = dict(saved)
    for buf, (numel, _) in HUB_ONLY_BUFFERS.items():
        ents[buf] = torch.empty(numel, device="meta")
    total = 0
    for n, t in ents.items():
        dt = "F32" if n.startswith("token2wav") else "BF16"
        e = json.dumps({n: {"dtype": dt, "shape": list(t.shape), "data_offsets": [10**9, 10**9]}}, separators=(",", ":"))
        total += len(e) - 2 + 1
    return total


def component_of(name: str) -> str:
    for comp in COMPONENTS:
        if name == comp or name.startswith(comp + "."):
            return comp
    return "other"


def saved_names(model: torch.nn.Module, state: dict) -> dict:
    """Names save_pretrained would write: same two steps as PreTrainedModel.save_pretrained."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(dict(state), model)
    return revert_weight_conversion(model, state)


def build_meta(config_dir: Path):
    config = Qwen2_5OmniConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(config)
    return config, model


def bytes_of(t: torch.Tensor, dtype: torch.dtype) -> int:
    return t.numel() * torch.empty((), dtype=dtype).element_size()


def report(size: str, list_names: int) -> list[str]:
    failures: list[str] = []
    config_dir = HERE / f"qwen2_5_omni_{size}"
    config, model = build_meta(config_dir)
    tc = config.thinker_config.text_config
    ta = config.talker_config
    print(f"\n=== Qwen2.5-Omni-{size.upper()}  ({config_dir.relative_to(HERE.parent.parent)}/config.json)")
    print(
        f"thinker text: hidden {tc.hidden_size}, layers {tc.num_hidden_layers}, heads {tc.num_attention_heads}/"
        f"{tc.num_key_value_heads} kv, inter {tc.intermediate_size}, vocab {tc.vocab_size}, "
        f"tie {tc.tie_word_embeddings}, mrope {tc.rope_parameters.get('mrope_section')}"
    )
    print(
        f"talker: hidden {ta.hidden_size}, emb {ta.embedding_size}, layers {ta.num_hidden_layers}, heads "
        f"{ta.num_attention_heads}/{ta.num_key_value_heads} kv, head_dim {ta.head_dim}, inter {ta.intermediate_size}, "
        f"vocab {ta.vocab_size}, mrope {ta.rope_parameters.get('mrope_section')}"
    )

    mem = model.state_dict()
    saved = saved_names(model, mem)
    print(f"tensors: state_dict {len(mem)}, written by save_pretrained {len(saved)}")

    counts = collections.Counter()
    params = collections.Counter()
    hub_bytes = 0
    for name, t in saved.items():
        comp = component_of(name)
        counts[comp] += 1
        params[comp] += t.numel()
        # hub dtypes: thinker + talker in bf16, token2wav kept in float32
        hub_bytes += bytes_of(t, torch.float32 if comp == "token2wav" else torch.bfloat16)
    print(f"{'component':22s} {'tensors':>8s} {'params':>16s}")
    for comp in COMPONENTS + ("other",):
        if counts[comp] or comp != "other":
            print(f"{comp:22s} {counts[comp]:8d} {params[comp]:16,d}")
    total = sum(params.values())
    print(f"{'TOTAL':22s} {sum(counts.values()):8d} {total:16,d}  (~{total / 1e9:.2f}B)")
    if counts["other"]:
        failures.append(f"{size}: {counts['other']} saved tensors outside the known components")

    dit = sum(t.numel() for n, t in saved.items() if n.startswith("token2wav.code2wav_dit_model."))
    bigvgan = sum(t.numel() for n, t in saved.items() if n.startswith("token2wav.code2wav_bigvgan_model."))
    print(f"token2wav split: DiT {dit:,d}  BigVGAN {bigvgan:,d}")

    # Names: a few real examples per component, and the internal -> saved renaming.
    if list_names:
        for comp in COMPONENTS:
            names = sorted(n for n in saved if component_of(n) == comp)
            print(f"  [{comp}] e.g. " + ", ".join(names[:list_names]))
    print("renamed on save (internal module path -> written name), tensors per rule:")
    for (src, dst), n in sorted(renaming_rules(mem, saved).items()):
        print(f"    {src:32s} -> {dst:24s} {n:5d}")

    # ---- checks against public hub facts
    hub = HUB[size]
    hub_total_tensors = len(saved) + len(HUB_ONLY_BUFFERS)
    for buf, (numel, dtype) in HUB_ONLY_BUFFERS.items():
        hub_bytes += numel * torch.empty((), dtype=dtype).element_size()

    def check(label, got, want):
        ok = got == want
        print(f"  check {label}: got {got:,} want {want:,} -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{size}: {label} {got} != {want}")

    if "tensor_count" in hub:
        check("hub tensor count (saved + DiT inv_freq buffer)", hub_total_tensors, hub["tensor_count"])
    if "shard_file_bytes" in hub:
        # The index's metadata.total_size does not equal the bytes actually stored, so compare with
        # the shard files: file size = 8-byte length + JSON header + tensor bytes. The header is
        # estimated from our own names/shapes with 10-digit offsets (an upper bound by a few KB).
        header = _header_estimate(saved) + len(hub["shard_file_bytes"]) * (8 + len('{"__metadata__":{"format":"pt"}}'))
        stored = sum(hub["shard_file_bytes"]) - header
        resid = stored - hub_bytes
        ok = abs(resid) < 16 * 1024
        print(f"  check tensor bytes vs hub shard files: ours {hub_bytes:,} (bf16 thinker/talker, fp32 token2wav), "
              f"files minus est. headers {stored:,}, residual {resid:+,} B -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{size}: tensor bytes differ from hub shard files by {resid} bytes")
        print(f"  note: index metadata.total_size {hub['total_size']:,} exceeds our tensor bytes by "
              f"{hub['total_size'] - hub_bytes:,} B (index quirk, see README)")
    for comp, want in hub.get("thinker_counts", {}).items():
        check(f"{comp} tensor count", counts[comp], want)
    if "thinker_total_size" in hub:
        thinker_bytes = 2 * sum(params[c] for c in COMPONENTS if c.startswith("thinker"))
        check("thinker-only total_size bytes (bf16)", thinker_bytes, hub["thinker_total_size"])
    check("talker tensor count", counts["talker"], hub["talker_count"])
    check("token2wav tensor count (+inv_freq)", counts["token2wav"] + len(HUB_ONLY_BUFFERS), hub["token2wav_count"])
    if "bigvgan_params" in hub:
        check("BigVGAN parameter count", bigvgan, hub["bigvgan_params"])
    rel = abs(total - hub["params_approx"]) / hub["params_approx"]
    print(f"  check total params ~{hub['params_approx'] / 1e9:.1f}B: {total / 1e9:.3f}B ({rel:.1%} off) -> "
          f"{'OK' if rel < 0.03 else 'MISMATCH'}")
    if rel >= 0.03:
        failures.append(f"{size}: total params {total} not within 3% of {hub['params_approx']}")
    return failures


def renaming_rules(mem: dict, saved: dict) -> collections.Counter:
    """Pair internal and written names through the tensor objects and fold them into prefix rules."""
    by_id = {id(t): n for n, t in mem.items()}
    rules = collections.Counter()
    for new, t in saved.items():
        old = by_id.get(id(t))
        if old is None or old == new:
            continue
        a, b = old.split("."), new.split(".")
        keep = []
        while a and b and a[-1] == b[-1]:
            keep.insert(0, a.pop())
            b.pop()
        if len(b) == 1 and keep:  # e.g. thinker.model.audio_tower.* -> thinker.audio_tower.*
            a.append(keep[0]), b.append(keep[0])
        rules[(".".join(a) + ".", ".".join(b) + ".")] += 1
    return rules


def tiny_save_check() -> list[str]:
    """Build a tiny full model, run save_pretrained, read the names back from the file."""
    from safetensors import safe_open

    failures: list[str] = []
    H = 64
    cfg = dict(
        enable_audio_output=True,
        thinker_config=dict(
            audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                              num_mel_bins=16, output_dim=H, max_source_positions=100, n_window=10),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H,
                               fullatt_block_indexes=[1]),
            text_config=dict(vocab_size=200, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}),
        ),
        talker_config=dict(vocab_size=120, embedding_size=H, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           rope_scaling={"mrope_section": [4, 2, 2], "rope_type": "default", "type": "default"}),
        token2wav_config=dict(
            dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, emb_dim=16,
                            num_embeds=50, mel_dim=8, enc_emb_dim=8, enc_dim=8, enc_channels=[16, 16, 16, 16, 48],
                            enc_attention_channels=8, enc_se_channels=8, look_ahead_layers=[1],
                            look_backward_layers=[0]),
            bigvgan_config=dict(mel_dim=8, upsample_initial_channel=64),
        ),
    )
    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(**cfg))
    internal = set(model.state_dict())
    predicted = set(saved_names(model, model.state_dict()))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        written = set()
        for fn in sorted(os.listdir(d)):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(d, fn), "pt") as f:
                    written.update(f.keys())
        # Round trip in the hub layout: add the DiT inv_freq buffer the hub files carry, a dummy
        # spk_dict.pt (from_pretrained requires it), and load the directory back.
        from safetensors.torch import load_file, save_file

        path = os.path.join(d, "model.safetensors")
        tensors = load_file(path)
        tensors[next(iter(HUB_ONLY_BUFFERS))] = torch.zeros(model.config.token2wav_config.dit_config.head_dim // 2)
        save_file(tensors, path, metadata={"format": "pt"})
        torch.save({"Chelsie": {"cond": torch.zeros(1)}}, os.path.join(d, "spk_dict.pt"))
        reloaded = Qwen2_5OmniForConditionalGeneration.from_pretrained(d)
        ref = model.state_dict()
        got = reloaded.state_dict()
        bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
    print("\n=== tiny model save_pretrained check")
    print(f"reload of the hub-layout directory: {len(ref) - len(bad)}/{len(ref)} tensors identical")
    if bad:
        failures.append(f"tiny: {len(bad)} tensors differ after reload, e.g. {bad[:3]}")
    print(f"internal state_dict names {len(internal)}, written names {len(written)}")
    folded = collections.Counter(component_of(n) for n in written)
    for comp in COMPONENTS + ("other",):
        print(f"  {comp:22s} {folded[comp]}")
    if written != predicted:
        failures.append("tiny: revert_weight_conversion prediction differs from the written file")
        print("  MISMATCH between predicted and written names:", sorted(written ^ predicted)[:10])
    else:
        print("  written names == names predicted by revert_weight_conversion: OK")
    if folded["other"]:
        failures.append("tiny: written names outside the hub components")
    for comp in COMPONENTS:
        ex = sorted(n for n in written if component_of(n) == comp)[:3]
        print(f"  e.g. {comp}: {ex}")
    internal_only = sorted(internal - written)
    print(f"  internal-only names (renamed on save): {len(internal_only)}, e.g. {internal_only[:3]}")
    return failures


def main() -> int:
    sys.path.insert(0, str(HERE))
    from shape_checks import verdict  # tests/data/shape_checks.py

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-tiny-save", action="store_true", help="skip the real save_pretrained round on a tiny model")
    ap.add_argument("--list-names", type=int, default=3, help="example names to print per component")
    ap.add_argument("--sizes", default="3b,7b")
    args = ap.parse_args()

    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    failures: list[str] = []
    for size in args.sizes.split(","):
        failures += report(size.strip(), args.list_names)
    if not args.no_tiny_save:
        failures += tiny_save_check()
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
