"""The Moshi demo live, end to end on the private PulseAudio server: the full-duplex engine behind
:class:`~omnidesk.audio.session.LiveSession` (what the window runs) and ``omnidesk live``.

Full duplex means audio flows while the user speaks: the demo's random model talks nonstop, so the
virtual speaker must carry its voice all through the question played into the virtual microphone.
Echo cancellation is on everywhere (speakers mode, ``headphones=False``); one test loops the
speaker back into the microphone (``echo_path``, as laptop speakers) so the canceller has an echo
to remove while the user talks over it.

Timing checks compare recorded clocks only (the session's sample clock, the recordings' sample
counts, the wall time of the status callbacks), with loose bounds; nothing depends on how
precisely a sleep wakes up.  Each test takes 10-20 s.

AEC3 mutes a user who speaks in its first seconds of far-end audio (see aec.py); a duplex session
warms its canceller past that (aec.DUPLEX_WARM_UP_S, tested offline in tests/test_aec.py).  The
questions here still start ~1.5 s into the session's audio: the streams take a moment to start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from audio_harness import pulse_server  # noqa: F401  (fixture)
from omnidesk.engine.timeline import validate
from support import cache  # noqa: F401  (fixture: a private XDG cache, where the Moshi demo is made)
from test_live import (AUDIBLE, BLOCK, REC_RATE, Recorder, audible_blocks, echo_path,  # noqa: F401  (fixture)
                       find_in_recording, start_session, wav)

FRAME_S = 0.08  # one Moshi step per 80 ms of audio
SESSION_FRAME_S = 0.04  # LiveSession hands the engine 40 ms frames
QUESTION = wav("question.wav")  # 2.2 s, speech from 0.05 s to 2.15 s
SPEECH = np.flatnonzero(np.abs(QUESTION) > AUDIBLE)
SPEECH_S = (SPEECH[-1] - SPEECH[0]) / REC_RATE
# Share of the question's 10 ms blocks with sound on the speaker: ~0 for a turn-based model, 0.9-1.0
# for the demo here; gaps are playback underruns when another job slows the steps.
MIN_SHARE = 0.6


@pytest.fixture(scope="module")
def moshi(cache):
    from omnidesk.models.families import load_model

    loaded = load_model("moshi-demo", "cpu")  # the demo is made on first use, in the private cache
    assert loaded.model_info["demo"] and loaded.model_info["family"] == "moshi"
    assert str(loaded.model_info["path"]).startswith(str(cache))
    return loaded


class LevelRecorder(Recorder):
    """Also keeps (wall time, level) of every status: the microphone after echo cancellation."""

    def __init__(self):
        super().__init__()
        self.levels: list[tuple[float, float]] = []

    def __call__(self, kind, payload):
        if kind == "status":
            self.levels.append((time.monotonic(), payload.level_dbfs))
        super().__call__(kind, payload)

    def level(self, t0: float, t1: float) -> float:
        xs = [lv for t, lv in list(self.levels) if t0 <= t <= t1]
        assert len(xs) >= 5, f"no status between {t0:.2f} and {t1:.2f}"
        return float(np.median(xs))


def talk_over(pulse, session=None, seconds: float = 7.0, lead_s: float = 1.5) -> SimpleNamespace:
    """Record speaker and mic for ``seconds``, playing the question into the mic ``lead_s`` in.
    Returns the recordings (``speaker``, ``mic``) with the wall times of their first samples
    (``t_speaker``, ``t_mic``), the wall time the question's speech reached the mic
    (``speech_at``) and the frames the in-process ``session`` (if any) counted meanwhile."""
    marks = {}

    def script():
        time.sleep(lead_s)  # the model is already talking when the user starts
        marks["question_start"] = time.monotonic()
        pulse.play_into_mic(QUESTION, REC_RATE)

    frames0 = session.frames if session is not None else 0
    speaker, mic = pulse.record(seconds, rate=REC_RATE, during=script)
    t_mic = pulse.last_mic_recording_start
    return SimpleNamespace(speaker=speaker, t_speaker=pulse.last_recording_start, mic=mic, t_mic=t_mic,
                           speech_at=find_in_recording(mic, t_mic, QUESTION, after=marks["question_start"]),
                           frames=session.frames - frames0 if session is not None else None)


def audible_while_user_speaks(r: SimpleNamespace) -> float:
    """Share of 10 ms speaker blocks with sound during the question's speech (wall clock)."""
    loud = audible_blocks(r.speaker)
    q0 = int(round((r.speech_at - r.t_speaker) * REC_RATE / BLOCK))
    q1 = q0 + int(SPEECH_S * REC_RATE) // BLOCK
    assert 0 <= q0 and q1 <= loud.size, "the speaker recording does not cover the question"
    return float(loud[q0:q1].mean())


