"""The labelled turn-taking set (issue 13): complete utterances and the same sentences cut
mid-sentence by a pause, synthesized with espeak-ng.

Not committed: :func:`ensure_set` generates it into a folder the caller gives (a test's tmp
dir, or ``~/.cache/omnidesk/turn-taking-set-v1`` for ``bench/turn_taking.py``) and reuses it
there while its manifest matches this file's spec.  Deterministic for a given espeak-ng
version (1.51 here): the text, voices, rates, pauses and the noise seeds are fixed below.

Items (16 by default, ~2-4 s each, 16 kHz mono float32 WAV, ~3.5 MB in all):

* ``complete``: a whole question or statement in one espeak call (sentence-final
  intonation).  espeak's own clause pause at a comma is capped at ``MAX_INNER_PAUSE_S`` so a
  complete item has no silence a 400 ms rule could end the turn in.
* ``incomplete``: the same sentence cut at a comma or mid-phrase (never after a whole
  sentence): the head is synthesized ending in a comma (espeak's continuation intonation,
  not a final fall), then ``pause_ms`` (300-900 ms) of silence, then the rest as its own
  espeak call.

Every file is ``LEAD_S`` of digital silence, the speech, ``TAIL_S`` of floor.  A continuous
noise floor (``NOISE_DBFS``, seeded white noise) lies under everything from the speech onset
on, so a pause is quiet but not digital zero (see NOISE_DBFS for why so low).  Speech is
peak-normalized to ``PEAK_DBFS`` (one gain per item: the head and the rest of an incomplete
item keep their relative level).

Manifest (``manifest.json`` in the folder)::

    {"version": 1, "spec": "<hash of the spec>", "espeak": "<espeak-ng --version>",
     "sample_rate": 16000, "items": [item, ...]}

    item = {"id", "path" (relative to the folder), "kind": "complete"|"incomplete",
            "sentence" (index into SENTENCES: a complete item and its incomplete twin share it),
            "text", "voice", "rate", "duration_s",
            "speech": [[start, end], ...]  (seconds in the file: one segment, or two around the pause),
            "pause": [start, end] | null    (incomplete: the labelled mid-sentence pause),
            "pause_ms": int | null}

Command line (prints the manifest path)::

    .venv/bin/python tests/turn_taking_set.py [--dir DIR] [--limit N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
from make_speech_fixtures import read_wav, shorten_pauses  # noqa: E402  (the speech fixtures' WAV reader, pause cutter)

RATE = 16000
VERSION = 1
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
DEFAULT_DIR = CACHE / "omnidesk" / f"turn-taking-set-v{VERSION}"
LEAD_S = 0.1  # digital silence before the speech (as talk's microphone between inputs)
TAIL_S = 0.15  # noise floor after the speech
# RMS of the floor under the speech and pauses (~3 LSB of 16-bit: quiet, but not digital zero).
# Not -60: talk's microphone is digital zero between inputs, and after such gaps webrtcvad's
# noise model takes a -60..-72 dBFS floor for speech for seconds (a whole 900 ms pause heard as
# speech, no endpoint at all); at -80 it hears 1-3 frames of hangover, as on a live microphone.
NOISE_DBFS = -80.0
PEAK_DBFS = -6.0
TRIM_REL = 0.01  # espeak's own leading/trailing silence: anything under 1% of the peak (-40 dB)
MAX_INNER_PAUSE_S = 0.15  # cap on espeak's clause pauses inside one call
VOICES = ("en-us", "en-gb", "en+f3")
RATES = (150, 175)

# (head, rest): the complete text is head + " " + rest; the incomplete item cuts there.  Cuts at
# a comma after a subordinate clause (2, 5, 6) and mid-phrase (the others).  No head is a whole
# sentence by itself ("Please send a message to Anna" would be a fair end of turn): a listener
# knows from the words that more is coming, and espeak gives it a continuation tone.
SENTENCES = (
    ("Can you book a table for", "four people at eight tonight?"),
    ("What is the weather going to be like in", "Paris tomorrow morning?"),
    ("If it rains tomorrow,", "remind me to take an umbrella."),
    ("Please send a message to", "Anna saying that I will be a little late."),
    ("How long does it take to drive from", "Berlin to Munich?"),
    ("When you get a chance,", "play some quiet music in the kitchen."),
    ("Before I leave the office,", "remind me to call my sister."),
    ("Turn off the lights in the living room and", "lock the front door."),
)
# the pause of sentence i's incomplete item (ms): two that a 400 ms silence rule sits out, the
# others 500-900 ms (webrtcvad's hangover hides ~100 ms of a pause, so 500 ms is near the rule)
PAUSES_MS = (600, 350, 800, 500, 900, 300, 700, 650)


def voice_and_rate(i: int) -> tuple[str, int]:
    """Sentence i's voice and rate: the 3 x 2 combinations in turn (all six within 6 sentences)."""
    return VOICES[i % len(VOICES)], RATES[i % len(RATES)]


