"""The microphone's path in a live session: device capture -> echo canceller -> the model's rate.

Rates.  The model hears the device at its own rate: :class:`CapturePath` hands the engine 40 ms
frames at the executor's input rate (16 kHz for the Qwen encoders, 24 kHz for Mimi), with one
resample on the way where it can.  The echo canceller (WebRTC AEC3) takes 8/16/32/48 kHz only;
it runs at :func:`~omnidesk.audio.aec.canceller_rate` of the model's rate (16 kHz for a 16 kHz
model; 48 kHz for Mimi, a clean 2:1 down to 24 kHz, and the session opens the device at 48 kHz
for it where it can).  With the canceller on (speakers)::

    mic, reference (device rate) --[to the canceller's rate, the same filter on both]-->
        canceller, 40 ms frames --[to the model's rate]--> engine

Each bracket is skipped when the rates already match: a 48 kHz device under Mimi resamples once
(48 -> 24 kHz after the canceller), a 16 kHz model once (device -> 16 kHz before it).  With the
canceller bypassed (headphones) the same path runs (it returns the microphone untouched), unless
that would resample twice (a 24 or 44.1 kHz device under Mimi): then the microphone goes from the
device's rate straight to the model's (none at all from a 24 kHz device).  A duplex engine makes
the speech detector's 16 kHz copy itself, a side branch off the model's path.

Engine thread only; the audio callbacks never see this.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from omnidesk.engine.frames import FRAME_MS, Reframer, frame_samples
# A device time that differs this much from the samples counted since (a dropped block, a reopened
# stream, or the sound card's clock drifting from the system's) moves the frames' stamps to it.
# Larger than the ADC times' jitter (a few ms on ALSA), smaller than half a frame.
RESYNC_S = 0.015


class Decimator:
    """Streaming low-pass + keep every ``factor``-th sample, for a device rate that is a whole
    multiple of the target's (48 -> 16 or 24 kHz, 32 -> 16 kHz).

    Why not soxr here: its HQ filter holds back the last ~21 ms of every block it is given (the
    tail of a long, steep filter), and on the microphone's path that is 21 ms added to every
    decision the engine takes on the audio: when the user stops, when they cut in.  This filter
    is a Kaiser-windowed sinc, linear phase, cut off at the target's Nyquist, flat (< 0.1 dB) to
    90 % of it and >= 80 dB down from 110 % on: what folds back lands above 90 % of the band,
    which the speech detector and the encoders' mel filters barely weigh.  It holds back half its
    length, ~1.6 ms at 48 kHz.  Output sample k is input sample ``factor * k`` (the filter's delay
    is taken off, as soxr does), so the stamps of the capture path stay right; the stream equals
    the one-shot :meth:`offline` to float precision.
    """

    def __init__(self, rate_in: int, rate_out: int, stop_db: float = 80.0):
        if rate_in % rate_out:
            raise ValueError(f"{rate_in} Hz is not a whole multiple of {rate_out} Hz")
        self.factor = rate_in // rate_out
        nyquist_out = rate_out / 2
        width = 0.2 * nyquist_out / rate_in  # transition 90 % -> 110 % of the target's Nyquist, cycles/sample
        beta = 0.1102 * (stop_db - 8.7)
        taps = int(np.ceil((stop_db - 7.95) / (2.285 * 2 * np.pi * width)))
        self.delay = -(-(taps // 2) // self.factor) * self.factor  # half the length, in whole output samples
        n = np.arange(2 * self.delay + 1) - self.delay
        cutoff = nyquist_out / rate_in
        h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(n.size, beta)
        self.taps = (h / h.sum()).astype(np.float32)
        self.clear()

    def clear(self) -> None:
        # the filter's history: it starts on silence, the delay's worth of output skipped
        self._hist = np.zeros(self.taps.size - 1, np.float32)
        self._skip = self.delay  # input samples whose outputs fall before sample 0
        self._phase = 0  # input samples (after the skip) until the next kept output

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32).reshape(-1)
        if x.size == 0:
            return x
        buf = np.concatenate([self._hist, x])
        y = np.convolve(buf, self.taps, mode="valid")  # y[i] = filtered input sample i of x (delay later)
        self._hist = buf[-(self.taps.size - 1):]
        # y[i] is the output centred on input sample (i - delay); drop the first `delay` overall
        skip = min(self._skip, y.size)
        self._skip -= skip
        y = y[skip:]
        out = y[self._phase::self.factor]
        self._phase = (self._phase - y.size) % self.factor
        return out.astype(np.float32, copy=False)

    def offline(self, x: np.ndarray) -> np.ndarray:
        """The same filter on a whole signal at once (zeros before it; its last ``delay`` input
        samples not out yet, as in the stream)."""
        full = np.convolve(np.concatenate([np.zeros(self.taps.size - 1, np.float32), np.asarray(x, np.float32)]),
                           self.taps, mode="valid")
        return full[self.delay::self.factor].astype(np.float32)


class _Resampler:
    """The capture path's resampler: a :class:`Decimator` for a whole-number ratio (the low-latency
    way), a streaming soxr resampler otherwise (e.g. 44.1 -> 16 kHz; ~21 ms held back), or
    nothing when the rates match."""

    def __init__(self, rate_in: int, rate_out: int):
        import soxr

        if rate_in == rate_out:
            self._rs = None
        elif rate_in % rate_out == 0:
            self._rs = Decimator(rate_in, rate_out)
        else:
            self._rs = soxr.ResampleStream(rate_in, rate_out, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self._rs is None:
            return x
        return self._rs(x) if isinstance(self._rs, Decimator) else self._rs.resample_chunk(x)

    @property
    def hold(self) -> int | None:
        """Input samples it holds back (0 for none, the Decimator's delay; None: soxr's varies)."""
        if self._rs is None:
            return 0
        return self._rs.delay if isinstance(self._rs, Decimator) else None

    def clear(self) -> None:
        if self._rs is not None:
            self._rs.clear()

    def release(self) -> None:
        """Let go of the soxr stream (see DeviceSpeaker.release_resampler); unusable afterwards."""
        self._rs = None


class CapturePath:
    """Device audio (microphone + the reference the speaker played meanwhile) -> 40 ms frames at
    ``rate``.  ``cancel(mic, reference)`` is the echo canceller on one 40 ms frame at
    ``canceller_rate`` (it returns the microphone untouched while bypassed)."""

    def __init__(self, device_rate: int, rate: int, canceller_rate: int,
                 cancel: Callable[[np.ndarray, np.ndarray], np.ndarray], canceller_delay_s: float = 0.0,
                 block: int | None = None):
        self.device_rate, self.rate, self.canceller_rate = device_rate, rate, canceller_rate
        # the device's callback block (samples): frames are cut so that each is whole when the block
        # holding its last sample arrives (see _lead); None: cut from the first sample
        self.block = block
        self.cancel = cancel
        # how late the canceller's output is against its input (EchoCanceller.processing_delay_s):
        # the frames' stamps say when the user spoke, not when the canceller let it out
        self.canceller_delay_s = canceller_delay_s
        # bypassed, the canceller's way would resample twice: go straight from the device then
        self.direct_when_bypassed = device_rate != canceller_rate and canceller_rate != rate
        self._mic_in = _Resampler(device_rate, canceller_rate)
        self._ref_in = _Resampler(device_rate, canceller_rate)  # the same filter: the pair stays aligned
        self._out = _Resampler(canceller_rate, rate)
        self._direct = _Resampler(device_rate, rate)
        self._cancel_n = frame_samples(canceller_rate)
        self._frame_n = frame_samples(rate)
        self._cut = Reframer(self._frame_n)  # the engine's 40 ms frames, cut as soon as they are whole
        self._direct_now = False
        self.clear()

    def clear(self) -> None:
        """Forget everything buffered (the streams were reopened)."""
        for rs in (self._mic_in, self._ref_in, self._out, self._direct):
            rs.clear()
        self._mic = self._ref = np.zeros(0, np.float32)
        self._cut.clear()
        self._drop_device, self._drop_cancelled = self._lead()  # still to drop, at each stage
        # what is dropped, in seconds: every drop is done before the first frame comes out
        self._lead_s = self._drop_device / self.device_rate + self._drop_cancelled / self.canceller_rate
        # Time stamps: the resamplers and the canceller keep samples in place (soxr's streams are
        # delay-compensated), so output sample k since the clear was heard at t0 + k / rate.
        self._t0: float | None = None  # session time of the first device sample since the clear
        self._in_n = 0  # device samples pushed since the clear
        self._out_n = 0  # frame samples handed out since the clear
        if not hasattr(self, "_t_end"):
            self._t_end = 0.0  # end of the last frame handed out, before the canceller's shift (never goes back)

    def release(self) -> None:
        """The session closed: drop the resamplers' native state now, not at interpreter exit."""
        for rs in (self._mic_in, self._ref_in, self._out, self._direct):
            rs.release()

    def _lead(self) -> tuple[int, int]:
        """(device samples, cancelled samples) to drop at the start, so that the frames line up with
        the device's blocks.  A decimator holds back its last ~1.6 ms (capture.Decimator): cut from
        the first sample, every 40 ms frame ended 1.6 ms short when its last block came and waited
        for the next one, 20 ms later, before the engine saw it: 20 ms on every decision (the end of
        the user's turn, a barge-in).  Dropping the start shifts the cut so that what a frame needs
        arrives with a block.  Where a stage holds back an unknown amount (soxr) nothing is dropped."""
        block = self.block
        if not block:
            return 0, 0
        if self._direct_now:
            hold = self._direct.hold
            per_frame = FRAME_MS * self.device_rate // 1000
            return ((-hold) % block if hold is not None and per_frame % block == 0 else 0), 0
        hold_in, hold_out = self._mic_in.hold, self._out.hold
        per_chunk = self._cancel_n * self.device_rate // self.canceller_rate  # device samples per canceller frame
        drop_in = (-hold_in) % block if hold_in is not None and per_chunk % block == 0 else 0
        # the last stage waits for the canceller's next 40 ms: let a frame end hold_out before a chunk does
        drop_out = (-hold_out) % self._cancel_n if hold_out is not None else 0
        return drop_in, drop_out

    def describe(self, bypassed: bool) -> str:
        """The rates along the path, e.g. "device 48000 Hz -> echo canceller 48000 Hz -> model 24000 Hz"."""
        if bypassed and self.direct_when_bypassed:
            steps = [("device", self.device_rate), ("model", self.rate)]
        else:
            steps = [("device", self.device_rate)] + ([] if bypassed else [("echo canceller", self.canceller_rate)]) \
                + [("model", self.rate)]
        return " -> ".join(f"{name} {rate} Hz" for name, rate in steps)

    def push(self, mic: np.ndarray, reference: np.ndarray, bypassed: bool) -> list[np.ndarray]:
        """What was captured since the last call -> the whole 40 ms frames now ready, at ``rate``."""
        return [frame for _, frame in self.timed(mic, reference, bypassed)]

    def timed(self, mic: np.ndarray, reference: np.ndarray, bypassed: bool,
              t: float | None = None) -> list[tuple[float, np.ndarray]]:
        """:meth:`push` with time stamps: ``t`` is the session time at which ``mic[0]`` was captured
        (its ADC time); each frame comes with the time of its first sample.  Without ``t`` the
        stamps count samples on from the last known time."""
        frames = self._frames(mic, reference, bypassed)
        if self._t0 is None:
            self._t0 = self._t_end if t is None else t
        elif t is not None:
            slip = t - (self._t0 + self._in_n / self.device_rate)
            if abs(slip) > RESYNC_S:
                self._t0 += slip
        self._in_n += mic.size
        shift = 0.0 if bypassed else self.canceller_delay_s
        out = []
        for frame in frames:
            start = max(self._t0 + self._lead_s + self._out_n / self.rate, self._t_end)
            self._out_n += frame.size
            self._t_end = start + frame.size / self.rate
            out.append((start - shift, frame))
        return out

    def _frames(self, mic: np.ndarray, reference: np.ndarray, bypassed: bool) -> list[np.ndarray]:
        direct = bypassed and self.direct_when_bypassed
        if direct != self._direct_now:  # headphones switched: the other way starts from scratch
            self._direct_now = direct
            self.clear()
        if self._drop_device:
            k = min(self._drop_device, mic.size)
            mic, reference = mic[k:], reference[k:]
            self._drop_device -= k
        if direct:
            y = self._direct(mic)
        else:
            self._mic = np.concatenate([self._mic, self._mic_in(mic)])
            self._ref = np.concatenate([self._ref, self._ref_in(reference)])
            n, k = min(self._mic.size, self._ref.size), self._cancel_n
            cleaned = [self.cancel(self._mic[i:i + k], self._ref[i:i + k]) for i in range(0, n - k + 1, k)]
            done = len(cleaned) * k
            self._mic, self._ref = self._mic[done:], self._ref[done:]
            y = np.concatenate(cleaned) if cleaned else np.zeros(0, np.float32)
            if self._drop_cancelled:
                k = min(self._drop_cancelled, y.size)
                y = y[k:]
                self._drop_cancelled -= k
            y = self._out(y) if y.size else y
        return self._cut.push(y)