def recorded_level(x: np.ndarray, t_x: float, t0: float, t1: float) -> float:
    """Median level (dBFS) of the 40 ms frames of recording ``x`` (first sample at wall time
    ``t_x``) between wall times ``t0`` and ``t1``: the same measure as LiveStatus.level_dbfs."""
    from omnidesk.engine.vad import level_dbfs

    n = REC_RATE * 40 // 1000
    a, b = max(0, int((t0 - t_x) * REC_RATE)), min(x.size, int((t1 - t_x) * REC_RATE))
    assert b - a >= 5 * n, f"the recording does not cover {t0:.2f}-{t1:.2f}"
    return float(np.median([level_dbfs(x[i:i + n]) for i in range(a, b - n + 1, n)]))


def overlaps(a0: float, a1: float | None, b0: float, b1: float | None) -> bool:
    inf = float("inf")
    return a0 < (inf if b1 is None else b1) and b0 < (inf if a1 is None else a1)


def check_duplex_section(duplex: dict, frames: int) -> None:
    """No errors; about one step per 80 ms of session time (``frames`` 40 ms session frames)."""
    assert duplex["errors"] == []
    steps = len(duplex["step_ms"])
    expected = frames * SESSION_FRAME_S / FRAME_S
    step_ms = np.asarray(duplex["step_ms"])
    print(f"session {frames * SESSION_FRAME_S:.2f} s: {steps} steps (+{duplex['dropped_frames']} dropped) for "
          f"{expected:.0f} model frames; step p50 {np.percentile(step_ms, 50):.1f} ms, max {step_ms.max():.1f} ms, "
          f"late {duplex['late_frames']}, max lag {duplex['max_lag_s'] * 1000:.0f} ms")
    assert steps > 0
    assert 0.8 * expected - 3 <= steps + duplex["dropped_frames"] <= expected + 1
    assert duplex["dropped_frames"] <= 0.1 * expected, "the model fell far behind the microphone"


def test_moshi_talks_while_the_user_speaks_with_echo_cancellation_on(pulse_server, moshi):  # noqa: F811
    from omnidesk.engine.duplex import DuplexEngine

    rec = Recorder()
    session = start_session(moshi.executor, rec)  # speakers mode (headphones=False): echo cancellation on
    try:
        assert isinstance(session.engine, DuplexEngine)
        assert session.aec is not None and not session.aec.bypass, "echo cancellation is not on"
        # Mimi hears 24 kHz: the canceller at 48 kHz (the device opened there), then one 2:1 resample
        assert session.hearing == "device 48000 Hz -> echo canceller 48000 Hz -> model 24000 Hz"
        r = talk_over(pulse_server, session)
    finally:
        session.close()

    d = session.timeline.to_dict()
    validate(d)
    duplex = d["duplex"]
    assert "error" not in rec.kinds(), [p for _, k, p in rec.events if k == "error"]
    check_duplex_section(duplex, session.frames)
    # the session clock ran all through the recording (it started before it and stopped after it)
    assert r.frames * SESSION_FRAME_S > 0.8 * r.speaker.size / REC_RATE

    # the VAD heard the question, through the canceller, while the assistant talked: one segment
    # as long as the question (the endpointer back-dates start and end to the speech itself)
    users = duplex["user_speech"]
    assistant = [(a["start"], a["end"]) for a in duplex["assistant_speech"]]
    print(f"user speech {users}; assistant speech {assistant}")
    assert len(users) == 1, users
    u0, u1 = users[0]
    assert u1 is not None and 1.6 < u1 - u0 < 2.8
    # on the session clock, the assistant's speech spanned the user's
    assert any(a0 < u0 and (a1 is None or a1 > u1) for a0, a1 in assistant), "the assistant paused for the user"

    # on the speaker: sound all through the question (wall clock of the two recordings)
    share = audible_while_user_speaks(r)
    print(f"speaker audible in {100 * share:.0f}% of the 10 ms blocks while the user spoke; underruns "
          f"{session.audio.speaker.underruns}, output underflows {session.audio.output_underflows}")
    assert share > MIN_SHARE, "the speaker went quiet while the user spoke: not full duplex"
    assert session.stats.barge_ins == 0


