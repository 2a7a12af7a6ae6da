"""The frame driver: microphone audio in 40 ms frames into an engine, on the session clock.

Every way a conversation is fed runs through here: ``omnidesk talk`` (:mod:`.talk`, scripted
WAV files), the window's sound-file microphone (``omnidesk.gui.file_mic``), live devices
(``omnidesk.audio.session``); and the full-duplex engine (:mod:`.duplex`) re-frames what it is
fed with the same cut.  Each of them says where its frames come from (a source) and where the
reply goes (the speaker it gave the engine); the parts that must be the same everywhere are
written once, here:

* the 40 ms frame (:data:`FRAME_S`, :func:`frame_samples`) and the cut: :class:`Reframer` turns
  audio that arrives in pieces of any size into whole frames, in order, counting the samples it
  cut (a clock that cannot drift);
* the session clock of a scripted source: a frame starts at ``samples heard / rate``, from the
  sample count, never a sum of 0.04 s steps;
* the speaker tick: the speaker plays the block ``[t, t + 40 ms)`` from what was buffered at ``t``,
  before the engine sees the microphone frame of that interval (which is only complete at its
  end); a virtual speaker's block is one frame (:func:`clocked_speaker`);
* pacing: in real time the next frame is due at ``start + t`` (sleep until then); off real time
  (tests, benchmarks) the engine runs what the frame started (``engine.settle()``) before the next.

Two kinds of source, because the two kinds of microphone really differ:

* :class:`ClockedSource` (pulled): a script or a sound file has no clock of its own.  The driver
  is the clock: it asks the source for the frame starting at ``t``, ticks the speaker, hands the
  frame to the engine and paces.
* :class:`PushedSource` (pushed): a sound card is the clock.  Its frames come when its blocks
  arrive, already stamped with when the microphone heard them (the ADC time of their first
  sample minus the session origin, from the capture path), its speaker is drained by the card's
  own callback, and the echo reference (what that speaker played, read from the device beside
  the microphone) goes with the microphone through the echo canceller before a frame exists.
  None of that is the driver's to redo: it hands each frame to the engine as soon as the source
  has it, with the source's stamp, and adds no buffering, no copy and no await of its own.  The
  device-specific parts (stall detection, reopening, the ADC times, the canceller) stay in
  ``omnidesk.audio``; this module imports nothing from there.

Both modes call the source's :meth:`~ClockedSource.heard` after the engine saw a frame (status
updates; False ends the run: ``omnidesk talk`` stops at a failed turn).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import Iterable, Protocol

import numpy as np

from .speaker import VirtualSpeaker

FRAME_MS = 40
FRAME_S = FRAME_MS / 1000  # one microphone frame, one speaker block


def frame_samples(rate: int) -> int:
    """Samples in one 40 ms frame at ``rate``."""
    return int(round(FRAME_S * rate))


def clocked_speaker(rate: int, capacity_s: float, record: bool = True) -> VirtualSpeaker:
    """A virtual speaker for a scripted source: the driver ticks it one frame per frame."""
    return VirtualSpeaker(sample_rate=rate, block=frame_samples(rate), capacity_s=capacity_s, record=record)


class Reframer:
    """The cut: audio in pieces of any size -> whole frames of ``n`` samples, in order.

    :attr:`samples` counts the samples cut into frames so far: frame ``k`` starts ``k * n``
    samples after the first, whatever the pieces were (:meth:`timed` stamps them so).

    ``borrow``: the frames (and what waits for the next piece) may be views of the piece pushed,
    which the caller must then leave unchanged; else every piece is copied once (with what was
    waiting) and the frames are views of that copy, contiguous and the caller's to keep.
    """

    def __init__(self, n: int, borrow: bool = False):
        if n <= 0:
            raise ValueError("a frame needs at least one sample")
        self.n = n
        self.borrow = borrow
        self.samples = 0
        self._rest = np.zeros(0, np.float32)

    @property
    def pending(self) -> int:
        """Samples waiting for the rest of their frame."""
        return self._rest.size

    def clear(self) -> None:
        """Forget what waits (a new stream); the sample count goes on."""
        self._rest = np.zeros(0, np.float32)

    def push(self, x: np.ndarray) -> list[np.ndarray]:
        """The frames that ``x`` completes (none, one or several)."""
        n = self.n
        if self.borrow and not self._rest.size:
            buf = x
        else:
            buf = np.concatenate((self._rest, x))
        end = buf.size - buf.size % n
        frames = [buf[i:i + n] for i in range(0, end, n)]
        # a borrowed piece's tail is copied once something was cut from it: it outlives the piece
        self._rest = buf[end:].copy() if end and buf is x else buf[end:]
        self.samples += end
        return frames

    def timed(self, x: np.ndarray, origin: float, rate: int) -> list[tuple[float, np.ndarray]]:
        """:meth:`push` with each frame's start on the clock that counts this stream's samples
        from ``origin`` at ``rate``."""
        first, n = self.samples, self.n
        return [(origin + (first + k * n) / rate, frame) for k, frame in enumerate(self.push(x))]


class DrivenEngine(Protocol):
    """What the driver needs of an engine (both engines' driving surface)."""

    async def on_frame(self, frame: np.ndarray, t: float) -> None: ...

    async def settle(self) -> None: ...


class ClockedSource(ABC):
    """A microphone without a clock of its own (a script, a sound file): the driver pulls."""

    @abstractmethod
    async def next_frame(self, t: float) -> np.ndarray | None:
        """The frame starting at session time ``t`` (:attr:`FrameDriver.frame_samples` samples),
        or None: the source is done and the run ends."""

    def heard(self, frame: np.ndarray) -> bool:
        """The engine has seen ``frame``; False ends the run (before the clock waits)."""
        return True


class PushedSource(ABC):
    """A microphone that is its own clock (a sound card): frames come stamped, when they come."""

    @abstractmethod
    async def captured(self) -> Iterable[tuple[float, np.ndarray]] | None:
        """Wait for the device; the frames that became whole since, each with the session time of
        its first sample, in order (the driver hands each to the engine as it takes it from the
        iterable), or None: the source is done and the run ends."""

    def heard(self, frame: np.ndarray) -> bool:
        """The engine has seen ``frame``; False ends the run."""
        return True


class FrameDriver:
    """One conversation's frame loop: frames from a source into ``engine``.

    ``rate``: the engine's input rate (``session_rate``).  ``speaker``: what a clocked source's
    clock plays out (the virtual speaker the engine writes to); a pushed source's speaker is the
    device's.  ``realtime`` (clocked sources): frames due at wall-clock ``start + t``; else as
    fast as the engine settles.  ``yield_when_late`` (real time): a frame already late still lets
    the event loop run once before it (the window's sound files); without it late frames follow
    back to back, as a device's burst would (``omnidesk talk``).
    """

    def __init__(self, engine: DrivenEngine, rate: int, speaker: VirtualSpeaker | None = None,
                 realtime: bool = True, yield_when_late: bool = True):
        self.engine = engine
        self.rate = rate
        self.speaker = speaker
        self.realtime = realtime
        self.yield_when_late = yield_when_late
        self.frame_samples = frame_samples(rate)
        self.sample = 0  # microphone samples the engine has heard (a clocked source's clock)
        self.start_mono = time.monotonic()  # wall-clock time of session time 0 (real time); set by run()

    @property
    def t(self) -> float:
        """Session time of the next frame's first sample (clocked sources)."""
        return self.sample / self.rate  # from the sample count: no drift from summing 0.04

    async def run(self, source: ClockedSource | PushedSource) -> None:
        """Drive until the source is done or its ``heard`` says stop."""
        if isinstance(source, PushedSource):
            await self._run_pushed(source)
        else:
            await self._run_clocked(source)

    async def _run_clocked(self, source: ClockedSource) -> None:
        engine, speaker = self.engine, self.speaker
        self.start_mono = time.monotonic()
        while True:
            t = self.t
            frame = await source.next_frame(t)
            if frame is None:
                return
            # The speaker plays the block [t, t + 40 ms) from what was buffered at t; the mic frame
            # covering the same interval is only complete (and processed) at its end.
            if speaker is not None:
                speaker.tick()
            await engine.on_frame(frame, t)
            self.sample += frame.size
            if not source.heard(frame):
                return
            if self.realtime:
                delay = self.start_mono + self.t - time.monotonic()
                if delay > 0 or self.yield_when_late:
                    await asyncio.sleep(max(0.0, delay))
            else:
                await engine.settle()

    async def _run_pushed(self, source: PushedSource) -> None:
        on_frame = self.engine.on_frame
        while True:
            frames = await source.captured()
            if frames is None:
                return
            for t, frame in frames:
                await on_frame(frame, t)
                if not source.heard(frame):
                    return


__all__ = ["FRAME_MS", "FRAME_S", "ClockedSource", "DrivenEngine", "FrameDriver", "PushedSource", "Reframer",
           "clocked_speaker", "frame_samples"]
