"""The session timeline written by ``omnidesk talk --timeline`` (contract — timeline JSON).

Shape (ARCHITECTURE.md)::

    {"model": {...}, "device": str, "turns": [turn, ...]}

Each turn has ``user_speech_start``, ``user_speech_end``, ``endpoint``,
``events`` {audio_encoded, prefill_done, first_text_token, first_codec_token,
first_audio_chunk, playback_start, reply_done}, ``prompt_token_ids``,
``text_token_ids``, ``codec_token_ids``, ``text``, ``reply_audio_s``,
``played_audio_s``, ``interrupted`` and ``barge_in`` (null unless interrupted).

A failed turn (an exception in one of its stages; the engine drops the turn
and listens again) carries ``error``: {``stage`` (encoder, thinker, talker,
vocoder, voice, speaker, engine, or server for a remote model), ``message``, ``t`` (session time),
``conversation_kept`` (false when the model state had to be cleared)}.  It is
additive: a turn without it did not fail.  Its events stop where it failed.

Every turn that reached its endpoint carries ``end_of_turn`` (additive):
{``detector`` ("fixed": the silence rule; "smart-turn-v3": the end-of-turn
model), ``ended_by`` ("silence", "model" or "length"; null before the
endpoint), ``scores``: [{``t``, ``silence_ms``, ``p_complete``, ``decision``
("complete", "incomplete", "unsure"), ``cpu_ms``}, ...] (the model's verdicts
at the turn's pauses, oldest first; empty for the fixed rule)}.

A turn whose model runs on a vLLM-Omni server (``omnidesk.remote``; additive,
reported by the executor through ``Executor.turn_extras``) carries ``network``:
{``server``, ``model``, ``request`` (the session's request count), session
times ``request_sent``, ``connected`` (a new connection only), ``first_byte``
(the response headers), ``first_text``, ``first_audio``, ``end``, ``aborted``
(a barge-in closed the stream), each also as ``<name>_ms`` after
``request_sent``; ``new_connection``, ``text_deltas``, ``audio_chunks``,
``audio_s``, ``bytes``, ``audio_only_at_end`` (true: the reply's audio came in
one piece after its text; null: cannot tell) and ``error`` (null, or the
failure's message)}.  The session times are the executor's monotonic stamps
mapped through the engine's clock when it collects them (exact when the session
runs in real time, approximate in ``talk --fast``); the ``_ms`` values are exact.
For such a turn ``prompt_token_ids`` and ``codec_token_ids`` are empty (the
server does not send them) and ``text_token_ids`` number the text deltas.

Times are seconds on the session monotonic clock (0 = first input frame).
A time that did not happen is ``None``/``null``, never invented: that is why
:meth:`TurnTimeline.mark` records only the first occurrence and nothing fills
in defaults.  Extension fields go in ``extra`` dicts, merged into the JSON
object next to the contract fields (they may not shadow them).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENT_NAMES = (
    "audio_encoded",
    "prefill_done",
    "first_text_token",
    "first_codec_token",
    "first_audio_chunk",
    "playback_start",
    "reply_done",
)

TURN_FIELDS = (
    "user_speech_start",
    "user_speech_end",
    "endpoint",
    "events",
    "prompt_token_ids",
    "text_token_ids",
    "codec_token_ids",
    "text",
    "reply_audio_s",
    "played_audio_s",
    "interrupted",
    "barge_in",
)

BARGE_IN_TIME_FIELDS = ("onset", "confirmed", "playback_stopped")
BARGE_IN_COUNT_FIELDS = ("kept_text_tokens", "rolled_back_tokens", "thinker_cache_before", "thinker_cache_after")
BARGE_IN_FIELDS = BARGE_IN_TIME_FIELDS + ("heard_audio_s",) + BARGE_IN_COUNT_FIELDS

SESSION_FIELDS = ("model", "device", "turns")


class TimelineError(ValueError):
    """A timeline dict breaks the contract; the message lists every problem found."""


@dataclass
class BargeIn:
    """What happened when the user cut in (times on the session clock; None = did not happen)."""

    onset: float | None  # first speech frame of the interruption
    confirmed: float | None  # when it was confirmed as speech (not a cough)
    playback_stopped: float | None  # when the speaker stopped (flush)
    heard_audio_s: float  # reply audio that reached the speaker before the stop
    kept_text_tokens: int  # reply text tokens kept in the thinker context
    rolled_back_tokens: int  # reply tokens removed from the thinker cache
    thinker_cache_before: int  # thinker cache length before the rollback
    thinker_cache_after: int  # ... and after

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in BARGE_IN_FIELDS}


@dataclass
class TurnTimeline:
    """One user turn and the reply to it.  Mutable: the engine fills it in as the turn runs."""

    user_speech_start: float | None = None
    user_speech_end: float | None = None
    endpoint: float | None = None
    events: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(EVENT_NAMES))
    prompt_token_ids: list[int] = field(default_factory=list)  # everything fed to the thinker this turn
    text_token_ids: list[int] = field(default_factory=list)
    codec_token_ids: list = field(default_factory=list)  # list[int], or list[list[int]] per step for multi-codebook families
    text: str = ""
    reply_audio_s: float = 0.0  # reply audio produced by the vocoder
    played_audio_s: float = 0.0  # reply audio that reached the speaker
    interrupted: bool = False
    barge_in: BargeIn | None = None
    # Extensions (e.g. preemptive starts used/discarded, cache overflow drops),
    # merged into this turn's JSON object.
    extra: dict[str, Any] = field(default_factory=dict)

    def mark(self, event: str, t: float) -> bool:
        """Record ``event`` at time ``t`` unless it was already recorded; True if recorded now.

        Unknown names raise KeyError so a typo cannot silently add a field."""
        if event not in EVENT_NAMES:
            raise KeyError(f"unknown timeline event {event!r}; known: {', '.join(EVENT_NAMES)}")
        if self.events.get(event) is not None:
            return False
        self.events[event] = float(t)
        return True

    def interrupt(self, barge_in: BargeIn) -> None:
        """Mark the turn interrupted; ``interrupted`` and ``barge_in`` always change together."""
        self.interrupted = True
        self.barge_in = barge_in

    def to_dict(self) -> dict[str, Any]:
        if self.interrupted != (self.barge_in is not None):
            raise TimelineError("interrupted must be True exactly when barge_in is set (use interrupt())")
        d: dict[str, Any] = {
            "user_speech_start": self.user_speech_start,
            "user_speech_end": self.user_speech_end,
            "endpoint": self.endpoint,
            "events": {name: self.events.get(name) for name in EVENT_NAMES},
            "prompt_token_ids": [int(i) for i in self.prompt_token_ids],
            "text_token_ids": [int(i) for i in self.text_token_ids],
            "codec_token_ids": [_codec_entry(c) for c in self.codec_token_ids],
            "text": self.text,
            "reply_audio_s": float(self.reply_audio_s),
            "played_audio_s": float(self.played_audio_s),
            "interrupted": bool(self.interrupted),
            "barge_in": self.barge_in.to_dict() if self.barge_in is not None else None,
        }
        return _merge_extra(d, self.extra, "turn")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TurnTimeline":
        b = d.get("barge_in")
        return cls(
            user_speech_start=d["user_speech_start"],
            user_speech_end=d["user_speech_end"],
            endpoint=d["endpoint"],
            events={name: d["events"].get(name) for name in EVENT_NAMES},
            prompt_token_ids=list(d["prompt_token_ids"]),
            text_token_ids=list(d["text_token_ids"]),
            codec_token_ids=list(d["codec_token_ids"]),
            text=d["text"],
            reply_audio_s=d["reply_audio_s"],
            played_audio_s=d["played_audio_s"],
            interrupted=d["interrupted"],
            barge_in=BargeIn(**{k: b[k] for k in BARGE_IN_FIELDS}) if b is not None else None,
            extra={k: v for k, v in d.items() if k not in TURN_FIELDS},
        )


@dataclass
class Timeline:
    """The whole session: model info, device, and the turns in order."""

    model: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    turns: list[TurnTimeline] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # session-level extensions

    def new_turn(self) -> TurnTimeline:
        """Append an empty turn and return it."""
        turn = TurnTimeline()
        self.turns.append(turn)
        return turn

    def to_dict(self) -> dict[str, Any]:
        d = {"model": dict(self.model), "device": str(self.device), "turns": [t.to_dict() for t in self.turns]}
        return _merge_extra(d, self.extra, "session")

    def to_json(self, indent: int | None = 2) -> str:
        # allow_nan=False: NaN/inf are not JSON and would hide a broken clock.
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write(self, path: str | os.PathLike) -> None:
        """Write the JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        text = self.to_json()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Timeline":
        """Rebuild from a loaded JSON dict (validated first); unknown keys land in ``extra``."""
        validate(d)
        return cls(
            model=dict(d["model"]),
            device=d["device"],
            turns=[TurnTimeline.from_dict(t) for t in d["turns"]],
            extra={k: v for k, v in d.items() if k not in SESSION_FIELDS},
        )


