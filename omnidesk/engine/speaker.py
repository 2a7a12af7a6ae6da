"""A simulated output device: a bounded play buffer drained by the caller's clock.

``omnidesk talk`` and the tests use it where the app uses the sound card: the
engine writes vocoder chunks with :meth:`VirtualSpeaker.write`, its clock
calls :meth:`VirtualSpeaker.tick` once per output block, and
:meth:`VirtualSpeaker.recording` is what the "device" played (OUT.wav).

The :attr:`~VirtualSpeaker.playhead` counts reply samples that actually
reached the device; rollback after a barge-in maps it to text tokens, so it
must never count audio that was only buffered.

Reply lifecycle::

    start_reply() -> write()* -> end_reply()          (plays out, then idle)
    start_reply() -> write()* -> [pause() -> resume()]* -> flush()  (barge-in)

No threads: every method does work proportional to the samples it moves.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 24000  # Qwen2.5-Omni's vocoder output rate
DEFAULT_BLOCK = 960  # 40 ms at 24 kHz, the same period as the mic frames
# Enough for a couple of vocoder chunks ahead of the playhead; more only makes
# the engine generate further past what the user may interrupt.
DEFAULT_CAPACITY_S = 4.0
DEFAULT_FADE_MS = 5.0  # long enough to avoid a click, short enough to feel instant
# Recording storage grows in chunks of this many seconds (no per-tick allocation).
RECORDING_CHUNK_S = 10.0


class VirtualSpeaker:
    """Simulated speaker with a bounded FIFO play buffer and a full recording.

    * :meth:`write` queues reply audio; returns False (nothing queued) when it
      does not fit, so the producer waits for ticks (backpressure).
    * :meth:`tick` plays ``n`` samples: buffered audio, or silence when paused
      or empty.  An empty buffer while a reply is active (started, not yet
      ended and drained, not paused) counts one underrun per tick.
    * :meth:`flush` drops all unplayed audio after a short fade-out.
    * No hard edges inside a reply: :meth:`pause` plays ``fade_ms`` more with a
      fade-out (those samples count as played); after a pause or an underrun
      the audio comes back with a ``fade_ms`` fade-in; an underrun fades out
      the last samples it still has.  A hard edge clicks for the listener, and
      the echo canceller lets the echo of a click through (measured: a 10-30 ms
      dropout in a reply left -40 dBFS of residual echo, enough for a false
      barge-in).
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE, block: int = DEFAULT_BLOCK,
                 capacity_s: float = DEFAULT_CAPACITY_S, fade_ms: float = DEFAULT_FADE_MS,
                 record: bool = True):
        if block <= 0 or capacity_s <= 0:
            raise ValueError("block and capacity_s must be > 0")
        self.sample_rate = sample_rate
        self.block = block
        self.capacity = int(round(capacity_s * sample_rate))
        self.fade_ms = fade_ms
        fade_n = max(1, int(round(fade_ms * sample_rate / 1000.0)))
        self._rise = (np.arange(1, fade_n + 1, dtype=np.float32) / fade_n)  # 1/n .. 1, preallocated
        self._fade_in_at = fade_n  # samples of the current fade-in done (fade_n: none running)
        self._pausing = 0  # fade-out samples still to play after pause()
        self._buf = np.zeros(self.capacity, dtype=np.float32)
        self._head = 0  # index of the next sample to play
        self._count = 0  # buffered samples
        self.record = record
        self._rec_chunk = max(block, int(round(RECORDING_CHUNK_S * sample_rate)))
        self._rec_chunks: list[np.ndarray] = []
        self._rec_fill = 0  # samples used in the last chunk
        self.clock_samples = 0  # every sample ticked since creation, silence included
        self.playhead = 0
        self.reply_first_sample: int | None = None
        self.underruns = 0
        self.paused = False
        self._reply_active = False
        self._reply_ending = False
        self._stale = 0  # buffered samples left from before start_reply() (a flush's fade tail)

    # ------------------------------------------------------------ state

    @property
    def buffered_samples(self) -> int:
        return self._count

    @property
    def free_samples(self) -> int:
        """How many samples :meth:`write` accepts right now."""
        return self.capacity - self._count

    @property
    def reply_active(self) -> bool:
        """A reply is started and not finished (ended and drained) or flushed."""
        return self._reply_active

    @property
    def heard_s(self) -> float:
        """Reply audio played so far, in seconds (``playhead / sample_rate``)."""
        return self.playhead / self.sample_rate

    # ------------------------------------------------------------ reply

    def start_reply(self) -> None:
        """Begin a reply: playhead back to 0.  Call it before writing the reply's first chunk;
        audio still buffered then (a flush's fade tail) does not count toward this reply.
        Underruns count once the reply's first sample has played."""
        self._stale = self._count
        self.playhead = 0
        self.reply_first_sample = None  # clock_samples at which its first sample played
        self.paused = False
        self._pausing = 0
        self._fade_in_at = self._rise.size  # a reply starts as the vocoder made it
        self._reply_active = True
        self._reply_ending = False

    def end_reply(self) -> None:
        """No more audio will be written for this reply; it stays active until the buffer drains,
        so the tail still plays but running dry is no longer an underrun."""
        self._reply_ending = True
        self._finish_if_drained()

    def write(self, samples: np.ndarray) -> bool:
        """Queue ``samples`` (float32 mono); False, and nothing queued, if they do not fit.

        Raises ValueError for a chunk longer than the whole buffer (it could never fit)."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"expected mono 1-D samples, got shape {x.shape}")
        n = x.size
        if n > self.capacity:
            raise ValueError(f"chunk of {n} samples exceeds the speaker buffer ({self.capacity})")
        if n > self.free_samples:
            return False
        tail = (self._head + self._count) % self.capacity
        first = min(n, self.capacity - tail)
        self._buf[tail : tail + first] = x[:first]
        self._buf[: n - first] = x[first:]
        self._count += n
        return True

    def tick(self, n_samples: int | None = None) -> np.ndarray:
        """Advance the device clock by ``n_samples`` (default ``block``); return what was played."""
        out = np.zeros(self.block if n_samples is None else int(n_samples), dtype=np.float32)
        self.tick_into(out)
        return out

    def tick_into(self, out: np.ndarray) -> None:
        """:meth:`tick` into a caller's float32 buffer (``out.size`` samples), allocating nothing
        when recording is off: the real device's audio callback plays through this."""
        n = out.size
        k = 0
        if not self.paused or self._pausing:
            k = min(n, self._count)
            if self.paused:  # the pause's fade-out is still playing
                k = min(k, self._pausing)
                self._pausing -= k
            if k:
                first = min(k, self.capacity - self._head)
                out[:first] = self._buf[self._head : self._head + first]
                out[first:k] = self._buf[: k - first]
                self._head = (self._head + k) % self.capacity
                self._count -= k
                stale = min(k, self._stale)
                self._stale -= stale
                if k > stale:
                    if self.reply_first_sample is None:
                        self.reply_first_sample = self.clock_samples + stale
                    self.playhead += k - stale
                fade_n = self._rise.size
                if self._fade_in_at < fade_n:  # back after a pause or an underrun
                    m = min(k, fade_n - self._fade_in_at)
                    out[:m] *= self._rise[self._fade_in_at:self._fade_in_at + m]
                    self._fade_in_at += m
            # Waiting for the first chunk is latency, not an underrun.
            started = self.reply_first_sample is not None
            if k < n and self._reply_active and not self._reply_ending and started and not self.paused:
                self.underruns += 1
                m = min(k, self._rise.size)
                if m:  # what is left goes out with a fade rather than a click
                    out[k - m:k] *= self._rise[m - 1::-1]
                self._fade_in_at = 0
            self._finish_if_drained()
        out[k:] = 0.0
        self._record(out)
        self.clock_samples += n

    def pause(self) -> None:
        """Stop consuming the buffer after a ``fade_ms`` fade-out (ticks play silence then); the
        playhead stops after the faded samples."""
        if not self.paused:
            self._pausing = self._fade_out_next(self._rise.size)
        self.paused = True

    def resume(self) -> None:
        """Continue with exactly the sample after the last one played, faded in."""
        if self.paused:
            self._fade_in_at = 0
        self.paused = False
        self._pausing = 0

    def _fade_out_next(self, keep: int) -> int:
        """Fade the next ``keep`` buffered samples (at most what is buffered) down to silence;
        return how many that is."""
        keep = min(self._count, keep)
        if keep:
            # Gains 1 - 1/keep ... 0: the first step down is one ramp step and
            # the last kept sample is silent, so there is no jump either side.
            gain = 1.0 - np.arange(1, keep + 1, dtype=np.float32) / keep
            idx = (self._head + np.arange(keep)) % self.capacity
            self._buf[idx] *= gain
        return keep

    def flush(self, fade_ms: float | None = None) -> int:
        """Drop everything not yet played; return how many samples were dropped.

        If audio is playing (not paused), the next ``fade_ms`` of it are kept
        with a linear fade to zero so the cut does not click; those samples
        still play (and count in the playhead).  Ends the reply and un-pauses."""
        fade_ms = self.fade_ms if fade_ms is None else fade_ms
        if self.paused:
            keep = self._pausing  # the pause's own fade-out, if it has not finished playing
        else:
            keep = self._fade_out_next(int(round(fade_ms * self.sample_rate / 1000.0)))
        dropped = self._count - keep
        self._count = keep
        self._stale = min(self._stale, keep)
        self.paused = False
        self._pausing = 0
        self._fade_in_at = self._rise.size
        self._reply_active = False
        self._reply_ending = False
        return dropped

    # -------------------------------------------------------- recording

    def recording(self) -> np.ndarray:
        """Everything played since creation, silence included (a copy; empty if ``record=False``)."""
        if not self._rec_chunks:
            return np.zeros(0, dtype=np.float32)
        parts = self._rec_chunks[:-1] + [self._rec_chunks[-1][: self._rec_fill]]
        return np.concatenate(parts)

    def _record(self, out: np.ndarray) -> None:
        if not self.record:
            return
        pos = 0
        while pos < out.size:
            if not self._rec_chunks or self._rec_fill == self._rec_chunk:
                self._rec_chunks.append(np.empty(self._rec_chunk, dtype=np.float32))
                self._rec_fill = 0
            k = min(out.size - pos, self._rec_chunk - self._rec_fill)
            self._rec_chunks[-1][self._rec_fill : self._rec_fill + k] = out[pos : pos + k]
            self._rec_fill += k
            pos += k

    def _finish_if_drained(self) -> None:
        if self._reply_ending and self._count == 0:
            self._reply_active = False
            self._reply_ending = False
