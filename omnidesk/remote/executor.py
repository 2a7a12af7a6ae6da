"""The remote executor: the turn-based engine on the desktop, the model on a vLLM-Omni server.

The engine, the audio layer and the window do what they do for a local model
(endpointing, echo cancellation, playback, barge-in).  What differs lives here:

* The conversation is kept on the client: earlier user turns as WAV data URLs,
  assistant turns as the text the user heard.  One turn = one streaming
  ``POST /v1/chat/completions`` carrying the whole history
  (:func:`.protocol.request_body`); the server keeps nothing between turns.
* The stream is read on its own thread (:class:`.client.ReplyStream`); the
  steps only collect what arrived, waiting at most ``poll_s`` when nothing
  has, so the engine's worker is never tied up and a cut-in is served at once.
  ``thinker_step`` hands over one text delta at a time (its "token id" is a
  session-unique number whose text :meth:`decode` knows: the server does not
  send its token ids); ``vocoder_step`` hands over the audio received so far,
  resampled to 24 kHz when the server sends another rate and cut into pieces
  of at most ``piece_s`` (the speaker's queue takes them one by one).  There is
  no local talker (``local_talker = False``): ``talker_step`` returns nothing,
  ``talker_done`` is always true, and the engine does not pace the text.
* Barge-in: ``interrupt`` closes the stream (the server aborts the request on
  every stage) and keeps in the history only the text the user heard, by the
  same played-audio -> text rule as the local executors
  (:func:`omnidesk.models.alignment.heard_text_pieces`, over the text deltas).
* Closing the session (``end_session``, called by every driver once its
  engine has stopped: ``omnidesk live`` ending or Ctrl-C, the window switching
  model or quitting, a restart) aborts a reply still streaming, as a barge-in
  does, and waits for its reader thread; the unfinished turn is forgotten.
* A failure (the server unreachable, TLS, API key, unknown model, an HTTP error
  before or during the stream, a malformed chunk, a stall) raises a
  :class:`.client.ServerError` tagged with the "server" stage; ``abandon_turn``
  closes the stream and forgets the turn, so the history is what it was before
  it and the user can say it again.
* ``turn_extras`` reports the ``network`` record of the latest request for the
  timeline: when it was sent, its first byte, first text, first audio, end or
  abort, on the session clock, and the same as milliseconds after the request.

Timeline fields that have no meaning here: ``prompt_token_ids`` is empty (the
server tokenizes), ``codec_token_ids`` is empty (the server's speech codes are
not sent), ``text_token_ids`` numbers the text deltas, and a barge-in's
``thinker_cache_before/after`` are 0 (no cache on this side).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..engine.executor import Executor, Rollback, stage
from ..models.alignment import heard_text_pieces
from .client import ServerClient, ServerError
from .protocol import QWEN_SYSTEM_PROMPT, audio_at_end_model, request_body, user_message

log = logging.getLogger("omnidesk.remote")

SAMPLE_RATE_IN = 16000  # what the session captures and the user's WAV carries (the Qwen encoders' rate)
SAMPLE_RATE_OUT = 24000  # what the engine plays; a server chunk at another rate is resampled to it
CHARS_PER_SECOND = 14.0  # the local executors' speaking-rate estimate (thinker_talker.DEFAULT_CHARS_PER_SECOND)
# A streaming server (vllm_omni/deploy/qwen3_omni_moe.yaml: a first chunk of 4 codec frames = 0.32 s,
# then 25 frames = 2 s per chunk) sends at least two chunks for any reply longer than this; one
# chunk this long that came after all the text is a server that sends the audio only at the end.
AUDIO_AT_END_MIN_S = 2.5
# end_session waits this long for the reader thread: an aborted socket wakes it at once, so this
# only bounds a reader stuck elsewhere (a TLS handshake, DNS) and is never waited out normally
END_SESSION_WAIT_S = 5.0
AUDIO_AT_END_NOTICE = ("this server sends the reply's audio only when it is complete (the whole reply is "
                       "generated before the first sound plays), so replies start later than with a "
                       "streaming model")


@dataclass
class _Reply:
    stream: object  # ReplyStream
    texts: list[str] = field(default_factory=list)  # text deltas received, in order
    ids: list[int] = field(default_factory=list)  # the ids handed to the engine (one per delivered delta)
    audio: list[np.ndarray] = field(default_factory=list)  # 24 kHz pieces not yet handed over
    audio_samples: int = 0  # 24 kHz samples received (resampled) so far
    audio_chunks: int = 0
    ended: bool = False
    error: ServerError | None = None
    text_after_audio: bool = False  # a text delta came after the first audio chunk (the server streams)
    resampler: object = None
    source_rate: int | None = None


@dataclass(frozen=True)
class _Mark:
    turn_open: bool
    audio_length: int
    history_length: int
    pending_user: dict | None


class RemoteExecutor(Executor):
    """A turn-based executor whose model is a vLLM-Omni server (see the module docstring)."""

    local_talker = False
    sample_rate_in = SAMPLE_RATE_IN
    sample_rate_out = SAMPLE_RATE_OUT
    block_samples = 2 * SAMPLE_RATE_IN  # nothing is encoded here; kept for the interface

    def __init__(self, client: ServerClient, model: str, system_prompt: str | None = QWEN_SYSTEM_PROMPT,
                 max_tokens: int | None = None, poll_s: float = 0.01, piece_s: float = 0.2,
                 chars_per_second: float = CHARS_PER_SECOND):
        self.client = client
        self.model = model
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens
        self.poll_s = poll_s
        self.piece_samples = max(1, int(piece_s * SAMPLE_RATE_OUT))
        self.chars_per_second = chars_per_second
        # None: not known yet; True: the audio comes only at the end of a reply (said by the model
        # name at connect, or seen in a reply); False: seen streaming
        self.audio_at_end: bool | None = True if audio_at_end_model(model) else None
        self.audio_at_end_why: str | None = (f"{model} runs on vLLM-Omni without async_chunk (its deploy config "
                                             f"runs the stages one after the other)" if self.audio_at_end else None)
        self._texts: dict[int, str] = {}  # every delta id handed out this session -> its text (decode)
        self._next_id = 0
        self._lock = threading.Lock()  # the network record is read on the engine's loop
        self._network: dict | None = None
        self._stamps: dict[str, float] = {}
        self._recorded: _Reply | None = None  # the latest request's reply, for the network record
        self._step_waited = False
        self.requests = 0
        self.reset_conversation()

    # ---------------------------------------------------------------- conversation
    def reset_conversation(self) -> None:
        self._close_stream()
        self.history: list[dict] = []  # user turns (WAV data URLs) and assistant turns (heard text)
        self._audio: list[np.ndarray] = []
        self._audio_length = 0
        self._turn_open = False
        self._pending_user: dict | None = None
        self._reply: _Reply | None = None

    @property
    def thinker_cache_length(self) -> int:
        return 0  # no cache here: the server re-reads the history every turn

    @property
    def turn_prompt_ids(self) -> list[int]:
        return []  # the server tokenizes; its ids are not sent

    def decode(self, text_ids: list[int]) -> str:
        return "".join(self._texts.get(int(i), "") for i in text_ids)

    def begin_user_turn(self) -> None:
        if self._turn_open:
            raise RuntimeError("begin_user_turn: the previous user turn is still open")
        self._audio, self._audio_length = [], 0
        self._turn_open = True
        self._pending_user = None
        with self._lock:
            self._network, self._stamps = None, {}  # _recorded stays: its stream is joined before the next

    def add_user_audio(self, samples: np.ndarray) -> int:
        if not self._turn_open:
            raise RuntimeError("add_user_audio outside a user turn")
        samples = np.asarray(samples, dtype=np.float32)
        self._audio.append(samples)
        self._audio_length += samples.size
        return 0  # nothing is encoded here: the server hears the whole turn with the request

    def end_user_turn(self) -> list[int]:
        if not self._turn_open:
            raise RuntimeError("end_user_turn without begin_user_turn")
        audio = np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)
        self._pending_user = user_message(audio[:self._audio_length], SAMPLE_RATE_IN)
        self._turn_open = False
        return []

    def mark(self) -> _Mark:
        return _Mark(self._turn_open, self._audio_length, len(self.history), self._pending_user)

    def rollback(self, mark: _Mark) -> None:
        """Undo a preemptive start: its request is aborted (the server drops it), the user's turn
        is open again with the audio it had at the mark."""
        self._close_stream()
        self._reply = None
        del self.history[mark.history_length:]
        self._turn_open = mark.turn_open
        self._pending_user = mark.pending_user
        if self._audio_length > mark.audio_length:
            audio = np.concatenate(self._audio)[:mark.audio_length] if self._audio else np.zeros(0, np.float32)
            self._audio, self._audio_length = [audio], mark.audio_length

    # ---------------------------------------------------------------- reply
    def start_reply(self, voice: str | None = None, seed: int = 0) -> None:
        if self._pending_user is None:
            raise RuntimeError("start_reply without a finished user turn")
        self._close_stream()
        body = request_body(self.model, self.history + [self._pending_user], voice, seed=seed,
                            max_tokens=self.max_tokens, system_prompt=self.system_prompt)
        with stage("server"):
            stream = self.client.stream(body, self.model)
        self.requests += 1
        self._reply = _Reply(stream=stream)
        with self._lock:
            self._recorded = self._reply
            self._stamps = stream.stamps
            self._network = {"server": self.client.url, "model": self.model, "request": self.requests,
                             "error": None, "audio_only_at_end": None}

    def _pump(self, wait: bool) -> None:
        """Move what the stream received into the reply; wait up to ``poll_s`` for something when
        nothing is waiting to be handed over (so an idle step does not spin)."""
        r = self._reply
        if r is None or r.ended:
            return
        waiting = len(r.ids) < len(r.texts) or bool(r.audio)
        block = wait and not waiting
        while True:
            try:
                kind, value = r.stream.events.get(timeout=self.poll_s) if block else r.stream.events.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "text":
                r.texts.append(value)
                r.text_after_audio = r.text_after_audio or r.audio_chunks > 0
            elif kind == "audio":
                self._take_audio(r, *value)
            elif kind == "end":
                r.ended = True
                self._flush_resampler(r)
                return
            elif kind == "error":
                r.ended = True
                r.error = value
                return

    def _take_audio(self, r: _Reply, samples: np.ndarray, rate: int) -> None:
        r.audio_chunks += 1
        if rate != SAMPLE_RATE_OUT:
            import soxr

            if r.resampler is None or r.source_rate != rate:
                self._flush_resampler(r)
                r.resampler = soxr.ResampleStream(rate, SAMPLE_RATE_OUT, 1, dtype="float32")
                r.source_rate = rate
            samples = r.resampler.resample_chunk(samples)
        self._queue_audio(r, samples)

    def _flush_resampler(self, r: _Reply) -> None:
        if r.resampler is not None:
            self._queue_audio(r, r.resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            r.resampler = None

    def _queue_audio(self, r: _Reply, samples: np.ndarray) -> None:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        for i in range(0, samples.size, self.piece_samples):
            r.audio.append(samples[i:i + self.piece_samples])
        r.audio_samples += samples.size

    def _raise_error(self) -> None:
        r = self._reply
        if r is not None and r.error is not None:
            with self._lock:
                if self._network is not None:
                    self._network["error"] = str(r.error)
            with stage("server"):
                raise r.error

    def thinker_step(self) -> int | None:
        """The next text delta (its id), or None when none has arrived yet."""
        r = self._reply
        if r is None:
            return None
        self._pump(wait=True)
        self._step_waited = True
        self._raise_error()
        if len(r.ids) < len(r.texts):
            text = r.texts[len(r.ids)]
            self._next_id += 1
            self._texts[self._next_id] = text
            r.ids.append(self._next_id)
            return self._next_id
        return None

    def talker_step(self) -> int | None:
        return None  # the server's talker: its codes are not sent

    def vocoder_step(self, final: bool = False) -> list[np.ndarray]:
        """The audio received since the last call (24 kHz pieces)."""
        r = self._reply
        if r is None:
            return []
        self._pump(wait=not self._step_waited)
        self._step_waited = False
        self._raise_error()
        out, r.audio = r.audio, []
        return out

    @property
    def thinker_done(self) -> bool:
        r = self._reply
        return r is None or (r.ended and r.error is None and len(r.ids) == len(r.texts))

    @property
    def talker_done(self) -> bool:
        return True  # no local talker (local_talker = False): nothing of it is pending here

    @property
    def pending_codes(self) -> int:
        return 0

    def finish_reply(self) -> None:
        """The reply played to the end: the user turn and the whole reply text join the history."""
        r = self._reply
        if r is None:
            return
        self._commit("".join(r.texts))
        self._judge_audio_pacing(r)
        self._reply = None

    def interrupt(self, heard_samples: int) -> Rollback:
        """Close the stream now and keep only the text the user heard (see the module docstring)."""
        r = self._reply
        if r is not None:
            r.stream.abort()  # first: the server stops generating at once
            self._pump(wait=False)  # what arrived before the cut counts for the alignment
        if self._turn_open:
            self.end_user_turn()
        kept = 0
        if r is not None and r.texts:
            speech_done = r.ended and r.error is None
            kept = heard_text_pieces([len(t) for t in r.texts], heard_samples, r.audio_samples, speech_done,
                                     self.chars_per_second, SAMPLE_RATE_OUT)
            kept = min(kept, len(r.ids))  # only what the engine was given can be counted as kept
        delivered = len(r.ids) if r is not None else 0
        if self._pending_user is not None:
            self._commit("".join(r.texts[:kept]) if r is not None else "")
        self._reply = None
        return Rollback(heard_samples=heard_samples, kept_text_tokens=kept, rolled_back_tokens=delivered - kept,
                        thinker_cache_before=0, thinker_cache_after=0)

    def abandon_turn(self) -> bool:
        """A failed turn: close its stream and forget it; the history is what it was before the turn."""
        self._close_stream()
        self._forget_turn()
        return True

    def end_session(self) -> None:
        """The session closed (or restarts) with a reply perhaps still streaming: the engine
        cancelled it without a call here (``Engine.aclose``), so without this its reader would go
        on reading, and the server generating, until the reply's end.  Abort the stream now (the
        server sees the disconnect), wait for its reader thread to end, and forget the unfinished
        turn: the history is what it was before it, and a restarted session goes on from there.
        The client stays open for that session."""
        self._close_stream(wait_s=END_SESSION_WAIT_S)
        self._forget_turn()

    def _forget_turn(self) -> None:
        self._reply = None
        self._turn_open = False
        self._pending_user = None
        self._audio, self._audio_length = [], 0

    def _commit(self, reply_text: str) -> None:
        self.history.append(self._pending_user)
        self.history.append({"role": "assistant", "content": reply_text})
        self._pending_user = None

    def _close_stream(self, wait_s: float = 1.0) -> None:
        """Abort the current reply's stream, and wait (up to ``wait_s``) for the latest stream's
        reader to let go of the pool's one connection before another request needs it."""
        r = getattr(self, "_reply", None)
        if r is not None:
            r.stream.abort()
        last = getattr(self, "_recorded", None)
        if last is not None:
            if last is not r and not last.stream.finished and not last.ended:
                last.stream.abort()  # an interrupted reply's stream is already aborted: no-op
            last.stream.join(wait_s)

    def _judge_audio_pacing(self, r: _Reply) -> None:
        """After a whole reply: did its audio stream, or come in one piece after all the text?"""
        at_end = (r.audio_chunks == 1 and not r.text_after_audio and bool(r.texts)
                  and r.audio_samples >= AUDIO_AT_END_MIN_S * SAMPLE_RATE_OUT)
        streamed = r.audio_chunks >= 2 or r.text_after_audio
        with self._lock:
            if self._network is not None:
                self._network["audio_only_at_end"] = at_end if (at_end or streamed) else None
        if at_end and not self.audio_at_end:
            self.audio_at_end = True
            self.audio_at_end_why = ("a reply came with all its text before one piece of audio "
                                     f"({r.audio_samples / SAMPLE_RATE_OUT:.1f} s)")
            log.info("%s: %s", self.client.url, AUDIO_AT_END_NOTICE)
        elif streamed and self.audio_at_end is None:
            self.audio_at_end = False

    @property
    def notice(self) -> str | None:
        """What the user should know about this server's audio, or None."""
        if not self.audio_at_end:
            return None
        return AUDIO_AT_END_NOTICE + (f" [{self.audio_at_end_why}]" if self.audio_at_end_why else "")

    # ---------------------------------------------------------------- timeline
    def turn_extras(self, now: float) -> dict:
        """``{"network": {...}}`` for the latest request (see the module docstring): session times
        (s) mapped from the stream's monotonic stamps through ``now``, and ms after the request."""
        with self._lock:
            if self._network is None:
                return {}
            record = dict(self._network)
            stamps = dict(self._stamps)
            r = self._recorded
        offset = now - time.monotonic()
        sent = stamps.get("request_sent")
        for name in ("request_sent", "connected", "first_byte", "first_text", "first_audio", "end", "aborted"):
            t = stamps.get(name)
            record[name] = None if t is None else round(t + offset, 4)
            if name != "request_sent":
                record[name + "_ms"] = None if t is None or sent is None else round((t - sent) * 1000, 1)
        record["new_connection"] = "connected" in stamps
        if r is not None:  # counts as the worker last saw them (read without the worker's lock: ints)
            record["text_deltas"] = len(r.texts)
            record["audio_chunks"] = r.audio_chunks
            record["audio_s"] = round(r.audio_samples / SAMPLE_RATE_OUT, 3)
            record["bytes"] = r.stream.received_bytes
        return {"network": record}
