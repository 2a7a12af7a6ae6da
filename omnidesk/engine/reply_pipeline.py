"""The reply pipeline of the turn-based engine (:class:`~omnidesk.engine.engine.Engine`): one reply run
from the executor's first step to its last sample on the speaker, and its pacing.

Pipeline.  A reply runs thinker, talker and vocoder steps interleaved: the
talker starts from the first thinker tokens, the vocoder emits a chunk as soon
as it has enough codes, and chunks go to the speaker at once (or are held
while PREEMPTING).  Backpressure: the thinker runs at most ``thinker_lead``
tokens ahead of the talker (unless the executor has no local talker: a server
streams text and speech already made), and generation pauses while more than
``max_audio_ahead_s`` of audio waits to be played, so memory stays flat in
long replies; a held (speculative) reply with its first chunk made also
waits while the end-of-turn judge scores the pause (and on a machine with no
core to spare, the score waits for that first chunk).  What only the executor
knows about a turn (a remote executor's network times) comes from its
``turn_extras`` hook into the turn's ``extra``.

Hand-offs.  The steps run on the engine's worker thread in bursts: one hand-off runs steps until
one makes audio, makes no progress, ends the reply, or has run ``BURST_S``, and the loop then books
what they made.  A hand-off per step cost a wake-up of the worker and one of the loop per token, and
loop work on the interpreter lock between tokens: on the CPU demo, through the sound devices, the
25 hand-offs before the first audio chunk took 4-24 ms of waiting, for ~35 ms of steps.  Stopping a
reply sets its ``stop`` flag, so a burst ends after the step it is in.

Pacing towards the speaker: a reply's chunks wait while it is held (PREEMPTING), and its first
chunk waits the adaptive playout delay (a jitter buffer: after the first seconds of playback the
next reply's delay is set from how long the speaker ran dry meanwhile, unless the executor was
still compiling its steps when or since the reply started: that gap is the compile's).  The events of a reply
are stamped on the session clock (the device's where the speaker has one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .executor import StepResult, stage
from .timeline import TurnTimeline
from .turn_state import TurnState

STARTUP_WINDOW_S = 1.5  # playback time over which a reply's start-up gaps are measured
BURST_S = 0.02  # the longest run of steps in one hand-off to the worker (see the module docstring)


@dataclass
class ReplyRun:
    """One reply in flight, from its start (at a pause or the endpoint) until it has played out or is cut."""

    turn: TurnTimeline
    held: bool  # playback held (preemptive start)
    pending: list[np.ndarray] = field(default_factory=list)  # audio not yet in the speaker
    on_speaker: bool = False  # the speaker's current reply is this one
    produced_samples: int = 0
    task: asyncio.Task | None = None
    mark: object = None  # executor mark taken before the preemptive start
    play_at: float | None = None  # session time the first chunk may start playing (playout delay)
    underruns_at_start: int | None = None  # speaker underruns when this reply started playing
    startup_measured: bool = False
    warming_up: bool = False  # the executor's hot steps were still compiling when the reply started
    stop: threading.Event = field(default_factory=threading.Event)  # read by the worker between steps
    # set once the first audio chunk is made or the reply has stopped: what an end-of-turn score
    # may wait for (turn_judge.SmartTurnJudge.score_after)
    past_first_chunk: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the reply: its burst of steps ends after the current one, its task is cancelled."""
        self.stop.set()
        self.past_first_chunk.set()
        if self.task is not None:
            self.task.cancel()


@dataclass
class Burst:
    """What one hand-off to the worker made (see the module docstring)."""

    text_tokens: list[int] = field(default_factory=list)
    codec_tokens: list[int] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    steps: int = 0
    first_text_t: float | None = None  # session time the burst's first text token was made
    first_codec_t: float | None = None
    idle: bool = False  # its last step made nothing (the executor waits on something)


