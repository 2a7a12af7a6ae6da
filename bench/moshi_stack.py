#!/usr/bin/env python
"""Random-weight Moshi stack (LM + Mimi) at the real 7B shapes, built on the device: per-frame step ms.

No download and no checkpoint files: the shapes come from the presets
(``MOSHI_7B`` in omnidesk/models/moshi/config.py, the published ``MIMI``
codec; ``--size demo``: the built-in demo's ``DEMO`` configs).  The LM is
built on the meta device and materialised on the target device in the target
dtype (bf16 on CUDA; nothing of it exists in fp32 on the host), then filled
with seeded random values (``MoshiLM.init_random_``, the demo's init); Mimi is
built on the device in fp32, as the product runs it, and filled by
``mimi.init_random_``.  Both go into the product's ``MoshiExecutor``
(sampling from the config, seed 0, no text tokenizer: the step never decodes
text), and its ``step`` - Mimi encode, temporal transformer, text sampling,
the depformer's dep_q codebooks, Mimi decode, for one 80 ms frame - is timed
on a voice-like test signal, the way the duplex engine calls it.  ``--compile``
picks how the LM's frame step runs (the decode runner's mode: eager, compile,
graphs); the JSON reports the mode and the runner's counts (calls per mode,
compiles, recompiles, graphs captured, warm-up seconds).

    python3 bench/moshi_stack.py --size 7b --device cuda --compile graphs --out bench/results/moshi_7b.json
    .venv/bin/python bench/moshi_stack.py --size demo --device cpu
    .venv/bin/python bench/moshi_stack.py --size 7b --device cpu --layers 1 --depformer-layers 1 --frames 5 --warmup 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from duplex import time_stages  # noqa: E402

from omnidesk.engine.duplex_bench import percentiles as stats, speech_like, time_steps  # noqa: E402

from omnidesk.models.checkpoint import DEFAULT_DEVICE_DTYPE, materialize  # noqa: E402
from omnidesk.models.moshi.config import DEMO as LM_DEMO  # noqa: E402
from omnidesk.models.moshi.config import MOSHI_7B, MoshiConfig  # noqa: E402
from omnidesk.models.moshi.executor import (SMALL_MODEL_PARAMS, MoshiExecutor, check_fits,  # noqa: E402
                                            estimate_memory)
from omnidesk.models.moshi.lm import MoshiLM  # noqa: E402
from omnidesk.models.moshi.mimi import DEMO as MIMI_DEMO  # noqa: E402
from omnidesk.models.moshi.mimi import MIMI, Mimi, MimiConfig, init_random_  # noqa: E402
from omnidesk.models.runner import MODES  # noqa: E402
from report import RESULTS, machine, prepare, report, write  # noqa: E402
from stacks import GB, check_fits_or_exit, device_name, memory_peaks  # noqa: E402

SIZES: dict[str, tuple[MoshiConfig, MimiConfig]] = {"7b": (MOSHI_7B, MIMI), "demo": (LM_DEMO, MIMI_DEMO)}
TARGET_MS = {"7b": 40.0, "demo": 20.0}  # 7B on an H200: half a frame; the demo: duplex.py's target


def configs(size: str, layers: int | None = None, depformer_layers: int | None = None
            ) -> tuple[MoshiConfig, MimiConfig]:
    """The LM and Mimi configs of ``size``, with the layer counts overridden (shape checks on a small machine)."""
    lm_cfg, mimi_cfg = SIZES[size]
    if layers:
        lm_cfg = replace(lm_cfg, num_layers=layers)
    if depformer_layers:
        lm_cfg = replace(lm_cfg, depformer_num_layers=depformer_layers)
    return lm_cfg, mimi_cfg


@torch.no_grad()
def build(lm_cfg: MoshiConfig, mimi_cfg: MimiConfig, device: str | torch.device = "cpu",
          dtype: torch.dtype | None = None, context: int | None = None, seed: int = 0,
          mode: str = "eager") -> MoshiExecutor:
    """A ready MoshiExecutor with seeded random weights, every tensor made on ``device``, its frame
    step run in runner ``mode`` (eager, compile, graphs).

    The product's memory estimate is checked first: on CUDA against the free device memory
    (``check_fits``, as load_moshi does), on the CPU against the host's free memory."""
    dev = torch.device(device)
    dtype = dtype or DEFAULT_DEVICE_DTYPE.get(dev.type, torch.float32)
    check_fits_or_exit(estimate_memory(lm_cfg, dtype, context, mimi_cfg), dev, check_fits,
                       "cut it with --layers / --depformer-layers (real widths, fewer layers) or use --dtype bfloat16")
    with torch.device("meta"):
        lm = MoshiLM(lm_cfg)
    materialize(lm, dev, dtype)  # as load_moshi_lm does: empty storage on the device, RoPE buffers moved
    lm.init_random_(seed).eval()
    with torch.device(dev):
        mimi = Mimi(mimi_cfg)  # fp32, as the product runs it; small (96 M numbers at the real size)
    init_random_(mimi, torch.Generator(device=dev).manual_seed(seed + 1))
    mimi.requires_grad_(False).eval()
    if dev.type == "cpu" and sum(p.numel() for p in lm.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)  # what load_moshi does for a model this small on the CPU
    # the runner mode named outright (not the user's auto/off/on setting): the bench compares modes
    return MoshiExecutor(lm, mimi, tokenizer=None, sampling=lm_cfg.sampling, seed=seed, context=context,
                         compile=mode)


