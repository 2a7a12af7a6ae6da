#!/usr/bin/env python
"""Live voice-to-voice latency measured on the sound itself, on one recording clock.

``omnidesk live --model demo`` (or the window, ``--app window``) runs on a private PulseAudio
server (tests/audio_harness.py: null sinks ``omnidesk_mic`` and ``omnidesk_speaker``).  A
combined sink (``module-combine-sink``, slaves = both null sinks) takes the questions: each one
reaches the app's microphone (``omnidesk_mic.monitor``) and the speaker sink at the same time.
ONE recorder (parec on ``omnidesk_speaker.monitor``, 16 kHz mono float) runs for the whole
session, so the question and the app's reply are in one recording, on one clock:

    acoustic_v2v_ms = reply onset in the recording - question speech end in the recording

Question speech end = where the played clip was found (cross-correlation) + its labelled
``speech_end_s``; reply onset = first 10 ms block after the question's start where the
recording minus the (fitted) question clip is loud for 50 ms (the demo's replies are noise at
RMS ~0.15), refined to the sample.  Each question is matched to the app's timeline turns it
started (the CLI's "(you're speaking)" lines while it played), and its app numbers are reported
next to the acoustic ones: app_v2v_ms = playback_start - user_speech_end (what the app's
latency table shows) and every timeline event relative to user_speech_end.  The same files
then go through ``omnidesk talk`` (no devices, real time) for the offline reference.

Questions: the ``complete`` files of ../shared/data/turns-human (read in place, played up to
``speech_end_s`` + 50 ms) and 3 espeak-ng questions made at run time in a temp dir.

Run:  .venv/bin/python bench/live_latency.py [--questions N] [--policies fixed,auto]
      [--conditions idle,load] [--app cli|window] [--no-offline] [--keep DIR] [--out FILE]

The JSON goes to stdout and --out (default bench/results/live_latency.json).  Everything runs
in real time: about 13 s per question (question + ~1 s + the demo's 6 s reply + gaps) live and
again offline, per policy x condition.  See bench/README.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# The analysis runs next to a busy core (the load condition) and the app: one BLAS thread, so
# that its small least-squares fits never wait on a thread pool that shares cores with them.
# The children (the app, talk) get the environment as it was.
_CHILD_ENV = dict(os.environ)
if "--window-child" not in sys.argv:  # the window's process is the app under test: as it is
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from report import RESULTS, load_avg, machine, when, write  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "turns-human"
DEFAULT_OUT = RESULTS / "live_latency.json"

REC_RATE = 16000
BLOCK = REC_RATE // 100  # 10 ms analysis blocks
QUESTION_PAD_S = 0.05  # played past the labelled speech end (the README allows a <=100 ms sub-threshold decay)
REPLY_RMS = 0.05  # a block of (recording - question) this loud is the reply (demo noise: RMS ~0.15)
REPLY_RUN = 5  # ... for 50 ms in a row
ONSET_ABS = 0.05  # the onset sample: first |residual| above this in the onset block or the one before
SILENT_RMS = 0.01  # a block this quiet inside a reply is a dropout (an underrun heard)
# The question subtracted from the recording leaves this much of it (dB of its energy) or more: it
# did not reach the recording as played (a gap in it), so no onset can be read after it.  Intact
# questions leave -63..-68 dB; every one above -30 in this bench's runs so far came with one core
# busy, -8..-1 dB, and read as a reply up to 7 s before the question's end.
QUESTION_LEFT_MAX_DB = -30.0
GAPPED = "the question reached the recording with a gap in it (its player stalled)"
QUIET_ABS = 0.02  # waiting between questions: the recording's tail stays under this peak ...
QUIET_S = 0.4  # ... for this long
GAP_S = 0.6  # then this much more silence before the next question (talk's GAP_S)
READY_SETTLE_S = 2.5  # after the app says it listens: ALSA's pulse plugin takes 1-2 s before blocks flow
MISS_AFTER_S = 8.0  # no turn started this long after a question ended: missed
TURN_TIMEOUT_S = 45.0  # a question's reply not over this long after the question: give up on it
STARTUP_TIMEOUT_S = 120.0  # model load + stream start (slower under load)
COMBINED = "omnidesk_combined"
COMBINE_ADJUST_S = 0
ESPEAK_QUESTIONS = (  # (voice, words per minute, text)
    ("en-us", 165, "What is the weather going to be like tomorrow afternoon?"),
    ("en-gb", 150, "Could you set a timer for twelve minutes, please?"),
    ("en-us+f3", 175, "How far is the moon from the earth?"),
)
NOISE_FLOOR_DBFS = -60.0  # as the human files: 100 ms of it before the speech, under it, 1.5 s after
POLICIES = ("fixed", "auto")
CONDITIONS = ("idle", "load")

try:  # talk's schedule (for mapping the offline timeline's turns to its inputs)
    from omnidesk.engine.talk import FRAME_S, LEAD_SILENCE_S
except ImportError:  # pragma: no cover - keep the bench usable if talk moves
    FRAME_S, LEAD_SILENCE_S = 0.04, 0.3

READY_RE = re.compile(r"^listening on ")
TURN_RE = re.compile(r"\(you're speaking\)")
ROW_RE = re.compile(r"^\s{0,3}\d+\s{2}")
BARGE_RE = re.compile(r"barge-ins (\d+) confirmed, (\d+) false")
UNITS = ("_ms", "_s", "_db", "_hz", "_khz", "_samples", "_frames", "_count", "_tokens")
CONTRACT_TURN_KEYS = {"user_speech_start", "user_speech_end", "endpoint", "events", "prompt_token_ids",
                      "text_token_ids", "codec_token_ids", "text", "reply_audio_s", "played_audio_s",
                      "interrupted", "barge_in"}


class BenchError(RuntimeError):
    """A plain-words reason the bench cannot go on."""


def log(msg: str) -> None:
    print(f"[live_latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ questions


@dataclass
class Question:
    name: str
    kind: str  # "human" or "espeak"
    speaker: str
    path: Path  # the whole file (talk's --input): in place for the human set, a temp file for espeak
    clip: np.ndarray  # what is played live: mono float32 at REC_RATE, up to the speech end + QUESTION_PAD_S
    speech_end_s: float  # in the clip / file
    text: str = ""


def speaker_of(row: dict) -> str:
    m = re.search(r"\b(p\d{3})\b", row.get("source_path", ""))
    if m:
        return m.group(1)
    if "ljspeech" in row.get("source_path", "").lower():
        return "LJ"
    return row.get("source_repo", "?").split("@")[0]


def human_questions(limit: int | None) -> list[Question]:
    labels = DATA / "labels.csv"
    if not labels.is_file():
        raise BenchError(f"{labels} not found: the human turn set lives in ../shared/data/turns-human "
                         "(next to the repository), read in place")
    out = []
    with open(labels, newline="") as f:
        for row in csv.DictReader(f):
            if row["label"] != "complete":
                continue
            if limit is not None and len(out) >= limit:
                break
            path = DATA / row["file"]
            audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
            audio = audio.mean(axis=1)
            if rate != REC_RATE:
                raise BenchError(f"{path}: {rate} Hz, expected {REC_RATE}")
            end = float(row["speech_end_s"])
            clip = audio[: int(round((end + QUESTION_PAD_S) * REC_RATE))].copy()
            out.append(Question(path.name, "human", speaker_of(row), path, clip, end,
                                row.get("transcript_of_kept_speech", "")))
    return out


def espeak_questions(count: int, tmp: Path) -> tuple[list[Question], str | None]:
    """Up to ``count`` espeak-ng questions, formatted like the human files (100 ms of a -60 dBFS
    noise floor, speech peak-normalised to -3 dBFS, the floor under it, 1.5 s of floor after);
    (questions, why none) - the reason when espeak-ng is missing or fails."""
    if count <= 0:
        return [], None
    exe = shutil.which("espeak-ng")
    if exe is None:
        return [], "espeak-ng not installed (apt-get install espeak-ng): espeak questions skipped"
    import soxr

    rng = np.random.default_rng(7)
    out = []
    for i, (voice, wpm, text) in enumerate(ESPEAK_QUESTIONS[:count]):
        raw = tmp / f"espeak-{i}-raw.wav"
        try:
            subprocess.run([exe, "-v", voice, "-s", str(wpm), "-w", str(raw), text], check=True,
                           capture_output=True, timeout=30)
        except (subprocess.SubprocessError, OSError) as e:
            return out, f"espeak-ng failed ({e}): {len(out)} espeak question(s)"
        x, rate = sf.read(str(raw), dtype="float32", always_2d=True)
        x = soxr.resample(x.mean(axis=1), rate, REC_RATE).astype(np.float32)
        loud = np.flatnonzero(np.abs(x) > 0.01 * np.abs(x).max())
        x = x[loud[0]:loud[-1] + 1]
        x *= 10 ** (-3 / 20) / np.abs(x).max()
        floor = 10 ** (NOISE_FLOOR_DBFS / 20)
        lead, tail = int(0.1 * REC_RATE), int(1.5 * REC_RATE)
        full = np.concatenate([np.zeros(lead, np.float32), x, np.zeros(tail, np.float32)])
        full += (floor * rng.standard_normal(full.size)).astype(np.float32)
        # speech end: the last sample above -40 dBFS
        end = (np.flatnonzero(np.abs(full) > 0.01)[-1] + 1) / REC_RATE
        path = tmp / f"espeak-{i}.wav"
        sf.write(str(path), full, REC_RATE, subtype="FLOAT")
        clip = full[: int(round((end + QUESTION_PAD_S) * REC_RATE))].copy()
        out.append(Question(f"espeak-{i}", "espeak", f"espeak-ng:{voice}", path, clip, float(end), text))
    return out, None


# ------------------------------------------------------------------ audio plumbing


class Recorder:
    """parec on one source into a raw float32 file; its tail can be read while it runs."""

    def __init__(self, harness, source: str, path: Path, latency_ms: int = 10):
        self.harness, self.source, self.path = harness, source, Path(path)
        self.latency_ms = latency_ms
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Recorder":
        h = self.harness
        with open(self.path, "wb") as out:
            self.proc = subprocess.Popen(
                ["parec", f"--server={h.server}", f"--device={self.source}", "--raw", "--format=float32le",
                 f"--rate={REC_RATE}", "--channels=1", f"--latency-msec={self.latency_ms}"],
                stdout=out, stderr=subprocess.DEVNULL, env=client_env(h), start_new_session=True)
        return self

    def tail(self, seconds: float) -> np.ndarray:
        n = int(seconds * REC_RATE) * 4
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                start = max(0, (size - n) // 4 * 4)
                f.seek(start)
                data = f.read(size - start)
        except OSError:
            return np.zeros(0, np.float32)
        return np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4")

    def stop(self) -> tuple[np.ndarray, float]:
        """The recording and the monotonic time of its first sample (counted back from its end:
        parec may take long to connect, so its start is no anchor)."""
        t_stop = time.monotonic()
        stop_process(self.proc, sig=signal.SIGTERM)
        data = self.path.read_bytes() if self.path.exists() else b""
        x = np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4").copy()
        return x, t_stop - x.size / REC_RATE


def stop_all(recorders: list[Recorder]) -> list[tuple[np.ndarray, float]]:
    """Stop recorders together (one stop time for all, so their anchors differ only by what each
    parec had buffered): [(recording, monotonic time of its first sample)]."""
    t_stop = time.monotonic()
    for r in recorders:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.terminate()
    out = []
    for r in recorders:
        stop_process(r.proc)
        data = r.path.read_bytes() if r.path.exists() else b""
        x = np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4").copy()
        out.append((x, t_stop - x.size / REC_RATE))
    return out


def client_env(harness) -> dict[str, str]:
    return dict(child_env(), **harness.client_env())


def child_env() -> dict[str, str]:
    """The environment the bench was started with (not its one-BLAS-thread setting)."""
    return dict(_CHILD_ENV)


def stop_process(proc: subprocess.Popen | None, sig=signal.SIGTERM, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass


def play(harness, sink: str, samples: np.ndarray, rate: int = REC_RATE) -> None:
    harness.play(samples, rate, sink, timeout=15 + 2 * len(samples) / rate)


def load_combined_sink(harness) -> str:
    # adjust_time=0: no rate adjustment of the two outputs.  With the default (10 s) the combine
    # sink re-rates one output's resampler as a stream starts: a question came out stretched by
    # 3-5 ms over its first seconds on one slave and not the other (the skew moved within a
    # question).  Both null sinks run on the same system clock, so nothing drifts without it.
    r = harness.pactl("load-module", "module-combine-sink", f"sink_name={COMBINED}",
                      "slaves=omnidesk_mic,omnidesk_speaker", f"adjust_time={COMBINE_ADJUST_S}",
                      f"sink_properties=device.description={COMBINED}")
    return r.stdout.strip()


def combine_latencies(harness) -> dict | None:
    """What PulseAudio reports for the combined sink's two outputs: buffer + sink latency of each
    slave's sink input (ms), and mic - speaker (the skew it reports: > 0 = the microphone hears
    the question that much later than the speaker sink's recording shows it)."""
    try:
        text = harness.pactl("list", "sink-inputs", timeout=5).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    lat = {}
    for block in text.split("Sink Input #")[1:]:
        m = re.search(r'media\.name = "Simultaneous output on (\w+)"', block)
        buf = re.search(r"Buffer Latency: (\d+) usec", block)
        snk = re.search(r"Sink Latency: (\d+) usec", block)
        if m and buf and snk:
            lat[m.group(1)] = (int(buf.group(1)) + int(snk.group(1))) / 1000.0
    if "omnidesk_mic" not in lat or "omnidesk_speaker" not in lat:
        return None
    return {"mic_ms": lat["omnidesk_mic"], "speaker_ms": lat["omnidesk_speaker"],
            "mic_minus_speaker_ms": round(lat["omnidesk_mic"] - lat["omnidesk_speaker"], 2)}


