"""Engine -> Qt: ``on_update(kind, payload)`` from the engine's thread becomes queued signals.

The engine calls :meth:`EngineBridge.on_update` on its own thread with live,
mutable objects (a ``TurnTimeline`` keeps changing while the reply runs).  The
bridge copies what the window needs into immutable :class:`TurnView`\\ s right
there, on the engine thread, so the UI thread never reads engine state.

Frequent kinds are coalesced: ``reply`` (one per token or audio chunk, hundreds
a second on a GPU), ``status`` (every 40 ms) and ``duplex`` (one per 80 ms model
frame, faster when the sound-file microphone runs ahead of real time) land in a
mailbox that keeps only the latest value, and one signal is queued until the UI
has taken it.  Rare kinds (``state``, ``turn``, ``interrupted``, ``done``,
``error``) are queued one by one, in order.

A full-duplex model (Moshi) has no turns: its ``duplex`` update is a
:class:`~omnidesk.engine.duplex.DuplexView` of the whole conversation.  The
bridge sees every one of them (the window only the latest), so it is the bridge
that notes where each exchange starts in the assistant's running text
(:class:`DuplexShown`); the transcript then shows one line per exchange.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from PySide6.QtCore import QObject, Signal

log = logging.getLogger("omnidesk.gui")


@dataclass(frozen=True)
class TurnView:
    """An immutable copy of one turn as the window shows it (times on the session clock, s)."""

    number: int  # 1-based within the session
    user_speech_start: float | None
    user_speech_end: float | None
    endpoint: float | None
    events: dict  # a copy of TurnTimeline.events
    text: str  # the reply text decoded so far (all of it, heard or not)
    text_tokens: int
    codec_tokens: int
    reply_audio_s: float
    played_audio_s: float
    done: bool = False  # played to the end
    interrupted: bool = False
    barge_in: object = None  # a copy of omnidesk.engine.timeline.BargeIn
    heard_text: str | None = None  # interrupted: the part of ``text`` the user heard
    preemptive: str | None = None
    paused_at: float | None = None  # voice barge-in: when playback was paused at the speech onset
    failed: str | None = None  # the turn failed: what went wrong, in words (the turn was dropped)
    end_of_turn: dict | None = None  # a copy of the turn's end_of_turn record (timeline.py): detector, scores
    network: dict | None = None  # a remote model's request times (omnidesk.remote: the turn's "network" record)

    @property
    def end_of_turn_text(self) -> str | None:
        """What ended the user's turn, for the overlay: "turn complete 0.93 at +180 ms (Smart Turn)",
        "silence 400 ms", or while the user pauses, the model's latest verdict."""
        record = self.end_of_turn
        if not record:
            return None
        scores = record.get("scores") or []
        last = scores[-1] if scores else None
        verdict = (f"turn {last['decision']} {last['p_complete']:.2f} at +{last['silence_ms']:.0f} ms"
                   if last else None)
        by = record.get("ended_by")
        if by == "model":
            return f"{verdict} (Smart Turn)"
        if by == "length":
            return "ended at the utterance length limit"
        if by == "silence" and self.endpoint is not None and self.user_speech_end is not None:
            waited = f"silence {(self.endpoint - self.user_speech_end) * 1000:.0f} ms"
            return waited + (f" (model: {verdict})" if verdict else "")
        return verdict

    @property
    def network_text(self) -> str | None:
        """A remote model: when the server's first byte, text and audio came, and its share of the
        voice-to-voice time (None for a local model)."""
        from omnidesk.remote.summary import network_summary

        return network_summary(self.network, self.voice_to_voice_s)

    @property
    def user_speech_s(self) -> float | None:
        if self.user_speech_start is None or self.user_speech_end is None:
            return None
        return self.user_speech_end - self.user_speech_start

    @property
    def voice_to_voice_s(self) -> float | None:
        """From the moment the user stopped speaking to the first sound of the reply."""
        start, end = self.user_speech_end, self.events.get("playback_start")
        return None if start is None or end is None else end - start

    @property
    def stop_s(self) -> float | None:
        """Barge-in: from the user's speech onset to the speaker pausing (a voice barge-in pauses
        playback at the onset; the 300 ms confirmation only decides stop or resume), or from the
        stop click to silence.  The device's own output buffer comes on top."""
        b = self.barge_in
        if b is not None and self.paused_at is not None and b.onset is not None:
            return self.paused_at - b.onset
        if b is None or b.playback_stopped is None:
            return None
        start = b.confirmed if b.confirmed is not None else b.onset
        return None if start is None else b.playback_stopped - start

    @property
    def discarded_text(self) -> str:
        """Interrupted: the part of the reply the user never heard (rolled back)."""
        if self.heard_text is None:
            return ""
        if self.text.startswith(self.heard_text):
            return self.text[len(self.heard_text):]
        return ""


