"""`omnidesk bench` for a full-duplex model: the frame clock, as JSON.

A duplex model keeps up with the microphone only if every step (one input frame
in, one output frame out) takes less than a frame.  This runs the executor's own
``step`` - the call the duplex engine makes - over a speech-like test signal and
reports the step time percentiles against the frame budget, the frames that
would have come late, and how long the model's delays keep its first output
frame back.  bench/duplex.py adds the per-stage breakdown of the Moshi step.

The device is synchronised between frames only (a step ends with its audio on
the host, so the step time is the host's wall time for the whole frame).
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
import torch

from .duplex import DuplexExecutor

BENCH_S = 20.0  # timed audio: 250 Moshi frames, enough for a stable p90 on the demo
WARMUP_FRAMES = 25  # untimed first frames (allocator, caches, the model's delays filling)


def speech_like(frames: int, rate: int, size: int) -> np.ndarray:
    """A voiced, pitch-gliding, amplitude-modulated tone: [frames, size] float32 at ``rate``."""
    t = np.arange(frames * size) / rate
    x = 0.3 * np.sin(2 * np.pi * (150 + 40 * np.sin(t)) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    return x.astype(np.float32).reshape(frames, size)


def percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms, dtype=np.float64)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3),
            "mean": round(float(a.mean()), 3)}


def sync(device) -> None:
    """Wait for a CUDA device; a no-op on the CPU.  Only ever called between frames."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(executor: DuplexExecutor, inputs: np.ndarray, warmup: int, device="cpu") -> tuple[list[float], int | None]:
    """Wall ms of ``executor.step`` per frame after ``warmup``, and the index of the first frame
    whose step returned a text token (None: never), from a fresh conversation."""
    executor.reset_conversation()
    ms, first = [], None
    for i, frame in enumerate(inputs):
        sync(device)
        t0 = time.perf_counter()
        out = executor.step(frame)
        sync(device)
        if i >= warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
        if first is None and out.text_token is not None:
            first = i
    return ms, first


def run(executor: DuplexExecutor, model_info: dict, device: str, seconds: float = BENCH_S,
        warmup: int = WARMUP_FRAMES) -> dict:
    """The bench JSON for a loaded duplex executor."""
    frame_ms = 1e3 * executor.frame_samples_in / executor.sample_rate_in
    frames = max(1, int(round(seconds * 1e3 / frame_ms)))
    inputs = speech_like(warmup + frames, executor.sample_rate_in, executor.frame_samples_in)
    load_before = os.getloadavg()
    ms, first = time_steps(executor, inputs, warmup, getattr(executor, "device", device))
    load_after = os.getloadavg()
    step = percentiles(ms)
    executor.reset_conversation()  # the bench's conversation is not the user's
    cores = os.cpu_count() or 1
    return {
        "kind": "duplex",
        "model": model_info,
        "machine": {"platform": platform.platform(), "cpus": cores, "torch": torch.__version__, "device": device,
                    "threads": torch.get_num_threads(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in load_after],
                    # other processes inflate the tail on a shared machine
                    "contended": max(load_before[0], load_after[0]) > max(cores - 1, 1)},
        "frame_ms": frame_ms, "frames": frames, "warmup_frames": warmup,
        "step_ms": step,
        # frames whose step took longer than the frame: the engine would have fallen behind by that much
        "late_frames": int(sum(m > frame_ms for m in ms)),
        "realtime_factor_p50": round(frame_ms / step["p50"], 2) if step["p50"] > 0 else None,
        # the model's own delays: no text (and no voice) comes out before this frame
        "first_output_frame": first,
        "first_output_ms": None if first is None else round((first + 1) * frame_ms, 1),
        "note": "executor.step per input frame (what the duplex engine calls), wall clock with the device "
                "synchronised between frames; the steps of the first warmup frames are not timed",
    }


__all__ = ["BENCH_S", "WARMUP_FRAMES", "percentiles", "run", "speech_like", "sync", "time_steps"]