def check_combine_skew(harness, tmp: Path, rounds: int = 3) -> dict:
    """Clicks played into the combined sink, recorded from both slaves' monitors at once (plus a
    second recorder on the speaker monitor as a control: two recorders of the same source differ
    only by how each recording is anchored in time).  Per round: (mic - speaker) and (speaker2 -
    speaker) click times, ms."""
    click = np.zeros(int(0.6 * REC_RATE), np.float32)
    click[int(0.1 * REC_RATE):int(0.1 * REC_RATE) + 8] = 0.8
    skews, controls, reported = [], [], []
    for r in range(rounds):
        recs = [Recorder(harness, src, tmp / f"skew-{r}-{i}.raw", latency_ms=5).start()
                for i, src in enumerate(("omnidesk_speaker.monitor", "omnidesk_mic.monitor",
                                         "omnidesk_speaker.monitor"))]
        try:
            time.sleep(0.5)
            for _ in range(2):
                play(harness, COMBINED, click)
            reported.append(combine_latencies(harness))
            time.sleep(0.3)
        finally:
            got = [rec.stop() for rec in recs]
        times = []
        for x, t0 in got:
            idx = np.flatnonzero(np.abs(x) > 0.3)
            if idx.size == 0:
                times.append(None)
                continue
            onsets = [idx[0]] + [b for a, b in zip(idx[:-1], idx[1:]) if b - a > REC_RATE // 5]
            times.append([t0 + o / REC_RATE for o in onsets])
        if any(t is None or len(t) != 2 for t in times):
            continue
        spk, mic, ctl = times
        skews += [float(1000 * (m - s)) for m, s in zip(mic, spk)]
        controls += [float(1000 * (c - s)) for c, s in zip(ctl, spk)]
        for rec in recs:
            rec.path.unlink(missing_ok=True)
    rep = [x["mic_minus_speaker_ms"] for x in reported if x]
    return {"measured_mic_minus_speaker_ms": [round(v, 1) for v in skews],
            "measured_median_ms": rnd(median(skews)),
            "control_speaker_minus_speaker_ms": [round(v, 1) for v in controls],
            "control_median_abs_ms": rnd(median([abs(v) for v in controls])),
            "pulse_reported_mic_minus_speaker_ms": rep,
            "note": "two recorders differ by their time anchors (see the control); within that, the clicks "
                    "reach both slaves together" if skews else "the clicks were not found in the recordings"}


# ------------------------------------------------------------------ the app under test


class AppOutput:
    """Reads the app's stdout+stderr on a thread; counts 'listening', turn starts and turn rows."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self.ready_at: float | None = None
        self.started = 0
        self.rows = 0
        self.barge = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            now = time.monotonic()
            with self.lock:
                self.lines.append((now, line))
                if self.ready_at is None and READY_RE.search(line):
                    self.ready_at = now
                elif TURN_RE.search(line):
                    self.started += 1
                elif self.ready_at is not None and ROW_RE.match(line):
                    self.rows += 1
                m = BARGE_RE.search(line)
                if m:
                    self.barge = (int(m.group(1)), int(m.group(2)))

    def after_ready(self, text: str) -> int:
        """Lines with ``text`` printed once the app was listening (ALSA's underrun messages while
        the streams start are not the conversation's)."""
        with self.lock:
            return sum(1 for t, line in self.lines if self.ready_at is not None and t > self.ready_at and text in line)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return self.started, self.rows

    def text(self, tail: int | None = None) -> str:
        with self.lock:
            lines = [line for _, line in self.lines]
        return "\n".join(lines if tail is None else lines[-tail:])


def app_command(app: str, policy: str, turns: int, duration: float, timeline: Path) -> tuple[list[str], dict]:
    if app == "window":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--window-child", "--policy", policy,
               "--turns", str(turns), "--duration", f"{duration:.0f}", "--timeline", str(timeline)]
        return cmd, {"QT_QPA_PLATFORM": "offscreen"}
    cmd = [sys.executable, "-m", "omnidesk", "live", "--model", "demo", "--end-of-turn", policy,
           "--turns", str(turns), "--duration", f"{duration:.0f}", "--timeline", str(timeline)]
    return cmd, {}


def run_live(harness, questions: list[Question], policy: str, app: str, tmp: Path, tag: str) -> dict:
    """One session: the recorder, the app, every question in turn.  Raw material for analyse_live."""
    timeline_path = tmp / f"live-{tag}.json"
    rec = Recorder(harness, "omnidesk_speaker.monitor", tmp / f"rec-{tag}.raw").start()
    # only to check the one clock: the microphone's monitor, and a second speaker recorder as the
    # control for how two recordings' time anchors differ
    checks = [Recorder(harness, "omnidesk_mic.monitor", tmp / f"mic-{tag}.raw").start(),
              Recorder(harness, "omnidesk_speaker.monitor", tmp / f"ctl-{tag}.raw").start()]
    time.sleep(0.3)
    duration = 60 + sum(q.clip.size / REC_RATE + 15 for q in questions)
    cmd, extra_env = app_command(app, policy, 2 * len(questions), duration, timeline_path)
    env = client_env(harness)
    env.update(extra_env, PYTHONUNBUFFERED="1")
    log(f"{tag}: starting {' '.join(cmd[1:4])} ... (--end-of-turn {policy})")
    t_launch = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = AppOutput(proc)
    plays: list[dict] = []
    skew_samples: list[float] = []
    problem = None
    try:
        while out.ready_at is None:
            if proc.poll() is not None:
                raise BenchError(f"the app exited ({proc.returncode}) before listening:\n{out.text(30)}")
            if time.monotonic() - t_launch > STARTUP_TIMEOUT_S:
                raise BenchError(f"the app did not start listening within {STARTUP_TIMEOUT_S:.0f} s:\n{out.text(30)}")
            time.sleep(0.05)
        startup_s = out.ready_at - t_launch
        time.sleep(READY_SETTLE_S)
        for i, q in enumerate(questions):
            if proc.poll() is not None:
                problem = f"the app exited ({proc.returncode}) before question {i + 1}"
                break
            started0, rows0 = out.counts()
            t0 = time.monotonic()
            play(harness, COMBINED, q.clip)
            t1 = time.monotonic()
            lat = combine_latencies(harness)
            if lat:
                skew_samples.append(lat["mic_minus_speaker_ms"])
            outcome, quiet_since = None, None
            while outcome is None:
                time.sleep(0.05)
                now = time.monotonic()
                started, rows = out.counts()
                tail = rec.tail(0.05)
                loud = tail.size > 0 and float(np.abs(tail).max()) >= QUIET_ABS
                quiet_since = None if loud else (quiet_since or now)
                if started > started0 and rows >= started and quiet_since and now - quiet_since >= QUIET_S:
                    outcome = "replied"
                elif started == started0 and now - t1 > MISS_AFTER_S:
                    outcome = "no turn"
                elif now - t1 > TURN_TIMEOUT_S:
                    outcome = "timeout"
                elif proc.poll() is not None:
                    outcome = "app exited"
            started, rows = out.counts()
            plays.append({"t_play": t0, "t_played": t1, "turns": list(range(started0, started)), "outcome": outcome,
                          "combine_skew_ms": lat["mic_minus_speaker_ms"] if lat else None})
            log(f"{tag}: {i + 1}/{len(questions)} {q.name}: {outcome}, turns {started0 + 1}..{started}")
            time.sleep(GAP_S)
        time.sleep(0.5)
    finally:
        if proc.poll() is None:  # Ctrl-C: the app writes its timeline and says its barge-in counts
            stop_process(proc, sig=signal.SIGINT, timeout=30)
        out.thread.join(timeout=5)
        (recording, t_rec), mic, ctl = stop_all([rec] + checks)
    timeline = None
    if timeline_path.exists():
        try:
            timeline = json.loads(timeline_path.read_text())
        except ValueError as e:
            problem = (problem + "; " if problem else "") + f"unreadable timeline: {e}"
    else:
        problem = (problem + "; " if problem else "") + "the app wrote no timeline"
    return {"recording": recording, "t_rec": t_rec, "wall_minus_monotonic": time.time() - time.monotonic(), "mic": mic, "control": ctl, "plays": plays, "timeline": timeline, "returncode": proc.returncode,
            "output": out.text(), "barge": out.barge, "startup_s": startup_s, "problem": problem,
            "turn_lines": out.counts()[0], "alsa_underruns": out.after_ready("underrun occurred"), "combine_skew_ms": skew_samples}


# ------------------------------------------------------------------ analysis


def window_energy(x: np.ndarray, n: int) -> np.ndarray:
    """Sum of x**2 over every window of n samples (len(x) - n + 1 of them)."""
    c = np.concatenate([[0.0], np.cumsum(x.astype(np.float64) ** 2)])
    return np.maximum(c[n:] - c[:-n], 0.0)


def find_clip(x: np.ndarray, clip: np.ndarray, around: int) -> tuple[int | None, float]:
    """Index in ``x`` where ``clip`` starts, searched from around-0.5 s to around+3 s; and the match
    quality (cosine similarity of the clip and the recording under it, 1 = identical)."""
    lo = max(0, around - REC_RATE // 2)
    seg = x[lo:lo + int(3.5 * REC_RATE) + clip.size].astype(np.float64)
    if seg.size <= clip.size:
        return None, 0.0
    c = clip.astype(np.float64)
    n = 1 << int(np.ceil(np.log2(seg.size + c.size)))
    corr = np.fft.irfft(np.fft.rfft(seg, n) * np.conj(np.fft.rfft(c, n)), n)[: seg.size - c.size + 1]
    energy = window_energy(seg, c.size)
    score = corr / np.sqrt(np.maximum(energy, 1e-12)) / np.linalg.norm(c)
    lag = int(np.argmax(score))
    return lo + lag, float(score[lag])


def refine_end(x: np.ndarray, q: "Question", at: int) -> tuple[int, int, float]:
    """The question's speech end in ``x`` found from its own last 0.6 s of speech (searched 25 ms
    either side of where the whole-clip match puts it), so that a stretch of the clip on its
    way through the sinks cannot move it: (end sample, shift from the whole-clip estimate,
    match quality)."""
    end_c = int(round(q.speech_end_s * REC_RATE))
    snip = q.clip[max(0, end_c - int(0.6 * REC_RATE)):end_c].astype(np.float64)
    guess = at + end_c
    if snip.size < REC_RATE // 10 or np.linalg.norm(snip) < 1e-3:
        return guess, 0, 1.0
    span = int(0.025 * REC_RATE)
    w = x[max(0, guess - snip.size - span):guess + span].astype(np.float64)
    if w.size < snip.size:
        return guess, 0, 0.0
    corr = np.correlate(w, snip, "valid")
    energy = window_energy(w, snip.size)
    score = corr / np.sqrt(np.maximum(energy, 1e-12)) / np.linalg.norm(snip)
    k = int(np.argmax(score))
    end = max(0, guess - snip.size - span) + k + snip.size
    return end, end - guess, float(score[k])


def subtract_question(x: np.ndarray, clip: np.ndarray, at: int, taps: int = 8) -> tuple[np.ndarray, float]:
    """``x`` (float64 copy) minus the question as it came through the sinks: the clip through a
    least-squares FIR of 2*taps+1 taps fitted over the clip's span (the path resamples twice and
    quantises to 16 bits: a plain gain leaves ~15% of a loud vowel, this leaves ~nothing), and
    the fraction of the question's energy left (residual / recording under the clip)."""
    res = x.astype(np.float64)
    y = res[at:at + clip.size]
    c = clip[: y.size].astype(np.float64)
    a = np.zeros((c.size, 2 * taps + 1))
    for i, k in enumerate(range(-taps, taps + 1)):
        if k >= 0:
            a[k:, i] = c[: c.size - k]
        else:
            a[:k, i] = c[-k:]
    h = np.linalg.solve(a.T @ a + 1e-9 * np.eye(a.shape[1]), a.T @ y)
    left = y - a @ h
    fraction = float(np.sum(left ** 2) / max(np.sum(y ** 2), 1e-12))
    res[at:at + c.size] = left
    return res, fraction


def block_rms(x: np.ndarray) -> np.ndarray:
    n = x.size // BLOCK
    return np.sqrt((x[: n * BLOCK].astype(np.float64).reshape(n, BLOCK) ** 2).mean(axis=1))


def reply_onset(res: np.ndarray, start: int, stop: int) -> int | None:
    """First sample of the reply in ``res`` (recording minus the question) in [start, stop)."""
    seg = res[start:stop]
    rms = block_rms(seg)
    loud = rms > REPLY_RMS
    if loud.size < REPLY_RUN:
        return None
    run = np.convolve(loud.astype(int), np.ones(REPLY_RUN, int), mode="valid")
    hits = np.flatnonzero(run == REPLY_RUN)
    if hits.size == 0:
        return None
    b = int(hits[0])
    lo = max(0, (b - 1) * BLOCK)
    above = np.flatnonzero(np.abs(seg[lo:(b + 1) * BLOCK]) > ONSET_ABS)
    return start + lo + int(above[0]) if above.size else start + b * BLOCK


def reply_extent(x: np.ndarray, onset: int, limit: int) -> tuple[int, int, int]:
    """(end sample, silent 10 ms blocks inside, runs of them) of the reply starting at ``onset``:
    the reply ends at its last loud block before ``limit``."""
    rms = block_rms(x[onset:limit])
    loud = np.flatnonzero(rms > SILENT_RMS)
    if loud.size == 0:
        return onset, 0, 0
    inside = rms[: loud[-1] + 1] <= SILENT_RMS
    runs = int(np.sum(inside[1:] & ~inside[:-1]) + (1 if inside.size and inside[0] else 0))
    return onset + (int(loud[-1]) + 1) * BLOCK, int(inside.sum()), runs


def flatten_extras(d: dict, prefix: str, base: float | None, times: dict, values: dict) -> None:
    """Numeric extras: unit-suffixed names and integers are values (as they are); other floats
    are session times (-> ms after ``base``).  Dicts are walked (``a.b``), lists and text skipped."""
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            flatten_extras(v, name + ".", base, times, values)
        elif isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
            continue
        elif k.lower().endswith(UNITS) or isinstance(v, int):
            values[name] = v
        elif base is not None and math.isfinite(v):
            times[name] = round(1000 * (v - base), 1)


def turn_hops(turn: dict) -> tuple[dict, dict]:
    """(every event and time-valued extra, ms after user_speech_end; numeric extras as they are)."""
    base = turn.get("user_speech_end")
    hops, values = {}, {}
    if base is None:
        return hops, values
    for k in ("user_speech_start", "endpoint"):
        if isinstance(turn.get(k), (int, float)):
            hops[k] = round(1000 * (turn[k] - base), 1)
    for k, v in (turn.get("events") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            hops[k] = round(1000 * (v - base), 1)
    b = turn.get("barge_in") or {}
    for k in ("onset", "confirmed", "playback_stopped"):
        if isinstance(b.get(k), (int, float)):
            hops[f"barge_in.{k}"] = round(1000 * (b[k] - base), 1)
    extras = {k: v for k, v in turn.items() if k not in CONTRACT_TURN_KEYS}
    flatten_extras(extras, "", base, hops, values)
    return hops, values


def first_audio_after_start(hops: dict | None) -> float | None:
    """First audio chunk minus the reply's start (timeline extra ``reply_started``), ms."""
    if not hops or hops.get("first_audio_chunk") is None or hops.get("reply_started") is None:
        return None
    return round(hops["first_audio_chunk"] - hops["reply_started"], 1)


def pick_turn(turns: list[dict], indices: list[int]) -> dict | None:
    """The question's turn among those it started: the last one that got a reply playing (a
    question split at a pause has its answer on the last part), else the last one."""
    cands = [turns[i] for i in indices if i < len(turns)]
    playing = [t for t in cands if (t.get("events") or {}).get("playback_start") is not None]
    return (playing or cands or [None])[-1]


def app_v2v(turn: dict | None) -> float | None:
    if not turn:
        return None
    ps, end = (turn.get("events") or {}).get("playback_start"), turn.get("user_speech_end")
    return None if ps is None or end is None else round(1000 * (ps - end), 1)


def analyse_live(raw: dict, questions: list[Question]) -> tuple[list[dict], list[str]]:
    x, t_rec = raw["recording"], raw["t_rec"]
    turns = (raw["timeline"] or {}).get("turns") or []
    notes = []
    if raw["timeline"] is not None and raw["turn_lines"] != len(turns):
        notes.append(f"the app printed {raw['turn_lines']} turn starts but its timeline has {len(turns)} turns: "
                     "question -> turn matching may be off")
    # where each question is: searched near the wall time it was played
    located = []
    for q, p in zip(questions, raw["plays"]):
        at, score = find_clip(x, q.clip, int(round((p["t_play"] - t_rec) * REC_RATE)))
        located.append((at, score))
    rows = []
    for k, (q, p) in enumerate(zip(questions, raw["plays"])):
        at, score = located[k]
        turn = pick_turn(turns, p["turns"])
        row = {"file": q.name, "speaker": q.speaker, "kind": q.kind, "outcome": p["outcome"],
               "turns": len(p["turns"]), "match_score": round(score, 3),
               "combine_skew_ms": p.get("combine_skew_ms")}
        hops, values = turn_hops(turn) if turn else ({}, {})
        row["app_v2v_ms"] = app_v2v(turn)

        def unmeasured(problem: str) -> None:
            row["problem"] = problem
            row.update(acoustic_v2v_ms=None, app_minus_acoustic_ms=None, hops_ms=hops, extras=values)
            rows.append(row)

        if at is None or score < 0.5:
            unmeasured("question not found in the recording")
            continue
        end, shift, end_score = refine_end(x, q, at)
        row["end_refine_ms"] = round(1000 * shift / REC_RATE, 2)
        row["end_match_score"] = round(end_score, 3)
        nxt = next((a for a, s in located[k + 1:] if a is not None and s >= 0.5), x.size)
        res, left = subtract_question(x, q.clip, at)
        row["question_left_db"] = round(10 * math.log10(max(left, 1e-12)), 1)
        if row["question_left_db"] > QUESTION_LEFT_MAX_DB:
            unmeasured(GAPPED)
            continue
        onset = reply_onset(res, at, nxt)
        if onset is None:
            unmeasured("no reply heard")
            continue
        played = (turn or {}).get("played_audio_s") or 8.0
        stop, silent_blocks, silent_runs = reply_extent(x, onset, min(nxt, onset + int((played + 2) * REC_RATE)))
        acoustic = round(1000 * (onset - end) / REC_RATE, 1)
        row["acoustic_v2v_ms"] = acoustic
        row["app_minus_acoustic_ms"] = None if row["app_v2v_ms"] is None else round(row["app_v2v_ms"] - acoustic, 1)
        if onset < end:
            row["reply_before_speech_end"] = True
        row["reply_heard_s"] = round((stop - onset) / REC_RATE, 2)
        row["reply_dropouts_ms"] = 10 * silent_blocks
        row["reply_dropout_runs"] = silent_runs
        origin = ((raw["timeline"] or {}).get("clock") or {}).get("session_origin_stream_time")
        if turn and origin is not None:
            # the app's stamps put on the recording's clock (PortAudio's stream time is the system's
            # wall clock here): where each of its two ends of the v2v is off
            at_rec = origin - raw["wall_minus_monotonic"] - t_rec
            if turn.get("user_speech_end") is not None:
                row["app_speech_end_minus_heard_ms"] = round(1000 * (at_rec + turn["user_speech_end"] - end / REC_RATE), 1)
            ps = (turn.get("events") or {}).get("playback_start")
            if ps is not None:
                row["app_playback_minus_heard_ms"] = round(1000 * (at_rec + ps - onset / REC_RATE), 1)
        if turn and turn.get("user_speech_end") is not None:
            # recording clock - session clock at the question's end: constant but for the VAD's end jitter
            # (and sample drops); its spread across turns says how steady the app's stamps are
            row["clock_offset_ms"] = round(1000 * (end / REC_RATE - turn["user_speech_end"]), 1)
        row["t_rec_s"] = round(end / REC_RATE, 3)  # the question's speech end in the recording
        t_end = t_rec + end / REC_RATE
        for key, (xx, t_xx) in (("mic_minus_speaker_ms", raw["mic"]), ("control_ms", raw["control"])):
            a2, s2 = find_clip(xx, q.clip, int(round((p["t_play"] - t_xx) * REC_RATE)))
            row[key] = None if a2 is None or s2 < 0.5 else \
                round(1000 * (t_xx + refine_end(xx, q, a2)[0] / REC_RATE - t_end), 2)
        row["hops_ms"], row["extras"] = hops, values
        rows.append(row)
    return rows, notes


def group_offline(questions: list[Question], turns: list[dict]) -> tuple[list[list[int]], list[str]]:
    """Which offline timeline turns came from which input (talk's schedule: lead-in, input, wait
    until the reply has played, GAP_S, next input): a turn belongs to the current input while it
    starts before that input's last frame (its start inferred from its first turn's speech
    start; the inputs start with 100 ms of floor before the speech)."""
    groups: list[list[int]] = [[] for _ in questions]
    notes: list[str] = []
    k, start = -1, None
    frames = [math.ceil(sf.info(str(q.path)).frames / REC_RATE / FRAME_S) for q in questions]
    for j, t in enumerate(turns):
        t0 = t.get("user_speech_start")
        if t0 is None:
            notes.append(f"offline turn {j}: no user_speech_start")
            continue
        if k >= 0 and t0 < start + frames[k] * FRAME_S:
            groups[k].append(j)
            continue
        k += 1
        if k >= len(questions):
            notes.append(f"offline turn {j} at {t0:.2f} s: after the last input")
            k = len(questions) - 1
            groups[k].append(j)
            continue
        start = t0 - 0.1 - FRAME_S  # the input's first frame, about (its speech starts 100 ms in)
        if k == 0 and abs(t0 - (LEAD_SILENCE_S + 0.1)) > 0.15:
            notes.append(f"offline: the first turn starts at {t0:.2f} s, not near {LEAD_SILENCE_S + 0.1:.2f} s "
                         "where the first input's speech is: the mapping may be off")
        groups[k].append(j)
    for q, g in zip(questions, groups):
        if not g:
            notes.append(f"offline: no turn for {q.name} (every later input may be off by one)")
    return groups, notes


def run_offline(questions: list[Question], policy: str, tmp: Path, tag: str) -> dict:
    timeline = tmp / f"offline-{tag}.json"
    cmd = [sys.executable, "-m", "omnidesk", "talk", "--model", "demo", "--end-of-turn", policy,
           "--timeline", str(timeline), "--output", str(tmp / f"offline-{tag}.wav")]
    for q in questions:
        cmd += ["--input", str(q.path)]
    budget = 120 + sum(sf.info(str(q.path)).duration + 15 for q in questions)
    log(f"{tag}: offline reference: omnidesk talk with {len(questions)} inputs (real time)")
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=budget,
                           env=dict(child_env(), PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "v2v_ms": [None] * len(questions), "notes": [f"talk ran past {budget:.0f} s"]}
    wall = time.monotonic() - t0
    if not timeline.exists():
        return {"status": f"failed ({r.returncode})", "v2v_ms": [None] * len(questions),
                "notes": [(r.stderr or r.stdout)[-800:]]}
    turns = json.loads(timeline.read_text()).get("turns") or []
    groups, notes = group_offline(questions, turns)
    v2v = [app_v2v(pick_turn(turns, g)) for g in groups]
    hops = [turn_hops(pick_turn(turns, g))[0] if g else {} for g in groups]
    return {"status": "ok" if r.returncode == 0 else f"exit {r.returncode}", "wall_s": round(wall, 1),
            "v2v_ms": v2v, "hops_ms": hops, "turns": len(turns), "split": [len(g) for g in groups], "notes": notes}


# ------------------------------------------------------------------ summary


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rnd(v, nd=1):
    return None if v is None else round(float(v), nd) + 0.0


def stats(values: list) -> dict:
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"n": 0, "median": None, "p90": None, "min": None, "max": None}
    return {"n": len(v), "median": rnd(np.median(v)), "p90": rnd(np.percentile(v, 90)), "min": rnd(min(v)),
            "max": rnd(max(v))}


def clock_drift(rows: list[dict]) -> float | None:
    """Slope of clock_offset_ms over the recording (ms per minute, least squares): < 0 = the app's
    session clock (its microphone's sample count) gains on the recording's."""
    pts = [(r["t_rec_s"], r["clock_offset_ms"]) for r in rows
           if r.get("clock_offset_ms") is not None and r.get("t_rec_s") is not None]
    if len(pts) < 3 or max(t for t, _ in pts) - min(t for t, _ in pts) < 10:
        return None
    t, o = np.array(pts).T
    return rnd(60 * np.polyfit(t, o, 1)[0])


def summarise(rows: list[dict], raw: dict) -> dict:
    hop_names = []
    for r in rows:
        hop_names += [k for k in r.get("hops_ms", {}) if k not in hop_names]
    extra_names = []
    for r in rows:
        extra_names += [k for k in r.get("extras", {}) if k not in extra_names]
    timeline = raw.get("timeline") or {}
    tl_extra = {k: v for k, v in timeline.items() if k not in ("model", "device", "turns")}
    reported = {}
    flatten_extras(tl_extra, "", None, {}, reported)
    for r in rows:  # and per turn
        for k, v in (r.get("extras") or {}).items():
            if "underrun" in k.lower() or "underflow" in k.lower():
                reported[k] = reported.get(k, 0) + v
    under_keys = [k for k in reported if "underrun" in k.lower() or "underflow" in k.lower()]
    false_b = raw["barge"][1] if raw.get("barge") else reported.get("false_barge_ins")
    confirmed_b = raw["barge"][0] if raw.get("barge") else reported.get("confirmed_barge_ins")
    return {
        "questions": len(rows),
        "acoustic_v2v_ms": stats([r.get("acoustic_v2v_ms") for r in rows]),
        "app_v2v_ms": stats([r.get("app_v2v_ms") for r in rows]),
        "app_minus_acoustic_ms": stats([r.get("app_minus_acoustic_ms") for r in rows]),
        "app_speech_end_minus_heard_ms": stats([r.get("app_speech_end_minus_heard_ms") for r in rows]),
        "app_playback_minus_heard_ms": stats([r.get("app_playback_minus_heard_ms") for r in rows]),
        "offline_v2v_ms": stats([r.get("offline_v2v_ms") for r in rows]),
        "live_minus_offline_ms": stats([r.get("live_minus_offline_ms") for r in rows]),
        "acoustic_minus_offline_ms": stats([r.get("acoustic_minus_offline_ms") for r in rows]),
        # the pipeline's own latency: first audio chunk after the reply's work began (at the pause,
        # for a speculative start), both on the app's clock
        "first_audio_after_start_ms": stats([first_audio_after_start(r.get("hops_ms")) for r in rows]),
        "offline_first_audio_after_start_ms": stats([first_audio_after_start(r.get("offline_hops_ms"))
                                                     for r in rows]),
        "hops_ms": {k: rnd(median([r["hops_ms"].get(k) for r in rows if "hops_ms" in r])) for k in hop_names},
        "extras_median": {k: rnd(median([r["extras"].get(k) for r in rows if "extras" in r]), 3) for k in extra_names},
        "underruns": sum(reported[k] for k in under_keys) if under_keys else raw.get("alsa_underruns"),
        "underruns_source": ("timeline: " + ", ".join(under_keys)) if under_keys else
        "the app's output: ALSA 'underrun occurred' messages after it was listening (its timeline has no count)",
        "reply_dropouts": sum(r.get("reply_dropout_runs") or 0 for r in rows),
        "reply_dropouts_ms": sum(r.get("reply_dropouts_ms") or 0 for r in rows),
        "alsa_underrun_messages": raw.get("alsa_underruns"),
        "false_barge_ins": false_b,
        "confirmed_barge_ins": confirmed_b,
        "missed_turns": sum(1 for r in rows if r.get("acoustic_v2v_ms") is None and r.get("problem") != GAPPED),
        "questions_played_with_a_gap": sum(1 for r in rows if r.get("problem") == GAPPED),
        "split_turns": sum(1 for r in rows if r.get("turns", 0) > 1),
        "replies_before_speech_end": sum(1 for r in rows if r.get("reply_before_speech_end")),
        "clock_offset_spread_ms": (rnd(max(o) - min(o)) if (o := [r["clock_offset_ms"] for r in rows
                                                                 if r.get("clock_offset_ms") is not None]) else None),
        "clock_drift_ms_per_min": clock_drift(rows),
    }


# ------------------------------------------------------------------ the bench


def cpu_probe_ms(repeats: int = 7) -> float:
    """How fast the machine is right now: the median time of a fixed single-threaded workload of many
    small numpy calls (the kind of work the demo's pipeline is made of).  This VM's speed drifts by up
    to 2x from one minute to the next (other tenants on the host): read each run's figures with its
    probe, taken just before and after it."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(1024).astype(np.float32), rng.standard_normal(1024).astype(np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = a
        for _ in range(1200):
            x = np.tanh(x * 0.5 + b)
            x = np.fft.irfft(np.fft.rfft(x), n=1024).astype(np.float32)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 1)


def start_load() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                            start_new_session=True)


def machine_info() -> dict:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return machine("platform", "cpu_count", "python", torch=version("torch"), numpy=np.__version__, load_avg=load_avg())


def check_out(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise BenchError(f"--out {path}: not writable ({e.strerror or e})") from None


def run_bench(args) -> dict:
    from audio_harness import PulseHarness, ensure_installed

    reason = ensure_installed()
    if reason:
        raise BenchError(f"PulseAudio tools needed (pulseaudio pulseaudio-utils libasound2-plugins): {reason}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for p in policies:
        if p not in ("fixed", "auto", "smart"):
            raise BenchError(f"--policies: unknown {p!r} (fixed, auto, smart)")
    for c in conditions:
        if c not in CONDITIONS:
            raise BenchError(f"--conditions: unknown {c!r} ({', '.join(CONDITIONS)})")
    tmp = Path(tempfile.mkdtemp(prefix="ll-", dir="/tmp"))  # short: the pulse socket path is limited
    notes: list[str] = []
    n_human = None if args.questions is None else max(0, args.questions - min(3, args.questions // 4))
    questions = human_questions(n_human)
    n_espeak = 3 if args.questions is None else args.questions - len(questions)
    extra, why = espeak_questions(n_espeak, tmp)
    questions += extra
    if why:
        notes.append(why)
    if not questions:
        raise BenchError("no questions")
    per_q = sum(q.clip.size / REC_RATE + 9 for q in questions)
    eta = len(policies) * len(conditions) * (per_q * (2 if not args.no_offline else 1) + 30)
    log(f"{len(questions)} questions ({sum(q.kind == 'espeak' for q in questions)} espeak), policies {policies}, "
        f"conditions {conditions}, app {args.app}: about {eta / 60:.0f} min")
    result = {"machine": machine_info(), "when": when(),
              "app": args.app, "questions": [{"file": q.name, "speaker": q.speaker, "kind": q.kind,
                                              "speech_end_s": round(q.speech_end_s, 3), "text": q.text}
                                             for q in questions],
              "notes": notes, "runs": {}}
    harness = PulseHarness(tmp / "pulse")
    load = None
    try:
        harness.start()
        load_combined_sink(harness)
        time.sleep(0.5)
        result["combine_sink"] = check_combine_skew(harness, tmp)
        log(f"combine sink: mic - speaker {result['combine_sink']['measured_mic_minus_speaker_ms']} ms "
            f"(control {result['combine_sink']['control_speaker_minus_speaker_ms']} ms, pulse says "
            f"{result['combine_sink']['pulse_reported_mic_minus_speaker_ms']} ms)")
        for condition in conditions:
            load = start_load() if condition == "load" else None
            try:
                if load is not None:
                    time.sleep(1.0)
                for policy in policies:
                    tag = f"{policy}-{condition}"
                    probe_before = cpu_probe_ms()
                    t0 = time.monotonic()
                    raw = run_live(harness, questions, policy, args.app, tmp, tag)
                    probe_after = cpu_probe_ms()
                    t_an = time.monotonic()
                    rows, run_notes = analyse_live(raw, questions)
                    log(f"{tag}: analysed in {time.monotonic() - t_an:.1f} s")
                    if raw["problem"]:
                        run_notes.append(raw["problem"])
                    if raw["returncode"] not in (0, None):
                        run_notes.append(f"the app exited with {raw['returncode']}: {raw['output'][-600:]}")
                    offline = None
                    if not args.no_offline:
                        offline = run_offline(questions, "smart" if policy == "smart" else policy, tmp, tag)
                        run_notes += offline["notes"]
                        for r, v, hops in zip(rows, offline["v2v_ms"], offline.get("hops_ms") or [{}] * len(rows)):
                            r["offline_v2v_ms"] = v
                            r["offline_hops_ms"] = hops
                            r["live_minus_offline_ms"] = (None if v is None or r.get("app_v2v_ms") is None
                                                          else round(r["app_v2v_ms"] - v, 1))
                            r["acoustic_minus_offline_ms"] = (None if v is None or r.get("acoustic_v2v_ms") is None
                                                              else round(r["acoustic_v2v_ms"] - v, 1))
                    if args.keep:
                        keep = Path(args.keep)
                        keep.mkdir(parents=True, exist_ok=True)
                        sf.write(str(keep / f"recording-{tag}.wav"), raw["recording"], REC_RATE, subtype="FLOAT")
                        for name in (f"live-{tag}.json", f"offline-{tag}.json", f"offline-{tag}.wav"):
                            if (tmp / name).exists():
                                shutil.copy(tmp / name, keep / name)
                        (keep / f"app-output-{tag}.txt").write_text(raw["output"])
                    summary = summarise(rows, raw)
                    skew = [r["mic_minus_speaker_ms"] for r in rows if r.get("mic_minus_speaker_ms") is not None]
                    ctl = [r["control_ms"] for r in rows if r.get("control_ms") is not None]
                    rep = raw["combine_skew_ms"]
                    summary["combine_skew_ms"] = {
                        "measured_median": rnd(median(skew), 2),
                        "measured_spread": rnd(max(skew) - min(skew), 2) if skew else None,
                        "control_median": rnd(median(ctl), 2),
                        "control_spread": rnd(max(ctl) - min(ctl), 2) if ctl else None,
                        "pulse_reported_median": rnd(median(rep), 2),
                        "pulse_reported_max_abs": rnd(max(map(abs, rep)), 2) if rep else None}
                    run = {"policy": policy, "condition": condition, "app": args.app,
                           "wall_s": round(time.monotonic() - t0, 1), "app_startup_s": rnd(raw["startup_s"]),
                           "cpu_probe_ms": {"before": probe_before, "after": probe_after},
                           "detector": next((t.get("end_of_turn", {}).get("detector")
                                             for t in (raw["timeline"] or {}).get("turns") or []
                                             if t.get("end_of_turn")), None),
                           "offline": None if offline is None else {k: offline[k] for k in ("status", "wall_s", "turns")
                                                                    if k in offline},
                           "notes": run_notes, "turns": rows, "summary": summary}
                    result["runs"][f"{policy}/{condition}"] = run
                    s = summary
                    log(f"{tag}: acoustic v2v median {s['acoustic_v2v_ms']['median']} ms, app {s['app_v2v_ms']['median']} "
                        f"ms, app-acoustic {s['app_minus_acoustic_ms']['median']} ms, offline "
                        f"{s['offline_v2v_ms']['median']} ms, missed {s['missed_turns']}; cpu probe "
                        f"{probe_before} / {probe_after} ms before / after")
            finally:
                if load is not None:
                    stop_process(load, sig=signal.SIGKILL)
                    load = None
    finally:
        if load is not None:
            stop_process(load, sig=signal.SIGKILL)
        harness.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result["machine"]["load_avg_after"] = load_avg()
    return result


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=None,
                    help="how many questions (default: every complete human file + 3 espeak-ng); "
                         "N takes N - min(3, N // 4) human files and the rest from espeak-ng")
    ap.add_argument("--policies", default=",".join(POLICIES), help="--end-of-turn policies (fixed, auto, smart)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="idle, load (one busy process on one core)")
    ap.add_argument("--app", choices=("cli", "window"), default="cli",
                    help="cli: omnidesk live; window: the desktop window, offscreen")
    ap.add_argument("--no-offline", action="store_true", help="skip the omnidesk talk reference")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results (also printed)")
    ap.add_argument("--keep", help="folder (outside the repository) for the recordings, timelines and app output")
    ap.add_argument("--keep-tmp", action="store_true", help=argparse.SUPPRESS)
    # the window variant's child process (see window_child)
    ap.add_argument("--window-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeline", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.window_child:
        return window_child(args)
    # A bench started in the background by a shell without job control inherits SIGINT ignored, and
    # the app it starts would too: deaf to the Ctrl-C that ends its session, it was killed 30 s later
    # without its timeline.  A handler here is reset to the default in the children.  SIGTERM ends
    # the bench through its finally blocks, which stop the busy core and the sound server.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    out = Path(args.out)
    try:
        if args.questions is not None and args.questions < 1:
            raise BenchError("--questions must be at least 1")
        check_out(out)
        if args.keep and Path(args.keep).resolve().is_relative_to(ROOT):
            raise BenchError("--keep: pick a folder outside the repository (recordings are not committed)")
        result = run_bench(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {"machine": result["machine"], "when": result["when"], "combine_sink": result.get("combine_sink"),
               "notes": result["notes"],
               "runs": {k: {"summary": v["summary"], "notes": v["notes"]} for k, v in result["runs"].items()}}
    print(json.dumps(summary, indent=1), flush=True)
    write(result, out, indent=1)
    log(f"wrote {out} (per-turn rows there)")
    return 0


# ------------------------------------------------------------------ --app window


def window_child(args) -> int:
    """The desktop window, offscreen, driven as tests/test_gui_live.py drives it (MainWindow.start():
    it loads the model and opens the live session by itself, no clicks), printing the same lines
    the parent reads from ``omnidesk live``; at the end its timeline (MainWindow.timeline_dict)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from omnidesk.gui.main_window import MainWindow
    from omnidesk.gui.settings import Settings
    from omnidesk.gui.worker import wait_for_background

    tmp = Path(tempfile.mkdtemp(prefix="ll-win-"))
    app = QApplication.instance() or QApplication(["omnidesk-bench"])
    settings = Settings(QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat))  # not the user's
    settings.end_of_turn = args.policy
    w = MainWindow(settings, model="demo", find_models=lambda: [], log_path=tmp / "omnidesk.log",
                   live_available=True)
    stop = {"flag": False, "ready": False, "started": 0, "done": 0}
    t_start = time.monotonic()
    signal.signal(signal.SIGINT, lambda *a: stop.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=True))

    def tick():
        session, timeline = w.session, w.conversation.timeline
        if not stop["ready"] and session is not None and w.conversation.running and getattr(session, "frames", 0) >= 25:
            stop["ready"] = True
            print(f"listening on the window's live session (end of turn: {settings.end_of_turn})", flush=True)
        if session is not None and timeline is not None:
            n = len(timeline.turns)
            while stop["started"] < n:
                stop["started"] += 1
                print("  (you're speaking)", flush=True)
            engine = getattr(session, "engine", None)
            done = n if engine is not None and engine.idle else max(0, n - 1)
            while stop["done"] < done:
                stop["done"] += 1
                print(f"{stop['done']:4d}  done", flush=True)
        over = args.duration and time.monotonic() - t_start > args.duration
        if stop["flag"] or over or (args.turns and stop["done"] >= args.turns):
            timer.stop()
            d = w.timeline_dict()
            if args.timeline:
                Path(args.timeline).write_text(json.dumps(d, indent=1))
            s = w.status
            print(f"{len(d.get('turns') or [])} turns; barge-ins {getattr(s, 'confirmed_barge_ins', 0)} confirmed, "
                  f"{getattr(s, 'false_barge_ins', 0)} false", flush=True)
            w.close()
            app.quit()

    timer = QTimer()
    timer.setInterval(20)
    timer.timeout.connect(tick)
    w.show()
    w.start()
    timer.start()
    app.exec()
    w.shutdown()
    wait_for_background(10000)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