def _calls(ex: MoshiExecutor) -> dict[str, int]:
    return dict(ex.runner.steps["moshi_frame"].stats.calls)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def run(size: str = "7b", device: str | None = None, dtype: str | None = None, frames: int = 250,
        warmup: int = 25, context: int | None = None, layers: int | None = None,
        depformer_layers: int | None = None, threads: int | None = None, stages: bool = True,
        inference_mode_pass: bool = True, mode: str = "eager", out: Path | None = None) -> dict:
    """Build the stack and time ``frames`` frames of ``executor.step`` after ``warmup`` untimed ones,
    then (``stages``) the same frames again taken apart into encode / LM / decode, then
    (``inference_mode_pass``, eager only) ``executor.step`` again inside ``torch.inference_mode``.

    The LM's frame step runs in runner ``mode``; compile mode waits for its compile before timing.
    The JSON is written to ``out`` after every part, so a run cut off later still reports what it
    measured; a part that fails is named under ``errors``.  If the step fails in a non-eager mode,
    the runner is switched to eager and the step timed again (``fallback``)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype) if dtype else DEFAULT_DEVICE_DTYPE.get(dev.type, torch.float32)
    lm_cfg, mimi_cfg = configs(size, layers, depformer_layers)
    warmup = max(warmup, lm_cfg.max_delay + 1)  # no audio comes out while the delays fill: never timed
    estimate = estimate_memory(lm_cfg, torch_dtype, context, mimi_cfg)
    result: dict = {
        "size": size,
        "device": str(dev),
        "device_name": device_name(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "mimi_dtype": "float32",
        "mode": mode,
        "config": {"dim": lm_cfg.dim, "num_layers": lm_cfg.num_layers, "num_heads": lm_cfg.num_heads,
                   "depformer_dim": lm_cfg.depformer_dim, "depformer_num_layers": lm_cfg.depformer_num_layers,
                   "text_card": lm_cfg.text_card, "n_q": lm_cfg.n_q, "dep_q": lm_cfg.dep_q, "card": lm_cfg.card,
                   "mimi_d_model": mimi_cfg.transformer.d_model, "mimi_layers": mimi_cfg.transformer.num_layers,
                   # True when --layers / --depformer-layers cut the stack: not the real model's step
                   "layers_overridden": bool(layers or depformer_layers)},
        # numbers in the checkpoint files these shapes would have (Mimi's codebooks included)
        "params": {"lm": estimate.lm_params, "mimi": estimate.mimi_params},
        "frames": frames, "warmup": warmup,
        "errors": {},
    }

    def save() -> None:
        write(result, out)

    save()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        ex = build(lm_cfg, mimi_cfg, dev, torch_dtype, context, mode=mode)
    except BaseException as e:  # SystemExit too (it does not fit): the JSON says why there are no figures
        result["errors"]["build"] = _error(e)
        save()
        raise
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    result["build_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    ex.runner.wait_ready()  # compile mode: the step compiles in the background from the executor's start
    result["compile_wait_s"] = round(time.perf_counter() - t0, 2)
    if threads:
        torch.set_num_threads(threads)
    after_build = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    frame_ms = 1e3 * ex.frame_samples_in / ex.sample_rate_in
    target = TARGET_MS[size]
    result.update({
        "context": ex.gen.cache.capacity,
        "context_s": round(ex.gen.cache.capacity * frame_ms / 1e3, 2),
        "sampling": {"greedy": ex.sampling.greedy, "text_top_k": ex.sampling.text_top_k,
                     "audio_top_k": ex.sampling.audio_top_k, "seed": ex.seed},
        "frame_ms": frame_ms, "target_p50_ms": target, "runner": ex.runner.stats(),
    })
    save()

    inputs = speech_like(warmup + frames, ex.sample_rate_in, ex.frame_samples_in)
    before = _calls(ex)
    try:
        step, _ = time_steps(ex, inputs, warmup, ex.device)
    except Exception as e:  # noqa: BLE001 - named in the JSON; the eager figures still come
        if mode == "eager":
            raise
        result["errors"]["step"] = _error(e)
        result["fallback"] = "eager"
        save()
        ex.runner.mode = "eager"  # the runner's one switch: every step runs its plain function from now on
        before = _calls(ex)
        step, _ = time_steps(ex, inputs, warmup, ex.device)
    step_stats = stats(step)
    result.update({
        "step_ms": step_stats,
        # calls of the frame step per mode in that pass (warm-up frames included): what actually ran
        "step_calls": {m: n - before[m] for m, n in _calls(ex).items()},
        "late_frames": int(sum(ms > frame_ms for ms in step)),
        "meets_target": step_stats["p50"] <= target,
        "runner": ex.runner.stats(), "decode": ex.runner.describe(),
    })
    save()

    if stages:
        try:
            staged = time_stages(ex, inputs, warmup)
            result["stages_ms"] = {
                "timer": "cuda events between stage marks" if dev.type == "cuda" else "perf_counter",
                "encode": stats(staged["encode"]), "lm": stats(staged["lm"]), "decode": stats(staged["decode"]),
                "step": stats(staged["step"])}
        except Exception as e:  # noqa: BLE001
            result["errors"]["stages"] = _error(e)
        save()
    try:
        last = ex.step(inputs[-1])  # one more frame, untimed: is what comes out sane (random weights: noise)?
        result["output"] = {
            "audio_finite": bool(np.isfinite(last.audio).all()),
            "audio_rms": round(float(np.sqrt(np.mean(np.square(last.audio, dtype=np.float64)))), 6),
            "audio_samples": int(last.audio.shape[0]), "text_token": last.text_token,
            "text_logits_finite": bool(torch.isfinite(ex.gen.text_logits).all())}
    except Exception as e:  # noqa: BLE001
        result["errors"]["output"] = _error(e)
    # Not the product's call: what running the engine's step in inference_mode would give.  Eager
    # only: a compiled step guards on the grad mode (it would recompile) and a graph replay ignores it.
    result["step_ms_inference_mode"] = None
    if inference_mode_pass and ex.runner.mode == "eager":
        try:
            with torch.inference_mode():
                step_im, _ = time_steps(ex, inputs, warmup, ex.device)
            result["step_ms_inference_mode"] = stats(step_im)
        except Exception as e:  # noqa: BLE001
            result["errors"]["inference_mode"] = _error(e)
    load_after = os.getloadavg()

    memory = {"estimate_gb": round(estimate.total / GB, 3),  # the product's check_fits estimate
              "estimate_weights_gb": round(estimate.weights / GB, 3),
              "estimate_kv_cache_gb": round(estimate.kv_cache / GB, 3),
              "kv_cache_gb": round(ex.gen.cache.nbytes / GB, 3),
              **memory_peaks(dev, after_build)}
    how = {"eager": "The frame step runs eagerly (no torch.compile, no CUDA graphs).",
           "compile": "The LM's frame step runs torch.compile'd (fullgraph), compiled before timing "
                      "(compile_wait_s); Mimi stays eager.",
           "graphs": "The LM's frame step (temporal transformer, text choice, the depformer's dep_q "
                     "sub-steps) replays one captured CUDA graph per frame, and Mimi's encode and decode one "
                     "each (each captured at its second call, in the warm-up)."}[mode]
    result.update({
        "runner": ex.runner.stats(), "decode": ex.runner.describe(),
        "memory": memory,
        "machine": machine("torch", "cuda", "threads", "cores", loadavg_before=[round(x, 2) for x in load_before],
                           loadavg_after=[round(x, 2) for x in load_after]),
        "method": (
            f"step_ms: wall clock of MoshiExecutor.step (the duplex engine's call) per frame, {frames} frames "
            f"after {warmup} untimed warm-up frames (the first {lm_cfg.max_delay} produce no audio while the "
            "LM's delays fill; CUDA/cuBLAS start-up costs and graph capture fall in the warm-up); the device "
            "is synchronised between frames only, the step's own syncs are the text token and the audio "
            f"copied to the host. {how} stages_ms: a second pass over the same frames with the step taken "
            "apart (encode, LM incl. the text token's sync, decode incl. the audio's copy to the host); its "
            "step is that pass's wall clock. step_ms_inference_mode: a third pass of executor.step inside "
            "torch.inference_mode (eager runs only) - not how the engine calls it (no_grad only), what that "
            "would gain. The temporal attention always spans the whole context (a fixed-shape ring with a "
            "mask), so a frame costs the same early and late in a conversation. Random weights: the output "
            "is noise, the cost is the real one for these shapes."),
    })
    save()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="7b",
                   help="7b: the published Moshi 7B + Mimi shapes; demo: the built-in demo's")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--dtype", help="the LM's dtype (default bfloat16 on CUDA, float32 on the CPU; Mimi is fp32)")
    p.add_argument("--frames", type=int, default=250, help="timed frames (250 = 20 s of audio)")
    p.add_argument("--warmup", type=int, default=25, help="untimed frames first")
    p.add_argument("--context", type=int, help="temporal attention span in frames (default: the config's)")
    p.add_argument("--layers", type=int, help="temporal layers instead of the config's (a shape check on the CPU)")
    p.add_argument("--depformer-layers", type=int, help="depformer layers instead of the config's")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: as load_moshi chooses)")
    p.add_argument("--no-stages", dest="stages", action="store_false", help="skip the per-stage pass")
    p.add_argument("--no-inference-mode-pass", dest="inference_mode_pass", action="store_false",
                   help="skip the pass of executor.step inside torch.inference_mode")
    p.add_argument("--compile", choices=MODES, default="eager",
                   help="how the LM's frame step runs: eager, compile (torch.compile) or graphs (CUDA graphs, "
                        "CUDA only) (default eager)")
    p.add_argument("--out", help="JSON file (default bench/results/moshi_<size>.json), written after every part")
    args = p.parse_args(argv)
    if args.frames < 1 or args.warmup < 0:
        p.error("--frames must be >= 1 and --warmup >= 0")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile == "graphs" and torch.device(device).type != "cuda":
        p.error("--compile graphs needs a CUDA device (use compile or eager on the CPU)")
    out = prepare(args.out or RESULTS / f"moshi_{args.size}.json")
    result = run(size=args.size, device=device, dtype=args.dtype, frames=args.frames, warmup=args.warmup,
                 context=args.context, layers=args.layers, depformer_layers=args.depformer_layers,
                 threads=args.threads, stages=args.stages, inference_mode_pass=args.inference_mode_pass,
                 mode=args.compile, out=out)
    report(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
