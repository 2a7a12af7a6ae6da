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
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omnidesk.engine.duplex_bench import percentiles as stats, speech_like, sync as _sync, time_steps  # noqa: E402
from report import machine, report  # noqa: E402


class StageClock:
    """Stage boundaries inside one frame: ``mark()`` at each, ``split()`` after the frame -> ms between them.

    On the CPU, perf_counter.  On CUDA, events recorded on the stream: marking adds no host sync (the
    frame's own syncs - the text token, the audio copied to the host - are the only ones), and the
    events are read after the frame, once the device has caught up.  An interval is then the time
    between the device reaching two marks: when the host's kernel launches are the bottleneck (small
    eager ops) that is the host's issue time, else the device's compute time."""

    def __init__(self, device, marks: int):
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else []
        self.times: list[float] = []

    def mark(self) -> None:
        if self.cuda:
            self.events[len(self.times)].record()
            self.times.append(0.0)
        else:
            self.times.append(time.perf_counter())

    def split(self) -> list[float]:
        if self.cuda:
            _sync(self.device)
            ms = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:len(self.times)])]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]
        self.times = []
        return ms


def time_stages(ex, inputs: np.ndarray, warmup: int) -> dict[str, list[float]]:
    """The executor's frame step taken apart: Mimi encode, the LM step (temporal transformer, text
    sampling, the depformer, and the one host sync for the text token, as ``MoshiExecutor.step``
    does), Mimi decode (and the copy of the audio to the host).  Returns ms per stage and for the
    whole frame (wall clock) for the frames after ``warmup``."""
    device = ex.device
    clock = StageClock(device, 4)
    out_ms: dict[str, list[float]] = {"encode": [], "lm": [], "decode": [], "step": []}
    ex.reset_conversation()
    # no inference_mode: the engine calls the step without it (the models run under no_grad), and a
    # sampler buffer first made inside it could not be updated outside it afterwards
    for i, frame in enumerate(inputs):
        _sync(device)
        t0 = time.perf_counter()
        clock.mark()
        codes = ex.encode_audio(frame)
        clock.mark()
        out = ex.gen.step(codes)
        text = None if out is None else out.text_id  # the host sync, as the executor does
        clock.mark()
        if out is not None:
            ex.decode_audio(out.audio).cpu().numpy()
        clock.mark()
        _sync(device)  # a no-op after the audio's copy to the host; waits only while the delays fill
        t1 = time.perf_counter()
        enc, lm, dec = clock.split()
        if i >= warmup:
            for key, ms in (("encode", enc), ("lm", lm), ("decode", dec), ("step", (t1 - t0) * 1e3)):
                out_ms[key].append(ms)
        del text
    return out_ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="Moshi checkpoint directory (default: the Moshi demo, made in a temp dir)")
    p.add_argument("--frames", type=int, default=600, help="timed frames (>= 500 for stable tails)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: what load_moshi chooses)")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--compile", choices=("auto", "off", "on"),
                   help="the LM's frame step: 'on' compiles it (waited for before timing), 'off' runs it eagerly "
                        "(default: what load_moshi picks, 'auto')")
    p.add_argument("--out", default="bench/results/duplex.json")
    args = p.parse_args(argv)

    import torch

    from omnidesk.models.moshi.demo import make_moshi_demo
    from omnidesk.models.moshi.executor import load_moshi

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.model) if args.model else make_moshi_demo(Path(tmp) / "moshi-demo")
        ex = load_moshi(root, greedy=args.greedy, seed=0, compile=args.compile)
    t0 = time.perf_counter()
    ex.runner.wait_ready()  # a compiled step compiles in the background: time it once it runs
    compile_wait_s = round(time.perf_counter() - t0, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = speech_like(args.warmup + args.frames, ex.sample_rate_in, ex.frame_samples_in)
    staged = time_stages(ex, inputs, args.warmup)
    enc, lm, dec, step = staged["encode"], staged["lm"], staged["decode"], staged["step"]
    # the executor's own step (the engine's call, as `omnidesk bench` times it) as a cross-check of the staged loop
    whole, _ = time_steps(ex, inputs[: args.warmup + min(args.frames, 200)], args.warmup, ex.device)
    load_after = os.getloadavg()
    cores = os.cpu_count() or 1
    frame_ms = 1e3 * ex.frame_samples_in / ex.sample_rate_in
    result = {
        "model": {"path": str(args.model) if args.model else "moshi-demo (temp)", **{
            k: v for k, v in ex.model_info().items() if k not in ("path", "threads")},
            "lm_params": sum(p.numel() for p in ex.lm.parameters()),
            "mimi_params": sum(p.numel() for p in ex.mimi.parameters())},
        "machine": machine("cpu", "cores", "torch", "threads",
                           loadavg_before=[round(x, 2) for x in load_before],
                           loadavg_after=[round(x, 2) for x in load_after],
                           contended=max(load_before[0], load_after[0]) > max(cores - 1, 1)),
        "frames": args.frames, "warmup": args.warmup, "frame_ms": frame_ms,
        "step_ms": stats(step), "encode_ms": stats(enc), "lm_ms": stats(lm), "decode_ms": stats(dec),
        "executor_step_ms": stats(whole),
        # how the LM's frame step ran (omnidesk/models/runner.py): calls per mode, compiles, recompiles
        "runner": ex.runner.stats(), "compile_wait_s": compile_wait_s,
        "late_frames": int(sum(ms > frame_ms for ms in step)),
        "target_p50_ms": 20.0, "meets_target": stats(step)["p50"] <= 20.0,
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
