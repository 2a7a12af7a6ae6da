"""Full-duplex engine: the model hears and speaks all the time, one step per audio frame.

A dual-autoregressive model (Moshi) has no turns: every input frame (80 ms
of the user's audio) produces one output frame (80 ms of its own voice) and
one text token, and the model decides by itself when to talk.  The engine's
job is the clock:

* Sessions hand it 40 ms frames at the executor's input rate (24 kHz for
  Mimi), converted once from the device's or the file's rate (none when
  they match); the engine queues one model frame every 80 ms and never
  resamples the model's path.  The speech detector hears its own 16 kHz
  copy (webrtcvad takes only 8/16/32/48 kHz), a side branch made here.
* One worker thread runs the steps back to back; every output frame goes to
  the speaker the moment it exists.
* Each step's compute time is measured against the frame.  A step slower
  than the frame makes the model fall behind the microphone: that lag is
  reported (overlay, timeline) and, past ``max_lag_s``, the oldest queued
  input frames are dropped (and counted) so the conversation stays live
  instead of drifting further behind.

Stop ("Stop reply", interrupt after N ms): a duplex model cannot be rolled
back to what was heard - it keeps its own history - so stopping flushes
playback and mutes the assistant until its text stream has been quiet for
``quiet_frames`` frames (it stopped the sentence it was saying); then it is
heard again.

Timeline (additive to the contract, documented in timeline.py): the session
dict gains ``duplex`` with per-frame step times, the user's speech segments
(VAD), the assistant's speech segments (audible output or non-pad text), and
per exchange the delay from the end of the user's speech to the start of the
assistant's (negative when it started while the user was still talking);
each assistant segment's ``text_token_ids`` (what it said, as ids) and every
step's text token (``step_text_token_ids``, null while the delays fill), so a
run compares id by id with a reference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .engine import EngineStats, TurnFailure, TurnState
from .executor import StageError
from .frames import Reframer
from .speaker import VirtualSpeaker
from .timeline import Timeline
from .vad import Endpoint, Endpointer, SpeechStart, _PreRoll

log = logging.getLogger("omnidesk.engine")


@dataclass
class DuplexStep:
    """What one model step produced: one output frame and the text token of that frame."""

    audio: np.ndarray  # float32 mono, frame_samples_out samples at sample_rate_out
    text_token: int | None  # None while the model's delays have not filled


class DuplexExecutor(ABC):
    """A full-duplex model family: ``step`` takes one input frame and returns one output frame.

    Synchronous and single-threaded, like :class:`~omnidesk.engine.executor.Executor`: the
    engine calls it from its one worker thread.  Exceptions should be tagged with their stage
    (``with stage("encoder"): ...``)."""

    duplex = True
    sample_rate_in: int  # what step() takes (24 kHz for Mimi)
    sample_rate_out: int  # what step() returns
    frame_samples_in: int  # samples per input frame (1920: 80 ms at 24 kHz)
    frame_samples_out: int

    @abstractmethod
    def reset_conversation(self) -> None: ...

    @abstractmethod
    def step(self, frame: np.ndarray) -> DuplexStep: ...

    @abstractmethod
    def decode(self, text_ids: list[int]) -> str: ...

    @abstractmethod
    def is_silent_text(self, token: int | None) -> bool:
        """True for the tokens the model emits while it says nothing (padding)."""


@dataclass
class DuplexConfig:
    audible_dbfs: float = -45.0  # an output frame louder than this is the assistant speaking
    segment_gap_s: float = 0.4  # a pause this long ends an assistant speech segment
    quiet_frames: int = 4  # after a stop, pad-only text for this many frames unmutes the assistant
    max_lag_s: float = 1.0  # past this much lag behind the microphone, queued input frames are dropped


@dataclass
class DuplexView:
    """An immutable summary for the UI (``on_update("duplex", view)``), times on the session clock."""

    frames: int
    frame_s: float
    step_ms_p50: float | None
    step_ms_p90: float | None
    last_step_ms: float | None
    late_frames: int
    dropped_frames: int
    lag_s: float
    user_speaking: bool
    assistant_speaking: bool
    muted: bool
    text: str  # the assistant's text so far (non-pad tokens, decoded)
    last_delay_s: float | None  # end of the user's speech -> start of the assistant's, last exchange
    delays_s: tuple[float, ...] = ()  # every exchange so far


@dataclass
class _Segment:
    start: float
    end: float | None = None
    text_ids: list[int] = field(default_factory=list)


class DuplexEngine:
    """One full-duplex conversation.  Same driving surface as :class:`~omnidesk.engine.engine.Engine`
    (``on_frame``, ``settle``, ``interrupt``, ``idle``, ``stats``, ``state``, ``failure``...), so
    the sessions and ``omnidesk talk`` drive either."""

    duplex = True

    def __init__(self, executor: DuplexExecutor, endpointer: Endpointer, speaker: VirtualSpeaker,
                 config=None, timeline: Timeline | None = None,
                 on_update: Callable[[str, object], None] | None = None, duplex_config: DuplexConfig | None = None):
        import soxr

        self.ex = executor
        self.endpointer = endpointer
        self.speaker = speaker
        self.config = config  # the EngineConfig (voice/seed are the executor's business here)
        self.duplex_config = duplex_config or DuplexConfig()
        self.timeline = timeline or Timeline(model={}, device="cpu")
        self.on_update = on_update or (lambda kind, payload: None)
        self.stats = EngineStats()
        self.state = TurnState.LISTENING
        self.failure: TurnFailure | None = None
        self.interrupt_after_s: float | None = None
        self.last_utterance: np.ndarray | None = None
        self.now = 0.0
        self.frame_s = executor.frame_samples_in / executor.sample_rate_in
        self._loop = asyncio.get_running_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnidesk-worker")
        rate_in, vad = executor.sample_rate_in, endpointer.sample_rate
        # the speech detector's own copy (a side branch; the model's path is never resampled here)
        self._to_vad = None if vad == rate_in else soxr.ResampleStream(rate_in, vad, 1, dtype="float32")
        # the detector's frames, on its own clock (the samples it was given since the first frame);
        # the resampler's output is the engine's own: the frames may be views of it
        self._vad_frames = Reframer(endpointer.frame_samples, borrow=True)
        self._t0: float | None = None  # session time of the first frame
        # the last utterance at the model's rate (repeat last question plays it into the model's path)
        cfg = endpointer.config
        self._recent = _PreRoll(int((cfg.pre_roll_ms / 1000 + cfg.max_utterance_s + 1.0) * rate_in))
        self._model_frames = Reframer(executor.frame_samples_in)  # 40 ms frames -> the model's frames
        self._queue: list[tuple[np.ndarray, float]] = []  # (model frame, session time its last sample arrived)
        self._task: asyncio.Task | None = None
        self._closing = False  # aclose() began: frames that still arrive are not stepped
        self._progress = asyncio.Event()
        self.steps_ms: list[float] = []
        self.step_text_ids: list[int | None] = []  # every step's text token (None while the delays fill)
        self.late_frames = 0
        self.dropped_frames = 0
        self.max_lag_s = 0.0
        self._lag_s = 0.0
        self.user_segments: list[_Segment] = []
        self.assistant_segments: list[_Segment] = []
        self.exchanges: list[dict] = []
        self.stops: list[dict] = []
        self.errors: list[dict] = []
        self._user_speaking = False
        self._assistant: _Segment | None = None  # the segment being spoken
        self._last_audible: float | None = None
        self._muted = False
        self._quiet_run = 0
        self._text_ids: list[int] = []
        self._text = (0, "")  # (tokens decoded, text): view() decodes only when a token came
        self._speaker_started = False
        self.timeline.extra["duplex"] = self._timeline_section()

    # ------------------------------------------------------------------ input side
    async def on_frame(self, frame: np.ndarray, t: float) -> None:
        """One mic frame at the executor's input rate (:func:`session_rate`), starting at session
        time ``t``: it goes to the model as it is; the speech detector hears a copy at its rate."""
        if self._closing:  # a driver's last frames after aclose: the worker pool is going away
            return
        try:
            x = np.asarray(frame, np.float32).reshape(-1)
            if self._t0 is None:
                self._t0 = t
            self.now = t + x.size / self.ex.sample_rate_in
            self._recent.push(x)
            self._listen(x)
            for model_frame in self._model_frames.push(x):
                self._queue.append((model_frame, self.now))
            self._drop_if_behind()
            if self._queue and (self._task is None or self._task.done()):
                self._task = self._loop.create_task(self._run_steps())
            await self._check_interrupt_after()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported like a failed step
            await self._fail(e)

    def _listen(self, x: np.ndarray) -> None:
        """The speech detector's side branch: whole detector frames, each stamped with its own clock
        (the resampler releases audio in bursts, so a call may carry zero, one or two frames)."""
        ep = self.endpointer
        y = x if self._to_vad is None else self._to_vad.resample_chunk(x)
        for t, frame in self._vad_frames.timed(y, self._t0, ep.sample_rate):
            for event in ep.push(frame, t):
                self._on_vad(event)

    def _utterance_at_model_rate(self, start: float | None) -> np.ndarray:
        """What the model heard from session time ``start`` (the utterance's first sample) to now."""
        if start is None:
            return np.zeros(0, np.float32)
        return self._recent.last(max(0, int(round((self.now - start) * self.ex.sample_rate_in))))

    def _on_vad(self, event) -> None:
        if isinstance(event, SpeechStart):
            self._user_speaking = True
            self.user_segments.append(_Segment(start=event.t))
            self._set_state(TurnState.USER_SPEAKING)
        elif isinstance(event, Endpoint):
            self._user_speaking = False
            if self.user_segments and self.user_segments[-1].end is None:
                self.user_segments[-1].end = event.t_speech_end
                start = self.endpointer.utterance_start_t
                self.last_utterance = self._utterance_at_model_rate(
                    self.user_segments[-1].start if start is None else start)
                self._pair_exchange()
            self.endpointer.reset()
            self._set_state(TurnState.RESPONDING if self._assistant is not None else TurnState.LISTENING)
        self._update_timeline()

    def _drop_if_behind(self) -> None:
        excess = len(self._queue) - max(1, int(self.duplex_config.max_lag_s / self.frame_s))
        if excess > 0:
            del self._queue[:excess]
            self.dropped_frames += excess

    # ------------------------------------------------------------------ the step loop
    def _timed_step(self, frame: np.ndarray):
        t0 = time.perf_counter()
        out = self.ex.step(frame)
        return out, (time.perf_counter() - t0) * 1000.0

    async def _run_steps(self) -> None:
        try:
            while self._queue and not self._closing:
                frame, arrived = self._queue.pop(0)
                try:
                    out, ms = await self._loop.run_in_executor(self._pool, self._timed_step, frame)
                except (StageError, asyncio.CancelledError):
                    raise
                except Exception as e:  # noqa: BLE001 - untagged: the model step
                    raise StageError("engine", e) from e
                self.stats.steps += 1
                self.steps_ms.append(round(ms, 3))
                self.step_text_ids.append(None if out.text_token is None else int(out.text_token))
                if ms > self.frame_s * 1000.0:
                    self.late_frames += 1
                self._lag_s = max(0.0, self.now - arrived)
                self.max_lag_s = max(self.max_lag_s, self._lag_s)
                self._play(out)
                self._progress.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            await self._fail(e)
        finally:
            self._progress.set()

    def _play(self, out: DuplexStep) -> None:
        audio = np.asarray(out.audio, np.float32)
        token = out.text_token
        silent_text = self.ex.is_silent_text(token)
        if self._muted:
            self._quiet_run = self._quiet_run + 1 if silent_text else 0
            if self._quiet_run >= self.duplex_config.quiet_frames:
                self._muted = False
                self.stops[-1]["unmuted"] = self.now
            else:
                audio = np.zeros_like(audio)
        if not self._speaker_started:
            self.speaker.start_reply()
            self._speaker_started = True
        # when it plays: after what the speaker still holds
        starts_at = self.now + self.speaker.buffered_samples / self.speaker.sample_rate
        if not self.speaker.write(audio):
            # the speaker is full (the model runs ahead of real time with a stalled output): drop
            # the oldest audio rather than the newest, the listener hears the present
            self.speaker.flush(fade_ms=0)
            self.speaker.write(audio)
        rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2))) if audio.size else 0.0
        audible = rms > 10 ** (self.duplex_config.audible_dbfs / 20) or (not silent_text and not self._muted)
        end = starts_at + audio.size / self.ex.sample_rate_out
        if audible:
            if self._assistant is None:
                self._assistant = _Segment(start=starts_at)
                self.assistant_segments.append(self._assistant)
                self._pair_exchange()
                self._set_state(TurnState.RESPONDING if not self._user_speaking else TurnState.USER_SPEAKING)
            self._last_audible = end
        elif self._assistant is not None and self._last_audible is not None \
                and starts_at - self._last_audible >= self.duplex_config.segment_gap_s:
            self._assistant.end = self._last_audible
            self._assistant = None
            if not self._user_speaking:
                self._set_state(TurnState.LISTENING)
        if token is not None and not silent_text and not self._muted:  # muted text was never heard
            self._text_ids.append(int(token))
            if self._assistant is not None:
                self._assistant.text_ids.append(int(token))
        # the timeline section is rebuilt at events and at the end, not per frame: it copies every
        # step time and decodes every segment, which would grow with the session on the hot path
        self.on_update("duplex", self.view())

    def _pair_exchange(self) -> None:
        """Pair each user segment with the first assistant segment that starts after the user began
        and has not been paired; the delay is measured once both ends are known."""
        paired = {x["user_speech_start"] for x in self.exchanges}
        for user in self.user_segments:
            if user.start in paired or user.end is None:
                continue
            reply = next((a for a in self.assistant_segments if a.start > user.start
                          and all(x["assistant_speech_start"] != a.start for x in self.exchanges)), None)
            if reply is not None:
                self.exchanges.append({"user_speech_start": user.start, "user_speech_end": user.end,
                                       "assistant_speech_start": reply.start,
                                       "delay_s": round(reply.start - user.end, 4)})

    # ------------------------------------------------------------------ stop
    async def interrupt(self, onset: float | None = None, confirmed: float | None = None) -> None:
        """Stop what the assistant is saying: flush playback, mute until its text goes quiet."""
        heard = self.speaker.playhead
        if self._speaker_started:
            self.speaker.flush()
        self._muted = True
        self._quiet_run = 0
        self.stops.append({"t": self.now, "onset": onset, "heard_audio_s": heard / self.speaker.sample_rate,
                           "unmuted": None})
        self.stats.barge_ins += 1
        if self._assistant is not None:
            self._assistant.end = self.now
            self._assistant = None
        self._set_state(TurnState.USER_SPEAKING if self._user_speaking else TurnState.LISTENING)
        self._update_timeline()
        self.on_update("duplex", self.view())

    async def _check_interrupt_after(self) -> None:
        after = self.interrupt_after_s
        if after is None or self._assistant is None or self._muted:
            return
        if self.now >= self._assistant.start + after:
            self.interrupt_after_s = None
            await self.interrupt(onset=self.now, confirmed=self.now)

    # ------------------------------------------------------------------ failures
    async def _fail(self, error: Exception) -> None:
        stage_name = error.stage if isinstance(error, StageError) else "engine"
        cause = error.cause if isinstance(error, StageError) else error
        log.error("duplex step failed in the %s", stage_name, exc_info=cause)
        self._queue.clear()
        try:
            await self._loop.run_in_executor(self._pool, self.ex.reset_conversation)
            kept = False  # a duplex model's stream restarts: its history is gone
        except Exception:  # noqa: BLE001
            log.exception("cannot reset the duplex model after a failure")
            kept = False
        message = str(error) if isinstance(error, StageError) else f"{type(error).__name__}: {error}"
        self.errors.append({"stage": stage_name, "message": message, "t": self.now})
        failure = TurnFailure(stage=stage_name, message=message, t=self.now, turn=None, conversation_kept=kept)
        self.failure = failure
        self.stats.failed_turns += 1
        self._update_timeline()
        self.on_update("error", failure)

    # ------------------------------------------------------------------ state and reporting
    def _set_state(self, state: TurnState) -> None:
        if state != self.state:
            self.state = state
            self.on_update("state", state)

    def _timeline_section(self) -> dict:
        segs = lambda xs: [[s.start, s.end] for s in xs]  # noqa: E731
        return {
            "frame_s": self.frame_s,
            "step_ms": list(self.steps_ms),
            "step_text_token_ids": list(self.step_text_ids),
            "late_frames": self.late_frames,
            "dropped_frames": self.dropped_frames,
            "max_lag_s": round(self.max_lag_s, 4),
            "user_speech": segs(self.user_segments),
            "assistant_speech": [{"start": s.start, "end": s.end, "text": self.ex.decode(s.text_ids),
                                  "text_token_ids": list(s.text_ids)} for s in self.assistant_segments],
            "exchanges": list(self.exchanges),
            "stops": list(self.stops),
            "errors": list(self.errors),
        }

    def _update_timeline(self) -> None:
        self.timeline.extra["duplex"] = self._timeline_section()

    def view(self) -> DuplexView:
        steps = np.asarray(self.steps_ms[-500:]) if self.steps_ms else None
        delays = tuple(x["delay_s"] for x in self.exchanges)
        if self._text[0] != len(self._text_ids):
            self._text = (len(self._text_ids), self.ex.decode(self._text_ids))
        return DuplexView(
            frames=len(self.steps_ms), frame_s=self.frame_s,
            step_ms_p50=None if steps is None else float(np.percentile(steps, 50)),
            step_ms_p90=None if steps is None else float(np.percentile(steps, 90)),
            last_step_ms=self.steps_ms[-1] if self.steps_ms else None,
            late_frames=self.late_frames, dropped_frames=self.dropped_frames, lag_s=self._lag_s,
            user_speaking=self._user_speaking, assistant_speaking=self._assistant is not None, muted=self._muted,
            text=self._text[1], last_delay_s=delays[-1] if delays else None, delays_s=delays)

    # ------------------------------------------------------------------ driving
    async def settle(self) -> None:
        """Non-real-time driving: run the queued steps before the next frame."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task})

    @property
    def idle(self) -> bool:
        """Nothing queued and nobody speaking (a duplex model may of course start talking again)."""
        return not self._queue and not self._user_speaking and self._assistant is None

    async def aclose(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._assistant is not None:
            self._assistant.end = self._last_audible
        self._update_timeline()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._update_timeline()
        self._to_vad = None  # its soxr state goes now, not at interpreter exit (nanobind reports that as a leak)


def make_engine(executor, endpointer: Endpointer, speaker: VirtualSpeaker, config=None, timeline=None,
                on_update=None):
    """The engine for this executor: turn-based (:class:`~omnidesk.engine.engine.Engine`) or full duplex."""
    from .engine import Engine

    if getattr(executor, "duplex", False):
        return DuplexEngine(executor, endpointer, speaker, config, timeline, on_update)
    return Engine(executor, endpointer, speaker, config, timeline, on_update)


VAD_RATE = 16000  # a duplex engine's speech detector: webrtcvad takes 8/16/32/48 kHz
SESSION_RATE = VAD_RATE  # what a session reads sound files at before a model is loaded


def session_rate(executor) -> int:
    """The rate a session feeds the engine and reads sound files at: the executor's own input rate
    (16 kHz for the Qwen encoders, 24 kHz for Mimi), so the model's path holds one resample at most,
    from the device's or the file's rate straight to the model's."""
    return executor.sample_rate_in


def vad_rate(executor) -> int:
    """The rate of the engine's speech detection (its endpointer): a turn-based executor's input
    rate; 16 kHz for a duplex one, whose engine makes that copy itself (a side branch)."""
    return VAD_RATE if getattr(executor, "duplex", False) else executor.sample_rate_in
