"""Latency numbers for the overlay and the session exports (pure functions, no Qt)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from omnidesk.engine.timeline import EVENT_NAMES, validate

# The stages of one turn as the overlay draws them, in pipeline order:
# (label, where the time is found).  None in a turn = the stage did not happen (never invented).
STAGES = (
    ("speech end", "user_speech_end"),
    ("endpoint", "endpoint"),
    ("encoded", "audio_encoded"),
    ("prefilled", "prefill_done"),
    ("1st token", "first_text_token"),
    ("1st speech token", "first_codec_token"),
    ("1st audio", "first_audio_chunk"),
    ("playing", "playback_start"),
)
BARGE_IN_MARKS = (("cut in", "onset"), ("confirmed", "confirmed"), ("stopped", "playback_stopped"))


def stage_times(view) -> list[tuple[str, float]]:
    """(label, session time) of the stages a TurnView has reached."""
    out = []
    for label, key in STAGES:
        t = getattr(view, key) if key in ("user_speech_end", "endpoint") else view.events.get(key)
        if t is not None:
            out.append((label, float(t)))
    return out


def barge_in_times(view) -> list[tuple[str, float]]:
    b = view.barge_in
    if b is None:
        return []
    seen, out = set(), []
    for label, key in BARGE_IN_MARKS:
        t = getattr(b, key)
        if t is not None and (key != "confirmed" or t not in seen):  # the stop button: onset == confirmed
            out.append((label, float(t)))
            seen.add(t)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(views, last: int = 10) -> dict:
    """Median and p90 (ms) of voice-to-voice and barge-in stop time over the last ``last`` turns."""
    recent = list(views)[-last:]
    v2v = [v.voice_to_voice_s * 1000 for v in recent if v.voice_to_voice_s is not None]
    stop = [v.stop_s * 1000 for v in recent if v.stop_s is not None]
    return {"turns": len(recent), "voice_to_voice_median_ms": percentile(v2v, 50),
            "voice_to_voice_p90_ms": percentile(v2v, 90), "stop_median_ms": percentile(stop, 50),
            "stop_p90_ms": percentile(stop, 90)}


# ------------------------------------------------------------------ export

CSV_COLUMNS = (["turn", "user_speech_start", "user_speech_end", "endpoint", *EVENT_NAMES, "voice_to_voice_ms",
                "text_tokens", "codec_tokens", "reply_audio_s", "played_audio_s", "interrupted",
                "barge_in_onset", "barge_in_confirmed", "playback_stopped", "stop_ms", "heard_audio_s",
                "kept_text_tokens", "rolled_back_tokens", "text"])


def _ms(a, b):
    return None if a is None or b is None else round((b - a) * 1000, 1)


# A full-duplex session has no turns: one row per exchange (the user spoke, the assistant answered)
DUPLEX_CSV_COLUMNS = ["exchange", "user_speech_start", "user_speech_end", "assistant_speech_start", "reply_delay_ms"]


def csv_text(timeline: dict) -> str:
    """One row per turn of a timeline dict (contract JSON); empty cells where a stage did not happen.
    A full-duplex session (a ``duplex`` section, no turns): one row per exchange, the reply delay
    negative where the assistant started before the user finished."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    duplex = timeline.get("duplex")
    if duplex is not None and not timeline["turns"]:
        writer.writerow(DUPLEX_CSV_COLUMNS)
        for i, x in enumerate(duplex.get("exchanges", []), 1):
            writer.writerow([i, x["user_speech_start"], x["user_speech_end"], x["assistant_speech_start"],
                             round(x["delay_s"] * 1000, 1)])
        return out.getvalue()
    writer.writerow(CSV_COLUMNS)
    for i, turn in enumerate(timeline["turns"], 1):
        ev = turn["events"]
        b = turn.get("barge_in") or {}
        stop_from = b.get("confirmed") if b.get("confirmed") is not None else b.get("onset")
        row = [i, turn["user_speech_start"], turn["user_speech_end"], turn["endpoint"],
               *(ev.get(name) for name in EVENT_NAMES), _ms(turn["user_speech_end"], ev.get("playback_start")),
               len(turn["text_token_ids"]), len(turn["codec_token_ids"]), turn["reply_audio_s"],
               turn["played_audio_s"], turn["interrupted"], b.get("onset"), b.get("confirmed"),
               b.get("playback_stopped"), _ms(stop_from, b.get("playback_stopped")), b.get("heard_audio_s"),
               b.get("kept_text_tokens"), b.get("rolled_back_tokens"), turn["text"]]
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def export_timeline(timeline: dict, path: str | os.PathLike) -> Path:
    """Write the session timeline as JSON (``.json``, the `omnidesk talk --timeline` contract) or CSV."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        _write_atomic(path, csv_text(timeline))
    else:
        validate(timeline)
        _write_atomic(path, json.dumps(timeline, indent=2, allow_nan=False) + "\n")
    return path
