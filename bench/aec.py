#!/usr/bin/env python
"""Echo canceller benchmark: echo reduction and CPU cost of omnidesk.audio.aec on the speech fixtures.

The scene is the one tests/test_aec.py uses: the speaker plays question.wav,
interrupt.wav and second_question.wav back to back (~6 s); the microphone
hears it through a seeded synthetic room (direct path at -10 dB after the
delay, plus decaying reflections) with -80 dBFS noise; 40 ms blocks at 16 kHz.

* per delay (0/30/60/120 ms of echo delay beyond the mic/speaker pairing): echo
  reduction (ERLE) after the first second, ERLE over the first 0.5 s
  (convergence), with the delay hint left at 0 and with the true delay given.
* noise suppression on/off at 60 ms.
* CPU: process time per second of audio (median of --repeats runs), 40 ms blocks; and per
  canceller rate (16 kHz, where a Qwen model's canceller runs; 48 kHz, where Moshi's does, see
  omnidesk/audio/capture.py): the scene resampled to that rate, with a 24 kHz model's 2:1
  resample after it, and the 6.25 s duplex warm-up a session pays once at its start.

Run:  .venv/bin/python bench/aec.py [--repeats 5 --out FILE]   (JSON on stdout; also to FILE if given)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from omnidesk.audio.aec import EchoCanceller, echo_reduction_db  # noqa: E402
from report import machine, report  # noqa: E402
from test_aec import FRAME, RATE, load, room_response, run  # noqa: E402  (same scene as the tests)

DELAYS_MS = (0, 30, 60, 120)


def scene(delay_ms: float) -> tuple[np.ndarray, np.ndarray]:
    reference = np.concatenate([load("question"), load("interrupt"), load("second_question")])
    echo = np.convolve(reference, room_response(delay_s=delay_ms / 1000))[:len(reference)]
    noise = 1e-4 * np.random.default_rng(1).standard_normal(len(reference))
    n = len(reference) // FRAME * FRAME
    return (echo + noise)[:n].astype(np.float32), reference[:n].astype(np.float32)


def measure(delay_ms: float, hint_ms: float, noise_suppression: bool = True) -> dict:
    mic, reference = scene(delay_ms)
    cleaned = run(EchoCanceller(RATE, noise_suppression=noise_suppression, delay_ms=hint_ms), mic, reference)
    # The first 0.5 s: how much echo a fresh canceller removes before it has
    # adapted.  A delay longer than that window is echo-free at the start,
    # so start the window at the first echo.
    start = int(delay_ms * RATE / 1000)
    first = slice(start, start + RATE // 2)
    return {"erle_db": echo_reduction_db(mic, cleaned, RATE, skip_s=1.0),
            "erle_first_0.5s_db": echo_reduction_db(mic[first], cleaned[first], RATE, skip_s=0.0)}


def cpu_per_audio_second(repeats: int, noise_suppression: bool = True, rate: int = RATE) -> dict:
    import soxr

    mic, reference = scene(60)
    if rate != RATE:  # the same scene at the canceller's rate (one filter for both, as the session does)
        mic, reference = (soxr.resample(x, RATE, rate).astype(np.float32) for x in (mic, reference))
    frame = rate * FRAME // RATE
    n = len(mic) // frame * frame
    mic, reference = mic[:n], reference[:n]
    audio_s = n / rate
    cpu, wall = [], []
    for _ in range(repeats):
        canceller = EchoCanceller(rate, noise_suppression=noise_suppression, delay_ms=60)
        c0, w0 = time.process_time(), time.perf_counter()
        run(canceller, mic, reference, frame)
        cpu.append((time.process_time() - c0) / audio_s)
        wall.append((time.perf_counter() - w0) / audio_s)
    med = statistics.median
    return {"cpu_ms_per_audio_s": med(cpu) * 1000, "wall_ms_per_audio_s": med(wall) * 1000,
            "wall_us_per_40ms_block": med(wall) * FRAME / RATE * 1e6}


def cpu_by_rate(repeats: int) -> dict:
    """The canceller at 16 and 48 kHz; at 48 kHz also the 2:1 resample to a 24 kHz model after it,
    and the duplex warm-up (CPU ms, once per session)."""
    import soxr

    from omnidesk.audio.aec import DUPLEX_WARM_UP_S

    out = {}
    for rate in (16000, 48000):
        r = cpu_per_audio_second(repeats, True, rate)
        c0 = time.process_time()
        EchoCanceller(rate, warm_up_s=DUPLEX_WARM_UP_S)
        r["duplex_warm_up_cpu_ms"] = (time.process_time() - c0) * 1000
        if rate == 48000:
            x = scene(60)[0]
            x = soxr.resample(x, RATE, rate).astype(np.float32)
            rs = soxr.ResampleStream(rate, 24000, 1, dtype="float32", quality="HQ")
            c0 = time.process_time()
            for i in range(0, len(x), 1920):
                rs.resample_chunk(x[i:i + 1920])
            r["resample_to_24k_cpu_ms_per_audio_s"] = (time.process_time() - c0) / (len(x) / rate) * 1000
        out[str(rate)] = r
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs for the CPU timing (median)")
    parser.add_argument("--out", help="also write the JSON here (e.g. bench/results/aec.json)")
    args = parser.parse_args()

    import livekit.rtc

    mic, _ = scene(0)
    result = {
        "machine": machine("platform", "cpus", livekit=getattr(livekit.rtc, "__version__", "?")),
        "scene": {"sample_rate": RATE, "block_samples": FRAME, "audio_s": len(mic) / RATE,
                  "echo_gain_db": -10.0, "noise_dbfs": -80.0,
                  "reference": ["question.wav", "interrupt.wav", "second_question.wav"]},
        "delays": {
            str(d): {"hint_0": measure(d, 0), "hint_true": measure(d, d)} for d in DELAYS_MS},
        "noise_suppression_60ms": {"on": measure(60, 60, True), "off": measure(60, 60, False)},
        "cpu": {"ns_on": cpu_per_audio_second(args.repeats, True),
                "ns_off": cpu_per_audio_second(args.repeats, False)},
        "cpu_by_rate": cpu_by_rate(args.repeats),
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
