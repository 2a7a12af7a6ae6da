"""The model on a server, on real (virtual) audio devices: `omnidesk live --server URL` and the live
session against the vLLM-Omni protocol double (tests/vllm_omni_double.py), as tests/test_live.py runs
the demo model: PortAudio on a private PulseAudio server (tests/audio_harness.py), speech played into
the ``omnidesk_mic`` null sink with ``pacat``, what the app plays captured from
``omnidesk_speaker.monitor`` with ``parec``.  Real time: each test takes 10-20 s.

Covered: a spoken question reaches the server as audio and its reply plays on the speaker, the
output naming the server (the user sees that audio leaves the machine); Ctrl-C in the middle of a
reply and closing the session in the middle of one (the server sees the disconnect, no reader
thread is left, nothing is logged).  Skipped where the PulseAudio harness cannot run.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import soundfile as sf

from audio_harness import pulse_server  # noqa: F401  (fixture)
from omnidesk.remote.frontend import PRIVACY_NOTE, connect
from test_live import BLOCK, REC_RATE, Recorder, audible_blocks, playing, start_session, wait_for, wav
from vllm_omni_double import DEFAULT_TEXT, VllmOmniDouble, slow_reply


class Live:
    """`omnidesk live ARGS` as a subprocess, its output read line by line as it comes (so a test
    can wait for "listening on" instead of guessing how long the start takes)."""

    def __init__(self, *argv):
        cmd = [sys.executable, "-m", "omnidesk", "live", *map(str, argv)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("listening on"):
                self.listening.set()

    def wait_listening(self) -> None:
        assert self.listening.wait(30), f"`omnidesk live` did not start listening:\n{self.output}"
        time.sleep(2.0)  # ALSA's pulse plugin takes 1-2 s before blocks flow steadily

    def finish(self, timeout: float = 60) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self._reader.join(timeout=10)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)


def user_audio(message: dict) -> tuple[np.ndarray, int]:
    url = message["content"][0]["audio_url"]["url"]
    assert url.startswith("data:audio/wav;base64,")
    return sf.read(io.BytesIO(base64.b64decode(url.split(",", 1)[1])), dtype="float32")


def reader_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "omnidesk-remote-stream"}


def test_live_with_a_server_on_virtual_devices(pulse_server, tmp_path):  # noqa: F811
    timeline_path = tmp_path / "t.json"
    with VllmOmniDouble() as double:
        live = Live("--server", double.url, "--end-of-turn", "fixed", "--turns", "1", "--duration", "60",
                    "--timeline", timeline_path)
        marks = {}

        def speak():
            pulse_server.play_into_mic(wav("question.wav"), REC_RATE)
            marks["question_end"] = time.monotonic()

        try:
            live.wait_listening()
            audio = pulse_server.record_speaker(12.0, rate=REC_RATE, during=speak)
            t_rec = pulse_server.last_recording_start
        finally:
            rc = live.finish()
        requests = list(double.requests)
    out = live.output
    assert rc == 0, out
    # what runs where, and that the voice leaves this machine
    assert f"model: the one served by {double.url}" in out
    assert f"connected: {double.model} on {double.url} (remote); {PRIVACY_NOTE.format(url=double.url)}" in out
    assert "voice-to-voice" in out  # the latency header
    assert [line for line in out.splitlines() if line.strip().startswith("1  ")], out
    assert "server + network: first byte" in out  # the turn's network share

    # the server heard the question: the request that was answered carries the user's audio
    answered = [r for r in requests if r.completed]
    assert len(answered) == 1, [(r.completed, r.disconnected) for r in requests]  # a preemptive start may be dropped
    message = answered[0].body["messages"][-1]
    assert message["role"] == "user"
    heard, rate = user_audio(message)
    print(f"the server got {heard.size / rate:.2f} s of audio, peak {np.abs(heard).max():.2f}; "
          f"{len(requests)} request(s)")
    assert rate == 16000 and 1.6 < heard.size / rate < 3.5  # the 2.2 s question, as the endpointer cut it
    assert np.abs(heard).max() > 0.05

    # its reply played on the speaker, after the question
    turn = json.loads(timeline_path.read_text())["turns"][0]
    assert turn["text"] == "".join(DEFAULT_TEXT) and turn["network"]["server"] == double.url
    assert turn["events"]["playback_start"] is not None
    loud = audible_blocks(audio)
    assert loud.any(), "nothing reached the speaker"
    onset = t_rec + np.flatnonzero(loud)[0] * BLOCK / REC_RATE
    assert onset > marks["question_end"], "sound on the speaker before the question had finished"
    assert loud.sum() * BLOCK / REC_RATE > 0.8 * turn["reply_audio_s"]  # the reply's length of sound, not a click


def test_ctrl_c_in_the_middle_of_a_reply_closes_its_stream(pulse_server):  # noqa: F811
    with VllmOmniDouble() as double:
        double.default = slow_reply()  # half a minute of reply: still streaming at Ctrl-C
        live = Live("--server", double.url, "--end-of-turn", "fixed", "--duration", "60")
        try:
            live.wait_listening()
            pulse_server.play_into_mic(wav("question.wav"), REC_RATE)

            def streaming():  # the latest request (a preemptive one may have been dropped) is well into its reply
                last = double.requests[-1] if double.requests else None
                return last is not None and last.chunks >= 20 and not last.gone.is_set()

            wait_for(streaming, 20, "the reply to stream")
            req = double.requests[-1]
            live.proc.send_signal(signal.SIGINT)
            assert req.wait_disconnected(5.0), "the server never saw the client hang up"
        finally:
            rc = live.finish(timeout=30)
    out = live.output
    assert rc == 0, out
    assert not req.completed
    assert "Traceback" not in out and "error: " not in out, out
    assert "1 turns; barge-ins 0 confirmed" in out, out


def test_closing_the_session_in_the_middle_of_a_reply_closes_its_stream(pulse_server, caplog,  # noqa: F811
                                                                        monkeypatch):
    # the window switching model or quitting, and `omnidesk live` ending, close the LiveSession:
    # its engine cancels the reply; the executor's end_session (LiveSession.close) aborts the stream
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    caplog.set_level(logging.WARNING)
    with VllmOmniDouble() as double:
        double.default = slow_reply()
        ex = connect(double.url).executor
        before = reader_threads()
        rec = Recorder()
        session = start_session(ex, rec, end_of_turn="fixed")
        try:
            pulse_server.play_into_mic(wav("question.wav"), REC_RATE)
            wait_for(lambda: playing(rec), 20, "the reply to start playing")
            wait_for(lambda: session.audio.speaker.playhead >= 0.5 * session.audio.speaker.sample_rate, 10,
                     "half a second of the reply to play")
        finally:
            session.close()
        left = [t for t in reader_threads() - before if t.is_alive()]  # close waited for the reader
        req = double.requests[-1]
        assert req.wait_disconnected(5.0), "the server never saw the client hang up"
    assert not req.completed and left == []
    assert ex.history == []  # the unfinished turn is forgotten: a restarted session goes on from before it
    noise = [r for r in caplog.records
             if r.exc_info or r.levelno >= logging.ERROR or r.name.startswith(("omnidesk.remote", "httpx", "httpcore"))]
    assert not raised and not noise, caplog.text
