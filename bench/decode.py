#!/usr/bin/env python
"""Thinker decode-step benchmark: omnidesk (eager and static-shape) vs transformers.

Same checkpoint, same machine, same process, fp32 on the CPU, inference_mode.
A random text prompt of P tokens is prefilled, then each implementation
decodes greedily (argmax, chosen id turned into a Python int each step, as a
real decoder must) for ``warmup`` untimed + ``steps`` timed steps; every step
is timed on its own with time.perf_counter.  By default the implementations
take turns every 25 steps (``--schedule blocked``): each runs back to back
within its turn, and load from other processes on a shared machine hits all
of them alike.

* ours_eager:  Thinker.forward on a KVCache (attention reads the valid prefix).
* ours_static: Thinker.forward_static with an input_pos tensor (attends over the
  whole cache capacity with a mask: the CUDA-graph form; shown for reference).
* transformers: Qwen2_5OmniThinkerForConditionalGeneration (from_pretrained on
  the same directory, sdpa attention, its CPU default) driven by the exact
  per-step calls of transformers' generate loop (prepare_inputs_for_generation
  -> forward -> _update_model_kwargs_for_generation -> fp32 logits copy ->
  argmax -> append to input_ids), DynamicCache, attention_mask dropped and 4-row
  position_ids as generate computes them for an unpadded input.
* transformers_forward: the bare forward (input_ids [1,1], cache, precomputed
  position_ids, use_cache) + argmax: a lower bound without generate's bookkeeping.
* transformers_generate: the wall time of ref.generate(N tokens) as a whole.

Run:  .venv/bin/python bench/decode.py [--steps 200 --prompt 128 --warmup 20 --threads T --model DIR]
Exit status 1 when our logits differ from transformers' by more than 1e-4.

``--quant``: instead, our eager decode step with the low-VRAM weights (omnidesk/models/quant.py) against
float32 and bfloat16, same schedule: int8 made on load (``_weight_int8pack_mm``), GPTQ and AWQ 4-bit
checkpoints written by tests/quant_writer.py (round-to-nearest, group 128 where the sizes allow, else 32)
on the int4pack kernel (``_weight_int4pack_mm_for_cpu``) and on the dequantize fallback, in a float32 and a
bfloat16 model; the kernels compute in bfloat16 as shipped, and in float32 (``*_fp32_kernel``) to show why.  ``--size medium`` writes a larger checkpoint (hidden 1024, 4 layers; the
tiny one is dominated by per-op overhead).  Reported per implementation: step times, the matmul path,
and the max |logit diff| against float32 after the prompt.

      .venv/bin/python bench/decode.py --quant --size medium --steps 100 --out bench/results/decode_quant.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from report import RESULTS, load_avg, machine, report  # noqa: E402

TOL = 1e-4
CHECK_STEPS = 5  # logits compared: after prefill + 4 decode steps


# ---------------------------------------------------------------- helpers

def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(step_s: list[float], prefill_s: list[float]) -> dict:
    ms = [t * 1e3 for t in step_s]
    mean = statistics.fmean(ms)
    fastest = min(ms)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "p90_ms": round(percentile(ms, 0.9), 4),
        "mean_ms": round(mean, 4),
        "min_ms": round(min(ms), 4),
        "tokens_per_s": round(1e3 / mean, 1),
        "prefill_ms": round(statistics.median(prefill_s) * 1e3, 3),
        "steps_timed": len(ms),
        # steps over 5x the fastest one: preemption by other processes (a descheduled worker thread
        # stalls a multi-threaded op for a scheduler tick); a large share means a contended machine
        "slow_steps_frac": round(sum(m > 5 * fastest for m in ms) / len(ms), 3),
    }


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- reference (transformers)

def load_reference_thinker(path: Path, attn: str):
    """transformers' thinker, loaded by transformers' own from_pretrained (its key renaming included)."""
    import transformers
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from omnidesk.models.checkpoint import weight_files

    config = Qwen2_5OmniConfig.from_pretrained(str(path))
    config.enable_audio_output = False  # talker and vocoder are not benchmarked: do not build them
    if not any(n.startswith("thinker.visual.") for n in weight_files(path)):
        config.thinker_config.vision_config.depth = 1  # vision tower absent (e.g. the demo) and never run
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # unused talker/vocoder tensors, tiny-config id warnings
    try:
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(path), config=config, dtype=torch.float32,
                                                                    attn_implementation=attn)
    finally:
        transformers.logging.set_verbosity(verbosity)
    thinker = model.thinker.eval()
    used = thinker.config.get_text_config()._attn_implementation
    if used != attn:
        raise SystemExit(f"reference thinker runs attention '{used}', asked for '{attn}'")
    return thinker


class RefDecoder:
    """transformers' generate loop for one unpadded prompt, unrolled into prefill() and step().

    Each step is what GenerationMixin._sample does per token with greedy search:
    prepare_inputs_for_generation -> forward -> _update_model_kwargs_for_generation
    -> fp32 copy of the last logits -> argmax -> append to input_ids; plus the
    host sync (int) a streaming decoder needs.  (generate's logits processors and
    stopping criteria are not run here; see transformers_generate for the whole.)
    """

    def __init__(self, thinker, prompt_ids: torch.Tensor):
        from transformers import DynamicCache

        self.m = thinker
        self.input_ids = prompt_ids[None].clone()
        # generate: the all-ones mask is built, used for the (4-row) position ids, then dropped.
        mask = torch.ones_like(self.input_ids)
        cache = DynamicCache(config=thinker.config.get_text_config(decoder=True))
        pos = thinker._prepare_position_ids_for_generation(self.input_ids, {"attention_mask": mask, "cache": cache})
        self.kwargs = {"cache": cache, "position_ids": pos, "use_cache": True}
        self.logits = None

    def _advance(self, outputs) -> int:
        self.kwargs = self.m._update_model_kwargs_for_generation(outputs, self.kwargs)
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        next_tokens = torch.argmax(logits, dim=-1)
        self.input_ids = torch.cat([self.input_ids, next_tokens[:, None]], dim=-1)
        self.logits = logits[0]
        return int(next_tokens[0])

    def prefill(self) -> int:
        inputs = self.m.prepare_inputs_for_generation(self.input_ids, next_sequence_length=self.input_ids.shape[1],
                                                      is_first_iteration=True, **self.kwargs)
        return self._advance(self.m(**inputs, return_dict=True))

    def step(self) -> int:
        inputs = self.m.prepare_inputs_for_generation(self.input_ids, next_sequence_length=1, **self.kwargs)
        return self._advance(self.m(**inputs, return_dict=True))


class RefForwardDecoder:
    """Bare transformers forward per step (input_ids [1,1], cache, position_ids, use_cache) + argmax.

    The position ids are the ones generate would pass (4 rows: text + TMRoPE,
    plus the rope delta, which is 0 for text), precomputed outside the timing.
    """

    def __init__(self, thinker, prompt_ids: torch.Tensor, total_steps: int):
        self.m = thinker
        self.gen = RefDecoder(thinker, prompt_ids)  # its prefill is generate's
        self.p, self.total, self.i = prompt_ids.shape[0], total_steps, 0

    def prefill(self) -> int:
        self.tok = self.gen.prefill()
        self.cache = self.gen.kwargs["cache"]
        delta = self.m.model.rope_deltas.view(1, -1, 1)
        pos = torch.arange(self.p, self.p + self.total).view(1, 1, -1).expand(4, 1, -1).clone()
        pos[1:] += delta
        self.positions = [pos[..., i:i + 1].clone() for i in range(self.total)]
        return self.tok

    def step(self) -> int:
        out = self.m(input_ids=torch.tensor([[self.tok]]), cache=self.cache, position_ids=self.positions[self.i],
                     use_cache=True)
        self.i += 1
        self.cache = out.cache
        self.tok = int(torch.argmax(out.logits[0, -1]))
        return self.tok


class OursDecoder:
    """omnidesk's thinker: eager (Thinker.forward) or static-shape (Thinker.forward_static + input_pos)."""

    def __init__(self, thinker, prompt_ids: torch.Tensor, capacity: int, static: bool):
        self.m, self.prompt, self.static = thinker, prompt_ids, static
        self.cache = thinker.new_cache(capacity)
        self.table = thinker.embed_tokens.weight
        self.input_pos = torch.zeros(1, dtype=torch.long)  # persistent, as a captured graph needs
        self.logits = None

    def prefill(self) -> int:
        embeds = self.m.embed(self.prompt)
        if self.static:
            hidden = self.m.forward_static(embeds, self.cache, torch.arange(self.prompt.shape[0]))
            self.cache.length = self.prompt.shape[0]
        else:
            hidden = self.m(embeds, self.cache)
        self.logits = self.m.logits(hidden[-1])
        self.tok = int(torch.argmax(self.logits))
        return self.tok

    def step(self, token: int | None = None) -> int:
        embed = self.table[self.tok if token is None else token][None]
        if self.static:
            self.input_pos.fill_(self.cache.length)
            hidden = self.m.forward_static(embed, self.cache, self.input_pos)
            self.cache.length += 1
        else:
            hidden = self.m(embed, self.cache)
        self.logits = self.m.logits(hidden[-1])
        self.tok = int(torch.argmax(self.logits))
        return self.tok


