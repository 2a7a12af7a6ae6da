"""Live rates of the reply pipeline, from compute time (not wall time).

Wall-clock rates of a playing reply mostly show playback speed: generation
waits whenever enough audio is queued.  :class:`TimedExecutor` wraps an
executor and adds up the time spent in each stage's steps, so the overlay can
show what the model really does: thinker and talker tokens per second of
compute, and the vocoder's real-time factor.  The timing runs on the worker
thread, inside the steps it measures.
"""

from __future__ import annotations

import time


def _timed(step, spent: float):
    """Run one step; its result and ``spent`` plus the seconds it took."""
    t0 = time.perf_counter()
    result = step()
    return result, spent + time.perf_counter() - t0


class TimedExecutor:
    """An executor with compute time per stage; every other attribute is the wrapped executor's."""

    def __init__(self, executor):
        self._ex = executor
        self._reset()

    def __getattr__(self, name):
        return getattr(self._ex, name)

    def _reset(self) -> None:
        self.thinker_s = self.talker_s = self.vocoder_s = self.vocoder_audio_s = 0.0
        self.thinker_tokens = self.talker_tokens = 0

    def start_reply(self, *args, **kwargs):
        self._reset()  # rates are per reply
        return self._ex.start_reply(*args, **kwargs)

    def thinker_step(self):
        token, self.thinker_s = _timed(self._ex.thinker_step, self.thinker_s)
        self.thinker_tokens += token is not None
        return token

    def talker_step(self):
        token, self.talker_s = _timed(self._ex.talker_step, self.talker_s)
        self.talker_tokens += token is not None
        return token

    def vocoder_step(self, final: bool = False):
        chunks, self.vocoder_s = _timed(lambda: self._ex.vocoder_step(final), self.vocoder_s)
        self.vocoder_audio_s += sum(c.size for c in chunks) / self._ex.sample_rate_out
        return chunks

    def rates(self) -> tuple[float | None, float | None, float | None]:
        """Thinker tok/s, talker tok/s (per second of compute) and the vocoder's real-time factor
        for the current (or last) reply; None until there is something to divide."""
        thinker = self.thinker_tokens / self.thinker_s if self.thinker_tokens and self.thinker_s > 0 else None
        talker = self.talker_tokens / self.talker_s if self.talker_tokens and self.talker_s > 0 else None
        rtf = self.vocoder_s / self.vocoder_audio_s if self.vocoder_audio_s > 0 else None
        return thinker, talker, rtf