def _codec_entry(c):
    # Multi-codebook families log one list of codebook ids per step.
    if isinstance(c, (list, tuple)):
        return [int(i) for i in c]
    return int(c)


def _merge_extra(d: dict[str, Any], extra: dict[str, Any], where: str) -> dict[str, Any]:
    clash = sorted(set(extra) & set(d))
    if clash:
        raise TimelineError(f"{where} extra fields shadow contract fields: {', '.join(clash)}")
    d.update(extra)
    return d


# ------------------------------------------------------------------ validate


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_time(v, where: str, problems: list[str]) -> None:
    if v is not None and not _is_number(v):
        problems.append(f"{where}: expected a finite number or null, got {v!r}")


def _check_int_list(v, where: str, problems: list[str], nested_ok: bool = False) -> None:
    if not isinstance(v, list):
        problems.append(f"{where}: expected a list of ints, got {type(v).__name__}")
        return
    for i, x in enumerate(v):
        if _is_int(x):
            continue
        if nested_ok and isinstance(x, list) and all(_is_int(y) for y in x):
            continue
        problems.append(f"{where}[{i}]: expected an int{' or list of ints' if nested_ok else ''}, got {x!r}")
        return  # one message per list is enough


def validate(d: Any) -> None:
    """Check a loaded timeline JSON dict against the contract; raise TimelineError listing
    every problem.  Extra keys are allowed (the contract may be extended)."""
    problems: list[str] = []
    if not isinstance(d, dict):
        raise TimelineError(f"timeline: expected an object, got {type(d).__name__}")
    _require(d, SESSION_FIELDS, "timeline", problems)
    if "model" in d and not isinstance(d["model"], dict):
        problems.append("model: expected an object")
    if "device" in d and not isinstance(d["device"], str):
        problems.append("device: expected a string")
    turns = d.get("turns", [])
    if not isinstance(turns, list):
        problems.append("turns: expected a list")
        turns = []
    for i, turn in enumerate(turns):
        _validate_turn(turn, f"turns[{i}]", problems)
    if problems:
        raise TimelineError("timeline breaks the contract:\n  " + "\n  ".join(problems))


