"""Echo cancellation and noise suppression for the microphone, via WebRTC's APM.

Why: on laptop speakers the assistant hears its own reply.  Without
cancellation the VAD calls that echo speech, the engine takes it for a barge-in
and cuts itself off mid-sentence.  With headphones there is no echo, and
:attr:`EchoCanceller.bypass` skips the work.

The canceller is WebRTC's AudioProcessingModule (AEC3 + noise suppression +
high-pass filter) as shipped in the ``livekit`` wheel (``rtc.AudioProcessingModule``);
it is a native library, costs ~11 ms of CPU per second of 16 kHz audio, and
needs no network or account.

Alignment.  The app pairs each captured microphone block with the speaker
samples rendered when it arrived (omnidesk.audio.device.AudioIO), on one rate
and one PortAudio clock.  :meth:`EchoCanceller.process` takes that pair.  The
echo of a rendered sample reaches the microphone later by the device's output
latency + input latency (plus the acoustic path, ~1 ms per 34 cm); that is
what :attr:`EchoCanceller.delay_ms` should carry (``stream.latency`` output +
input from sounddevice).  AEC3 estimates the
delay itself: on a synthetic room with 0-500 ms of delay the hint changes the
echo reduction by under 1 dB, so a rough value is enough.

The APM works on exactly 10 ms frames of int16 PCM (livekit does not check
this: a 20 ms or 22.05 kHz frame is accepted without an error, so we check).  The
app's 40 ms blocks are fed as four 10 ms pieces, far-end (reference) first so
the canceller has seen the played audio before the microphone audio that
contains its echo.  The APM is deterministic: the same input gives the same
output whether it arrives in 10 ms or 40 ms blocks.

The output lags the input by ~14 ms with echo cancellation and noise
suppression on (~8 ms AEC, ~6 ms NS): harmless for the VAD and the model, but
compare cleaned and raw audio with a lag search, not sample by sample.  A new
instance is warmed up on synthetic far-end audio (see ``_warm_up``): until
AEC3 has heard 6 s of far-end audio it assumes the speaker reaches the
microphone and mutes a user who talks over the assistant when nothing comes
back (headphones left on speakers, virtual devices).  The default 5 s warm-up
leaves it 1 s of that; :data:`DUPLEX_WARM_UP_S` none, for a model that talks
from its first frame, at the price of a ~0.2 s echo leak at the start on
speakers (``_warm_up`` has the numbers).  It keeps adapting afterwards, so
keep one instance for the life of the stream.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_RATES = (8000, 16000, 32000, 48000)  # what the WebRTC APM accepts
CHUNK_MS = 10  # the APM processes exactly 10 ms per call
WARM_UP_S = 5.0  # far-end audio fed at construction; see EchoCanceller._warm_up
# Past AEC3's 6 s: hears a user without echo path from the far-end's first frame (full-duplex
# models talk from theirs), lets the first ~0.2 s of a real echo through; see EchoCanceller._warm_up
DUPLEX_WARM_UP_S = 6.25


def canceller_rate(model_rate: int) -> int:
    """The canceller's rate in front of a model that hears ``model_rate``: that rate when the
    canceller takes it (16 kHz for the Qwen encoders), else the lowest rate it takes that is a whole
    multiple of it (48 kHz for Mimi's 24: a clean 2:1 down after it; 12.7 ms of CPU per second of
    audio against 10.3 at 16 kHz, bench/aec.py's ``cpu_by_rate``), else the highest."""
    if model_rate in SUPPORTED_RATES:
        return model_rate
    return next((r for r in SUPPORTED_RATES if r > model_rate and r % model_rate == 0), SUPPORTED_RATES[-1])


class EchoCancellerUnavailable(RuntimeError):
    """The native WebRTC audio processing (the ``livekit`` package) could not be loaded."""


def _import_rtc():
    try:
        from livekit import rtc  # deferred: optional native dependency
    except Exception as e:  # ImportError, or a native library that fails to load
        raise EchoCancellerUnavailable(
            f"echo cancellation needs the 'livekit' package (WebRTC audio processing), which "
            f"could not be loaded ({e}); install it with `pip install livekit`, or use "
            f"headphones mode, which works without it") from e
    return rtc


_PROCESSING_DELAY: dict[tuple[int, bool, bool], float] = {}  # see EchoCanceller.processing_delay_s


class EchoCanceller:
    """Removes the speaker's echo (and steady noise) from microphone frames.

    ``process(mic, reference)`` takes float32 mono frames of equal length, a
    multiple of 10 ms, where ``reference`` is what the speaker played over the
    same sample interval; it returns the cleaned microphone frame.  The state
    (echo path, noise estimate) carries across calls: feed one contiguous
    stream, and call :meth:`reset` before an unrelated one.
    """

    def __init__(self, sample_rate: int = 16000, *, echo_cancellation: bool = True,
                 noise_suppression: bool = True, delay_ms: float = 0.0, warm_up_s: float = WARM_UP_S):
        if sample_rate not in SUPPORTED_RATES:
            raise ValueError(
                f"sample rate {sample_rate} Hz is not supported by the WebRTC echo canceller; "
                f"use one of {', '.join(str(r) for r in SUPPORTED_RATES)} Hz")
        self._rtc = _import_rtc()
        self.sample_rate = sample_rate
        self.echo_cancellation = echo_cancellation
        self.noise_suppression = noise_suppression
        self.chunk = sample_rate * CHUNK_MS // 1000
        self.delay_ms = delay_ms
        self.warm_up_s = warm_up_s
        # Headphones: no echo to cancel, so return the microphone untouched.
        # The APM stays constructed so switching back costs nothing (it
        # re-adapts within a second or so).
        self.bypass = False
        # One reusable 10 ms frame per direction; _mic_pcm/_ref_pcm are numpy
        # views on their bytearrays, so filling a piece is a single copy and
        # the APM writes its result straight back into _mic_pcm.
        self._mic_frame = self._rtc.AudioFrame.create(sample_rate, 1, self.chunk)
        self._ref_frame = self._rtc.AudioFrame.create(sample_rate, 1, self.chunk)
        self._mic_pcm = np.frombuffer(self._mic_frame.data, dtype=np.int16)
        self._ref_pcm = np.frombuffer(self._ref_frame.data, dtype=np.int16)
        self._apm = None
        self.reset()

    @property
    def delay_ms(self) -> float:
        """Delay from the reference block's playback to its echo at the mic, beyond the pairing."""
        return self._delay_ms

    @delay_ms.setter
    def delay_ms(self, value: float) -> None:
        if not 0 <= value <= 500:  # WebRTC clamps to 0..500 ms; beyond that the numbers are wrong
            raise ValueError(f"delay_ms must be in 0..500 ms, got {value}")
        self._delay_ms = float(value)

    def reset(self) -> None:
        """Start over with a fresh APM (forget the learned echo path and noise)."""
        self._apm = self._rtc.AudioProcessingModule(
            echo_cancellation=self.echo_cancellation,
            noise_suppression=self.noise_suppression,
            # Removes DC and rumble below ~80 Hz that would otherwise mislead
            # the echo path estimate and the VAD.
            high_pass_filter=True,
            # The VAD and the model want the user's level as spoken; AGC would
            # also pump the level between turns.
            auto_gain_control=False)
        if self.echo_cancellation and self.warm_up_s > 0:
            self._warm_up()

    def _warm_up(self) -> None:
        # AEC3 cannot tell from the far-end alone whether the speaker reaches the microphone.  Its
        # "transparent mode" (headset detection; the legacy classifier in this build) turns on
        # after 6 s of active far-end audio (1500 blocks of 4 ms) in which it found no echo delay.
        # Until then it assumes a 0 dB echo path and suppresses everything below the far-end's
        # level: with no echo path at all the user is muted whenever the assistant talks
        # (measured: 40 to 170 dB down).  Seeded noise as far-end with a silent microphone counts
        # towards those 6 s; only the amount counts (speech as warm-up far-end, or a noise floor
        # on the warm-up mic, changes nothing; measured).  With an echo path, AEC3 finds its delay
        # ~0.2 s after the echo starts, which restarts the 6 s.  So the warm-up length chooses
        # what happens before AEC3 knows:
        # * 5 s (WARM_UP_S): transparent mode after 1 s of far-end, after an echo has been found
        #   (~0.85 s when under ~8 ms of delay leaves no delay to find: AEC3 then needs its filter
        #   converged), so the echo is cancelled from its first frame (~60 dB over the first 0.5 s);
        #   but a user without echo path is cut (by up to ~70 dB) in the first ~1 s of assistant
        #   speech.  A turn-based assistant starts its reply after the user stopped; a duplex
        #   model talks at once and the user who answers at once is not heard.
        # * 6.25 s (DUPLEX_WARM_UP_S): transparent from the first frame, so that user passes
        #   (within ~1 dB over the first 0.5 s); but a real echo passes too until its delay is
        #   found: ~0.2 s of it reduced by only ~5-10 dB (a 120-200 ms VAD blip; under ~8 ms of
        #   delay there is none to find and it lasts ~1 s), then cancelled as with 5 s.  As the
        #   default it fails tests/test_live.py's two echo-path tests (turn-based, loopback echo):
        #   the blip pauses the first reply (measured: 2 pauses, reply echo reduction 61 -> 33 dB).
        # Costs ~20 ms of CPU per warm-up second at 16 kHz (110-170 ms for 6.25 s on a busy
        # 2-core machine; ~40% of it livekit's per-call overhead).
        rng = np.random.default_rng(0)
        n = 4 * self.chunk
        bypass, self.bypass = self.bypass, False
        try:
            for _ in range(int(round(self.warm_up_s * 1000 / (4 * CHUNK_MS)))):
                self.process(np.zeros(n, np.float32), (rng.standard_normal(n) * 0.1).astype(np.float32))
        finally:
            self.bypass = bypass

    def processing_delay_s(self) -> float:
        """How much later a sound leaves :meth:`process` than it went in (its filter banks: 8 ms with
        echo cancellation, 14 ms with noise suppression too, at 16 kHz; 0 when bypassed).  Measured
        once per setting on a spare APM: white noise in, the output's lag at its cross-correlation
        peak."""
        if self.bypass:
            return 0.0
        key = (self.sample_rate, self.echo_cancellation, self.noise_suppression)
        if key not in _PROCESSING_DELAY:
            probe = EchoCanceller(self.sample_rate, echo_cancellation=self.echo_cancellation,
                                  noise_suppression=self.noise_suppression, warm_up_s=0.0)
            n, rate = 4 * self.chunk, self.sample_rate
            x = (np.random.default_rng(1).standard_normal(rate) * 0.1).astype(np.float32)
            y = np.concatenate([probe.process(x[i:i + n], np.zeros(n, np.float32))
                                for i in range(0, x.size - n + 1, n)])
            a = x[rate // 2: rate // 2 + rate // 4]  # past the start, where the noise model settles
            lags = np.arange(rate // 20)  # up to 50 ms
            corr = [float(np.dot(a, y[rate // 2 + k: rate // 2 + k + a.size])) for k in lags]
            _PROCESSING_DELAY[key] = int(lags[int(np.argmax(corr))]) / rate
        return _PROCESSING_DELAY[key]

    def process(self, mic: np.ndarray, reference: np.ndarray) -> np.ndarray:
        mic = np.asarray(mic, dtype=np.float32).reshape(-1)
        reference = np.asarray(reference, dtype=np.float32).reshape(-1)
        if mic.size != reference.size:
            raise ValueError(
                f"mic frame has {mic.size} samples but reference has {reference.size}; "
                f"they must cover the same interval")
        if mic.size == 0 or mic.size % self.chunk:
            raise ValueError(
                f"frame of {mic.size} samples is not a multiple of {CHUNK_MS} ms "
                f"({self.chunk} samples at {self.sample_rate} Hz)")
        if self.bypass:
            return mic
        out = np.empty_like(mic)
        delay = int(round(self._delay_ms))
        n = self.chunk
        for i in range(0, mic.size, n):
            # Clip before int16: a float slightly over 1.0 would wrap to a
            # full-scale negative sample, a loud click the canceller can't undo.
            np.multiply(np.clip(reference[i:i + n], -1.0, 1.0), 32767.0, out=self._ref_pcm, casting="unsafe")
            np.multiply(np.clip(mic[i:i + n], -1.0, 1.0), 32767.0, out=self._mic_pcm, casting="unsafe")
            self._apm.process_reverse_stream(self._ref_frame)
            if self.echo_cancellation:
                # WebRTC requires the delay before every process_stream call
                # when echo cancellation is on (and forbids relying on a stale one).
                self._apm.set_stream_delay_ms(delay)
            self._apm.process_stream(self._mic_frame)
            np.multiply(self._mic_pcm, 1.0 / 32768.0, out=out[i:i + n], casting="unsafe")
        return out


def echo_reduction_db(mic: np.ndarray, cleaned: np.ndarray, sample_rate: int, skip_s: float = 1.0) -> float:
    """Echo return loss enhancement: 10*log10(mean mic power / mean cleaned power) after ``skip_s``.

    Meaningful when ``mic`` holds only echo (and noise) over the measured part;
    ``skip_s`` leaves out the canceller's convergence.
    """
    start = int(round(skip_s * sample_rate))
    m = np.asarray(mic, dtype=np.float64).reshape(-1)[start:]
    c = np.asarray(cleaned, dtype=np.float64).reshape(-1)[start:]
    if m.size == 0 or m.size != c.size:
        raise ValueError(
            f"need equal-length signals longer than skip_s={skip_s} s ({start} samples); "
            f"got {m.size + start} and {c.size + start} samples")
    tiny = 1e-20  # an all-zero cleaned signal is infinite reduction; keep it finite
    return float(10 * np.log10((np.mean(m * m) + tiny) / (np.mean(c * c) + tiny)))