@dataclass(frozen=True)
class DuplexShown:
    """What the window shows of a full-duplex conversation: the engine's latest view and where each
    exchange starts.  ``lines`` is ("you", offset) when the user started speaking and
    ("assistant", offset) when the assistant did, ``offset`` being the length of ``view.text`` just
    before: the assistant's words of one exchange are ``view.text[offset:next assistant offset]``."""

    view: object  # omnidesk.engine.duplex.DuplexView (the engine makes a new one per update)
    lines: tuple[tuple[str, int], ...] = ()

    def line_texts(self, last: int | None = None) -> list[tuple[str, str]]:
        """(who, text) per line, oldest first (the last ``last`` lines); a "you" line has no text:
        the model hears the user's audio, there is no transcription of it."""
        text = self.view.text
        lines = self.lines[-last:] if last else self.lines  # a line ends where a later one of the tail starts
        starts = [offset for who, offset in lines if who == "assistant"] + [len(text)]
        out, k = [], 0
        for who, offset in lines:
            if who == "assistant":
                k += 1
                out.append((who, text[offset:starts[k]].strip()))
            else:
                out.append((who, ""))
        return out


class EngineBridge(QObject):
    """Receives engine updates on any thread and re-emits them as signals for the UI thread.

    Connect the signals with ``Qt.QueuedConnection``.  ``turn_changed`` and
    ``status_changed`` carry nothing: call :meth:`take_turns` / :meth:`take_status`.
    """

    state_changed = Signal(object)  # omnidesk.engine.engine.TurnState
    turn_started = Signal(object)  # TurnView
    turn_changed = Signal()  # coalesced "reply" updates: take_turns()
    turn_interrupted = Signal(object)  # TurnView
    turn_done = Signal(object)  # TurnView
    status_changed = Signal()  # coalesced: take_status()
    turn_failed = Signal(object, str)  # TurnView, plain words: one turn failed, the session goes on
    error = Signal(str)  # plain words; the session has stopped its audio
    duplex_changed = Signal()  # coalesced "duplex" updates (full-duplex models): take_duplex()

    def __init__(self, decode: Callable[[list[int]], str] | None = None, model: dict | None = None,
                 device: str = "", parent: QObject | None = None):
        super().__init__(parent)
        self._decode = decode
        self.model = dict(model or {})
        self.device = device
        self._lock = threading.Lock()
        self._numbers: dict[int, tuple[object, int]] = {}  # id(TurnTimeline) -> (the turn, number)
        self._decoded: dict[int, tuple[int, str]] = {}  # number -> (token count, text)
        self._turns: dict[int, TurnView] = {}
        self._status = None
        self._status_queued = False
        self._exported: dict[int, dict] = {}  # number -> TurnTimeline.to_dict() at its last milestone
        self._current = None  # the TurnTimeline of the latest turn
        self._seen_events: dict[int, dict] = {}  # id(current turn) -> its events at the last status tick
        self._duplex: DuplexShown | None = None  # the latest, until the UI takes it
        self._duplex_queued = False
        self._duplex_lines: tuple[tuple[str, int], ...] = ()  # engine thread only
        self._duplex_before = None  # the previous DuplexView (engine thread only)

    # ------------------------------------------------------------------ engine thread
    def on_update(self, kind: str, payload) -> None:
        """The session's ``on_update`` callback: any thread, returns at once."""
        try:
            if kind == "state":
                self._snapshot_for_export(self._current)
                self.state_changed.emit(payload)
            elif kind == "turn":
                self._current = payload
                view = self._view(payload)
                self._snapshot_for_export(payload)
                self.turn_started.emit(view)
            elif kind in ("reply", "end_of_turn"):  # a reply's progress; the end-of-turn model's verdict
                self._post_turn(self._view(payload))
            elif kind == "interrupted":
                view = self._view(payload, final=True)
                self._snapshot_for_export(payload)
                self.turn_interrupted.emit(view)
            elif kind == "done":
                view = self._view(payload, final=True)
                self._snapshot_for_export(payload)
                self.turn_done.emit(view)
            elif kind == "status":
                self._refresh_current()
                with self._lock:
                    self._status = payload
                    queue, self._status_queued = not self._status_queued, True
                if queue:
                    self.status_changed.emit()
            elif kind == "duplex":
                self._post_duplex(payload)
            elif kind == "error":
                turn = getattr(payload, "turn", None)  # an engine TurnFailure: the session goes on
                if turn is not None or hasattr(payload, "stage"):
                    view = self._view(turn, final=True) if turn is not None else None
                    self._snapshot_for_export(turn)
                    self.turn_failed.emit(view, str(payload))
                else:
                    self.error.emit(str(payload))
        except Exception:  # never let a display problem break the engine's loop
            log.exception("bridge: cannot handle %r update", kind)

    def _refresh_current(self) -> None:
        # Playback starts on the audio clock, not with a token: when the whole reply was generated
        # before it started playing, no "reply" update says so.  The status tick (every 40 ms, on
        # the engine's thread) carries such changes of the current turn to the window.
        turn = self._current
        if turn is None or turn.interrupted:
            return
        seen = self._seen_events.get(id(turn))
        if seen != turn.events:
            self._seen_events = {id(turn): dict(turn.events)}
            if seen is not None:
                self._post_turn(self._view(turn))

    def _number(self, turn) -> int:
        entry = self._numbers.get(id(turn))
        if entry is None or entry[0] is not turn:
            entry = (turn, len(self._numbers) + 1)
            self._numbers[id(turn)] = entry
        return entry[1]

    def _text(self, number: int, ids: list[int], given: str) -> str:
        if given:
            return given  # the live session decodes as it streams
        if self._decode is None or not ids:
            return ""
        count, text = self._decoded.get(number, (-1, ""))
        if count != len(ids):  # audio-only updates do not re-decode
            text = self._decode(list(ids))
            self._decoded[number] = (len(ids), text)
        return text

    def _view(self, turn, final: bool = False) -> TurnView:
        number = self._number(turn)
        ids = turn.text_token_ids
        text = self._text(number, ids, turn.text)
        if not final:
            # a character of several bytes (Chinese, an emoji) comes in several byte-level tokens: until
            # the last one arrives the decoded text ends in U+FFFD, which would flash in the transcript
            text = text.rstrip("\ufffd")
        heard = None
        barge_in = dataclasses.replace(turn.barge_in) if turn.barge_in is not None else None
        if turn.interrupted and barge_in is not None:
            heard = turn.extra.get("heard_text")
            if heard is None and self._decode is not None:
                heard = self._decode(list(ids[:barge_in.kept_text_tokens]))
            if heard is None:
                heard = ""
        error = turn.extra.get("error")
        failed = f"the reply failed in the {error['stage']}: {error['message']}" if error else None
        return TurnView(number=number, user_speech_start=turn.user_speech_start, user_speech_end=turn.user_speech_end,
                        endpoint=turn.endpoint, events=dict(turn.events), text=text, text_tokens=len(ids),
                        codec_tokens=len(turn.codec_token_ids), reply_audio_s=float(turn.reply_audio_s),
                        played_audio_s=float(turn.played_audio_s),
                        done=final and not turn.interrupted and failed is None, failed=failed,
                        interrupted=bool(turn.interrupted), barge_in=barge_in, heard_text=heard,
                        preemptive=turn.extra.get("preemptive"), paused_at=turn.extra.get("playback_paused"),
                        end_of_turn=copy.deepcopy(turn.extra.get("end_of_turn")),
                        network=copy.deepcopy(turn.extra.get("network")))

    def _post_turn(self, view: TurnView) -> None:
        with self._lock:
            queue = not self._turns
            self._turns[view.number] = view
        if queue:
            self.turn_changed.emit()

    def _post_duplex(self, view) -> None:
        # every view passes here, so no start of speech is missed (the UI sees one in several)
        before = self._duplex_before
        self._duplex_before = view
        # the view in which speech starts already holds that frame's token: a new line starts after
        # the text of the view before
        start = len(before.text) if before is not None else 0
        if view.user_speaking and not (before is not None and before.user_speaking):
            self._duplex_lines += (("you", start),)
        if view.assistant_speaking and not (before is not None and before.assistant_speaking):
            self._duplex_lines += (("assistant", start),)
        shown = DuplexShown(view, self._duplex_lines)
        with self._lock:
            self._duplex = shown
            queue, self._duplex_queued = not self._duplex_queued, True
        if queue:
            self.duplex_changed.emit()

    def _snapshot_for_export(self, turn) -> None:
        if turn is None:
            return
        try:
            d = turn.to_dict()
        except Exception:  # mid-update (e.g. interrupted without barge_in for an instant): keep the last one
            return
        with self._lock:
            self._exported[self._number(turn)] = d

    # ------------------------------------------------------------------ UI thread
    def take_turns(self) -> list[TurnView]:
        """The latest view of every turn that changed since the last call."""
        with self._lock:
            views, self._turns = list(self._turns.values()), {}
        return views

    def take_status(self):
        """The latest status (LiveStatus-like) or None."""
        with self._lock:
            self._status_queued = False
            return self._status

    def take_duplex(self) -> DuplexShown | None:
        """The latest full-duplex view (with its exchange lines) or None."""
        with self._lock:
            self._duplex_queued = False
            return self._duplex

    def timeline_dict(self, extra: dict | None = None) -> dict:
        """The session's timeline JSON (contract) from the snapshots taken at each turn's milestones."""
        with self._lock:
            turns = [self._exported[n] for n in sorted(self._exported)]
        d = {"model": dict(self.model), "device": str(self.device), "turns": turns}
        d.update(extra or {})
        return d