def _require(obj: dict, fields, where: str, problems: list[str]) -> None:
    for key in fields:
        if key not in obj:
            problems.append(f"{where}: missing field '{key}'")


def _validate_turn(turn: Any, where: str, problems: list[str]) -> None:
    if not isinstance(turn, dict):
        problems.append(f"{where}: expected an object")
        return
    _require(turn, TURN_FIELDS, where, problems)
    for key in ("user_speech_start", "user_speech_end", "endpoint"):
        if key in turn:
            _check_time(turn[key], f"{where}.{key}", problems)
    events = turn.get("events")
    if "events" in turn:
        if not isinstance(events, dict):
            problems.append(f"{where}.events: expected an object")
        else:
            _require(events, EVENT_NAMES, f"{where}.events", problems)
            for name in EVENT_NAMES:
                if name in events:
                    _check_time(events[name], f"{where}.events.{name}", problems)
    for key in ("prompt_token_ids", "text_token_ids"):
        if key in turn:
            _check_int_list(turn[key], f"{where}.{key}", problems)
    if "codec_token_ids" in turn:
        _check_int_list(turn["codec_token_ids"], f"{where}.codec_token_ids", problems, nested_ok=True)
    if "text" in turn and not isinstance(turn["text"], str):
        problems.append(f"{where}.text: expected a string")
    for key in ("reply_audio_s", "played_audio_s"):
        if key in turn and not _is_number(turn[key]):
            problems.append(f"{where}.{key}: expected a finite number, got {turn[key]!r}")
    if "interrupted" in turn and not isinstance(turn["interrupted"], bool):
        problems.append(f"{where}.interrupted: expected a bool")
    if "barge_in" not in turn or "interrupted" not in turn:
        return
    b = turn["barge_in"]
    if turn["interrupted"] is not True:
        if b is not None:
            problems.append(f"{where}.barge_in: must be null when interrupted is false")
        return
    if not isinstance(b, dict):
        problems.append(f"{where}.barge_in: expected an object when interrupted is true")
        return
    _require(b, BARGE_IN_FIELDS, f"{where}.barge_in", problems)
    for key in BARGE_IN_TIME_FIELDS:
        if key in b:
            _check_time(b[key], f"{where}.barge_in.{key}", problems)
    if "heard_audio_s" in b and not _is_number(b["heard_audio_s"]):
        problems.append(f"{where}.barge_in.heard_audio_s: expected a finite number")
    for key in BARGE_IN_COUNT_FIELDS:
        if key in b and not _is_int(b[key]):
            problems.append(f"{where}.barge_in.{key}: expected an int, got {b[key]!r}")