def spec() -> dict:
    return {"version": VERSION, "rate": RATE, "lead_s": LEAD_S, "tail_s": TAIL_S, "noise_dbfs": NOISE_DBFS,
            "peak_dbfs": PEAK_DBFS, "trim_rel": TRIM_REL, "max_inner_pause_s": MAX_INNER_PAUSE_S,
            "sentences": [list(s) for s in SENTENCES], "pauses_ms": list(PAUSES_MS),
            "voices": [list(voice_and_rate(i)) for i in range(len(SENTENCES))]}


def spec_hash() -> str:
    return hashlib.sha256(json.dumps(spec(), sort_keys=True).encode()).hexdigest()[:16]


def espeak_version() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng not found (apt-get install -y espeak-ng)")
    out = subprocess.run([exe, "--version"], check=True, capture_output=True, text=True, timeout=30).stdout
    return out.split("Data at")[0].strip()


# ------------------------------------------------------------------ audio helpers


def synthesize(text: str, voice: str, rate: int, workdir: Path) -> np.ndarray:
    """espeak-ng -> 16 kHz float32 (soxr HQ), espeak's leading/trailing silence trimmed."""
    import soxr

    raw = workdir / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-w", str(raw), text],
                   check=True, capture_output=True, timeout=60)
    x, src = read_wav(raw)
    if src != RATE:
        x = soxr.resample(x, src, RATE, quality="HQ").astype(np.float32)
    loud = np.flatnonzero(np.abs(x) > TRIM_REL * np.abs(x).max())
    if loud.size == 0:
        raise RuntimeError(f"espeak-ng produced no sound for {text!r}")
    return cap_pauses(x[loud[0]:loud[-1] + 1])


def cap_pauses(x: np.ndarray, max_s: float = MAX_INNER_PAUSE_S) -> np.ndarray:
    """Shorten every run of 10 ms frames under ``TRIM_REL`` of the peak to ``max_s`` (keeping its ends):
    the speech fixtures' pause cutter, the frames' RMS in float64."""
    return shorten_pauses(x, RATE, max_s, TRIM_REL, np.float64)


def samples(s: float) -> int:
    return int(round(s * RATE))


def build_item(parts: list[np.ndarray], pause_s: float | None, seed: int) -> tuple[np.ndarray, list, list | None]:
    """Lead + parts (separated by ``pause_s`` of floor) + tail, one gain, the floor under it all.
    Returns (audio, speech segments, pause interval) with times in seconds in the file."""
    gain = 10 ** (PEAK_DBFS / 20) / max(float(np.abs(p).max()) for p in parts)
    pieces, segments, pause = [np.zeros(samples(LEAD_S), np.float32)], [], None
    pos = len(pieces[0])
    for k, part in enumerate(parts):
        if k:
            gap = np.zeros(samples(pause_s), np.float32)
            pause = [pos / RATE, (pos + len(gap)) / RATE]
            pieces.append(gap)
            pos += len(gap)
        pieces.append((part * gain).astype(np.float32))
        segments.append([pos / RATE, (pos + len(part)) / RATE])
        pos += len(part)
    pieces.append(np.zeros(samples(TAIL_S), np.float32))
    x = np.concatenate(pieces)
    # the floor starts with the speech: before it talk's microphone is digital zero, and a step
    # from zero up to a floor is itself called speech by webrtcvad for a while (its noise model
    # adapts); under the speech onset the step is masked
    on = samples(LEAD_S)
    rng = np.random.default_rng(seed)
    x[on:] += (10 ** (NOISE_DBFS / 20) * rng.standard_normal(len(x) - on)).astype(np.float32)
    return x, segments, pause


