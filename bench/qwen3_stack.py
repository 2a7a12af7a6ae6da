#!/usr/bin/env python
"""Random-weight Qwen3-Omni stack at the real 30B-A3B shapes, built on the device: thinker, talker and code2wav timings.

No download and no checkpoint files: the shapes come from the published
config.json (rebuilt in tests/data/qwen3_omni/config.json; ``--config`` takes
any Qwen3-Omni config.json, e.g. the demo's).  The model is built on the meta
device, materialised on the target device (thinker and talker in the target
dtype, bf16 on CUDA; code2wav in fp32, as ``load_stack`` does) and filled there
with seeded random values (``omnidesk.models.random_init``: norms 1, biases 0,
the rest N(0, 0.02)), so no weight ever exists on the host.

The tokenizer is a stand-in written to a temp dir: a byte-level BPE that fills
every id below the real ``<|endoftext|>`` (151643), then the Qwen3 demo's
special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` keep their
real ids; the rest come in the demo's order) and the real chat template.  The
config's token ids (audio placeholder, tts pad/bos/eos, roles, ...) are pointed
at the stand-in's ids before the config is parsed (``ids_overridden`` in the
JSON lists each change); every size, and every codec id of the talker, is the
file's.  Then the product's executor runs on it, its decode steps through the decode
runner in the mode ``--compile`` names (eager, compile, graphs).

    python3 bench/qwen3_stack.py --device cuda --compile graphs --out OUT.json    # what gpu.sh runs (eager, graphs)
    .venv/bin/python bench/qwen3_stack.py --config DEMO/config.json --device cpu  # the demo's shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from omnidesk.engine.duplex_bench import percentiles as stats  # noqa: E402
from omnidesk.models.checkpoint import DEFAULT_DEVICE_DTYPE, materialize  # noqa: E402
from omnidesk.features import FeatureConfig  # noqa: E402
from omnidesk.models.qwen2_5_omni.tokenizer import Tokenizer, write_tokenizer_files  # noqa: E402
from omnidesk.models.qwen3_omni.config import Qwen3OmniConfig  # noqa: E402
from omnidesk.models.qwen3_omni.demo import MEDIA, PREPROCESSOR, ROLE_CORPUS, SPECIAL_TOKENS, TEMPLATE  # noqa: E402
from omnidesk.models.qwen3_omni.executor import Qwen3OmniExecutor, talker_defaults  # noqa: E402
from omnidesk.models.qwen3_omni.loading import Qwen3OmniModel, Qwen3OmniStack  # noqa: E402
from omnidesk.models.qwen3_omni.memory import check_fits, estimate_memory  # noqa: E402
from omnidesk.models.random_init import init_module_  # noqa: E402
from omnidesk.models.runner import MODES  # noqa: E402
from omnidesk.models.sampling import SamplingParams  # noqa: E402
from omnidesk.models.turn_bench import realtime_latency, stage_rates, synthetic_utterance  # noqa: E402
from report import RESULTS, machine, prepare, report, write  # noqa: E402
from stacks import GB, check_fits_or_exit, device_name, memory_peaks  # noqa: E402

DEFAULT_CONFIG = ROOT / "tests" / "data" / "qwen3_omni" / "config.json"
FRAME_BUDGET_MS = 80.0  # one talker step = one 80 ms frame: slower than this is not real time
TALKER_TARGET_MS = 25.0  # talker + code predictor per frame on an H200
FIRST_AUDIO_TARGET_MS = 250.0  # endpoint -> first audio on an H200
VLLM_OMNI_FIRST_AUDIO_MS = 523.0  # vLLM-Omni's published figure for this model, for comparison
CONTEXT = 4096  # the executor's default thinker capacity
# limits of the executor runs: about 3 s of speech (the short reply of `omnidesk bench`)
REPLY_LIMITS = {"max_reply_tokens": 24, "max_codec_tokens": 38}

# config key -> stand-in tokenizer name ("role:x": the single token of role x), per config section
ID_KEYS = {
    "": {"im_start_token_id": "im_start", "im_end_token_id": "im_end", "tts_pad_token_id": "tts_pad",
         "tts_bos_token_id": "tts_bos", "tts_eos_token_id": "tts_eos", "system_token_id": "role:system",
         "user_token_id": "role:user", "assistant_token_id": "role:assistant"},
    "thinker_config": {"audio_token_id": "audio_pad", "audio_start_token_id": "audio_start",
                       "audio_end_token_id": "audio_end", "image_token_id": "image_pad",
                       "video_token_id": "video_pad", "vision_start_token_id": "vision_start",
                       "vision_end_token_id": "vision_end", "user_token_id": "role:user"},
    "talker_config": {"audio_token_id": "audio_pad", "audio_start_token_id": "audio_start",
                      "audio_end_token_id": "audio_end", "image_token_id": "image_pad",
                      "video_token_id": "video_pad", "vision_start_token_id": "vision_start",
                      "vision_end_token_id": "vision_end"},
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _now(dev: torch.device) -> float:
    """perf_counter after the device has finished everything queued so far."""
    _sync(dev)
    return time.perf_counter()


def point_ids(raw: dict, ids: dict[str, int]) -> dict[str, list[int]]:
    """Point ``raw``'s token ids at the stand-in tokenizer's (in place; sizes untouched).
    Returns ``{"section.key": [file's id, id used]}`` for every id that changed."""
    changed = {}
    for section, keys in ID_KEYS.items():
        d = raw[section] if section else raw
        for key, name in keys.items():
            if key in d and d[key] != ids[name]:
                changed[f"{section}.{key}" if section else key] = [d[key], ids[name]]
                d[key] = ids[name]
    return changed


def write_stand_in(raw: dict, root: Path) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The stand-in tokenizer, preprocessor and generation configs in ``root``; ``raw``'s ids pointed
    at them (and written there as config.json).  Returns (tokenizer ids, ids_overridden)."""
    text_vocab = raw["thinker_config"]["text_config"]["vocab_size"]
    first = raw["im_start_token_id"] - 1  # the real <|endoftext|> (151643) precedes <|im_start|>
    ids = write_tokenizer_files(root, vocab_size=text_vocab, first_special_id=first, specials=SPECIAL_TOKENS,
                                media=MEDIA, template=TEMPLATE, processor_class="Qwen3OmniMoeProcessor",
                                extra_corpus=ROLE_CORPUS)
    tok = Tokenizer.from_dir(root)
    ids = dict(ids)
    for role in ("system", "user", "assistant"):
        pieces = tok.encode(role)
        if len(pieces) != 1:  # the talker finds the user's turns by these single tokens
            raise RuntimeError(f"stand-in tokenizer: role '{role}' is {len(pieces)} tokens, expected one")
        ids[f"role:{role}"] = pieces[0]
    changed = point_ids(raw, ids)
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    (root / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["im_end"], ids["endoftext"]], "pad_token_id": ids["endoftext"]}, indent=2))
    (root / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return ids, changed


def check_memory(cfg: Qwen3OmniConfig, dev: torch.device, dtype: torch.dtype) -> dict:
    """The product's estimate, checked against the device's free memory (the host's on the CPU)."""
    est = estimate_memory(cfg, dtype, CONTEXT)
    check_fits_or_exit(est, dev, check_fits,
                       "the real shapes are for a GPU (use --config with the demo's config.json here)")
    return {"estimate_gb": round(est.total / GB, 3), "estimate_weights_gb": round(est.weights / GB, 3),
            "estimate_code2wav_gb": round(est.vocoder / GB, 3),
            "estimate_kv_cache_gb": round((est.thinker_kv + est.talker_kv) / GB, 3), "estimate_context": CONTEXT}


@torch.no_grad()
def build(config_path: Path, device: str | torch.device, dtype: torch.dtype, seed: int = 0
          ) -> tuple[Qwen3OmniStack, dict]:
    """A ready Qwen3OmniStack with seeded random weights made on ``device``, and what build knows
    (ids_overridden, memory estimate)."""
    dev = torch.device(device)
    raw = json.loads(Path(config_path).read_text())
    root = Path(tempfile.mkdtemp(prefix="omnidesk-qwen3-random-"))
    _, changed = write_stand_in(raw, root)
    cfg = Qwen3OmniConfig.from_dict(raw, str(config_path))
    if cfg.talker is None or cfg.code2wav is None:
        raise SystemExit(f"{config_path}: enable_audio_output is false (no talker): nothing to time")
    memory = check_memory(cfg, dev, dtype)
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    materialize(model.thinker, dev, dtype)  # empty storage on the device; RoPE / sinusoid buffers made there
    materialize(model.talker, dev, dtype)
    materialize(model.code2wav, dev, torch.float32)
    init_module_(model, torch.Generator(device=dev).manual_seed(seed))
    model.eval()
    features = dataclasses.replace(FeatureConfig.from_preprocessor_config(root / "preprocessor_config.json"),
                                   pad_to_longest=True)  # as load_stack reads a Qwen3-Omni preprocessor
    generation_config = json.loads((root / "generation_config.json").read_text())
    stack = Qwen3OmniStack(path=root, config=cfg, model=model, tokenizer=Tokenizer.from_dir(root), features=features,
                           generation_config=generation_config, dtype=dtype, device=dev)
    return stack, {"ids_overridden": changed, "memory": memory}


def _stop_ids(stack: Qwen3OmniStack) -> tuple[int, ...]:
    g = stack.generation_config.get("eos_token_id", stack.config.im_end_id)
    return tuple(sorted({stack.config.im_end_id, *(g if isinstance(g, list) else [g])}))


def _endless(params: SamplingParams, ids: tuple[int, ...]) -> SamplingParams:
    """``params`` that never choose ``ids`` (the stop ids): every timed reply runs its full length."""
    return dataclasses.replace(params, suppress_ids=tuple(sorted(set(params.suppress_ids) | set(ids))))


def time_prefill(stack: Qwen3OmniStack, prompt: int, seed: int) -> dict:
    """Prefill of ``prompt`` random text ids into a fresh cache as ``_forward_thinker`` runs it (the
    thinker with the talker's hidden layer, the rows' talker projection, the last logits in fp32),
    median of 3 after one untimed."""
    dev, th, talker = stack.device, stack.thinker, stack.talker
    layer = stack.config.talker.accept_hidden_layer
    text_ids = stack.config.im_start_id - 1  # every id below the specials is text
    ids = torch.randint(0, text_ids, (prompt,), generator=torch.Generator(device=dev).manual_seed(seed), device=dev)
    cache = th.new_cache(prompt + 8)
    times = []
    for i in range(4):
        cache.reset()
        t0 = _now(dev)
        embeds = th.embed(ids)
        hidden, _ = th(embeds, cache, hidden_layer=layer)
        talker.text_projection(embeds)
        logits = th.logits(hidden[-1])
        t1 = _now(dev)
        if i:
            times.append((t1 - t0) * 1e3)
    return {"prompt_tokens": prompt, "prefill_ms": round(statistics.median(times), 3),
            "prefill_ms_all": [round(x, 3) for x in times], "logits_finite": bool(torch.isfinite(logits).all())}


def make_executor(stack: Qwen3OmniStack, mode: str, thinker_sampling: SamplingParams | None = None,
                  **limits) -> Qwen3OmniExecutor:
    """The product's executor with its decode steps in ``mode``; greedy text (``thinker_sampling``'s
    choice, greedy by default) and the product's talker sampling, both with their stop ids suppressed
    so every timed reply runs its full length; compile mode waits for its background compile."""
    text = thinker_sampling or SamplingParams(greedy=True)
    ex = Qwen3OmniExecutor(stack, **limits, compile=mode, thinker_sampling=_endless(text, _stop_ids(stack)),
                           talker_sampling=_endless(talker_defaults(stack), (stack.config.talker.codec_eos_id,)))
    ex.runner.wait_ready()
    return ex


def time_decode(ex: Qwen3OmniExecutor, audio: np.ndarray, tokens: int, frames: int, warmup: int, seed: int) -> dict:
    """The decode steps as the engine calls them, through the executor's decode runner: after one user
    turn (the utterance), ``warmup`` untimed then ``tokens`` timed ``thinker_step`` calls (each the
    runner's thinker step + reading its token: one whole step), then, the text done, ``warmup`` untimed
    then ``frames`` timed ``talker_step`` calls (one 80 ms frame each: the runner's ``talker_frame`` step,
    i.e. the code predictor's G-1 sub-steps and the talker's step, + the frame's one host sync), each
    followed by ``vocoder_step`` (code2wav's push of that frame, incl. the copy to the host).  The
    device is synchronised around every timed call."""
    dev = ex.device
    ex.reset_conversation()
    ex.begin_user_turn()
    ex.add_user_audio(audio)
    ex.end_user_turn()
    context = ex.thinker_cache_length
    ex.start_reply(seed=seed)
    step_ms = []
    for i in range(warmup + tokens):
        t0 = _now(dev)
        ex.thinker_step()
        t1 = _now(dev)
        if i >= warmup:
            step_ms.append((t1 - t0) * 1e3)
    while not ex.thinker_done:
        ex.thinker_step()
    logits_finite = bool(torch.isfinite(ex.thinker.logits(ex._last_hidden)).all())
    frame_ms, push_ms, parts = [], [], []
    for i in range(warmup + frames):
        t0 = _now(dev)
        code = ex.talker_step()
        t1 = _now(dev)
        chunks = ex.vocoder_step()
        t2 = _now(dev)
        if code is None:
            raise RuntimeError(f"the talker stopped after {len(ex.reply_codec_frames)} frames (limit too low?)")
        if i >= warmup:
            frame_ms.append((t1 - t0) * 1e3)
            push_ms.append((t2 - t1) * 1e3)
            parts += chunks
    last = ex.reply_codec_frames[-1]
    hidden_finite = bool(torch.isfinite(ex._reply.talker_hidden).all())
    ex.interrupt(0)
    s, audio_out = stats(frame_ms), np.concatenate(parts)
    c2w = ex.code2wav
    thinker = {"context_tokens": context, "decode_steps": tokens, "warmup_steps": warmup, "step_ms": stats(step_ms),
               "tokens_per_s": round(1e3 / stats(step_ms)["mean"], 2), "logits_finite": logits_finite}
    talker = {"frames": frames, "warmup": warmup, "code_groups": len(last), "code_predictor_steps": len(last) - 1,
              "frame_ms": s, "frame_budget_ms": FRAME_BUDGET_MS,
              "late_frames": int(sum(ms > FRAME_BUDGET_MS for ms in frame_ms)),
              "x_realtime": round(FRAME_BUDGET_MS / s["mean"], 2), "target_p50_ms": TALKER_TARGET_MS,
              "meets_target": s["p50"] <= TALKER_TARGET_MS, "last_codes": last, "hidden_finite": hidden_finite}
    code2wav = {"frames": frames, "warmup": warmup, "samples_per_frame": c2w.samples_per_frame,
                "sliding_window": c2w.cfg.sliding_window, "push_ms": stats(push_ms),
                "x_realtime": round(FRAME_BUDGET_MS / float(np.mean(push_ms)), 2),
                "audio_samples": int(audio_out.size), "audio_finite": bool(np.isfinite(audio_out).all()),
                "audio_rms": round(float(np.sqrt(np.mean(np.square(audio_out, dtype=np.float64)))), 6)}
    return {"thinker": thinker, "talker": talker, "code2wav": code2wav}


def first_audio(ex: Qwen3OmniExecutor, audio: np.ndarray, reps: int, seed: int) -> dict:
    """Endpoint -> first audio through the executor ``ex``, no preemption, ``reps`` turns after
    one untimed.  Per turn (fresh conversation): the utterance is added first (in the product
    its blocks are encoded and prefilled while the user speaks), then, timed: end_user_turn (the
    last block + the turn's tail), start_reply (the first reply token, from the prompt's logits),
    then the engine's loop - thinker_step, talker_step, vocoder_step - until the first audio:
    the first talker_step prefills the talker (its prompt ends with reply token 1's row, so it
    waits for thinker_step 1) and makes frame 1 once the thinker has token 2's row; code2wav's
    first push gives its samples."""
    dev = ex.device
    turns = []
    for rep in range(reps + 1):
        ex.reset_conversation()
        ex.begin_user_turn()
        ex.add_user_audio(audio)
        t0 = _now(dev)
        prompt = ex.end_user_turn()
        t1 = _now(dev)
        ex.start_reply(seed=seed + rep)
        t2 = _now(dev)
        row = {"prompt_tokens": len(prompt), "context_tokens": ex.thinker_cache_length,
               "end_user_turn_ms": (t1 - t0) * 1e3, "start_reply_ms": (t2 - t1) * 1e3,
               "thinker_steps": 0, "thinker_steps_ms": 0.0, "talker_prefill_ms": None,
               "talker_first_frame_ms": None, "code2wav_first_push_ms": None, "first_chunk_samples": None,
               "total_ms": None}
        talker_calls = 0
        for _ in range(64):
            a = time.perf_counter()
            if not ex.thinker_done:
                ex.thinker_step()
                row["thinker_steps"] += 1
            b = _now(dev)
            code = ex.talker_step()
            c = _now(dev)
            talker_calls += 1
            if talker_calls == 1:
                row["talker_prefill_ms"] = (c - b) * 1e3
            row["thinker_steps_ms"] += (b - a) * 1e3
            if code is None:
                continue
            row["talker_first_frame_ms"] = (c - b) * 1e3
            chunks = ex.vocoder_step()
            d = _now(dev)
            row["code2wav_first_push_ms"] = (d - c) * 1e3
            row["first_chunk_samples"] = int(sum(ch.size for ch in chunks))
            row["first_chunk_finite"] = bool(all(np.isfinite(ch).all() for ch in chunks))
            row["total_ms"] = (d - t0) * 1e3
            break
        if talker_calls == 1 and row["talker_first_frame_ms"] is not None:
            row["talker_prefill_ms"] = None  # the prefill and frame 1 came in one call: see talker_first_frame_ms
        if rep:  # the first turn is a warm-up (first calls, allocator, cuBLAS plans)
            turns.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    ex.interrupt(0)
    keys = ("end_user_turn_ms", "start_reply_ms", "thinker_steps_ms", "talker_prefill_ms", "talker_first_frame_ms",
            "code2wav_first_push_ms", "total_ms")
    median = {}
    for k in keys:
        xs = [t[k] for t in turns if t[k] is not None]
        median[k] = round(statistics.median(xs), 3) if xs else None
    total = median["total_ms"]
    return {"turns": reps, "warmup_turns": 1, "utterance_s": round(audio.size / ex.sample_rate_in, 3),
            "median_ms": median, "per_turn": turns, "target_ms": FIRST_AUDIO_TARGET_MS,
            "vllm_omni_ms": VLLM_OMNI_FIRST_AUDIO_MS,
            "meets_target": total is not None and total <= FIRST_AUDIO_TARGET_MS}


def decode_stages(stack: Qwen3OmniStack, mode: str, audio: np.ndarray, tokens: int, frames: int, warmup: int,
                  reps: int, seed: int) -> dict:
    """thinker / talker / code2wav / first_audio through one executor whose decode steps run in
    ``mode``, with its runner's stats and how long it took to be ready (compile mode: the background
    compile; graphs: capture happens in the first steps, inside the warm-up)."""
    t0 = time.perf_counter()
    # room for the timed reply, and at least the first-audio turns' few steps
    ex = make_executor(stack, mode, max_reply_tokens=warmup + tokens + 2, max_codec_tokens=warmup + frames + 2)
    ready_s = time.perf_counter() - t0
    out = time_decode(ex, audio, tokens, frames, warmup, seed)
    out["first_audio"] = first_audio(ex, audio, reps, seed)
    out["runner"] = {"describe": ex.runner.describe(), "ready_s": round(ready_s, 2), **ex.runner.stats()}
    return out
def count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def shapes(cfg: Qwen3OmniConfig) -> dict:
    t, tk, cp, c2w, au = cfg.thinker.text, cfg.talker.text, cfg.talker.code_predictor, cfg.code2wav, cfg.thinker.audio

    def dec(d):
        out = {"hidden": d.hidden_size, "layers": d.num_layers, "heads": d.num_heads, "kv_heads": d.num_kv_heads,
               "head_dim": d.head_dim, "vocab": d.vocab_size}
        if d.num_experts:
            out.update(experts=d.num_experts, experts_per_token=d.num_experts_per_tok,
                       moe_intermediate=d.moe_intermediate_size)
        return out

    thinker, talker = dec(t), dec(tk)
    return {"thinker": thinker, "audio_encoder": {"d_model": au.d_model, "layers": au.encoder_layers},
            "talker": talker, "code_predictor": dec(cp), "code_groups": cfg.talker.num_code_groups,
            "accept_hidden_layer": cfg.talker.accept_hidden_layer,
            "code2wav": {"hidden": c2w.hidden_size, "layers": c2w.num_hidden_layers, "decoder_dim": c2w.decoder_dim,
                         "samples_per_frame": c2w.samples_per_frame}}


def run(config: Path = DEFAULT_CONFIG, device: str | None = None, dtype: str | None = None, prompt: int = 200,
        tokens: int = 100, frames: int = 100, warmup: int = 10, reps: int = 5, turns: int = 2,
        realtime: bool = True, seed: int = 0, mode: str = "eager",
        save: Callable[[dict], None] | None = None) -> dict:
    """The bench JSON.  ``save(result)`` is called after every part (the decode figures are saved
    before the real-time engine runs, so a run cut off there still reports them)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype) if dtype else DEFAULT_DEVICE_DTYPE.get(dev.type, torch.float32)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    stack, info = build(config, dev, torch_dtype, seed)
    _sync(dev)
    build_s = time.perf_counter() - t0
    after_build = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    audio = synthetic_utterance(rate=stack.features.sampling_rate)
    m = stack.model
    params = {"thinker": count(m.thinker) - count(m.thinker.audio_encoder),
              "audio_encoder": count(m.thinker.audio_encoder), "talker": count(m.talker),
              "code2wav": count(m.code2wav)}
    params["total"] = sum(params.values())
    result: dict = {"config": str(config), "device": str(dev), "device_name": device_name(dev),
                    "dtype": str(torch_dtype).removeprefix("torch."), "code2wav_dtype": "float32", "mode": mode,
                    "shapes": shapes(stack.config), "params": params, "ids_overridden": info["ids_overridden"],
                    "build_s": round(build_s, 2)}

    def record() -> None:  # memory and machine as they stand, then the JSON so far
        result["memory"] = {**info["memory"], **memory_peaks(dev, after_build)}
        result["machine"] = machine(
            "platform", "python", "torch", "cuda", cores=os.cpu_count(),
            # torch intra-op threads the timings ran with (on the CPU the executor sets cores - 1)
            threads=torch.get_num_threads(),
            gpu_memory_gb=round(torch.cuda.get_device_properties(dev).total_memory / GB, 1)
            if dev.type == "cuda" else None,
            loadavg_before=[round(x, 2) for x in load_before],
            loadavg_after=[round(x, 2) for x in os.getloadavg()])
        if save is not None:
            save(result)

    # Outside inference_mode, as the engine runs the executor (its decode state is written in place
    # from the engine's worker thread); no autograd either way (the weights do not require grad).
    with torch.no_grad():
        result["thinker"] = time_prefill(stack, prompt, seed)
        try:
            stages = decode_stages(stack, mode, audio, tokens, frames, warmup, reps, seed)
            failed = {name: s["error"] for name, s in stages["runner"]["steps"].items() if s["error"]}
            if failed:  # the runner fell back to eager for these steps: their figures are eager ones
                result["mode_error"] = failed
        except Exception as e:  # noqa: BLE001 - the eager figures still come, with the error said
            if mode == "eager":
                raise
            said = str(e).strip().splitlines()
            result["mode_error"] = {"run": f"{type(e).__name__}: {said[0] if said else ''}"}
            stages = decode_stages(stack, "eager", audio, tokens, frames, warmup, reps, seed)
        result["decode_mode"] = stages["runner"]["mode"]  # what the figures ran as
        result["thinker"].update(stages["thinker"])
        result.update({k: stages[k] for k in ("talker", "code2wav", "first_audio", "runner")})
        record()

        # then the executor-driven stage rates and the real-time engine, in the same mode
        factory = functools.partial(make_executor, mode=result["decode_mode"])
        result["executor_stages"] = stage_rates(factory, stack, audio, REPLY_LIMITS["max_reply_tokens"],
                                                REPLY_LIMITS["max_codec_tokens"])
        record()
    result["realtime"] = None
    if realtime and turns:
        result["realtime"] = []
        for preemptive in (True, False):
            r = realtime_latency(factory, stack, audio, turns, preemptive, dict(REPLY_LIMITS))
            r["turns_with_audio"] = sum(t["first_audio_chunk_ms"] is not None for t in r["turns"])
            result["realtime"].append(r)
            record()
    result["method"] = METHOD
    record()
    return result


METHOD = (
    "Random weights at the config's shapes (output is noise; the cost is these shapes'), built on the device. "
    "The decode steps run through the executor's decode runner (omnidesk/models/runner.py) in `mode`: eager, "
    "compile (torch.compile fullgraph, waited for before timing) or graphs (CUDA graphs, captured in the "
    "warm-up steps); `runner` has its stats, `decode_mode` what the figures ran as (eager where a mode failed: "
    "`mode_error`). Every timing is wall clock with the device synchronised before and after the timed call. "
    "thinker: prefill_ms is a module-level prefill of prompt_tokens random text ids (median of 3 after 1 "
    "untimed); step_ms is thinker_step after one user turn (the 2 s utterance): the runner's thinker step + "
    "reading its token, greedy, stop ids suppressed. talker: frame_ms is talker_step, one 80 ms frame = the "
    "runner's talker_frame step (the code predictor's 15 sub-steps + the talker's step, code 0 sampled with the "
    "product's talker sampling, end-of-speech suppressed) + the frame's one host sync, fed text-eos/pad after "
    "the reply; late_frames counts frames over 80 ms. code2wav: vocoder_step after each frame (one stream push "
    "incl. the copy to the host). first_audio: the same executor, no preemption, from end_user_turn to "
    "code2wav's first push (the utterance was added untimed before, as during speech). Then executor_stages "
    "(omnidesk bench's stage_rates, a ~3 s reply) and realtime (omnidesk bench's realtime_latency, preemptive "
    "then not) in the same mode; the JSON is written before them. No inference_mode (the engine runs without "
    "it). The tokenizer is a stand-in and the config's token ids point at it (ids_overridden); all sizes are "
    "the file's.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="a Qwen3-Omni config.json (default: the published 30B-A3B's, tests/data/qwen3_omni)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--dtype", help="thinker and talker dtype (default bfloat16 on CUDA, float32 on the CPU; "
                                   "code2wav is fp32)")
    p.add_argument("--prompt", type=int, default=200, help="thinker prefill tokens")
    p.add_argument("--tokens", type=int, default=100, help="timed thinker decode steps")
    p.add_argument("--frames", type=int, default=100, help="timed talker frames and code2wav pushes (80 ms each)")
    p.add_argument("--warmup", type=int, default=10, help="untimed decode steps / frames first")
    p.add_argument("--reps", type=int, default=5, help="timed first-audio turns (after one untimed)")
    p.add_argument("--turns", type=int, default=2, help="turns of each real-time engine run (0: skip them)")
    p.add_argument("--no-realtime", dest="realtime", action="store_false", help="skip the real-time engine runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default="eager", choices=MODES,
                   help="decode-step mode (omnidesk/models/runner.py): eager, compile (torch.compile) or graphs "
                        "(CUDA graphs) (default eager)")
    p.add_argument("--out", help="JSON file (default bench/results/qwen3_stack.json)")
    args = p.parse_args(argv)
    if min(args.prompt, args.tokens, args.frames, args.reps) < 1 or args.warmup < 2 or args.turns < 0:
        p.error("--prompt, --tokens, --frames and --reps must be >= 1; --warmup >= 2 (a CUDA graph is captured at "
                "a step's second call); --turns >= 0")
    out = prepare(args.out or RESULTS / "qwen3_stack.json")

    def save(result: dict) -> None:
        write(result, out)

    result = run(config=Path(args.config), device=args.device, dtype=args.dtype, prompt=args.prompt,
                 tokens=args.tokens, frames=args.frames, warmup=args.warmup, reps=args.reps, turns=args.turns,
                 realtime=args.realtime, seed=args.seed, mode=args.compile, save=save)
    report(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