class ReplyPipeline:
    """The reply side of :class:`~omnidesk.engine.engine.Engine` (a mixin: the engine owns the state it
    reads, ``ex``, ``speaker``, ``config``, ``stats``, ``now``, ``endpointer``, ``playout_delay``, ``_reply``,
    ``_first_chunk``, ``_turn``, and the calls it makes, ``_work``, ``_fail``, ``_set_state``, ``_collect_extras``, ``on_update``)."""

    def _start_reply(self, held: bool, mark=None) -> None:
        # when the reply's work began (at the pause for a speculative one): its events are stamped
        # on the same clock, so first audio - reply_started is the pipeline's own latency
        self._turn.extra["reply_started"] = self._clock_now()
        # a held reply's first chunk is what the pause's end-of-turn scores were told to wait for
        reply = ReplyRun(turn=self._turn, held=held, mark=mark, warming_up=self.ex.warming_up,
                         past_first_chunk=self._speculative_first_chunk() if held else threading.Event())
        if reply.warming_up:
            self._turn.extra["decode_steps_warming_up"] = True
        self._reply = reply
        reply.task = self._loop.create_task(self._run_reply(reply))

    def _expect_speculative_reply(self) -> None:
        """The user speaks: at the next pause a speculative reply starts, and the end-of-turn judge's
        scores of that pause may wait for its first chunk (turn_judge.SIDE_BY_SIDE_CORES).  Told
        now, not when the reply starts: the endpointer may score a pause in the very frame that
        announces it, before the engine has seen the Pause."""
        self._first_chunk = threading.Event()
        judge = self.endpointer.judge
        if judge is not None:
            judge.score_after(self._first_chunk if self.config.preemptive else None)

    def _speculative_first_chunk(self) -> threading.Event:
        """The event the current pause's scores wait for (set once no reply will make it)."""
        if self._first_chunk is None:
            self._first_chunk = threading.Event()
        return self._first_chunk

    def _release_playback(self) -> None:
        reply = self._reply
        if reply is not None and reply.held:
            reply.held = False
            self._drain_pending(reply)

    def _drain_pending(self, reply: ReplyRun) -> None:
        if reply.held:
            return
        if not reply.on_speaker and reply.pending:
            if reply.play_at is None:
                reply.play_at = self.now + self.playout_delay
                if self.playout_delay > 0:
                    reply.turn.extra["playout_delay_ms"] = round(self.playout_delay * 1000)
            if self.now < reply.play_at:
                return
        while reply.pending:
            chunk = reply.pending[0]
            with stage("speaker"):
                if not reply.on_speaker:
                    self.speaker.start_reply()
                    reply.on_speaker = True
                    reply.turn.extra["written_to_device"] = self._clock_now()
                if not self.speaker.write(chunk):
                    return
            reply.pending.pop(0)

    def _mark_first(self, turn, event: str, t: float | None = None) -> None:
        """Stamp ``event`` the first time it happens, at ``t`` (when the worker made it) or now on the
        session clock (read only then: on a device it is a PortAudio call)."""
        if turn.events.get(event) is None:
            turn.mark(event, self._clock_now() if t is None else t)

    def _clock_now(self) -> float:
        """Session time now: the device's clock where the speaker has one (a live session), else the
        latest frame's end (talk's virtual devices run on the frame clock)."""
        now = getattr(self.speaker, "session_now", None)
        t = now() if now is not None else None
        return self.now if t is None else t

    def _audio_ahead(self, reply: ReplyRun) -> float:
        pending = sum(c.size for c in reply.pending)
        return (pending + self.speaker.buffered_samples) / self.ex.sample_rate_out

    def _awaiting_verdict(self, reply: ReplyRun) -> bool:
        """A held reply with audio ready waits while the end-of-turn judge scores the pause: the
        verdict decides whether it plays at all, and on a busy machine the two share a core (there
        the score waits for the reply's first chunk, ``past_first_chunk``, and comes right after it;
        see turn_judge.SIDE_BY_SIDE_CORES)."""
        judge = self.endpointer.judge
        return reply.held and bool(reply.pending) and judge is not None and judge.pending

    def _pipeline_burst(self, reply: ReplyRun, text_ahead: int) -> Burst:
        """Steps in the worker until one makes audio or nothing, the reply is done or stopped, or
        ``BURST_S`` has passed.  ``text_ahead``: text tokens made beyond the talker's codes so far
        (the thinker may lead by ``thinker_lead``)."""
        ex, lead = self.ex, self.config.thinker_lead
        burst = Burst()
        deadline = time.perf_counter() + BURST_S
        while True:
            out = self._pipeline_step(not ex.local_talker or text_ahead < lead)
            burst.steps += 1
            if out.text_token is not None:
                burst.text_tokens.append(out.text_token)
                text_ahead += 1
                if burst.first_text_t is None:
                    burst.first_text_t = self._clock_now()
            if out.codec_token is not None:
                burst.codec_tokens.append(out.codec_token)
                text_ahead -= 1
                if burst.first_codec_t is None:
                    burst.first_codec_t = self._clock_now()
            burst.audio.extend(out.audio)
            burst.idle = out.text_token is None and out.codec_token is None and not out.audio
            if (out.audio or burst.idle or (ex.talker_done and ex.thinker_done) or reply.stop.is_set()
                    or time.perf_counter() >= deadline):
                return burst

    def _pipeline_step(self, lead_ok: bool) -> StepResult:
        """One unit of work in the worker: a thinker step (if allowed), a talker step, vocoding."""
        ex = self.ex
        out = StepResult()
        if not ex.thinker_done and lead_ok:
            with stage("thinker"):
                out.text_token = ex.thinker_step()
        with stage("talker"):
            out.codec_token = ex.talker_step()
        with stage("vocoder"):
            if ex.talker_done:
                out.audio = ex.vocoder_step(final=True)
            elif out.codec_token is not None:
                out.audio = ex.vocoder_step()
        return out

    async def _run_reply(self, reply: ReplyRun) -> None:
        turn = reply.turn
        try:
            prompt = await self._work(self.ex.end_user_turn, at="thinker")
            t = self._clock_now()
            turn.prompt_token_ids = list(prompt)
            overflows = self.ex.take_overflows()
            if overflows:  # the conversation outgrew the cache: old turns were dropped this turn
                turn.extra.setdefault("cache_overflow", []).extend(overflows)  # a discarded start may have some
            turn.mark("audio_encoded", t)
            turn.mark("prefill_done", t)
            await self._work(self.ex.start_reply, self.config.voice, self.config.seed, at="thinker")
            self._collect_extras(turn)
            while True:
                if self._audio_ahead(reply) > self.config.max_audio_ahead_s or self._awaiting_verdict(reply):
                    self._progress.set()  # blocked on playback, or on the end-of-turn judge
                    await asyncio.sleep(0.01)
                    self._drain_pending(reply)
                    continue
                burst = await self._work(self._pipeline_burst, reply,
                                         len(turn.text_token_ids) - len(turn.codec_token_ids))
                self.stats.steps += burst.steps
                if burst.text_tokens:
                    turn.text_token_ids.extend(burst.text_tokens)
                    self._mark_first(turn, "first_text_token", burst.first_text_t)
                if burst.codec_tokens:
                    turn.codec_token_ids.extend(burst.codec_tokens)
                    self._mark_first(turn, "first_codec_token", burst.first_codec_t)
                if burst.audio:
                    reply.past_first_chunk.set()
                for chunk in burst.audio:
                    self._mark_first(turn, "first_audio_chunk")
                    reply.pending.append(chunk)
                    reply.produced_samples += chunk.size
                self._drain_pending(reply)
                if burst.text_tokens or burst.audio:
                    self._collect_extras(turn)
                    self.on_update("reply", turn)
                if self.ex.talker_done and self.ex.thinker_done and not burst.audio:
                    break
                if burst.idle:
                    await asyncio.sleep(0)  # nothing to do this instant
            turn.mark("reply_done", self._clock_now())
            turn.reply_audio_s = reply.produced_samples / self.ex.sample_rate_out
            turn.text = self.ex.decode(turn.text_token_ids)
            # play out: wait for the speaker to drain, then keep the whole reply in the conversation
            while reply.held or reply.pending or self.speaker.buffered_samples:
                self._progress.set()
                await asyncio.sleep(0.01)
                self._drain_pending(reply)
            if reply.on_speaker:
                self.speaker.end_reply()
            turn.played_audio_s = self._heard(reply) / self.ex.sample_rate_out
            await self._work(self.ex.finish_reply, at="thinker")
            self._collect_extras(turn)
            if self._reply is reply:
                self._reply = None
                self._set_state(TurnState.LISTENING)
            self.on_update("done", turn)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported as a failed turn
            if self._reply is reply:  # else the reply was already stopped (interrupt, another failure)
                await self._fail(e, reply)
        finally:
            reply.past_first_chunk.set()
            self._progress.set()

    def _heard(self, reply: ReplyRun) -> int:
        """Samples of this reply that reached the speaker (the playhead belongs to the speaker's current reply)."""
        return self.speaker.playhead if reply.on_speaker else 0

    def _check_playback(self) -> None:
        reply = self._reply
        if reply is None:
            return
        if not reply.on_speaker and reply.pending and not reply.held:
            self._drain_pending(reply)  # a playout delay may have run out
        if reply.on_speaker and self.speaker.reply_first_sample is not None:
            t = self.speaker.reply_first_sample / self.speaker.sample_rate
            if reply.turn.mark("playback_start", t):
                self.on_update("reply", reply.turn)  # the first sound: listeners show "speaking"
                reply.underruns_at_start = self.speaker.underruns
            self._measure_startup(reply, t)

    def _measure_startup(self, reply: ReplyRun, started: float) -> None:
        """After the first seconds of playback, set the next reply's playout delay from how long the
        speaker ran dry meanwhile (underrun blocks x block length)."""
        if reply.startup_measured or not self.config.adaptive_playout or self.now < started + STARTUP_WINDOW_S:
            return
        reply.startup_measured = True
        dry_s = (self.speaker.underruns - reply.underruns_at_start) * self.speaker.block / self.speaker.sample_rate
        reply.turn.extra["startup_dry_ms"] = round(dry_s * 1000)
        if reply.warming_up or self.ex.warming_up:
            # The steps ran eagerly next to the compile: a gap then says nothing of the replies that
            # follow, and learning from it delayed the next three or four (300, 150, 75 ms ...;
            # bench/live_latency.py under load, when the first question came during the compile).
            return
        # grow at once to cover the gap seen; shrink slowly when replies keep up
        self.playout_delay = min(self.config.max_playout_delay_s, max(dry_s, 0.5 * self.playout_delay))
        if self.playout_delay < 0.01:
            self.playout_delay = 0.0
