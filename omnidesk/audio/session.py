"""A live conversation on real audio devices: streams -> echo canceller -> endpointer -> engine.

:class:`LiveSession` is what ``omnidesk live`` and the window run.  It owns

* the :class:`~omnidesk.audio.device.AudioIO` streams (PortAudio's threads
  copy into rings; nothing else happens there),
* an :class:`~omnidesk.engine.engine.EngineThread` whose asyncio loop runs the
  engine and :meth:`_drive`: the frame driver
  (:class:`~omnidesk.engine.frames.FrameDriver`) with the devices as its pushed
  source (:class:`_DeviceFrames`): every 10 ms it takes what was captured through
  the :class:`~omnidesk.audio.capture.CapturePath` (microphone and playback
  reference to the echo canceller's rate with the same filter, so they stay
  aligned; the echo cancelled in 40 ms frames; on to the model's own rate),
  applies mute / push-to-talk, and hands each frame to the engine.

Rates.  The model hears the device at its own rate (session_rate: 16 kHz for
the Qwen encoders, 24 kHz for Mimi).  A full-duplex model's device opens at
its rate in headphones mode (no resampling at all when the device takes it)
and at the canceller's (48 kHz for Mimi) on speakers, where it can; a
turn-based one's at the devices' native rate, as always.

Everything the outside calls (``interrupt``, ``set_muted``, ...) is safe from
any thread and returns at once.  The voice is ``engine_config.voice`` (the
caller's EngineConfig, shared): the engine reads it when a reply starts.  ``on_update(kind, payload)`` is called on the
engine's thread; a GUI must marshal it (queued signals).

Kinds: "state" (TurnState), "turn" (new TurnTimeline), "end_of_turn" (TurnTimeline
whose ``extra["end_of_turn"]`` got a score), "reply" (TurnTimeline
with ``.text`` decoded so far), "interrupted" (TurnTimeline with ``barge_in``
and ``extra["heard_text"]``), "done" (reply played out), "status"
(:class:`LiveStatus`, every frame), "error" (plain-words message; the audio is
stopped, :meth:`restart` retries).

Privacy: audio lives in memory only; the last utterance is kept for "repeat
last question" and dropped with the session.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from omnidesk.engine.duplex import DuplexEngine, make_engine, session_rate, vad_rate
from omnidesk.engine.engine import Engine, EngineConfig, EngineThread, TurnState
from omnidesk.engine.executor import Executor, end_session
from omnidesk.engine.frames import FrameDriver, PushedSource
from omnidesk.engine.rates import TimedExecutor
from omnidesk.engine.timeline import Timeline
from omnidesk.engine.vad import Endpointer, EndpointerConfig, level_dbfs

from .capture import CapturePath
from .device import DEFAULT_BLOCK_MS, DEFAULT_LATENCY_S, AudioDeviceError, AudioIO

POLL_S = 0.01
# No callback for this long while the stream claims to run: the device is gone.  Some
# backends (ALSA's pulse plugin) take 1-2 s to deliver the first blocks: a longer grace then.
STALL_S = 2.0
STARTUP_GRACE_S = 6.0
STARTUP_REOPENS = 3


@dataclass
class LiveSettings:
    input_device: str | int | None = None  # name or index; None = system default
    output_device: str | int | None = None
    headphones: bool = False  # True: no echo cancellation (nothing leaks from speaker to mic)
    noise_suppression: bool = True
    vad_aggressiveness: int = 2
    speech_start_ms: float = 120.0
    barge_in_confirm_ms: float = 300.0
    endpoint_silence_ms: float = 400.0
    pre_roll_ms: float = 200.0
    push_to_talk: bool = False
    block_ms: float = DEFAULT_BLOCK_MS  # callback period; see omnidesk.audio.device
    latency_s: float = DEFAULT_LATENCY_S  # device buffering; see omnidesk.audio.device
    # end of turn (omnidesk.engine.turn_judge): "auto" = the Smart Turn model when installed, else the
    # fixed silence rule; "smart"; "fixed".  Thresholds: see EndpointerConfig.
    end_of_turn: str = "auto"
    turn_complete: float = EndpointerConfig.turn_complete
    turn_incomplete: float = EndpointerConfig.turn_incomplete
    turn_min_silence_ms: float = EndpointerConfig.turn_min_silence_ms
    turn_max_wait_ms: float = EndpointerConfig.turn_max_wait_ms

    def endpointer_config(self) -> EndpointerConfig:
        return EndpointerConfig(speech_start_ms=self.speech_start_ms, barge_in_start_ms=self.barge_in_confirm_ms,
                                endpoint_silence_ms=self.endpoint_silence_ms, pre_roll_ms=self.pre_roll_ms,
                                preempt_silence_ms=min(EndpointerConfig.preempt_silence_ms, self.endpoint_silence_ms),
                                turn_complete=self.turn_complete, turn_incomplete=self.turn_incomplete,
                                turn_min_silence_ms=self.turn_min_silence_ms,
                                turn_max_wait_ms=max(self.turn_max_wait_ms, self.endpoint_silence_ms))

    def make_endpointer(self, detector, sample_rate: int, duplex: bool, blocking: bool = False) -> Endpointer:
        """The session's endpointer, with the end-of-turn judge this setting asks for (none for a
        full-duplex model: it decides by itself when to talk).  Close ``endpointer.judge`` with the
        session."""
        from omnidesk.engine.turn_judge import make_judge

        judge = None if duplex else make_judge(self.end_of_turn, blocking=blocking)
        return Endpointer(detector, self.endpointer_config(), sample_rate, judge=judge)


@dataclass
class LiveStatus:
    level_dbfs: float  # microphone after echo cancellation (what the model and the VAD hear)
    playback_buffer_ms: float
    underruns: int
    overflows: int
    confirmed_barge_ins: int
    false_barge_ins: int
    thinker_tok_s: float | None = None  # current/last reply, per second of compute
    talker_tok_s: float | None = None
    vocoder_rtf: float | None = None  # vocoder compute time / audio produced
    muted: bool = False
    talk_pressed: bool = False


class LiveSession:
    def __init__(self, executor: Executor, settings: LiveSettings | None = None,
                 engine_config: EngineConfig | None = None,
                 on_update: Callable[[str, object], None] | None = None, timeline: Timeline | None = None):
        self.ex = TimedExecutor(executor)  # compute-time rates for the status
        self.settings = settings or LiveSettings()
        self.engine_config = engine_config or EngineConfig()
        self.on_update = on_update or (lambda kind, payload: None)
        self.timeline = timeline or Timeline(model={}, device="cpu")
        self.engine: Engine | DuplexEngine | None = None
        self.audio: AudioIO | None = None
        self.aec = None
        self.capture: CapturePath | None = None
        self._judge = None  # the end-of-turn judge (its thread), closed with the session
        self._thread: EngineThread | None = None
        self._drive_future = None
        self._muted = False
        self._talk_pressed = False
        self._inject: list[np.ndarray] = []  # audio mixed into the mic path (repeat last question)
        self._interrupt_after: float | None = None
        self._closing = False
        self.frames = 0
        # mic power before / after echo cancellation while the assistant speaks (echo only, unless
        # the user talks over it): their ratio is the echo reduction achieved
        self._echo_in = 0.0
        self._echo_out = 0.0

    # ------------------------------------------------------------ lifecycle

    def start(self, new_conversation: bool = True) -> None:
        """Open the devices and start listening.  Raises AudioDeviceError (plain words) or
        EchoCancellerUnavailable; nothing is left running then."""
        from omnidesk.audio.aec import (DUPLEX_WARM_UP_S, WARM_UP_S, EchoCanceller, EchoCancellerUnavailable,
                                        canceller_rate)
        from omnidesk.audio.vad import WebRtcVAD

        s = self.settings
        rate_in = session_rate(self.ex)  # what the model hears
        duplex = getattr(self.ex, "duplex", False)
        cancel_rate = canceller_rate(rate_in)
        # a duplex model: the device at the model's rate with headphones, at the canceller's on speakers;
        # a turn-based one at a whole multiple of the canceller's rate where the devices take one
        # (48 kHz: 48 -> 16 kHz is capture.Decimator, ~1.6 ms held back, where soxr from the
        # usual 44.1 kHz holds back ~21 ms of every block: 21 ms later to every decision)
        if duplex:
            prefer = (rate_in,) if s.headphones else (cancel_rate,)
        else:
            prefer = tuple(r for r in (48000, 32000) if r % cancel_rate == 0 and r % rate_in == 0)
        audio = AudioIO(s.input_device, s.output_device, model_out_rate=self.ex.sample_rate_out,
                        block_ms=s.block_ms, latency_s=s.latency_s,
                        speaker_capacity_s=self.engine_config.max_audio_ahead_s + 3.0, prefer_rates=prefer)
        try:
            # a duplex model talks from its first frame: warm the canceller past AEC3's start-up mute
            # (see aec.DUPLEX_WARM_UP_S) so a user who speaks at once is heard
            self.aec = EchoCanceller(cancel_rate, noise_suppression=s.noise_suppression,
                                     warm_up_s=DUPLEX_WARM_UP_S if duplex else WARM_UP_S)
            self.aec.bypass = s.headphones
        except EchoCancellerUnavailable:
            if not s.headphones:
                raise
            self.aec = None  # headphones need no cancellation: run without the library
            cancel_rate = rate_in
        self.capture = CapturePath(audio.rate, rate_in, cancel_rate, self._cancel,
                                   canceller_delay_s=self._canceller_delay(), block=audio.block)
        audio.open()
        self.audio = audio
        # the echo of a reply's last words arrives through both device buffers
        self.engine_config.echo_tail_s = max(self.engine_config.echo_tail_s, sum(audio.latency_s) + 0.3)
        self._thread = EngineThread()
        detector = WebRtcVAD(s.vad_aggressiveness, vad_rate(self.ex))  # a duplex engine gives it a 16 kHz copy
        try:
            endpointer = s.make_endpointer(detector, vad_rate(self.ex), duplex=duplex)
        except Exception:
            self.close()
            raise
        self._judge = endpointer.judge

        async def new_engine():
            if new_conversation:
                self.ex.reset_conversation()
            engine = make_engine(self.ex, endpointer, audio.speaker, self.engine_config, self.timeline, self._forward)
            engine.interrupt_after_s, self._interrupt_after = self._interrupt_after, None
            return engine

        try:
            self.engine = self._thread.call(new_engine()).result(timeout=10)
        except Exception:
            self.close()
            raise
        self._closing = False
        self._drive_future = self._thread.call(self._drive())

    @property
    def hearing(self) -> str:
        """The rates along the model's path now, e.g. "device 48000 Hz -> echo canceller 48000 Hz ->
        model 24000 Hz" (empty before start)."""
        if self.capture is None:
            return ""
        return self.capture.describe(bypassed=self.aec is None or self.aec.bypass)

    @property
    def end_of_turn(self) -> str:
        """The end-of-turn detector deciding this session's turns: "fixed" or the judge's name."""
        return self._judge.name if self._judge is not None else "fixed"

    def close(self) -> None:
        self._closing = True
        if self._drive_future is not None:
            try:
                self._drive_future.result(timeout=5)
            except Exception:  # noqa: BLE001 - closing reports nothing; errors went to on_update
                pass
            self._drive_future = None
        if self.audio is not None:
            self.audio.close()
        if self.capture is not None:
            self.capture.release()  # start() makes a new one
        if self.engine is not None and self._thread is not None:
            try:
                self._thread.call(self.engine.aclose()).result(timeout=10)
            except Exception:  # noqa: BLE001 - closing must not raise; the pool shutdown below still runs
                pass
            self.engine.close()
        # aclose cancelled the reply without telling the executor: a remote one would go on
        # streaming it from the server
        end_session(self.ex)
        if self._judge is not None:
            self._judge.close()
            self._judge = None
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def restart(self, settings: LiveSettings | None = None) -> None:
        """The retry path: close, then start again (e.g. after a device came back or was changed);
        the conversation and its timeline go on."""
        self.close()
        if settings is not None:
            self.settings = settings
        self.engine = None
        self.start(new_conversation=False)

    # ------------------------------------------------------------ controls (any thread)

    def interrupt(self) -> None:
        """The stop button: the same path as a confirmed barge-in."""
        if self._thread is None or self.engine is None:
            return
        engine = self.engine

        async def stop():
            await engine.interrupt(onset=engine.now, confirmed=engine.now)

        self._thread.call(stop())

    def set_muted(self, muted: bool) -> None:
        self._muted = bool(muted)

    def set_push_to_talk(self, enabled: bool) -> None:
        self.settings.push_to_talk = bool(enabled)

    def set_talk_pressed(self, pressed: bool) -> None:
        self._talk_pressed = bool(pressed)

    def set_headphones(self, on: bool) -> None:
        self.settings.headphones = bool(on)
        if self.aec is not None:
            self.aec.bypass = bool(on)
        elif not on:
            import logging

            logging.getLogger(__name__).warning("no echo canceller (livekit missing): speakers mode runs "
                                                "without cancellation until the session restarts")

    def repeat_last_question(self) -> bool:
        """Play the last user utterance into the microphone path again (reproducible tests)."""
        last = self.engine.last_utterance if self.engine is not None else None
        if last is None or last.size == 0:
            return False
        self._inject.append(last.copy())
        return True

    def inject(self, audio: np.ndarray) -> None:
        """Mix mono ``audio`` at the model's input rate (session_rate: 16 kHz for Qwen, 24 kHz for
        Moshi) into the microphone path from the next frame on."""
        self._inject.append(np.asarray(audio, np.float32).reshape(-1).copy())

    def interrupt_after(self, ms: float) -> None:
        """Interrupt the current (or next) reply ``ms`` after its playback started."""
        self._interrupt_after = max(0.0, float(ms)) / 1000.0
        if self.engine is not None:  # else the engine gets it when it starts
            self.engine.interrupt_after_s, self._interrupt_after = self._interrupt_after, None

    @property
    def stats(self):
        return self.engine.stats if self.engine is not None else None

    # ------------------------------------------------------------ engine side

    def _forward(self, kind: str, payload) -> None:
        if kind == "reply":
            payload.text = self.ex.decode(payload.text_token_ids)
        elif kind == "interrupted":
            kept = payload.barge_in.kept_text_tokens if payload.barge_in is not None else 0
            payload.extra["heard_text"] = self.ex.decode(payload.text_token_ids[:kept])
        try:
            self.on_update(kind, payload)
        except Exception as e:  # noqa: BLE001 - a broken listener must not stop the conversation
            import logging

            logging.getLogger(__name__).exception("on_update(%s) failed: %s", kind, e)

    def _status(self) -> LiveStatus:
        engine, audio = self.engine, self.audio
        think, talk, rtf = self.ex.rates()
        return LiveStatus(level_dbfs=self._level, playback_buffer_ms=audio.speaker.buffered_samples / audio.speaker.sample_rate * 1000.0,
                          underruns=audio.speaker.underruns + audio.output_underflows,
                          overflows=audio.capture_overflows + audio.input_overflows,
                          confirmed_barge_ins=engine.stats.barge_ins, false_barge_ins=engine.stats.false_barge_ins,
                          thinker_tok_s=think, talker_tok_s=talk, vocoder_rtf=rtf, muted=self._muted,
                          talk_pressed=self._talk_pressed)

    async def _drive(self) -> None:
        self.capture.clear()
        self._level = -120.0
        try:
            await FrameDriver(self.engine, self.capture.rate).run(_DeviceFrames(self))
        except Exception as e:  # noqa: BLE001 - shown to the user; the session stops cleanly
            import logging

            logging.getLogger(__name__).exception("live session stopped")
            self.on_update("error", f"the conversation stopped: {e}")

    def echo_reduction_db(self) -> float | None:
        """Mic power before / after echo cancellation over the frames played while the assistant
        spoke (None before any)."""
        if self._echo_in <= 0 or self._echo_out <= 0:
            return None
        return 10.0 * math.log10(self._echo_in / self._echo_out)

    def _canceller_delay(self) -> float:
        if self.aec is None:
            return 0.0
        bypass, self.aec.bypass = self.aec.bypass, False
        try:
            return self.aec.processing_delay_s()
        finally:
            self.aec.bypass = bypass

    def _cancel(self, frame: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """The echo canceller on one 40 ms frame at its rate (CapturePath calls it)."""
        aec = self.aec
        if aec is None or aec.bypass:
            return frame
        aec.delay_ms = min(500.0, max(0.0, self.audio.delay_s * 1000.0))
        cleaned = aec.process(frame, reference)
        if self.engine.state == TurnState.RESPONDING and float(np.dot(reference, reference)) > 0:
            self._echo_in += float(np.dot(frame, frame))
            self._echo_out += float(np.dot(cleaned, cleaned))
        return cleaned

    def _prepare(self, frame: np.ndarray) -> np.ndarray:
        """Mute, push-to-talk and injected audio on a frame at the model's rate; the level meter."""
        if self._muted or (self.settings.push_to_talk and not self._talk_pressed):
            frame = np.zeros_like(frame)
        if self._inject:
            frame = frame.copy()
            pos = 0
            while self._inject and pos < frame.size:
                head = self._inject[0]
                k = min(head.size, frame.size - pos)
                frame[pos:pos + k] += head[:k]
                pos += k
                if k == head.size:
                    self._inject.pop(0)
                else:
                    self._inject[0] = head[k:]
        self._level = level_dbfs(frame)
        return frame


class _DeviceFrames(PushedSource):
    """The devices as the frame driver's source: the sound card is the clock.

    Every ``POLL_S`` it reads what was captured (microphone, the playback reference and the ADC
    time of the microphone's first sample), watches the stream (stalls, a start that died), and
    hands over the frames the capture path completed, each prepared (mute, push-to-talk,
    injected audio) just before the engine takes it."""

    def __init__(self, session: LiveSession):
        self.session = session
        self.audio, self.engine, self.capture = session.audio, session.engine, session.capture
        # The session clock: stream time minus the ADC time of the first captured sample.  Frames
        # are stamped with when their samples reached the microphone's ADC and the reply's start
        # with when it reached the DAC (DeviceSpeaker.origin), both from PortAudio, so the turn's
        # voice-to-voice includes the device buffers the user hears through.
        self.origin = None
        self.last_callbacks, self.stalled_since = -1, None
        self.reopens = 0
        self.loop = asyncio.get_running_loop()

    async def captured(self):
        s = self.session
        audio, engine, capture, loop = self.audio, self.engine, self.capture, self.loop
        while not s._closing:
            await asyncio.sleep(POLL_S)
            if audio.error is None:
                if audio.callbacks == self.last_callbacks:
                    self.stalled_since = self.stalled_since or loop.time()
                    limit = STALL_S if audio.callbacks > 50 else STARTUP_GRACE_S
                    if loop.time() - self.stalled_since > limit:
                        audio.fail(f"no audio from {audio.input.name!r} for {STALL_S:.1f} s "
                                   "(device unplugged or taken by another program?)")
                else:
                    self.last_callbacks, self.stalled_since = audio.callbacks, None
            if audio.error is not None and audio.callbacks <= 50 and self.reopens < STARTUP_REOPENS:
                # died while starting (seen with ALSA's pulse plugin): try again quietly
                self.reopens += 1
                try:
                    audio.reopen()
                    capture.clear()
                    self.last_callbacks, self.stalled_since = -1, None
                    continue
                except AudioDeviceError as e:
                    audio.fail(str(e))
            if audio.error is not None:
                await engine.interrupt(onset=engine.now, confirmed=engine.now)
                s.on_update("error", audio.error + "; check the device and press Retry")
                return None
            mic, ref, t_adc = audio.read()
            if mic.size == 0:
                continue
            if self.origin is None and t_adc is not None:
                self.origin = audio.speaker.origin = t_adc
                s.timeline.extra["clock"] = {
                    "session_origin_stream_time": t_adc,
                    "stream_clock": "PortAudio stream time: session time = stream time - origin; "
                                    "frames stamped with their ADC time, playback with its DAC time"}
            t = None if t_adc is None or self.origin is None else t_adc - self.origin
            prepare = s._prepare
            return ((t_frame, prepare(frame))
                    for t_frame, frame in capture.timed(mic, ref, s.aec is None or s.aec.bypass, t))
        return None

    def heard(self, frame: np.ndarray) -> bool:
        s = self.session
        s.frames += 1
        s.on_update("status", s._status())
        return True


__all__ = ["LiveSession", "LiveSettings", "LiveStatus", "AudioDeviceError"]