# ---------------------------------------------------------------- checks

def check_logits(thinker, ref, prompt, capacity) -> dict:
    """Max |our logits - reference logits| over CHECK_STEPS steps, both fed the reference's greedy ids."""
    dec = RefDecoder(ref, prompt)
    eager = OursDecoder(thinker, prompt, capacity, static=False)
    static = OursDecoder(thinker, prompt, capacity, static=True)
    tok = dec.prefill()
    eager.prefill()
    static.prefill()
    d_eager, d_static = [], []
    for step in range(CHECK_STEPS):
        d_eager.append((eager.logits - dec.logits).abs().max().item())
        d_static.append((static.logits - dec.logits).abs().max().item())
        if step == CHECK_STEPS - 1:
            break
        eager.step(tok)
        static.step(tok)
        tok = dec.step()
    worst = max(d_eager + d_static)
    return {"steps": CHECK_STEPS, "tolerance": TOL, "max_abs_diff_eager": max(d_eager),
            "max_abs_diff_static": max(d_static), "per_step_eager": d_eager, "per_step_static": d_static,
            "ok": worst <= TOL}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# ---------------------------------------------------------------- low-VRAM weights (--quant)

MEDIUM = dict(  # a tiny.py variant big enough that the decoder's matmuls dominate a step
    text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, mrope_section=[16, 24, 24], rope_theta=1000000.0, tie=False),
    audio=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64),
    talker=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=24, mrope_section=[4, 4, 4]),
)


