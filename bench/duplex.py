#!/usr/bin/env python
"""Full-duplex step benchmark: the Moshi demo's per-frame step on the CPU, with its breakdown.

One 80 ms frame = Mimi encode (1920 samples @24 kHz -> 8 codes) + the LM step
(temporal transformer, text sampling, 8 depformer steps) + Mimi decode (8 codes
-> 1920 samples).  The loaded MoshiExecutor runs ``--warmup`` untimed frames,
then ``--frames`` timed ones on a voice-like test signal; each stage is timed
on its own with perf_counter (the LM stage includes the one host sync per
frame: reading the text token), and the three add up to the step.  The frame
budget is 80 ms; a duplex model falls behind the microphone when a step is
slower, and the target for the demo is p50 <= 20 ms.

The machine's load average before and after is recorded: on a shared machine
other processes inflate the tail (``contended`` is true when the 1-minute
load exceeded the cores minus one at either point).

Run:  .venv/bin/python bench/duplex.py [--frames 600 --warmup 50 --threads 1 --model DIR --out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def signal(frames: int, rate: int, size: int) -> np.ndarray:
    t = np.arange(frames * size) / rate
    x = 0.3 * np.sin(2 * np.pi * (150 + 40 * np.sin(t)) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    return x.astype(np.float32).reshape(frames, size)


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3),
            "mean": round(float(a.mean()), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="Moshi checkpoint directory (default: the Moshi demo, made in a temp dir)")
    p.add_argument("--frames", type=int, default=600, help="timed frames (>= 500 for stable tails)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: what load_moshi chooses)")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--out", default="bench/results/duplex.json")
    args = p.parse_args(argv)

    import torch

    from omnidesk.models.moshi.demo import make_moshi_demo
    from omnidesk.models.moshi.executor import load_moshi

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.model) if args.model else make_moshi_demo(Path(tmp) / "moshi-demo")
        ex = load_moshi(root, greedy=args.greedy, seed=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = signal(args.warmup + args.frames, ex.sample_rate_in, ex.frame_samples_in)
    enc, lm, dec, step = [], [], [], []
    ex.reset_conversation()
    clock = time.perf_counter
    with torch.inference_mode():
        for i, frame in enumerate(inputs):
            t0 = clock()
            codes = ex.mimi.encode_frame(torch.from_numpy(frame))
            t1 = clock()
            out = ex.gen.step(codes)
            text = None if out is None else out.text_id  # the host sync, as the executor does
            t2 = clock()
            if out is not None:
                ex.mimi.decode_frame(out.audio).numpy()
            t3 = clock()
            if i >= args.warmup:
                enc.append((t1 - t0) * 1e3)
                lm.append((t2 - t1) * 1e3)
                dec.append((t3 - t2) * 1e3)
                step.append((t3 - t0) * 1e3)
            del text
        # the executor's own step (the engine's call) as a cross-check of the staged loop
        ex.reset_conversation()
        whole = []
        for i, frame in enumerate(inputs[: args.warmup + min(args.frames, 200)]):
            t0 = clock()
            ex.step(frame)
            if i >= args.warmup:
                whole.append((clock() - t0) * 1e3)
    load_after = os.getloadavg()
    cores = os.cpu_count() or 1
    frame_ms = 1e3 * ex.frame_samples_in / ex.sample_rate_in
    result = {
        "model": {"path": str(args.model) if args.model else "moshi-demo (temp)", **{
            k: v for k, v in ex.model_info().items() if k not in ("path", "threads")},
            "lm_params": sum(p.numel() for p in ex.lm.parameters()),
            "mimi_params": sum(p.numel() for p in ex.mimi.parameters())},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": cores,
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in load_after],
                    "contended": max(load_before[0], load_after[0]) > max(cores - 1, 1)},
        "frames": args.frames, "warmup": args.warmup, "frame_ms": frame_ms,
        "step_ms": stats(step), "encode_ms": stats(enc), "lm_ms": stats(lm), "decode_ms": stats(dec),
        "executor_step_ms": stats(whole),
        "late_frames": int(sum(ms > frame_ms for ms in step)),
        "target_p50_ms": 20.0, "meets_target": stats(step)["p50"] <= 20.0,
    }
    text = json.dumps(result, indent=2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
