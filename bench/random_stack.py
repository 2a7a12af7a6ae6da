#!/usr/bin/env python
"""Random-weight Qwen2.5-Omni stacks of the real 3B / 7B shapes, built directly on the device.

No download and no checkpoint files for the weights: the real config.json
(tests/data/qwen2_5_omni_{3b,7b}) gives the shapes, our modules are built on
the meta device and materialised on the target device in the target dtype
(the vocoder in fp32, as always), and filled with seeded random values
(omnidesk/models/random_init.py, the init of the demo and of the real-size test
checkpoint).  The tokenizer is a small stand-in written to a temp dir (the
model's vocabulary is larger than the tokenizer's, as with the real files); the
voices are random, in the published spk_dict.pt shapes (cond [1, 192], ref_mel
[1, 400, 80]), read through the loader's voice check.  Then `omnidesk bench`
runs on it and the JSON lands in --out.

``--quantize int4`` / ``int8`` builds the thinker's decoder linears as the low-VRAM paths hold them
(omnidesk/models/quant.py): random 4-bit values in groups of 128 with fp16 scales (the layout of the
published GPTQ/AWQ 7B), or random int8 with per-row scales, written straight into QuantLinear on the
device; their float weights are never allocated, so the peak GPU memory is that of the quantized
model.

    python3 bench/random_stack.py --size 7b --device cuda --dtype bfloat16 --out results/7b.json
    python3 bench/random_stack.py --size 7b --device cuda --dtype bfloat16 --quantize int4 --out results/7b_int4.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor  # noqa: E402
from omnidesk.models.sampling import SamplingParams  # noqa: E402
from omnidesk.models.turn_bench import run as run_turn_bench, synthetic_utterance  # noqa: E402
from report import prepare, write  # noqa: E402
from turn_bench import decode_rates  # noqa: E402
from omnidesk.models.qwen2_5_omni.config import OmniConfig  # noqa: E402
from omnidesk.models.qwen2_5_omni.demo import PREPROCESSOR  # noqa: E402
from omnidesk.features import FeatureConfig  # noqa: E402
from omnidesk.models.checkpoint import materialize  # noqa: E402
from omnidesk.models.qwen2_5_omni.loading import (OmniModel, OmniStack, VoiceDims, quantizable_linears,  # noqa: E402
                                                   voice_from_entry)
from omnidesk.models.quant import IntWeights, describe_paths, path_summary, replace_linears  # noqa: E402
from omnidesk.models.random_init import INIT_STD, init_module_  # noqa: E402

GROUP = 128  # the published 4-bit checkpoints' group size


def group_for(k: int) -> int:
    """GROUP where it divides in_features (the real shapes); else the largest kernel group size that does, else one
    group (the demo's sizes: that layer then runs the dequantize path)."""
    return next((g for g in (GROUP, 64, 32) if k % g == 0), k)
from omnidesk.models.qwen2_5_omni.tokenizer import Tokenizer, write_tokenizer_files  # noqa: E402


@torch.no_grad()
def fill_quantized(modules: dict, linears: list, device: torch.device, dtype: torch.dtype, mode: str, seed: int) -> None:
    """Random quantized weights about as large as INIT_STD floats: int4 q - 8 in [-8, 7] (std ~4.6), int8 in
    [-127, 127] (std ~73), each times a constant scale."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for lin in linears:
        m = modules[lin.module]
        n, k = lin.out_features, lin.in_features
        if mode == "int4":
            group = group_for(k)
            groups = k // group
            q = torch.randint(0, 16, (n, k), generator=g, device=device, dtype=torch.uint8)
            w = IntWeights(q, torch.full((groups, n), 8, dtype=torch.int16, device=device),
                           torch.full((groups, n), INIT_STD / 4.6, dtype=torch.float16, device=device),
                           torch.arange(k, device=device) // group)
            m.set_int4(w, device, dtype)
            del q, w
        else:
            m.alloc_int8(device, dtype)
            m.weight_int8.random_(-127, 128, generator=g)
            m.weight_scales.fill_(INIT_STD / 73)


def build(config_path: Path, device: str, dtype: torch.dtype, seed: int = 0, quantize: str | None = None) -> OmniStack:
    raw = json.loads(config_path.read_text())
    text_vocab = raw["thinker_config"]["text_config"]["vocab_size"]
    first = raw["thinker_config"]["audio_token_index"] - 3  # where the real added tokens begin
    tmp = Path(tempfile.mkdtemp(prefix="omnidesk-random-"))
    ids = write_tokenizer_files(tmp, vocab_size=text_vocab, first_special_id=first)
    (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    # The stand-in tokenizer orders its special tokens its own way: point the config's ids at them
    # (same shapes, and every id still comes from config + tokenizer, as at run time).
    th, tk = raw["thinker_config"], raw["talker_config"]
    th.update(audio_token_index=ids["audio"], audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"])
    tk.update(tts_text_start_token_id=ids["tts_text_bos"], tts_text_end_token_id=ids["tts_text_eod"],
              tts_text_pad_token_id=ids["tts_text_pad"])
    cfg = OmniConfig.from_dict(raw, str(config_path))
    with torch.device("meta"):
        model = OmniModel(cfg)
    dev = torch.device(device)
    linears = [lin for lin in quantizable_linears(cfg) if lin.module.startswith("thinker.")] if quantize else []
    qmodules = replace_linears(model, [lin.module for lin in linears])  # no float weights for these
    materialize(model.thinker, dev, dtype)
    materialize(model.talker, dev, dtype)
    materialize(model.vocoder, dev, torch.float32)
    init_module_(model, torch.Generator(device=dev).manual_seed(seed))
    if quantize:
        fill_quantized(qmodules, linears, dev, dtype, quantize, seed)
    model.eval()
    cpu = torch.Generator().manual_seed(seed)
    dims = VoiceDims.of(cfg)
    voices = {}
    for i, name in enumerate(("Chelsie", "Ethan")):
        entry = {"bos_token": ids[f"speaker_{i}"], "cond": torch.randn(1, dims.cond, generator=cpu),
                 "ref_mel": torch.randn(1, 400, dims.mel, generator=cpu)}
        voices[name] = voice_from_entry(name, entry, dims, "random voices")
    return OmniStack(path=tmp, config=cfg, model=model, tokenizer=Tokenizer.from_dir(tmp),
                     features=FeatureConfig.from_preprocessor_config(tmp / "preprocessor_config.json"),
                     voices=voices, generation_config={}, dtype=dtype, device=dev,
                     quantization=None if not quantize else {
                         "format": quantize, "label": f"random {quantize}", "group_size": GROUP if quantize == "int4" else None,
                         "desc_act": False, "linears": len(qmodules), "paths": path_summary(model),
                         "summary": f"random {quantize}: {describe_paths(path_summary(model))}"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["3b", "7b"], help="real shapes from tests/data")
    p.add_argument("--config", help="any config.json instead of --size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--interrupts", type=int,
                   help="interruptions timed (default 50 on a GPU; 3 on the CPU, where a real-size stack runs "
                        "~1 token/s and the run is a smoke test that every stage works at these shapes)")
    p.add_argument("--quantize", choices=["none", "int4", "int8"], default="none",
                   help="the thinker's decoder linears in 4 bits (group 128, as the published GPTQ/AWQ 7B) or int8")
    p.add_argument("--compile", default="eager",
                   help="decode-step modes to time, comma-separated: eager, compile, graphs (CUDA) (default eager)")
    p.add_argument("--tokens", type=int, default=64, help="timed thinker decode steps per mode")
    p.add_argument("--codes", type=int, default=150, help="timed talker decode steps per mode (50 per second of speech)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    config = Path(args.config) if args.config else ROOT / "tests" / "data" / f"qwen2_5_omni_{args.size}" / "config.json"
    out = prepare(args.out)
    result: dict = {"config": str(config)}

    def save() -> None:  # after every part: a run cut off by its timeout still reports what it measured
        if torch.cuda.is_available():
            result["gpu"] = {"name": torch.cuda.get_device_name(),
                             "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                             "max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
        write(result, out)

    t0 = time.perf_counter()
    quantize = None if args.quantize == "none" else args.quantize
    stack = build(config, args.device, getattr(torch, args.dtype), quantize=quantize)
    result["build_s"] = built = time.perf_counter() - t0
    result["quantization"] = stack.quantization  # None: float weights; else format and matmul paths
    print(f"built in {built:.1f} s" + (f"; weights: {stack.quantization['summary']}" if quantize else ""),
          file=sys.stderr)
    from omnidesk.models.qwen2_5_omni.memory import estimate_memory

    estimate = estimate_memory(stack.config, stack.dtype, 8192, quantization=quantize, group_size=GROUP)
    result["memory_estimate_gb"] = {"total_8192_tokens": estimate.total / 1e9, "weights": estimate.weights / 1e9,
                                    "vocoder": estimate.vocoder / 1e9}
    save()
    # the decode steps in each mode first (bounded, seconds), then the real-time runs
    audio = synthetic_utterance(rate=stack.features.sampling_rate)
    modes = [m for m in args.compile.split(",") if m]
    result["decode"] = {}
    for mode in modes:
        t0 = time.perf_counter()
        try:
            ex = QwenOmniExecutor(stack, capacity=1024, max_reply_tokens=64, max_codec_tokens=args.codes + 16,
                                  thinker_sampling=SamplingParams(greedy=True), compile=mode)
            ex.runner.wait_ready()  # compile mode: compiled in the background from the executor's start
            first = decode_rates(ex, audio, tokens=16, codes=16, warmup=4, vocoder=False)  # captures / compiles
            rates = decode_rates(ex, audio, tokens=args.tokens, codes=args.codes)
            rates["warm_up"] = {"first_pass": first, "seconds": round(time.perf_counter() - t0, 2)}
            result["decode"][mode] = rates
            del ex
        except Exception as e:  # noqa: BLE001 - the other modes and parts still report
            result["decode"][mode] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{mode}: {json.dumps({k: v for k, v in result['decode'][mode].items() if k.endswith('_ms')})}",
              file=sys.stderr)
        save()
    eager, fast = result["decode"].get("eager", {}), result["decode"].get(modes[-1], {})
    if eager.get("thinker_ms") and fast.get("thinker_ms") and modes[-1] != "eager":
        result["speedup_over_eager"] = {
            "mode": modes[-1],
            "thinker": round(eager["thinker_ms"]["p50"] / fast["thinker_ms"]["p50"], 2),
            "talker": round(eager["talker_ms"]["p50"] / fast["talker_ms"]["p50"], 2)}
        save()
    interrupts = args.interrupts if args.interrupts is not None else (50 if stack.device.type == "cuda" else 3)
    if args.turns:
        # the stages and the real-time engine in the fastest mode asked for
        make = functools.partial(QwenOmniExecutor, compile=modes[-1] if modes else None)
        result.update(run_turn_bench(make, stack, turns=args.turns, interrupts=interrupts, codes_per_second=50.0))
        save()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