def time_decoders(makers: dict, args, total: int) -> tuple[dict, dict, dict]:
    """Prefill and decode timings of every decoder ``makers[name]()`` makes: (prefill seconds, decode
    step seconds after the warm-up, greedy ids), by name.

    Prefill: fresh prefills, cache creation included, the first round a warm-up.  Decode: all
    decoders are prefilled, then advance in blocks of ``args.block`` consecutive steps, taking turns
    in a rotating order: within a block a decoder runs back to back (warm caches, as in a real
    decode loop); across blocks, load from other processes on a shared machine hits every
    implementation alike."""
    names = list(makers)
    prefill = {k: [] for k in names}
    for r in range(args.prefill_repeats + 1):
        for name in names:
            gc.collect()
            t0 = time.perf_counter()
            makers[name]().prefill()
            if r:
                prefill[name].append(time.perf_counter() - t0)
    block = total if args.schedule == "sequential" else 1 if args.schedule == "interleaved" else args.block
    block = max(1, min(block, total))
    times = {k: [] for k in names}
    ids: dict[str, list[int]] = {}
    for r in range(args.repeats):
        gc.collect()
        decs = {n: makers[n]() for n in names}
        ids = {n: [d.prefill()] for n, d in decs.items()}
        for c, lo in enumerate(range(0, total, block)):
            k = (c + r) % len(names)
            for n in names[k:] + names[:k]:
                dec, seq, ts = decs[n], ids[n], times[n]
                for i in range(lo, min(lo + block, total)):
                    t0 = time.perf_counter()
                    tok = dec.step()
                    dt = time.perf_counter() - t0
                    seq.append(tok)
                    if i >= args.warmup:
                        ts.append(dt)
    return prefill, times, ids


