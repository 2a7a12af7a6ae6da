#!/usr/bin/env python
"""Write the small speech fixtures in tests/fixtures/ (16 kHz mono int16 WAV).

The echo-cancellation and barge-in tests need real speech: white noise or
tones converge an echo canceller differently and a VAD does not call them
speech.  Recorded voices would need consent and licences, so the utterances
are synthesized locally with the ``espeak-ng`` command (``apt-get install -y
espeak-ng``), resampled to 16 kHz with soxr, trimmed to ~50 ms of silence at
either end, internal pauses capped at 150 ms, and peak-normalized to about
-6 dBFS, so every test starts from the same level.  ``noise_burst.wav`` is not
speech: a 120 ms seeded band-limited noise burst (a cough/click stand-in) that
a VAD may briefly call speech but that is shorter than a 300 ms barge-in
confirmation.

The output is deterministic for a given espeak-ng version (1.51 made the
files in tests/fixtures/).

Run:  .venv/bin/python dev/make_speech_fixtures.py [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import soxr

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000
PAD_S = 0.05  # silence kept at each end: a VAD/endpointer sees a clean onset
MAX_PAUSE_S = 0.15  # espeak's ~0.4 s sentence pause would stretch "Wait, stop. ..." past 3 s
PEAK_DBFS = -6.0  # headroom so a synthetic room response on top does not clip
VOICE = "en-us"
# name -> (text, words per minute).  espeak's default is 175; questions a
# little slower (conversational), the interruption faster (people cut in in a
# hurry, and it keeps the clip near 2 s).
UTTERANCES = {
    "question": ("What is the weather like in Paris today?", 165),
    "interrupt": ("Wait, stop. Tell me about trains instead.", 210),
    "second_question": ("And how far away is the moon?", 165),
}


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * w.getsampwidth()}-bit")
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    x = pcm.reshape(-1, channels).mean(axis=1).astype(np.float32) / 32768.0
    return x, rate


def write_wav(path: Path, x: np.ndarray, rate: int = RATE) -> None:
    pcm = (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def shorten_pauses(x: np.ndarray, rate: int = RATE, max_s: float = MAX_PAUSE_S, quiet_rel: float = 0.01,
                   dtype=np.float32) -> np.ndarray:
    """Cut every run of 10 ms frames quieter than ``quiet_rel`` of the peak (-40 dB) down to ``max_s``;
    ``dtype``: what the frames' RMS is computed in.  tests/turn_taking_set.py uses it too."""
    hop = rate // 100
    frames = len(x) // hop
    rms = np.sqrt((x[:frames * hop].reshape(frames, hop).astype(dtype) ** 2).mean(axis=1))
    quiet = rms < quiet_rel * np.abs(x).max()
    keep = np.ones(len(x), dtype=bool)
    max_frames = int(round(max_s * 100))
    start = None
    for i, q in enumerate(np.append(quiet, False)):
        if q and start is None:
            start = i
        elif not q and start is not None:
            if i - start > max_frames:
                # keep the pause's two ends so the fades into and out of it survive
                cut0 = start + max_frames // 2
                cut1 = i - (max_frames - max_frames // 2)
                keep[cut0 * hop:cut1 * hop] = False
            start = None
    return x[keep]


def trim_and_normalize(x: np.ndarray, rate: int = RATE) -> np.ndarray:
    # espeak pads with a few hundred ms of silence; anything 40 dB below the
    # peak counts as silence here.
    loud = np.flatnonzero(np.abs(x) > 0.01 * np.abs(x).max())
    x = shorten_pauses(x[loud[0]:loud[-1] + 1], rate)
    pad = np.zeros(int(PAD_S * rate), dtype=np.float32)
    x = np.concatenate([pad, x, pad])
    return (x * (10 ** (PEAK_DBFS / 20) / np.abs(x).max())).astype(np.float32)


def synthesize(text: str, wpm: int, workdir: Path) -> np.ndarray:
    raw = workdir / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(wpm), "-w", str(raw), text], check=True)
    x, rate = read_wav(raw)
    if rate != RATE:
        x = soxr.resample(x, rate, RATE, quality="HQ").astype(np.float32)
    return trim_and_normalize(x)


def noise_burst(seed: int = 0, rate: int = RATE) -> np.ndarray:
    """120 ms of 300-3400 Hz noise, 3 ms attack, ~25 ms exponential decay."""
    n = int(0.120 * rate)
    rng = np.random.default_rng(seed)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    spectrum[(freqs < 300) | (freqs > 3400)] = 0  # the band a phone-like cough/click occupies
    burst = np.fft.irfft(spectrum, n)
    t = np.arange(n) / rate
    envelope = np.minimum(t / 0.003, 1.0) * np.exp(-t / 0.025)
    return trim_and_normalize((burst * envelope).astype(np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures"))
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        print("espeak-ng not found; install it with: apt-get install -y espeak-ng", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omnidesk-fixtures-") as tmp:
        clips = {name: synthesize(text, wpm, Path(tmp)) for name, (text, wpm) in UTTERANCES.items()}
    clips["noise_burst"] = noise_burst()
    for name, x in clips.items():
        path = out / f"{name}.wav"
        write_wav(path, x)
        print(f"{path}: {len(x) / RATE:.2f} s, {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