def write_float_wav(path: Path, x: np.ndarray) -> None:
    """32-bit float mono WAV (WAVE_FORMAT_IEEE_FLOAT), written by hand: libsndfile adds a PEAK
    chunk with a time stamp, which would make two generations differ byte for byte."""
    data = np.asarray(x, "<f4").tobytes()
    fmt = struct.pack("<HHIIHHH", 3, 1, RATE, RATE * 4, 4, 32, 0)  # IEEE float, mono, cbSize 0
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"fact" + struct.pack("<II", 4, len(x))
            + b"data" + struct.pack("<I", len(data)) + data)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    os.replace(tmp, path)


# ------------------------------------------------------------------ the set


def generate(directory: Path, limit: int | None = None) -> dict:
    """Write the items (the first ``limit`` sentences, each complete and incomplete) and the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    sentences = SENTENCES[:limit] if limit else SENTENCES
    items = []
    with tempfile.TemporaryDirectory(prefix="omnidesk-turn-set-") as tmp:
        work = Path(tmp)
        for i, (head, rest) in enumerate(sentences):
            voice, rate = voice_and_rate(i)
            text = f"{head} {rest}"
            whole = synthesize(text, voice, rate, work)
            # the head ends in a comma: espeak's continuation intonation, as a speaker who goes on
            first = synthesize(head if head.endswith(",") else head + ",", voice, rate, work)
            second = synthesize(rest, voice, rate, work)
            pause_ms = PAUSES_MS[i]
            for kind, parts, pause_s in (("complete", [whole], None),
                                         ("incomplete", [first, second], pause_ms / 1000)):
                item_id = f"s{i}-{kind}"
                seed = 1000 * VERSION + 2 * i + (kind == "incomplete")
                audio, segments, pause = build_item(parts, pause_s, seed)
                path = f"{item_id}.wav"
                write_float_wav(directory / path, audio)
                items.append({"id": item_id, "path": path, "kind": kind, "sentence": i, "text": text,
                              "cut": [head, rest] if kind == "incomplete" else None,
                              "voice": voice, "rate": rate, "duration_s": len(audio) / RATE,
                              "speech": [[round(a, 6), round(b, 6)] for a, b in segments],
                              "pause": None if pause is None else [round(pause[0], 6), round(pause[1], 6)],
                              "pause_ms": pause_ms if kind == "incomplete" else None})
    manifest = {"version": VERSION, "spec": spec_hash(), "espeak": espeak_version(), "sample_rate": RATE,
                "limit": limit, "items": items}
    tmp_manifest = directory / "manifest.json.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_manifest, directory / "manifest.json")
    return manifest


def load_manifest(directory: Path) -> dict | None:
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest


def ensure_set(directory: str | os.PathLike | None = None, limit: int | None = None) -> dict:
    """The manifest of the set in ``directory`` (default :data:`DEFAULT_DIR`), generated first if it
    is missing, incomplete or from another spec.  Item paths in the returned manifest are absolute."""
    directory = Path(directory) if directory is not None else DEFAULT_DIR
    manifest = load_manifest(directory)
    fresh = (manifest is not None and manifest.get("spec") == spec_hash() and manifest.get("limit") == limit
             and all((directory / it["path"]).is_file() for it in manifest.get("items", [])))
    if not fresh:
        manifest = generate(directory, limit)
    manifest = dict(manifest, dir=str(directory.resolve()))
    manifest["items"] = [dict(it, path=str((directory / it["path"]).resolve())) for it in manifest["items"]]
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="generate the labelled turn-taking set (issue 13)")
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help=f"where (default {DEFAULT_DIR})")
    parser.add_argument("--limit", type=int, help="only the first N sentences (2N items)")
    args = parser.parse_args(argv)
    manifest = ensure_set(args.dir, args.limit)
    for it in manifest["items"]:
        pause = "" if it["pause"] is None else f"  pause {it['pause'][0]:.2f}-{it['pause'][1]:.2f} s"
        print(f"{it['id']:14s} {it['voice']:6s} {it['rate']}  {it['duration_s']:.2f} s{pause}  {it['text']}")
    print(Path(manifest["dir"]) / "manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