def quant_main(args) -> int:
    import tiny
    import quant_writer

    from omnidesk.models.quant import quant_linears
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_avg()
    tmp = tempfile.TemporaryDirectory(prefix="omnidesk-bench-quant-")
    base = Path(tmp.name)
    t_setup = time.perf_counter()
    if args.model:
        src, variant = Path(args.model), None
    else:
        variant = "medium" if args.size == "medium" else args.variant
        if variant == "medium":
            tiny.VARIANTS["medium"] = MEDIUM
        src = base / "float"
        tiny.write_checkpoint(src, variant)
    text = json.loads((src / "config.json").read_text())["thinker_config"]["text_config"]
    dims = (text["hidden_size"], text["intermediate_size"])
    group = next(g for g in (128, 64, 32) if all(d % g == 0 for d in dims))
    quant_writer.write_quantized(src, base / "gptq", "gptq", group=group, sym=True, fast=True)
    quant_writer.write_quantized(src, base / "awq", "awq", group=group, fast=True)
    f32, bf16 = torch.float32, torch.bfloat16
    configs = {  # name -> (checkpoint, load_stack options)
        "fp32": (src, dict(dtype=f32)),
        "bf16": (src, dict(dtype=bf16)),
        "int8_fp32": (src, dict(dtype=f32, quantize="int8")),
        "int8_bf16": (src, dict(dtype=bf16, quantize="int8")),
        "int8_fp32_kernel": (src, dict(dtype=f32, quantize="int8", kernel_dtype=f32)),
        "gptq_int4_fp32": (base / "gptq", dict(dtype=f32)),
        "gptq_int4_bf16": (base / "gptq", dict(dtype=bf16)),
        "awq_int4_fp32": (base / "awq", dict(dtype=f32)),
        "gptq_int4_fp32_kernel": (base / "gptq", dict(dtype=f32, kernel_dtype=f32)),
        "gptq_int4_dequant_fp32": (base / "gptq", dict(dtype=f32, force_dequant=True)),
    }
    stacks = {name: load_stack(path, device="cpu", **kw) for name, (path, kw) in configs.items()}
    setup_s = time.perf_counter() - t_setup
    t = stacks["fp32"].config.thinker.text
    specials = [i for i in stacks["fp32"].tokenizer.special_ids.values() if 0 <= i < t.vocab_size]
    high = min(specials) if specials else t.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, high, (args.prompt,), generator=g)
    capacity = args.prompt + args.steps + args.warmup + 8
    names = list(configs)
    total = args.warmup + args.steps
    with torch.inference_mode():
        ref = OursDecoder(stacks["fp32"].thinker, prompt, capacity, static=False)
        ref.prefill()
        diffs = {}
        for name in names:
            d = OursDecoder(stacks[name].thinker, prompt, capacity, static=False)
            d.prefill()
            diffs[name] = round((d.logits - ref.logits).abs().max().item(), 6)
        makers = {n: (lambda n=n: OursDecoder(stacks[n].thinker, prompt, capacity, static=False)) for n in names}
        prefill, times, ids = time_decoders(makers, args, total)
    tmp.cleanup()
    impls = {}
    for name in names:
        st = stacks[name]
        kernels = {str(m.kernel_dtype).removeprefix("torch.") for m in quant_linears(st.model).values() if m.kernel_dtype}
        impls[name] = {**summarize(times[name], prefill[name]), "dtype": str(st.dtype).removeprefix("torch."),
                       "weights": st.quantization["summary"] if st.quantization else "float",
                       "kernel_dtype": ",".join(sorted(kernels)) or None,
                       "max_abs_logit_diff_vs_fp32_after_prompt": diffs[name],
                       "greedy_first_divergence_vs_fp32": first_divergence(ids["fp32"], ids[name])}
    fp32 = impls["fp32"]["median_ms"]
    result = {
        "benchmark": "thinker decode step, low-VRAM weights vs float (ours, eager, CPU)",
        "machine": machine("platform", "processor", "python", "cpu_count", "torch", "threads",
                           load_avg_before=load_before, load_avg_after=load_avg()),
        "checkpoint": {"source": "--model" if args.model else f"tests/tiny.py variant {variant}",
                       "thinker_hidden": t.hidden_size, "thinker_intermediate": t.intermediate_size,
                       "thinker_layers": t.num_layers, "thinker_vocab": t.vocab_size, "group_size": group,
                       "quantizer": "round-to-nearest (tests/quant_writer.py), GPTQ v1 sym and AWQ GEMM layouts"},
        "prompt_tokens": args.prompt, "decode_steps": args.steps, "warmup_steps": args.warmup,
        "repeats": args.repeats, "schedule": args.schedule, "device": "cpu",
        "implementations": impls,
        "ratio_over_fp32_median": {k: round(v["median_ms"] / fp32, 3) for k, v in impls.items()},
        "setup_s": round(setup_s, 2),
        "note": "the int4/int8 logit diffs are quantization error (random weights), not kernel error; "
                "tests/test_quant.py checks the kernels against the dequantized weights",
    }
    slow = max(v["slow_steps_frac"] for v in impls.values())
    result["contended"] = slow > 0.05
    report(result, args.out, newline=True)
    return 0


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: write tests/tiny.py's checkpoint to a temp dir)")
    ap.add_argument("--variant", default="a", help="tests/tiny.py variant when --model is not given (default a)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens P (default 128)")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps N (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed decode steps before timing (default 20)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds over all implementations; per-step times are pooled (default 2)")
    ap.add_argument("--prefill-repeats", type=int, default=5, help="prefill timings per implementation (default 5)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--ref-attn", default="sdpa", choices=["sdpa", "eager"],
                    help="transformers attention implementation (default sdpa, its CPU default)")
    ap.add_argument("--schedule", default="blocked", choices=["blocked", "interleaved", "sequential"],
                    help="blocked (default): the implementations take turns every --block steps; interleaved: "
                         "every step; sequential: each runs all its steps back to back")
    ap.add_argument("--block", type=int, default=25, help="steps per turn with --schedule blocked (default 25)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quant", action="store_true",
                    help="low-VRAM weights (int8, GPTQ/AWQ int4) against fp32/bf16 instead of transformers")
    ap.add_argument("--size", choices=["tiny", "medium"], default="tiny",
                    help="with --quant: the checkpoint written (tiny: --variant; medium: hidden 1024, 4 layers)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/decode.json, "
                                                "decode_quant.json with --quant)")
    args = ap.parse_args(argv)
    if args.prompt < 1 or args.steps < 2 or args.warmup < 0 or args.repeats < 1:
        ap.error("need --prompt >= 1, --steps >= 2, --warmup >= 0, --repeats >= 1")
    if args.out is None:
        args.out = str(RESULTS / ("decode_quant.json" if args.quant else "decode.json"))
    if args.quant:
        return quant_main(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_avg()
    torch.manual_seed(args.seed)
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    tmp = None
    t_setup = time.perf_counter()
    if args.model:
        path, variant = Path(args.model), None
    else:
        import tiny

        tmp = tempfile.TemporaryDirectory(prefix="omnidesk-bench-")
        path, variant = Path(tmp.name), args.variant
        tiny.write_checkpoint(path, variant)  # the returned (eager-attention) model is not used: load from disk
    try:
        stack = load_stack(path, device="cpu", dtype=torch.float32)
        thinker = stack.thinker
        ref = load_reference_thinker(path, args.ref_attn)
    finally:
        if tmp is not None:
            tmp.cleanup()
    setup_s = time.perf_counter() - t_setup

    text = stack.config.thinker.text
    specials = [i for i in stack.tokenizer.special_ids.values() if 0 <= i < text.vocab_size]
    high = min(specials) if specials else text.vocab_size  # ordinary text ids: no audio placeholders
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, high, (args.prompt,), generator=g)
    capacity = args.prompt + args.steps + args.warmup + 8

    result: dict = {
        "benchmark": "thinker decode step",
        "machine": machine("platform", "processor", "python", "cpu_count", "torch", "threads"),
        "checkpoint": {"path": None if variant else str(path), "variant": variant,
                       "source": f"tests/tiny.py variant {variant}" if variant else "--model",
                       "thinker_hidden": text.hidden_size, "thinker_layers": text.num_layers,
                       "thinker_heads": text.num_heads, "thinker_kv_heads": text.num_kv_heads,
                       "thinker_vocab": text.vocab_size},
        "dtype": "float32", "device": "cpu",
        "prompt_tokens": args.prompt, "decode_steps": args.steps, "warmup_steps": args.warmup,
        "repeats": args.repeats, "schedule": args.schedule,
        "block": args.block if args.schedule == "blocked" else None, "kv_capacity": capacity, "reference_attention": args.ref_attn,
    }
    try:
        import transformers
        result["machine"]["transformers"] = transformers.__version__
    except Exception:
        pass

    with torch.inference_mode():
        correctness = check_logits(thinker, ref, prompt, capacity)

        total = args.warmup + args.steps
        makers = {
            "ours_eager": lambda: OursDecoder(thinker, prompt, capacity, static=False),
            "ours_static": lambda: OursDecoder(thinker, prompt, capacity, static=True),
            "transformers": lambda: RefDecoder(ref, prompt),
            "transformers_forward": lambda: RefForwardDecoder(ref, prompt, total),
        }
        names = list(makers)

        # prefill: cache creation included (ours: KVCache; theirs: DynamicCache and generate's position ids)
        prefill, times, ids = time_decoders(makers, args, total)

        # transformers' generate as a whole: N tokens = its prefill + N-1 decode forwards
        gen_ids = None
        gen_s = []
        n_gen = args.steps
        kw = dict(max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False)
        ref.generate(prompt[None], **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
        for _ in range(max(2, args.repeats + 1)):
            gc.collect()
            out, s = timed(lambda: ref.generate(prompt[None], **kw))
            gen_s.append(s)
            gen_ids = out[0, args.prompt:].tolist()

    impls = {k: summarize(times[k], prefill[k]) for k in names}
    gen_total = statistics.median(gen_s)
    per_step = (gen_total - statistics.median(prefill["transformers"])) / (n_gen - 1)
    impls["transformers_generate"] = {
        "tokens": n_gen, "total_ms": round(gen_total * 1e3, 3), "runs_ms": [round(s * 1e3, 3) for s in gen_s],
        "per_step_ms_est": round(per_step * 1e3, 4),
        "tokens_per_s_est": round(1 / per_step, 1) if per_step > 0 else None,
        "tokens_per_s_incl_prefill": round(n_gen / gen_total, 1),
        "note": "per_step_ms_est = (median total - transformers prefill_ms) / (tokens - 1)",
    }
    result["implementations"] = impls
    slow = max(v["slow_steps_frac"] for v in impls.values() if "slow_steps_frac" in v)
    result["contended"] = slow > 0.05
    if result["contended"]:
        print(f"warning: up to {slow:.0%} of the steps ran over 5x the fastest one: the machine is busy, "
              f"the medians are not trustworthy; rerun on a quiet machine", file=sys.stderr)
    eager, static = impls["ours_eager"]["median_ms"], impls["ours_static"]["median_ms"]
    result["ratio_transformers_over_ours_eager"] = round(impls["transformers"]["median_ms"] / eager, 3)
    result["ratio_transformers_over_ours_static"] = round(impls["transformers"]["median_ms"] / static, 3)
    result["ratio_transformers_forward_over_ours_eager"] = round(impls["transformers_forward"]["median_ms"] / eager, 3)
    result["ratio_transformers_generate_over_ours_eager"] = round(per_step * 1e3 / eager, 3)
    n_cmp = 1 + args.warmup + args.steps
    result["greedy_ids"] = {
        "compared_tokens": n_cmp,
        "first_divergence": {k: first_divergence(ids["ours_eager"], v)
                             for k, v in ids.items() if k != "ours_eager"},
        "generate_first_divergence": first_divergence(ids["ours_eager"], gen_ids),
        "note": "index of the first greedy id that differs from ours_eager (null: identical)",
    }
    result["correctness"] = correctness
    result["machine"]["load_avg_before"] = load_before
    result["machine"]["load_avg_after"] = load_avg()
    result["setup_s"] = round(setup_s, 2)

    report(result, args.out, newline=True)
    if not correctness["ok"]:
        print(f"FAIL: logits differ from the reference by {max(correctness['max_abs_diff_eager'], correctness['max_abs_diff_static']):.3g} "
              f"> {TOL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