def test_echo_canceller_removes_the_assistant_but_not_the_user(pulse_server, moshi, echo_path):  # noqa: F811
    # laptop speakers: the assistant's voice reaches the mic ~15 dB down, all the time
    rec = LevelRecorder()
    session = start_session(moshi.executor, rec)
    try:
        assert session.aec is not None and not session.aec.bypass
        r = talk_over(pulse_server, session, seconds=6.5, lead_s=2.0)
        erle_reported = session.echo_reduction_db()
    finally:
        session.close()

    duplex = session.timeline.to_dict()["duplex"]
    assert "error" not in rec.kinds(), [p for _, k, p in rec.events if k == "error"]
    check_duplex_section(duplex, session.frames)
    # the second before the question holds only the echo: in the mic recording (what the app
    # captures) and, after cancellation, in the status level (what the VAD and the model hear);
    # then the middle of the question, the user talking over the echo
    echo_window = (r.speech_at - 1.2, r.speech_at - 0.2)
    echo_raw = recorded_level(r.mic, r.t_mic, *echo_window)
    echo_left = rec.level(*echo_window)
    user_window = (r.speech_at + 0.4, r.speech_at + SPEECH_S - 0.4)
    user_raw = recorded_level(r.mic, r.t_mic, *user_window)
    user = rec.level(*user_window)
    share = audible_while_user_speaks(r)
    print(f"echo {echo_raw:.1f} dBFS in the mic, {echo_left:.1f} dBFS after cancellation (reduction "
          f"{echo_raw - echo_left:.1f} dB; the session reports {erle_reported and round(erle_reported, 1)} dB); "
          f"user over the echo {user_raw:.1f} dBFS in the mic, {user:.1f} dBFS after cancellation; speaker audible {100 * share:.0f}% while the user spoke; "
          f"user speech segments (the VAD) {duplex['user_speech']}")
    assert echo_raw > -45, "no echo reached the mic: the test proves nothing"
    assert echo_raw - echo_left > 10, "the canceller did not remove the echo"
    assert user - echo_left > 15, "the canceller left the echo about as loud as the user"
    assert user > user_raw - 6, "the canceller suppressed the user with the echo"
    assert share > MIN_SHARE, "the speaker went quiet while the user spoke: not full duplex"


def test_live_command_runs_the_moshi_demo(pulse_server, moshi, tmp_path):  # noqa: F811
    # `moshi` made the demo in the module's cache; the subprocess inherits XDG_CACHE_HOME and PULSE_*
    timeline_path = tmp_path / "t.json"
    duration = 10.0
    cmd = [sys.executable, "-m", "omnidesk", "live", "--model", "moshi-demo", "--duration", str(duration),
           "--timeline", str(timeline_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    lines: list[str] = []
    listening = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("listening on"):
                listening.set()
        listening.set()  # it exited: stop waiting

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(lines)
        assert proc.poll() is None, "".join(lines)
        # the question comes ~2 s into the session's audio (its streams take 1-2 s to start)
        r = talk_over(pulse_server, seconds=7.5, lead_s=3.0)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out = "".join(lines)
    print(out)
    assert proc.returncode == 0, out
    assert "Moshi demo model" in out  # the demo notice
    assert "echo cancellation on" in out
    assert "the model hears: device 48000 Hz -> echo canceller 48000 Hz -> model 24000 Hz" in out
    m = re.search(r"^duplex: (\d+) frames of 80 ms; step p50", out, re.M)
    assert m, out
    frames = int(m.group(1))
    m = re.search(r"^user speech: (\d+) segment", out, re.M)
    assert m and int(m.group(1)) == 1, out
    assert re.search(r"^\d+ exchanges; barge-ins 0 confirmed, \d+ false; echo reduction ", out, re.M), out
    assert "error" not in out.lower(), out

    d = json.loads(timeline_path.read_text())
    validate(d)
    duplex = d["duplex"]
    assert duplex["errors"] == []
    assert len(duplex["step_ms"]) == frames
    # --duration is wall time on an Event; the frame count only has to show the model ran in real
    # time for most of it
    assert frames + duplex["dropped_frames"] >= 0.5 * duration / FRAME_S
    (u0, u1), = duplex["user_speech"]
    assert u1 is not None and 1.6 < u1 - u0 < 2.8
    assert any(overlaps(u0, u1, a["start"], a["end"]) for a in duplex["assistant_speech"])
    share = audible_while_user_speaks(r)
    print(f"speaker audible in {100 * share:.0f}% of the 10 ms blocks while the user spoke")
    assert share > MIN_SHARE, "the speaker went quiet while the user spoke: not full duplex"
