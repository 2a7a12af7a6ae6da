"""The streaming engine: one conversation, its turn state machine, and the reply pipeline.

Threads and loop.  The engine lives on an asyncio loop (its own thread in the
app: :class:`EngineThread`).  All tensor work goes to ONE worker thread, one
short call at a time (an audio block, a decode step, a vocoder chunk), so the
loop stays free: ``interrupt()`` silences the speaker at once on the loop and
the rollback runs as soon as the step in flight returns.  The speaker and the
timeline are only touched on the loop.

Turn state machine (ARCHITECTURE.md)::

    LISTENING -> USER_SPEAKING -> (pause) PREEMPTING -> (endpoint) RESPONDING -> LISTENING
                        ^               | (user resumes: roll back)        | (barge-in:
                        +---------------+                                  |  roll back to
                        +--------------------------------------------------+  what was heard)

Pipeline.  A reply runs thinker, talker and vocoder steps interleaved, paced against the
speaker (:mod:`omnidesk.engine.reply_pipeline`, the engine's :class:`~omnidesk.engine.reply_pipeline.ReplyPipeline`
part).  The engine's states, settings, counters and failure record are in :mod:`omnidesk.engine.turn_state`.

Failures.  An exception in any stage (encoder, thinker, talker, vocoder, voice,
speaker) ends its turn as failed instead of killing a task silently: playback
stops, the executor forgets the turn (``abandon_turn``), the turn gets an
``error`` record {stage, message, t} in the timeline, ``on_update("error",
TurnFailure)`` is sent once, ``failure`` holds it, and the engine listens again.

Driving.  Something must call :meth:`Engine.on_frame` every 40 ms with a mic
frame and tick the speaker: the real-time audio layer, ``omnidesk talk``'s
scripted microphone, or a test.  With ``realtime=False`` the driver awaits
:meth:`Engine.settle` after each frame, which lets the pipeline run until it
blocks: deterministic, and as fast as the CPU allows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable

import numpy as np

from .executor import Executor, StageError
from .reply_pipeline import ReplyPipeline, ReplyRun
from .speaker import VirtualSpeaker
from .timeline import BargeIn, Timeline, TurnTimeline
from .turn_state import EngineConfig, EngineStats, TurnFailure, TurnState
from .vad import Endpoint, Endpointer, OnsetCancelled, Pause, Resume, SpeechOnset, SpeechStart, TurnScore

log = logging.getLogger("omnidesk.engine")


class Engine(ReplyPipeline):
    """One conversation.  Create it on the loop that will drive it."""

    def __init__(self, executor: Executor, endpointer: Endpointer, speaker: VirtualSpeaker,
                 config: EngineConfig | None = None, timeline: Timeline | None = None,
                 on_update: Callable[[str, object], None] | None = None):
        self.ex = executor
        self.endpointer = endpointer
        self.speaker = speaker
        self.config = config or EngineConfig()
        self.timeline = timeline or Timeline(model={}, device="cpu")
        self.on_update = on_update or (lambda kind, payload: None)
        self.stats = EngineStats()
        self.state = TurnState.LISTENING
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnidesk-worker")
        self._loop = asyncio.get_running_loop()
        self._turn: TurnTimeline | None = None
        self._reply: ReplyRun | None = None
        self._first_chunk: threading.Event | None = None  # see ReplyPipeline._expect_speculative_reply
        self._fed = 0  # utterance samples handed to the executor
        self._progress = asyncio.Event()  # set whenever the pipeline blocks or finishes
        self._onset: float | None = None
        self.now = 0.0  # session time of the latest frame end
        self.last_utterance: np.ndarray | None = None
        self._echo_tail_until: float | None = None
        self._paused_at: float | None = None  # playback paused at a speech onset (suspected barge-in)
        self.playout_delay = 0.0  # seconds the next reply's first chunk waits (adaptive_playout)
        # "Interrupt after X ms" (reproducible manual tests): the current or next reply is cut this
        # long after its playback started, by the stop-button path.  One-shot; set from any thread.
        self.interrupt_after_s: float | None = None
        self.failure: TurnFailure | None = None  # the latest failed turn (``talk`` stops at the first)

    # ------------------------------------------------------------------ helpers
    async def _work(self, fn, *args, at: str = "engine"):
        """Run ``fn`` on the worker; an exception comes back tagged with its stage (``at`` unless
        the executor tagged it more precisely)."""
        try:
            return await self._loop.run_in_executor(self._pool, fn, *args)
        except (StageError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with its stage
            raise StageError(at, e) from e

    def _collect_extras(self, turn: TurnTimeline | None) -> None:
        """The executor's own per-turn timeline fields (Executor.turn_extras) into the turn."""
        if turn is not None:
            extras = self.ex.turn_extras(self.now)
            if extras:
                turn.extra.update(extras)

    def _set_state(self, state: TurnState) -> None:
        if state != self.state:
            finished_reply = self.state == TurnState.RESPONDING and state == TurnState.LISTENING
            self.state = state
            # a reply is audible (or about to be): only a longer run of speech is a barge-in
            audible = state in (TurnState.RESPONDING, TurnState.SUSPECTED_BARGE_IN)
            self._echo_tail_until = self.now + self.config.echo_tail_s if finished_reply else None
            self.endpointer.assistant_speaking = audible or self._echo_tail_until is not None
            self.on_update("state", state)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

    async def aclose(self) -> None:
        """Stop a reply in progress (no rollback: the conversation is over) and wait for its task,
        so nothing is left to touch the worker after :meth:`close`."""
        reply, self._reply = self._reply, None
        if reply is not None and reply.task is not None and not reply.task.done():
            reply.cancel()
            try:
                await reply.task
            except asyncio.CancelledError:
                pass

    # ------------------------------------------------------------------ input side
    async def on_frame(self, frame: np.ndarray, t: float) -> None:
        """One 40 ms mic frame starting at session time ``t``.  A failure in the listening path
        (encoding, prefill, a rollback) fails the current turn; it never escapes to the driver."""
        try:
            await self._on_frame(frame, t)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported as a failed turn
            await self._fail(e, self._reply)

    async def _on_frame(self, frame: np.ndarray, t: float) -> None:
        self.now = t + len(frame) / self.endpointer.sample_rate
        if self._echo_tail_until is not None and self.now >= self._echo_tail_until:
            self._echo_tail_until = None
            self.endpointer.assistant_speaking = self.state in (TurnState.RESPONDING, TurnState.SUSPECTED_BARGE_IN)
        for event in self.endpointer.push(frame, t):
            await self._on_event(event)
        if self.state == TurnState.USER_SPEAKING:
            await self._feed_audio()
        self._check_playback()
        await self._check_interrupt_after()

    async def _on_event(self, ev) -> None:
        cfg = self.config
        if isinstance(ev, SpeechOnset):
            if self.state == TurnState.RESPONDING and cfg.barge_in:
                self._onset = ev.t
                self.speaker.pause()  # duck at once; confirmed or resumed below
                self._paused_at = self.now  # the user hears silence from here (plus the device buffer)
                self._set_state(TurnState.SUSPECTED_BARGE_IN)
        elif isinstance(ev, OnsetCancelled):
            if self.state == TurnState.SUSPECTED_BARGE_IN:
                self.speaker.resume()
                self.stats.false_barge_ins += 1
                self._onset = self._paused_at = None
                self._set_state(TurnState.RESPONDING)
        elif isinstance(ev, SpeechStart):
            if self.state in (TurnState.RESPONDING, TurnState.SUSPECTED_BARGE_IN):
                if not cfg.barge_in:
                    return
                await self.interrupt(onset=self._onset if self._onset is not None else ev.t,
                                     confirmed=ev.t_confirmed)
            if self.state == TurnState.LISTENING:
                await self._begin_turn(ev.t)
        elif isinstance(ev, Pause):
            if self.state == TurnState.USER_SPEAKING and cfg.preemptive:
                await self._feed_audio()
                mark = await self._work(self.ex.mark, at="thinker")
                self._start_reply(held=True, mark=mark)
                self._set_state(TurnState.PREEMPTING)
            else:  # no speculative reply this pause: its scores have nothing to wait for
                self._speculative_first_chunk().set()
        elif isinstance(ev, Resume):
            if self.state == TurnState.PREEMPTING:
                await self._discard_preemptive()
            self._expect_speculative_reply()
        elif isinstance(ev, TurnScore):
            scores = self._end_of_turn()["scores"]
            scores.append({"t": round(ev.t, 4), "silence_ms": round(ev.silence_ms, 1),
                           "p_complete": round(ev.p_complete, 4), "decision": ev.decision,
                           "cpu_ms": round(ev.cpu_ms, 2)})
            self.on_update("end_of_turn", self._turn)
        elif isinstance(ev, Endpoint):
            self.last_utterance = self._trimmed_utterance(ev)
            self._turn.user_speech_end = ev.t_speech_end
            self._turn.endpoint = ev.t_endpoint
            self._end_of_turn()["ended_by"] = ev.by
            self._turn.extra["endpoint_seen"] = self._clock_now()  # the frame's stamp is when it was heard
            if self.state == TurnState.PREEMPTING:
                self.stats.preemptive_used += 1
                self._turn.extra["preemptive"] = "used"
                self._release_playback()
            elif self.state == TurnState.USER_SPEAKING:
                await self._feed_audio()
                self._start_reply(held=False)
            # a held preemptive reply stopped before the endpoint (Stop pressed during the pause)
            # leaves nothing to respond with: listen again instead of waiting for a reply
            self._set_state(TurnState.RESPONDING if self._reply is not None else TurnState.LISTENING)
            self.endpointer.reset()

    def _end_of_turn(self) -> dict:
        """The turn's ``end_of_turn`` record (timeline.py): which detector decided, its scores."""
        judge = self.endpointer.judge
        return self._turn.extra.setdefault("end_of_turn", {"detector": judge.name if judge else "fixed",
                                                           "ended_by": None, "scores": []})

    def _trimmed_utterance(self, ev: Endpoint) -> np.ndarray:
        """The user's last utterance without the endpointing silence (kept in memory only, for
        "repeat last question")."""
        ep = self.endpointer
        audio = ep.utterance_audio()
        start = ep.utterance_start_t
        if start is None:
            return audio
        return audio[:max(0, int(round((ev.t_speech_end - start) * ep.sample_rate)))]

    async def _begin_turn(self, t_start: float) -> None:
        self._turn = self.timeline.new_turn()
        self._turn.user_speech_start = t_start
        self._fed = 0
        self._expect_speculative_reply()
        await self._work(self.ex.begin_user_turn, at="thinker")
        self._set_state(TurnState.USER_SPEAKING)
        self.on_update("turn", self._turn)

    async def _feed_audio(self) -> None:
        # only committed audio: silence past the pause point waits until speech resumes, so a
        # reply does not depend on whether it was started preemptively or at the endpoint
        new = self.endpointer.new_audio_since(self._fed)[:max(0, self.endpointer.committed_samples - self._fed)]
        if new.size:
            self._fed += new.size
            await self._work(self.ex.add_user_audio, new, at="thinker")

    async def _discard_preemptive(self) -> None:
        reply = self._reply
        self._reply = None
        reply.cancel()
        # the executor is back at the mark, which was taken right after feeding self._fed samples;
        # what came since (the pause) is fed below
        await self._work(self.ex.rollback, reply.mark, at="thinker")
        self.stats.preemptive_discarded += 1
        self._turn.extra["preemptive_discarded"] = self._turn.extra.get("preemptive_discarded", 0) + 1
        for name in ("audio_encoded", "prefill_done", "first_text_token", "first_codec_token",
                     "first_audio_chunk"):
            self._turn.events[name] = None  # those belonged to the discarded start
        self._turn.prompt_token_ids, self._turn.text_token_ids, self._turn.codec_token_ids = [], [], []
        self._set_state(TurnState.USER_SPEAKING)
        await self._feed_audio()

    # ------------------------------------------------------------------ failures
    async def _fail(self, error: Exception, reply: ReplyRun | None) -> None:
        """End the current turn as failed: silence, forget the turn, record it, tell the UI, listen."""
        stage_name = error.stage if isinstance(error, StageError) else "engine"
        cause = error.cause if isinstance(error, StageError) else error
        log.error("turn failed in the %s", stage_name, exc_info=cause)
        turn = reply.turn if reply is not None else self._turn
        if reply is not None:
            self._reply = None
            heard = self._heard(reply)
            if reply.task is not asyncio.current_task():
                reply.cancel()
            if reply.on_speaker:
                try:
                    self.speaker.flush()
                except Exception:  # noqa: BLE001 - the speaker itself may be what failed
                    log.exception("cannot flush the speaker after a failure")
        try:
            kept = await self._loop.run_in_executor(self._pool, self.ex.abandon_turn)
        except Exception:  # noqa: BLE001 - last resort: a fresh conversation
            log.exception("cannot drop the failed turn; clearing the conversation")
            await self._loop.run_in_executor(self._pool, self.ex.reset_conversation)
            kept = False
        message = str(error) if isinstance(error, StageError) else f"{type(error).__name__}: {error}"
        overflows = self.ex.take_overflows()  # drops this turn made before it failed stay reported
        if overflows and turn is not None:
            turn.extra.setdefault("cache_overflow", []).extend(overflows)
        self._collect_extras(turn)
        failure = TurnFailure(stage=stage_name, message=message, t=self.now, turn=turn, conversation_kept=kept)
        if turn is not None:
            turn.extra["error"] = {"stage": stage_name, "message": message, "t": self.now,
                                   "conversation_kept": kept}
            if reply is not None:
                turn.reply_audio_s = reply.produced_samples / self.ex.sample_rate_out
                turn.played_audio_s = heard / self.ex.sample_rate_out
        self.failure = failure
        self.stats.failed_turns += 1
        self._onset = self._paused_at = None
        self.endpointer.reset()
        self._set_state(TurnState.LISTENING)
        self.on_update("error", failure)

    # ------------------------------------------------------------------ barge-in
    async def _check_interrupt_after(self) -> None:
        after, reply = self.interrupt_after_s, self._reply
        if after is None or reply is None or self.state not in (TurnState.RESPONDING, TurnState.SUSPECTED_BARGE_IN):
            return
        started = reply.turn.events.get("playback_start")
        if started is not None and self.now >= started + after:
            self.interrupt_after_s = None
            await self.interrupt(onset=self.now, confirmed=self.now)

    async def interrupt(self, onset: float | None = None, confirmed: float | None = None) -> None:
        """Stop the reply now (barge-in or the stop button) and keep only what was heard."""
        try:
            await self._interrupt(onset, confirmed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the rollback failed: the turn is dropped instead
            await self._fail(e, None)

    async def _interrupt(self, onset: float | None, confirmed: float | None) -> None:
        reply = self._reply
        if reply is None:
            return
        self._reply = None
        heard = self._heard(reply)
        if reply.on_speaker:
            self.speaker.flush()
        stopped = self.now
        reply.cancel()
        turn = reply.turn
        turn.played_audio_s = heard / self.ex.sample_rate_out
        turn.reply_audio_s = reply.produced_samples / self.ex.sample_rate_out
        turn.text = self.ex.decode(turn.text_token_ids)
        rb = await self._work(self.ex.interrupt, heard, at="thinker")
        if overflows := self.ex.take_overflows():  # cut during the prefill: its end_user_turn may have made room
            turn.extra.setdefault("cache_overflow", []).extend(overflows)
        if not turn.prompt_token_ids:  # cut during the prefill: the executor closed the turn
            turn.prompt_token_ids = list(self.ex.turn_prompt_ids)
        self._collect_extras(turn)
        if self._paused_at is not None:  # a voice barge-in: playback was paused at the speech onset
            turn.extra["playback_paused"] = self._paused_at
        turn.interrupt(BargeIn(onset=onset, confirmed=confirmed, playback_stopped=stopped,
                               heard_audio_s=heard / self.ex.sample_rate_out,
                               kept_text_tokens=rb.kept_text_tokens, rolled_back_tokens=rb.rolled_back_tokens,
                               thinker_cache_before=rb.thinker_cache_before,
                               thinker_cache_after=rb.thinker_cache_after))
        self.stats.barge_ins += 1
        self._onset = self._paused_at = None
        self._set_state(TurnState.LISTENING)
        self.on_update("interrupted", turn)

    # ------------------------------------------------------------------ driving
    async def settle(self) -> None:
        """Let the reply pipeline run until it blocks on playback or finishes (non-real-time driving)."""
        reply = self._reply
        while reply is not None and reply.task is not None and not reply.task.done():
            self._progress.clear()
            waiter = asyncio.ensure_future(self._progress.wait())
            done, _ = await asyncio.wait({waiter, reply.task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if waiter in done:
                return

    @property
    def idle(self) -> bool:
        return self.state == TurnState.LISTENING and self._reply is None and not self.endpointer.in_utterance


class EngineThread:
    """Runs an asyncio loop on its own thread for the app; ``call`` schedules a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="omnidesk-engine", daemon=True)
        self._thread.start()

    def call(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
