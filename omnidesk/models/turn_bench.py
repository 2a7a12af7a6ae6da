"""``omnidesk bench``: where the time of a spoken turn goes, as JSON.

Sections (all on this machine, this checkpoint, one process):

* ``stages``: compute-bound rates from driving the executor directly on a
  synthetic utterance: prefill, thinker and talker tokens/s, vocoder and
  whole-pipeline real-time factors, and the compute time from the endpoint to
  the first audio chunk without preemption.
* ``realtime``: the engine paced in real time through ``omnidesk talk``'s
  scripted microphone and virtual speaker, with and without preemptive
  replies, for a short and a long reply limit: first audio chunk and playback
  start relative to the endpoint (median over turns).
* ``interrupt``: time for ``interrupt()`` to silence the speaker and for the
  KV-cache rollback (pointer moves), medians over many interruptions.
* ``transformers``: the same checkpoint and audio through transformers'
  ``generate``, whose first audio is its whole run - if transformers is
  installed (it is a test dependency only); each family supplies its own.

Shared by the thinker-talker families: each passes a factory for its executor
(``make_executor(stack, max_reply_tokens=..., max_codec_tokens=...)``).  The per-step decode
times the benchmark scripts add (``decode_rates``) are theirs: bench/turn_bench.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import statistics
import time
import warnings

import numpy as np
import torch

from typing import Callable

from ..engine.engine import EngineConfig
from ..engine.talk import Script, run_script
from ..engine.timeline import Timeline
from .sampling import SamplingParams

UTTERANCE_S = 2.0


def synthetic_utterance(seconds: float = UTTERANCE_S, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Voiced harmonics with a moving pitch and syllable-like loudness: speech-like for the VAD and encoder."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    wave = sum(0.3 / k * np.sin(k * phase) for k in range(1, 6))
    wave = wave * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)
    return wave.astype(np.float32)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def stage_rates(make_executor: Callable, stack, audio: np.ndarray, max_text: int, max_codec: int) -> dict:
    ex = make_executor(stack, max_reply_tokens=max_text, max_codec_tokens=max_codec,
                       thinker_sampling=SamplingParams(greedy=True))
    ex.begin_user_turn()
    ex.add_user_audio(audio)
    t0 = time.perf_counter()
    ex.end_user_turn()
    prefill = time.perf_counter() - t0
    ex.start_reply()
    t_think = t_talk = t_voc = 0.0
    first_audio = None
    samples = 0
    while not (ex.thinker_done and ex.talker_done):
        a = time.perf_counter()
        if not ex.thinker_done:
            ex.thinker_step()
        b = time.perf_counter()
        code = ex.talker_step()
        c = time.perf_counter()
        chunks = ex.vocoder_step(final=ex.talker_done) if (code is not None or ex.talker_done) else []
        d = time.perf_counter()
        t_think, t_talk, t_voc = t_think + b - a, t_talk + c - b, t_voc + d - c
        samples += sum(ch.size for ch in chunks)
        if chunks and first_audio is None:
            first_audio = d - t0
    text, codes = len(ex.reply_text_ids), len(ex.reply_codec_ids)
    audio_s = samples / ex.sample_rate_out
    total = prefill + t_think + t_talk + t_voc
    return {"prefill_ms": prefill * 1e3, "text_tokens": text, "codec_tokens": codes, "audio_s": audio_s,
            "thinker_tok_s": text / t_think if t_think else None, "talker_tok_s": codes / t_talk if t_talk else None,
            "talker_x_realtime": (codes / t_talk) / (ex.sample_rate_out / ex.samples_per_code) if t_talk else None,
            "vocoder_rtf": t_voc / audio_s if audio_s else None, "pipeline_rtf": total / audio_s if audio_s else None,
            "first_audio_after_endpoint_ms_no_preemption": first_audio * 1e3 if first_audio else None}


def realtime_latency(make_executor: Callable, stack, audio: np.ndarray, turns: int, preemptive: bool,
                     limits: dict) -> dict:
    ex = make_executor(stack, **limits)
    timeline = Timeline(model={}, device=str(stack.device))
    asyncio.run(run_script(ex, Script([audio] * turns), EngineConfig(preemptive=preemptive), timeline, realtime=True))
    rows = []
    for turn in timeline.turns:
        ev = turn.events
        rows.append({
            "first_audio_chunk_ms": (ev["first_audio_chunk"] - turn.endpoint) * 1e3
            if ev["first_audio_chunk"] is not None and turn.endpoint is not None else None,
            "playback_start_ms": (ev["playback_start"] - turn.endpoint) * 1e3
            if ev["playback_start"] is not None and turn.endpoint is not None else None,
            "voice_to_voice_ms": (ev["playback_start"] - turn.user_speech_end) * 1e3
            if ev["playback_start"] is not None and turn.user_speech_end is not None else None,
            "reply_audio_s": turn.reply_audio_s, "played_audio_s": turn.played_audio_s})
    return {"preemptive": preemptive, "limits": limits, "turns": rows,
            "first_audio_chunk_ms_median": _median(r["first_audio_chunk_ms"] for r in rows),
            "playback_start_ms_median": _median(r["playback_start_ms"] for r in rows),
            "voice_to_voice_ms_median": _median(r["voice_to_voice_ms"] for r in rows)}


def interrupt_costs(make_executor: Callable, stack, audio: np.ndarray, n: int) -> dict:
    from ..engine.speaker import VirtualSpeaker

    ex = make_executor(stack, max_reply_tokens=24, max_codec_tokens=64)
    rollback, stop = [], []
    speaker = VirtualSpeaker(record=False)
    for i in range(n):
        if i % 20 == 0:
            ex.reset_conversation()
        ex.begin_user_turn()
        ex.add_user_audio(audio[:8000])
        ex.end_user_turn()
        ex.start_reply(seed=i)
        for _ in range(8):
            ex.thinker_step()
            ex.talker_step()
        speaker.start_reply()
        speaker.write(np.zeros(4800, np.float32))
        speaker.tick(960)
        t0 = time.perf_counter()
        speaker.flush()
        t1 = time.perf_counter()
        ex.interrupt(heard_samples=960)
        t2 = time.perf_counter()
        stop.append((t1 - t0) * 1e3)
        rollback.append((t2 - t1) * 1e3)
    return {"interruptions": n, "playback_stop_ms_median": _median(stop), "rollback_ms_median": _median(rollback),
            "note": "playback stops in the interrupt() call itself (speaker flush with a 5 ms fade); the worker "
                    "step in flight, at most one decode step or vocoder chunk, finishes before the rollback"}


@contextlib.contextmanager
def quiet_reference():
    """Keep the reference model's chatter (deprecation and generation-flag warnings, rope-key notes, the
    "MISSING" weights load report about its vision tower: ~30 lines about its own layout, not about the
    user's checkpoint) out of the user's terminal while it loads and generates; transformers' logging,
    its progress bars and Python's warning filters are restored afterwards.  Exceptions are not
    touched: a failing reference still says why."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no reference to quiet: the family's side says it was skipped
        yield
        return
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def run(make_executor: Callable, stack, turns: int = 3, interrupts: int = 50,
        transformers_side: Callable | None = None, codes_per_second: float = 50.0) -> dict:
    """The bench JSON for one checkpoint.  ``transformers_side(stack, audio, max_text, max_codec)``
    runs the reference (None: skipped); ``codes_per_second``: the talker's step rate, which sets
    how many steps the reply limits allow (50 for Qwen2.5-Omni's codec, 12.5 for Qwen3-Omni's frames)."""
    audio = synthetic_utterance(rate=stack.features.sampling_rate)
    # about 3 s and 12 s of speech
    short = {"max_reply_tokens": 24, "max_codec_tokens": int(3 * codes_per_second)}
    long_ = {"max_reply_tokens": 96, "max_codec_tokens": int(12 * codes_per_second)}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": str(stack.device), "dtype": str(stack.dtype).replace("torch.", "")},
        "checkpoint": str(stack.path),
        "utterance_s": UTTERANCE_S,
        "stages": stage_rates(make_executor, stack, audio, short["max_reply_tokens"], short["max_codec_tokens"]),
        "realtime": [realtime_latency(make_executor, stack, audio, turns, True, short),
                     realtime_latency(make_executor, stack, audio, turns, True, long_),
                     realtime_latency(make_executor, stack, audio, turns, False, short)],
        "interrupt": interrupt_costs(make_executor, stack, audio, interrupts),
    }
    if transformers_side is not None:
        with quiet_reference():
            ref = transformers_side(stack, audio, short["max_reply_tokens"], short["max_codec_tokens"])
        result["transformers"] = ref
        ours = result["stages"]["first_audio_after_endpoint_ms_no_preemption"]
        if "first_audio_after_endpoint_ms" in ref and ours:
            result["first_audio_ratio_transformers_over_ours_no_preemption"] = ref["first_audio_after_endpoint_ms"] / ours
            pre = result["realtime"][0]["first_audio_chunk_ms_median"]
            result["first_audio_ours_preemptive_ms"] = pre
    return result
