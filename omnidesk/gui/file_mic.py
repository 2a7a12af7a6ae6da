"""A conversation whose microphone is sound files: :class:`FileMicSession`.

For machines without a microphone (the window still works: "speak" a WAV
file), for reproducible manual tests (the same question every time), and for
the GUI tests, which drive the real engine through it.  It has the interface
of the live audio session (``omnidesk.audio.session.LiveSession``: start,
close, interrupt, interrupt_after, repeat_last_question, set_muted, ...), so
the window treats both alike.  The speaker is virtual: replies are timed and
played out like on a device, but not heard.

The loop is ``omnidesk talk``'s (:class:`~omnidesk.engine.frames.FrameDriver`, this
session being its clocked source): every 40 ms one microphone frame (file audio
or silence) goes to the engine and the virtual speaker plays one block.  With
``realtime=False`` the loop runs as fast as the CPU allows (tests) and stands
still while there is nothing to hear or say.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import numpy as np

from omnidesk.audio.session import LiveSettings, LiveStatus
from omnidesk.audio.vad import WebRtcVAD
from omnidesk.engine.duplex import DuplexEngine, make_engine, session_rate, vad_rate
from omnidesk.engine.engine import Engine, EngineConfig, EngineStats, EngineThread, TurnState
from omnidesk.engine.executor import end_session
from omnidesk.engine.frames import ClockedSource, FrameDriver, clocked_speaker
from omnidesk.engine.rates import TimedExecutor
from omnidesk.engine.speaker import VirtualSpeaker
from omnidesk.engine.timeline import Timeline
from omnidesk.engine.vad import level_dbfs

log = logging.getLogger("omnidesk.gui")

STATUS_EVERY_S = 0.04  # wall time between status updates (the live session's rate)
REPLYING = (TurnState.RESPONDING, TurnState.SUSPECTED_BARGE_IN)


class FileMicSession(ClockedSource):
    """Same interface as the live session; :meth:`say` plays audio into the (virtual) microphone."""

    def __init__(self, executor, settings: LiveSettings | None = None, engine_config: EngineConfig | None = None,
                 on_update=None, timeline: Timeline | None = None, realtime: bool = True):
        self.executor = TimedExecutor(executor)
        self.settings = settings or LiveSettings()  # the endpointing settings apply; the devices do not
        self.engine_config = engine_config or EngineConfig()
        self.timeline = timeline if timeline is not None else Timeline(model={}, device="cpu")
        self._on_update = on_update or (lambda kind, payload: None)
        self.realtime = realtime
        self.engine: Engine | DuplexEngine | None = None
        self._judge = None  # the end-of-turn judge (its thread), closed with the session
        self.speaker: VirtualSpeaker | None = None
        self._thread: EngineThread | None = None
        self._run_future = None
        self._closing = False
        self._queue: collections.deque[np.ndarray] = collections.deque()  # utterances waiting to be said
        self._saying: np.ndarray | None = None
        self._pos = 0
        self._last_said: np.ndarray | None = None
        self.muted = False
        self._stop_clicks: collections.deque[float] = collections.deque()  # monotonic times of stop clicks
        self._interrupt_after_s: float | None = None  # armed before the engine exists
        self._driver: FrameDriver | None = None
        self._last_status = 0.0  # monotonic time of the last status update (0: none since the clock stood still)
        self._frame: np.ndarray | None = None  # the last frame heard
        self.now = 0.0  # session time of the frame being processed
        self.push_to_talk = False
        self.talk_pressed = False
        self.headphones = self.settings.headphones

    # ------------------------------------------------------------------ any thread
    @property
    def stats(self) -> EngineStats:
        return self.engine.stats if self.engine is not None else EngineStats()

    def start(self) -> None:
        """Start the engine thread (blocks briefly: call it off the UI thread)."""
        self._thread = EngineThread()
        try:
            self._thread.call(self._setup()).result(timeout=30)
        except BaseException:
            self.close()  # nothing is left running
            raise
        self._run_future = self._thread.call(self._run())

    def close(self) -> None:
        """Stop the loop and the engine (blocks until the step in flight returns)."""
        self._closing = True
        if self._run_future is not None:
            try:
                self._run_future.result(timeout=30)
            except Exception:
                log.exception("file microphone loop ended with an error")
        if self.engine is not None:
            if self._thread is not None:
                try:
                    self._thread.call(self.engine.aclose()).result(timeout=30)
                except Exception:
                    log.exception("stopping the reply at close failed")
            self.engine.close()
            end_session(self.executor)  # a remote executor stops streaming the cancelled reply
        if self._judge is not None:
            self._judge.close()
            self._judge = None
        if self._thread is not None:
            self._thread.stop()

    @property
    def end_of_turn(self) -> str:
        """The end-of-turn detector deciding this session's turns: "fixed" or the judge's name."""
        return self._judge.name if self._judge is not None else "fixed"

    def say(self, audio: np.ndarray) -> None:
        """Queue one utterance (mono float32 at the model's input rate, :func:`session_rate`: 16 kHz
        for Qwen, 24 kHz for Moshi) for the microphone; it starts at once if nothing else is being
        said (while a reply plays, that is a barge-in, as with a person)."""
        audio = np.ascontiguousarray(audio, dtype=np.float32).reshape(-1)
        self._last_said = audio
        self._queue.append(audio)

    def repeat_last_question(self) -> bool:
        if self._last_said is None:
            return False
        self._queue.append(self._last_said)
        return True

    def interrupt(self) -> None:
        """The stop button: the reply stops as on a confirmed barge-in.  Returns at once."""
        self._stop_clicks.append(time.monotonic())  # deque: safe from any thread

    def interrupt_after(self, ms: float) -> None:
        """Interrupt the current (or next) reply ``ms`` after its playback started."""
        self._interrupt_after_s = max(0.0, float(ms)) / 1000.0
        if self.engine is not None:
            self.engine.interrupt_after_s, self._interrupt_after_s = self._interrupt_after_s, None

    def set_muted(self, muted: bool) -> None:
        self.muted = bool(muted)

    def set_push_to_talk(self, enabled: bool) -> None:
        self.push_to_talk = bool(enabled)  # sound files are said on purpose: never gated

    def set_talk_pressed(self, pressed: bool) -> None:
        self.talk_pressed = bool(pressed)

    def set_headphones(self, on: bool) -> None:
        self.headphones = bool(on)  # a virtual speaker has no echo to cancel

    # ------------------------------------------------------------------ engine thread
    async def _setup(self) -> None:
        ex = self.executor
        await asyncio.get_running_loop().run_in_executor(None, ex.reset_conversation)  # a new conversation
        self.speaker = clocked_speaker(ex.sample_rate_out, self.engine_config.max_audio_ahead_s + 2.0, record=False)
        # the same speech detection and endpointing as on a microphone (a duplex engine gives it a
        # 16 kHz copy of what the model hears)
        rate = vad_rate(ex)
        detector = WebRtcVAD(self.settings.vad_aggressiveness, rate)
        # off real time the end-of-turn model scores inline: its verdict lands where it would live
        endpointer = self.settings.make_endpointer(detector, rate, duplex=getattr(ex, "duplex", False),
                                                   blocking=not self.realtime)
        self._judge = endpointer.judge
        self.engine = make_engine(ex, endpointer, self.speaker, self.engine_config, self.timeline, self._on_update)
        self.engine.interrupt_after_s, self._interrupt_after_s = self._interrupt_after_s, None

    def _has_input(self) -> bool:
        return self._saying is not None or bool(self._queue)

    def _next_frame(self, n: int) -> np.ndarray:
        if self._saying is None and self._queue:
            self._saying, self._pos = self._queue.popleft(), 0
        frame = np.zeros(n, np.float32)
        if self._saying is not None:
            part = self._saying[self._pos:self._pos + n]
            frame[:part.size] = part
            self._pos += n
            if self._pos >= self._saying.size:
                self._saying = None
        if self.muted:
            frame[:] = 0.0
        return frame

    async def _stop_if_asked(self, t: float) -> None:
        clicked = None
        while self._stop_clicks:
            clicked = self._stop_clicks.popleft()
        # a full-duplex model is stopped whatever the engine's state, as on the live session: it may be
        # talking over the user (state USER_SPEAKING), and its stop is a flush + mute, nothing to roll back
        duplex = getattr(self.engine, "duplex", False)
        if clicked is not None and (duplex or self.engine.state in REPLYING):
            # the click on the session clock (realtime), never later than the frame being processed
            due = min(clicked - self._driver.start_mono, t) if self.realtime else t
            await self.engine.interrupt(onset=due, confirmed=due)

    async def _run(self) -> None:
        self._driver = FrameDriver(self.engine, session_rate(self.executor), self.speaker, realtime=self.realtime)
        self._last_status = 0.0
        self._frame = np.zeros(self._driver.frame_samples, np.float32)
        await self._driver.run(self)

    async def next_frame(self, t: float) -> np.ndarray | None:
        """The driver's next frame: the files being said, or silence (None once closing)."""
        engine = self.engine
        while not self._closing:
            if not self.realtime and engine.idle and not self._has_input() and not self._stop_clicks:
                if self._last_status:  # the clock stops: send the final counters once
                    self._last_status = 0.0
                    self._on_update("status", self._status(self._frame))
                await asyncio.sleep(0.005)  # nothing to hear or play: the simulated clock stands still
                continue
            self.now = t
            await self._stop_if_asked(t)
            return self._next_frame(self._driver.frame_samples)
        return None

    def heard(self, frame: np.ndarray) -> bool:
        self._frame = frame
        now = time.monotonic()
        if now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            self._on_update("status", self._status(frame))
        return True

    def _status(self, frame: np.ndarray) -> LiveStatus:
        thinker, talker, rtf = self.executor.rates()
        stats = self.engine.stats
        return LiveStatus(level_dbfs=level_dbfs(frame),
                          playback_buffer_ms=1000.0 * self.speaker.buffered_samples / self.speaker.sample_rate,
                          underruns=self.speaker.underruns, overflows=0,
                          confirmed_barge_ins=stats.barge_ins, false_barge_ins=stats.false_barge_ins,
                          thinker_tok_s=thinker, talker_tok_s=talker, vocoder_rtf=rtf, muted=self.muted,
                          talk_pressed=self.talk_pressed)


def read_sound_file(path, rate: int = 16000) -> np.ndarray:
    """A sound file as mono float32 at ``rate`` (resampled with soxr when needed)."""
    import soundfile as sf

    data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    audio = data.mean(axis=1)
    if file_rate != rate:
        import soxr

        audio = soxr.resample(audio, file_rate, rate)
    return np.ascontiguousarray(audio, dtype=np.float32)
