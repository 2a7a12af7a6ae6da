#!/usr/bin/env python
"""Vocoder benchmark: streaming token2wav (ours) vs whole-reply token2wav (ours and transformers).

Same checkpoint, same codes, same voice, same machine, one process, fp32 CPU.

* first chunk: codes arrive one at a time as fast as the vocoder takes them
  (compute-bound); reported are the number of codes the first chunk needs and
  the compute time from the first code to the first chunk.  In the app the
  codes come at the talker's rate, so the wall time to first audio is the
  talker's time for those codes plus this compute time.
* streaming RTF: all compute time of the stream / seconds of audio.
* offline: the whole reply at once - ours and transformers' Qwen2_5OmniToken2WavModel.

Run:  .venv/bin/python bench/vocoder.py [--codes 250 --repeats 3 --threads T --model DIR --out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from report import RESULTS, machine, report  # noqa: E402


def run_stream(vocoder, voice, codes: list[int], seed: int) -> dict:
    stream = vocoder.stream(voice, seed=seed)
    t0 = time.perf_counter()
    first = None
    samples = 0
    for i, code in enumerate(codes):
        for chunk in stream.push([code]):
            if first is None:
                first = {"codes": i + 1, "ms": (time.perf_counter() - t0) * 1000}
            samples += chunk.numel()
    for chunk in stream.flush():
        samples += chunk.numel()
    total = time.perf_counter() - t0
    seconds = samples / (vocoder.hop_length * 100)
    return {"first_chunk_codes": first["codes"] if first else None, "first_chunk_ms": first["ms"] if first else None,
            "total_ms": total * 1000, "audio_s": seconds, "rtf": total / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (default: tests/tiny.py variant 'a' written by transformers)")
    parser.add_argument("--codes", type=int, default=250, help="reply length in codec tokens (50 per second)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", default=str(RESULTS / "vocoder.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnidesk.models.qwen2_5_omni.loading import load_stack
    from omnidesk.models.qwen2_5_omni.vocoder import StreamingPlan

    if args.model:
        path = Path(args.model)
    else:
        import tiny

        path = Path(tempfile.mkdtemp(prefix="omnidesk-bench-"))
        tiny.write_checkpoint(path, "a")
    stack = load_stack(path)
    vocoder = stack.vocoder
    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    v = stack.voices[stack.default_voice]
    voice = vocoder.voice(v.cond, v.ref_mel)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, stack.config.talker.codec_pad_id, (args.codes,), generator=g)

    run_stream(vocoder, voice, codes[:60].tolist(), 0)  # warm-up
    streams = [run_stream(vocoder, voice, codes.tolist(), seed) for seed in range(args.repeats)]
    ours_offline, ref_offline = [], []
    for seed in range(args.repeats):
        t0 = time.perf_counter()
        wave = vocoder.offline(codes, voice, seed=seed)
        ours_offline.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref.token2wav(codes[None], conditioning=v.cond[None], reference_mel=v.ref_mel[None])
        ref_offline.append(time.perf_counter() - t0)
    audio_s = wave.numel() / (vocoder.hop_length * 100)

    med = statistics.median
    result = {
        "machine": machine("platform", "cpus", "torch", "threads"),
        "checkpoint": str(path),
        "codes": args.codes,
        "audio_s": audio_s,
        "streaming": {
            "plan": asdict(StreamingPlan()),
            "first_chunk_codes": streams[0]["first_chunk_codes"],
            "first_chunk_ms_median": med(s["first_chunk_ms"] for s in streams),
            "rtf_median": med(s["rtf"] for s in streams),
            "runs": streams,
        },
        "offline_ours": {"ms_median": med(ours_offline) * 1000, "rtf": med(ours_offline) / audio_s},
        "offline_transformers": {"ms_median": med(ref_offline) * 1000, "rtf": med(ref_offline) / audio_s,
                                 "first_audio_ms": med(ref_offline) * 1000},
    }
    result["first_audio_speedup_vs_transformers"] = (result["offline_transformers"]["first_audio_ms"]
                                                     / result["streaming"]["first_chunk_ms_median"])
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
