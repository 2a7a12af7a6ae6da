"""The bench-only part of the turn benchmark: per-step decode times of a turn-based executor
(Qwen2.5-Omni, Qwen3-Omni), as bench/decode_runner.py and bench/random_stack.py time them.

The rest of the turn benchmark (``run``, ``stage_rates``, ``realtime_latency``,
``synthetic_utterance``) is ``omnidesk bench`` itself and stays in the product,
:mod:`omnidesk.models.turn_bench`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omnidesk.engine.duplex_bench import percentiles, sync  # noqa: E402


def decode_rates(ex, audio: np.ndarray, tokens: int = 64, codes: int = 100, warmup: int = 8,
                 vocoder: bool = True) -> dict:
    """Per-step times of the executor's decode steps, as the engine calls them (so through its decode
    runner, in whatever mode it runs): ``warmup`` untimed then ``tokens`` timed ``thinker_step`` calls,
    then ``codes`` timed ``talker_step`` calls (the thinker's text is done by then: the talker reads the
    reply rows, then text-eos/pad), then the vocoder over the codes as ``vocoder_step`` hands them over.

    Stop ids are switched off, so a random model's replies run their full length.  A step's time
    includes the one host sync that reads the previous step's token, so in steady state it is one whole
    step.  Bounded by the counts given: nothing here runs in real time."""
    ex.stop_ids, ex.talker_stop_ids = set(), set()
    ex.max_reply_tokens = warmup + tokens + 1
    ex.max_codec_tokens = warmup + codes + 1
    ex.reset_conversation()
    ex.begin_user_turn()
    ex.add_user_audio(audio)
    ex.end_user_turn()
    ex.start_reply()
    thinker_ms = []
    for i in range(warmup + tokens):
        t0 = time.perf_counter()
        ex.thinker_step()
        t1 = time.perf_counter()
        if i >= warmup:
            thinker_ms.append((t1 - t0) * 1e3)
    while not ex.thinker_done:
        ex.thinker_step()
    talker_ms = []
    for i in range(warmup + codes):
        t0 = time.perf_counter()
        if ex.talker_step() is None:
            break
        t1 = time.perf_counter()
        if i >= warmup:
            talker_ms.append((t1 - t0) * 1e3)
    sync(ex.device)
    out = {"thinker_steps": len(thinker_ms), "talker_steps": len(talker_ms), "warmup": warmup,
           "thinker_ms": percentiles(thinker_ms) if thinker_ms else None,
           "talker_ms": percentiles(talker_ms) if talker_ms else None,
           "talker_x_realtime": round((1e3 / ex.sample_rate_out * ex.samples_per_code)
                                      / float(np.mean(talker_ms)), 2) if talker_ms else None}
    runner = getattr(ex, "runner", None)
    if runner is not None:
        out["runner"] = runner.stats()
    if vocoder and talker_ms:  # every code at once, the way the last push of a reply goes
        t0 = time.perf_counter()
        chunks = ex.vocoder_step(final=True)
        elapsed = time.perf_counter() - t0
        audio_s = sum(c.size for c in chunks) / ex.sample_rate_out
        out["vocoder"] = {"chunks": len(chunks), "ms": round(elapsed * 1e3, 2), "audio_s": round(audio_s, 3),
                          "rtf": round(elapsed / audio_s, 4) if audio_s else None}
    ex.interrupt(0)
    return out
