"""The Moshi demo live, end to end on the private PulseAudio server: the full-duplex engine behind
:class:`~omnidesk.audio.session.LiveSession` (what the window runs) and ``omnidesk live``.

Full duplex means audio flows while the user speaks: the demo's random model talks nonstop, so the
virtual speaker must carry its voice all through the question played into the virtual microphone.
Echo cancellation is on (speakers mode) with the speaker looped back into the microphone
(``echo_path``, as laptop speakers), so the canceller has an echo to remove while both talk.

Timing checks compare recorded clocks only (the session's sample clock, the recordings' sample
counts), with loose bounds; nothing depends on how precisely a sleep wakes up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from audio_harness import pulse_server  # noqa: F401  (fixture)
from omnidesk.engine.timeline import validate
from test_live import (BLOCK, REC_RATE, Recorder, audible_blocks, echo_path,  # noqa: F401  (fixture)
                       find_in_recording, start_session, wav)

FRAME_S = 0.08  # one Moshi step per 80 ms of audio
SESSION_FRAME_S = 0.04  # LiveSession hands the engine 40 ms frames


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private XDG cache where the Moshi demo is made; torch threads restored after."""
    import torch

    root = tmp_path_factory.mktemp("xdg-moshi-live")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        mp.setenv("XDG_STATE_HOME", str(root / "state"))
        mp.setenv("HF_HOME", str(root / "hf"))
        yield root
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def moshi(cache):
    from omnidesk.models.families import load_model

    loaded = load_model("moshi-demo", "cpu")
    assert loaded.model_info.get("demo") and loaded.model_info.get("family") == "moshi"
    assert str(loaded.model_info["path"]).startswith(str(cache))  # never the user's cache
    return loaded


def speech_span(x: np.ndarray) -> tuple[int, int]:
    """First and last audible sample of a clip."""
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return int(loud[0]), int(loud[-1])


def overlaps(a0: float, a1: float | None, b0: float, b1: float | None) -> bool:
    inf = float("inf")
    return a0 < (inf if b1 is None else b1) and b0 < (inf if a1 is None else a1)


