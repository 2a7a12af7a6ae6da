"""A :class:`~omnidesk.engine.vad.SpeechDetector` backed by Google's WebRTC VAD.

The engine hands detectors 40 ms float32 mono frames at 16 kHz.  ``webrtcvad``
(distribution ``webrtcvad-wheels``) only accepts 10, 20 or 30 ms of 16-bit
little-endian PCM at 8, 16, 32 or 48 kHz, so each 40 ms frame is converted to
int16 (clipped to [-1, 1] first) and judged as two 20 ms halves.

The frame counts as speech when *either* half is speech.  Requiring both
would drop a frame whose speech begins in its second half, delaying the
``SpeechOnset``/``SpeechStart`` of the endpointer by a whole frame (40 ms) and
cutting the first 20 ms of a word from the confirming run; "either" keeps onset
latency at one half-frame.  The cost is at most 20 ms of extra trailing speech
at the end of a run, which the endpoint silence timer absorbs anyway.

WebRTC VAD keeps internal state (noise estimates, hangover) between calls, so
one instance should see one contiguous stream; :meth:`WebRtcVAD.reset` starts
over.  While that noise model adapts (the first ~100 ms of a fresh stream, or
after a step up in the noise floor) steady noise around -60 dBFS can be called
speech; a microphone stream that has been open a moment is past it.  A file is all start-up, so
checking one for speech takes a floor: a frame quieter than ``floor_dbfs`` (RMS; ``FILE_FLOOR_DBFS``
= -65 dBFS, 5 dB under the noise floor of the recorded human turns in shared/data/turns-human, the
quietest frames webrtcvad calls speech there) is never speech, so a file of faint hiss (sox's
``whitenoise vol -60dB``: -70 dBFS RMS) holds no speech, like a silent one.  The live microphone
path has no floor: behind the echo canceller the first frames of a user talking over the assistant
can be that quiet, and a floor there delayed barge-ins by ~350 ms (tests/test_live.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_MS = 40  # what the engine delivers
_SUBFRAME_MS = 20  # what webrtcvad is fed (10/20/30 ms allowed)
_SUPPORTED_RATES = (8000, 16000, 32000, 48000)
# After digital silence, a frame whose samples all lie within this many 16-bit steps of zero is
# still digital silence (at most -84 dBFS: the echo canceller's residue of zeros); see is_speech.
DIGITAL_SILENCE_LSB = 2
FILE_FLOOR_DBFS = -65.0  # checking a file for speech: quieter frames are not speech (module docstring)


@dataclass
class WebRtcVADConfig:
    # 0 = least aggressive about filtering out non-speech (most frames called
    # speech), 3 = most aggressive.  2 rejects steady fan/room noise while
    # keeping soft onsets.
    aggressiveness: int = 2
    floor_dbfs: float | None = None  # frames quieter than this (RMS) are not speech (module docstring)

    def __post_init__(self):
        if isinstance(self.aggressiveness, bool) or not isinstance(self.aggressiveness, int):
            raise ValueError(f"aggressiveness must be an int in 0..3, got {self.aggressiveness!r}")
        if not 0 <= self.aggressiveness <= 3:
            raise ValueError(f"aggressiveness must be in 0..3, got {self.aggressiveness}")


class WebRtcVAD:
    """Speech detector on ``frame_ms`` (40) ms float32 frames in [-1, 1], via ``webrtcvad``."""

    def __init__(self, aggressiveness: int = 2, sample_rate: int = 16000, *,
                 config: WebRtcVADConfig | None = None):
        self.config = config or WebRtcVADConfig(aggressiveness)
        if sample_rate not in _SUPPORTED_RATES:
            raise ValueError(
                f"sample rate {sample_rate} Hz is not supported by webrtcvad; "
                f"use one of {', '.join(str(r) for r in _SUPPORTED_RATES)} Hz")
        import webrtcvad  # deferred: optional native dependency

        self._webrtcvad = webrtcvad
        self.sample_rate = sample_rate
        self.frame_samples = sample_rate * FRAME_MS // 1000
        self._half = sample_rate * _SUBFRAME_MS // 1000
        self._vad = webrtcvad.Vad(self.config.aggressiveness)
        self._after_zeros = False  # the last frames were digital silence (see is_speech)

    @property
    def aggressiveness(self) -> int:
        return self.config.aggressiveness

    def reset(self) -> None:
        """Forget the noise/hangover state (a new, unrelated stream follows)."""
        self._vad = self._webrtcvad.Vad(self.config.aggressiveness)
        self._after_zeros = False

    def is_speech(self, frame: np.ndarray) -> bool:
        x = np.asarray(frame, dtype=np.float32).reshape(-1)
        if x.size != self.frame_samples:
            raise ValueError(
                f"frame of {x.size} samples; WebRtcVAD needs exactly {self.frame_samples} samples "
                f"({FRAME_MS} ms at {self.sample_rate} Hz)")
        pcm = (np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")
        peak = int(np.abs(pcm).max())
        if peak == 0 or (self._after_zeros and peak <= DIGITAL_SILENCE_LSB):
            # Digital silence (talk's gaps between inputs, a muted or starting stream) is not speech,
            # and webrtcvad is not shown it: its noise model would settle at zero, and the next real
            # noise floor is then called speech for up to ~1.5 s (recorded turns played after a gap
            # ended 0.9-2 s after the speech instead of ~0.5 s).  Nor the echo canceller's +-1 LSB
            # residue that follows such zeros once a reply plays into its reference: webrtcvad's
            # last sound was then the question, and its hangover went on into the residue (3 frames
            # of speech 0.4 s into each reply on the virtual devices: a false barge-in, an audible
            # pause).  Quiet frames straight after speech (the noise suppressor's output in a pause)
            # are shown as always: the end-of-turn timing was set on them.
            self._after_zeros = True
            return False
        self._after_zeros = False
        h = self._half
        # Evaluate both halves (no short-circuit) so the VAD's internal state
        # sees the whole stream.
        first = self._vad.is_speech(pcm[:h].tobytes(), self.sample_rate)
        second = self._vad.is_speech(pcm[h:].tobytes(), self.sample_rate)
        if not (first or second):
            return False
        floor = self.config.floor_dbfs
        return floor is None or float(np.dot(x, x)) / x.size > 10.0 ** (floor / 10.0)