def test_moshi_talks_while_the_user_speaks_with_echo_cancellation(pulse_server, moshi, echo_path):  # noqa: F811
    from omnidesk.engine.duplex import DuplexEngine

    question = wav("question.wav")
    rec = Recorder()
    session = start_session(moshi.executor, rec)  # speakers mode: headphones=False
    marks = {}
    try:
        assert isinstance(session.engine, DuplexEngine)
        assert session.aec is not None and not session.aec.bypass, "echo cancellation is not on"
        frames_at_start = session.frames

        def script():
            time.sleep(1.0)  # the model is talking (and echoing) before the user starts
            marks["question_start"] = time.monotonic()
            pulse_server.play_into_mic(question, REC_RATE)

        speaker, mic = pulse_server.record(7.0, rate=REC_RATE, during=script)
        t_speaker, t_mic = pulse_server.last_recording_start, pulse_server.last_mic_recording_start
        erle = session.echo_reduction_db()
    finally:
        session.close()

    d = session.timeline.to_dict()
    validate(d)
    duplex = d["duplex"]
    kinds = rec.kinds()
    assert "error" not in kinds, [p for _, k, p in rec.events if k == "error"]
    assert duplex["errors"] == []

    # -- the engine stepped: about one step per 80 ms of session time (the session's sample clock)
    session_s = session.frames * SESSION_FRAME_S
    steps = len(duplex["step_ms"])
    expected = session_s / FRAME_S
    step_ms = np.asarray(duplex["step_ms"])
    print(f"session {session_s:.2f} s, {steps} steps (+{duplex['dropped_frames']} dropped) for {expected:.0f} "
          f"model frames; step p50 {np.percentile(step_ms, 50):.1f} ms, max {step_ms.max():.1f} ms, late "
          f"{duplex['late_frames']}, max lag {duplex['max_lag_s'] * 1000:.0f} ms; echo reduction "
          f"{erle if erle is None else round(erle, 1)} dB; user speech {duplex['user_speech']}; assistant "
          f"speech {[(s['start'], s['end']) for s in duplex['assistant_speech']]}")
    assert steps > 0
    assert 0.8 * expected - 3 <= steps + duplex["dropped_frames"] <= expected + 1
    assert duplex["dropped_frames"] <= 0.1 * expected, "the model fell far behind the microphone"
    # the session clock ran through the whole recording (it started before it and ended after it)
    recorded_s = speaker.size / REC_RATE
    assert (session.frames - frames_at_start) * SESSION_FRAME_S > 0.8 * recorded_s

    # -- the VAD heard the user, and the assistant's speech overlapped it on the session clock
    users = duplex["user_speech"]
    assert len(users) >= 1, "the VAD did not hear the question"
    assert any(e - s > 1.0 for s, e in users if e is not None) or users[-1][1] is None
    assert any(overlaps(u0, u1, a["start"], a["end"]) for u0, u1 in users for a in duplex["assistant_speech"]), \
        "the assistant never spoke while the user did"

    # -- on the speaker: sound all through the question, found in the mic recording (wall clock of
    #    the recordings, both anchored on their own sample counts)
    first, last = speech_span(question)
    q_at = find_in_recording(mic, t_mic, question, after=marks["question_start"])  # first audible sample
    q0 = int(round((q_at - t_speaker) * REC_RATE / BLOCK))
    q1 = q0 + (last - first) // BLOCK
    loud = audible_blocks(speaker)
    assert 0 <= q0 and q1 <= loud.size, "the speaker recording does not cover the question"
    during = loud[q0:q1].mean()
    print(f"speaker audible in {100 * during:.0f}% of the 10 ms blocks while the user spoke "
          f"({(q1 - q0) * BLOCK / REC_RATE:.2f} s); {100 * loud.mean():.0f}% over the whole recording; "
          f"speaker underruns {session.audio.speaker.underruns}, output underflows "
          f"{session.audio.output_underflows}")
    assert during > 0.8, "the speaker went quiet while the user spoke: not full duplex"

    # -- the echo canceller removed the assistant's echo from the microphone
    assert erle is not None and erle > 10, f"echo reduction {erle} dB"
    assert session.stats.barge_ins == 0  # nothing interrupted it


def test_live_command_runs_the_moshi_demo(pulse_server, moshi, echo_path, tmp_path):  # noqa: F811
    # `moshi` made the demo in the module's cache; the subprocess inherits XDG_CACHE_HOME and PULSE_*
    timeline_path = tmp_path / "t.json"
    duration = 8.0
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
        listening.set()  # exited: do not wait any longer

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(lines)
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.5)
        pulse_server.play_into_mic(wav("question.wav"), REC_RATE)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out = "".join(lines)
    print(out)
    assert proc.returncode == 0, out
    assert "echo cancellation on" in out
    assert "Moshi demo model" in out  # the demo notice
    m = re.search(r"^duplex: (\d+) frames of 80 ms; step p50", out, re.M)
    assert m, out
    frames = int(m.group(1))
    m = re.search(r"^user speech: (\d+) segment", out, re.M)
    assert m and int(m.group(1)) >= 1, out
    assert re.search(r"exchanges; barge-ins 0 confirmed, \d+ false; echo reduction [\d.]+ dB", out), out

    d = json.loads(timeline_path.read_text())
    validate(d)
    duplex = d["duplex"]
    assert duplex["errors"] == []
    assert len(duplex["step_ms"]) == frames
    # --duration is wall-clock time on an Event; the frames count only has to show the model ran
    # for most of it in real time
    assert frames + duplex["dropped_frames"] >= 0.5 * duration / FRAME_S
    assert len(duplex["user_speech"]) >= 1
