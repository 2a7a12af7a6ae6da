"""The live session end to end on real (virtual) audio devices: PortAudio duplex stream on a private
PulseAudio server, the demo model, webrtcvad endpointing, echo cancellation.

Speech goes into the ``omnidesk_mic`` null sink with ``pacat``; what the app plays is captured from
``omnidesk_speaker.monitor`` with ``parec``.  Everything runs in real time, so each test takes
10-20 s.  Times measured on the harness's wall clock are compared to the session's timeline only
through differences, with tolerances for the device latencies (about 0.1-0.3 s each way here).
"""

from __future__ import annotations

import csv
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from audio_harness import MIC, SPEAKER, pulse_server  # noqa: F401  (fixture)
from omnidesk.engine.timeline import validate

FIXTURES = Path(__file__).parent / "fixtures"
REC_RATE = 16000
BLOCK = REC_RATE // 100  # 10 ms analysis blocks of the speaker recording
AUDIBLE = 0.01  # peak above which a recorded block counts as sound (the demo plays at RMS 0.15)
# Speaker silent this soon after the interrupting speech reaches the microphone (found in a
# recording of the mic taken alongside the speaker's): capture latency + onset detection (one
# 40 ms frame) + output latency, 0.16-0.28 s here; 0.56-0.58 s with another CPU-heavy job on
# the two cores.  The margin is for such a machine: that playback pauses at the onset frame is
# checked on the timeline (check_interrupted), so a lost pause fails there.
BARGE_IN_STOP_BOUND_S = 0.9


def wav(name: str) -> np.ndarray:
    x, rate = sf.read(str(FIXTURES / name), dtype="float32")
    assert rate == REC_RATE
    return x


@pytest.fixture(scope="module")
def executor():
    from omnidesk.models.qwen2_5_omni.executor import executor_for
    from omnidesk.models.qwen2_5_omni.demo import make_demo
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    return executor_for(load_stack(make_demo(), device="cpu"))


class Recorder:
    """Collects the session's updates (called on the engine thread)."""

    def __init__(self):
        self.events: list[tuple[float, str, object]] = []
        self.lock = threading.Lock()

    def __call__(self, kind, payload):
        if kind == "status":
            return
        with self.lock:
            self.events.append((time.monotonic(), kind, payload))

    def kinds(self) -> list[str]:
        with self.lock:
            return [k for _, k, _ in self.events]

    def first(self, kind: str, pred=lambda p: True):
        with self.lock:
            return next(((t, p) for t, k, p in self.events if k == kind and pred(p)), None)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_session(executor, rec: Recorder, **settings):
    from omnidesk.audio.session import LiveSession, LiveSettings

    session = LiveSession(executor, LiveSettings(**settings), on_update=rec)
    session.start()
    # ALSA's pulse plugin takes 1-2 s before blocks flow steadily
    wait_for(lambda: session.frames >= 25, 15, "the microphone stream to run")
    return session


def audible_blocks(x: np.ndarray) -> np.ndarray:
    x = x[: x.size // BLOCK * BLOCK]
    return np.abs(x).reshape(-1, BLOCK).max(axis=1) > AUDIBLE


def playing(rec: Recorder):
    return rec.first("reply", lambda turn: turn.events.get("playback_start") is not None) is not None


def run_turn(pulse, executor, during_reply=None, rec_seconds=14.0, settle=True, **settings):
    """Play question.wav into the mic; optionally call ``during_reply(session)`` once the reply plays.
    Returns (session, recorder, speaker recording, wall time the recording started, wall times);
    the microphone recording is ``marks["mic"]``, its first sample at ``marks["t_mic"]``."""
    rec = Recorder()
    session = start_session(executor, rec, **settings)
    marks = {}

    def script():
        marks["question_start"] = time.monotonic()
        pulse.play_into_mic(wav("question.wav"), REC_RATE)
        marks["question_end"] = time.monotonic()
        if during_reply is not None:
            wait_for(lambda: playing(rec), 15, "the reply to start playing")
            marks["playing_seen"] = time.monotonic()
            during_reply(session, marks)

    try:
        audio, marks["mic"] = pulse.record(rec_seconds, rate=REC_RATE, during=script)
        t_rec, marks["t_mic"] = pulse.last_recording_start, pulse.last_mic_recording_start
        if settle:
            wait_for(lambda: session.engine.idle, 20, "the conversation to go idle")
    finally:
        session.close()
    return session, rec, audio, t_rec, marks


def test_question_gets_reply_after_it_ends(pulse_server, executor):
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor)
    turns = session.timeline.turns
    assert len(turns) == 1, [t.to_dict()["events"] for t in turns]
    turn = turns[0]
    validate(session.timeline.to_dict())
    assert not turn.interrupted
    ev = turn.events
    assert turn.user_speech_start < turn.user_speech_end < turn.endpoint <= ev["playback_start"]
    # the question lasts 2.2 s; the endpointer back-dates its start and end to the speech itself
    assert 1.6 < turn.user_speech_end - turn.user_speech_start < 2.8
    assert turn.played_audio_s == pytest.approx(turn.reply_audio_s, abs=0.05)
    # the recording: the reply is there, and it starts after the question ended
    loud = audible_blocks(audio)
    assert loud.any(), "nothing reached the speaker"
    onset_wall = t_rec + np.flatnonzero(loud)[0] * BLOCK / REC_RATE
    gap_wall = onset_wall - marks["question_end"]
    gap_timeline = ev["playback_start"] - turn.user_speech_end
    print(f"question end -> reply on the speaker: {gap_wall * 1000:.0f} ms (wall), "
          f"{gap_timeline * 1000:.0f} ms (timeline: speech end -> playback start)")
    print(f"underruns (20 ms blocks short of reply audio): {session.audio.speaker.underruns}, "
          f"PortAudio output underflows: {session.audio.output_underflows}, capture overflows: "
          f"{session.audio.capture_overflows + session.audio.input_overflows}")
    assert gap_wall > 0, "the reply started before the question had finished playing"
    # What the user hears, on the harness's recordings: the question's voice ending in the
    # microphone -> the reply's first sound on the speaker.  The timeline stamps the question with
    # PortAudio's ADC times (less the canceller's lag) and the reply with its DAC time, and looks
    # for the voice's end in the audio: it reports the same, within what its estimate of the
    # voice's end, the two recorders' anchors and the null sinks' monitors allow.
    question = wav("question.wav")
    at = find_in_recording(marks["mic"], marks["t_mic"], question, after=marks["question_start"])
    heard_end = at - np.flatnonzero(np.abs(question) > AUDIBLE)[0] / REC_RATE + voice_end(question)
    acoustic = onset_wall - heard_end
    print(f"voice-to-voice heard: {acoustic * 1000:.0f} ms; the timeline says {gap_timeline * 1000:.0f} ms")
    assert abs(acoustic - gap_timeline) < 0.08
    # about the reply's length of sound, not a click
    assert loud.sum() * BLOCK / REC_RATE > 0.8 * turn.reply_audio_s
    assert [k for k in rec.kinds() if k in ("turn", "done")] == ["turn", "done"]


def barge_in(pulse):
    def barge(session, marks):
        time.sleep(1.0)  # let a second of the reply play
        marks["barge_start"] = time.monotonic()
        pulse.play_into_mic(wav("interrupt.wav"), REC_RATE)
    return barge


def check_interrupted(session, audio, t_rec, marks, rec=None):
    turns = session.timeline.turns
    validate(session.timeline.to_dict())
    first = turns[0]
    assert first.interrupted, "the reply was not interrupted"
    b = first.barge_in
    assert b.onset <= b.confirmed <= b.playback_stopped
    # confirmation needs 300 ms of speech (the default barge_in_confirm_ms)
    assert b.confirmed - b.onset >= 0.28
    assert 0.3 < b.heard_audio_s <= first.reply_audio_s  # equal when a busy CPU had produced no more yet
    assert first.played_audio_s == b.heard_audio_s
    # playback paused at the onset frame, before the confirmation
    paused = first.extra["playback_paused"]
    assert b.onset < paused <= b.onset + 0.1 and paused < b.confirmed
    # rollback: the cache lost the unheard part of the reply
    assert b.thinker_cache_after < b.thinker_cache_before
    assert b.kept_text_tokens <= len(first.text_token_ids)
    assert session.stats.barge_ins == 1
    # the interruption became the next turn
    assert len(turns) >= 2 and turns[1].user_speech_start >= b.onset - 0.05
    # the recordings: the speaker went quiet soon after the interrupting speech reached the mic
    loud = audible_blocks(audio)
    speech_at = find_in_recording(marks["mic"], marks["t_mic"], wav("interrupt.wav"), after=marks["barge_start"])
    start = int(round((speech_at - t_rec) * REC_RATE / BLOCK))
    # first 300 ms of silence after the barge-in started
    run = 0
    stop_block = None
    for i in range(start, loud.size):
        run = 0 if loud[i] else run + 1
        if run == 30:
            stop_block = i - 29
            break
    assert stop_block is not None, "the speaker never went quiet after the barge-in"
    assert loud[start - 20:start].any(), "the reply was not playing when the barge-in started"
    stop_s = (stop_block - start) * BLOCK / REC_RATE
    print(f"barge-in stop time (interrupting speech in the mic -> speaker silent): {stop_s * 1000:.0f} ms "
          f"(pacat took {1000 * (speech_at - marks['barge_start']):.0f} ms to start it); timeline onset -> "
          f"confirmed {1000 * (b.confirmed - b.onset):.0f} ms, kept {b.kept_text_tokens} text tokens, "
          f"rolled back {b.rolled_back_tokens}; false barge-ins {session.stats.false_barge_ins}")
    if rec is not None:  # shown when it fails: where the time went
        for wall, kind, payload in rec.events:
            if kind == "state":
                print(f"  {payload.name} at {1000 * (wall - speech_at):+.0f} ms from the speech in the mic")
    assert stop_s < BARGE_IN_STOP_BOUND_S


def voice_end(clip: np.ndarray, drop_db: float = 30.0) -> float:
    """Where the voice in ``clip`` ends (s): the end of its last 10 ms block within ``drop_db`` of
    its speech level (the 90th percentile of the block levels), as the human turn set labels it."""
    x = clip[: clip.size // BLOCK * BLOCK].reshape(-1, BLOCK)
    level = 10 * np.log10(np.mean(x.astype(np.float64) ** 2, axis=1) + 1e-12)
    loud = np.flatnonzero(level >= np.percentile(level, 90) - drop_db)
    return (int(loud[-1]) + 1) * BLOCK / REC_RATE


def find_in_recording(recording: np.ndarray, t_start: float, clip: np.ndarray, after: float) -> float:
    """Wall time at which ``clip``'s first audible sample appears in ``recording`` (which starts at
    ``t_start``), searched from wall time ``after`` on.  Cross-correlation, so that other sound in
    the recording (the assistant's echo) does not move it."""
    first = int(np.flatnonzero(np.abs(clip) > AUDIBLE)[0])
    lo = max(0, int((after - t_start) * REC_RATE) - REC_RATE // 10)
    seg = recording[lo:lo + 3 * REC_RATE + clip.size]
    assert seg.size > clip.size, "the microphone recording ended before the interrupting speech"
    n = 1 << int(np.ceil(np.log2(seg.size + clip.size)))
    corr = np.fft.irfft(np.fft.rfft(seg, n) * np.conj(np.fft.rfft(clip, n)), n)[: seg.size - clip.size + 1]
    # normalise by the segment's energy under the clip so loud echo does not win
    energy = np.convolve(seg.astype(np.float64) ** 2, np.ones(clip.size), mode="valid")
    score = corr / np.sqrt(np.maximum(energy, 1e-12))
    lag = int(np.argmax(score))
    assert score[lag] > 0.5 * np.linalg.norm(clip), "the interrupting speech is not in the microphone recording"
    return t_start + (lo + lag + first) / REC_RATE


def test_speech_during_reply_interrupts_it(pulse_server, executor):
    # echo cancellation on (the default) with nothing leaking from the virtual speaker into the
    # virtual mic: the canceller must not mute the user (it did before its warm-up, see aec.py)
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor, during_reply=barge_in(pulse_server),
                                                 rec_seconds=16.0)
    check_interrupted(session, audio, t_rec, marks, rec)


def test_noise_burst_during_reply_does_not_interrupt(pulse_server, executor):
    def burst(session, marks):
        time.sleep(1.0)
        marks["burst_start"] = time.monotonic()
        pulse_server.play_into_mic(wav("noise_burst.wav"), REC_RATE)
        marks["burst_end"] = time.monotonic()

    # headphones: echo cancellation bypassed
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor, during_reply=burst, headphones=True)
    turns = session.timeline.turns
    assert len(turns) == 1
    turn = turns[0]
    assert not turn.interrupted
    assert session.stats.barge_ins == 0
    # the burst was heard as a possible barge-in (playback paused) and then let go
    assert session.stats.false_barge_ins >= 1
    assert "done" in rec.kinds()
    # playback resumed: the whole reply was played, and sound continues after the burst
    assert turn.played_audio_s == pytest.approx(turn.reply_audio_s, abs=0.05)
    loud = audible_blocks(audio)
    after = int(round((marks["burst_end"] + 0.6 - t_rec) * REC_RATE / BLOCK))
    assert loud[after:after + 50].mean() > 0.8, "playback did not resume after the noise burst"


@pytest.fixture
def echo_path(pulse_server):
    """Route the speaker back into the microphone like a laptop's own speakers: about 15 dB
    quieter (pulse volume 0.55 = -15.6 dB on its cubic scale), 20 ms of loopback buffer on top of
    the null sinks' own latency."""
    r = pulse_server.pactl("load-module", "module-loopback", f"source={SPEAKER}.monitor", f"sink={MIC}",
                           "latency_msec=20", "source_dont_move=true", "sink_dont_move=true")
    module = r.stdout.strip()
    deadline = time.monotonic() + 5
    index = None
    while index is None and time.monotonic() < deadline:
        for block in pulse_server.pactl("list", "sink-inputs").stdout.split("Sink Input #")[1:]:
            if f"Owner Module: {module}\n" in block:
                index = block.split()[0]
        time.sleep(0.05)
    assert index is not None, "loopback did not appear"
    pulse_server.pactl("set-sink-input-volume", index, "36045")  # 0.55 of 65536
    yield
    pulse_server.pactl("unload-module", module, check=False)


def test_echo_cancellation_keeps_the_assistant_from_interrupting_itself(pulse_server, executor, echo_path):
    # "Interrupting itself" = its own echo pausing playback (a suspected barge-in: the reply
    # stutters) or cutting the reply off (confirmed).  Which of the two the echo reaches depends on
    # the speaker->mic loop latency: playback pauses at the first speech frame, so the echo itself
    # stops one loop later, and it confirms only if it lasts barge_in_start_ms.  On this machine it
    # does a few times per reply; a CI machine with a shorter loop only stuttered.  Both count.
    on, rec_on, *_ = run_turn(pulse_server, executor)
    erle = on.echo_reduction_db()
    # the same with cancellation off ("headphones")
    # (it then goes on talking to its own echo, so do not wait for it to settle)
    off, rec_off, *_ = run_turn(pulse_server, executor, headphones=True, settle=False)
    on_pauses = on.stats.barge_ins + on.stats.false_barge_ins
    off_pauses = off.stats.barge_ins + off.stats.false_barge_ins
    print(f"echo reduction with cancellation on: {erle:.1f} dB; playback paused by the echo: "
          f"{on_pauses} times with cancellation ({on.stats.barge_ins} cut off), "
          f"{off_pauses} times without ({off.stats.barge_ins} cut off)")
    assert erle is not None and erle > 15
    assert on.stats.barge_ins == 0, "interrupted itself with echo cancellation on"
    assert not on.timeline.turns[0].interrupted
    # a stray frame of residual echo may pause it once; without cancellation it stutters throughout
    assert on_pauses <= 1, f"its echo paused the reply {on_pauses} times with echo cancellation on"
    assert off_pauses >= 3, "the echo did not disturb the reply without cancellation: the test proves nothing"


def test_barge_in_works_through_echo_cancellation(pulse_server, executor, echo_path):
    # laptop speakers: the user talks over the assistant's echo
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor, during_reply=barge_in(pulse_server),
                                                 rec_seconds=16.0)
    check_interrupted(session, audio, t_rec, marks, rec)


def test_live_command_on_virtual_devices(pulse_server, tmp_path):
    import subprocess
    import sys

    timeline_path = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "omnidesk", "live", "--model", "demo", "--turns", "1", "--duration", "60",
           "--timeline", str(timeline_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(8)  # model load + stream start
        pulse_server.play_into_mic(wav("question.wav"), REC_RATE)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "replies are noise" in out  # the demo notice
    assert "voice-to-voice" in out  # the latency header
    rows = [line for line in out.splitlines() if line.strip().startswith("1  ")]
    assert rows, out
    import json

    turns = json.loads(timeline_path.read_text())["turns"]
    assert len(turns) >= 1 and turns[0]["events"]["playback_start"] is not None


def test_missing_device_is_a_clear_error(pulse_server, executor):
    from omnidesk.audio.device import AudioDeviceError
    from omnidesk.audio.session import LiveSession, LiveSettings

    session = LiveSession(executor, LiveSettings(input_device="USB Headset 9000"))
    with pytest.raises(AudioDeviceError, match=r"microphone \(input\) 'USB Headset 9000' not found.*available: .*pulse"):
        session.start()
    assert session.engine is None  # nothing left running


def test_stream_that_stops_is_reported_and_restart_recovers(pulse_server, executor):
    rec = Recorder()
    session = start_session(executor, rec)
    try:
        # past the start-up phase (where a stream that dies is reopened quietly)
        wait_for(lambda: session.audio.callbacks > 80, 10, "the stream to run steadily")
        # the device goes away under the session (as when a USB microphone is unplugged)
        session.audio._in.abort()
        wait_for(lambda: rec.first("error") is not None, 10, "the error report")
        _, message = rec.first("error")
        assert "stopped" in message or "no audio" in message
        assert "Retry" in message
        # the retry path: the same conversation continues on fresh streams
        before = session.frames
        session.restart()
        wait_for(lambda: session.frames > before + 25, 15, "audio after the restart")
    finally:
        session.close()


def test_next_reply_waits_out_the_startup_gap_of_the_last(pulse_server, executor):
    """Adaptive playout delay: however fast this machine is, turn 2 waits exactly what turn 1's
    first 1.5 s of playback ran dry (capped at 0.3 s) before it starts playing."""
    rec = Recorder()
    session = start_session(executor, rec)
    try:
        for name in ("question.wav", "second_question.wav"):
            count = len(rec.kinds())
            pulse_server.play_into_mic(wav(name), REC_RATE)
            wait_for(lambda: "done" in rec.kinds()[count:], 30, f"the reply to {name}")
    finally:
        session.close()
    first, second = session.timeline.turns[:2]
    dry_ms = first.extra["startup_dry_ms"]
    delay_ms = min(300, dry_ms)
    print(f"turn 1 ran dry {dry_ms} ms in its first 1.5 s; turn 2: playout delay {delay_ms} ms, "
          f"ran dry {second.extra.get('startup_dry_ms')} ms")
    assert second.extra.get("playout_delay_ms", 0) == pytest.approx(delay_ms, abs=1)
    released = max(second.endpoint, second.events["first_audio_chunk"])
    assert second.events["playback_start"] >= released + delay_ms / 1000 - 0.05


def test_headphones_mode_runs_without_the_echo_canceller_library(pulse_server, executor, monkeypatch):
    from omnidesk.audio.aec import EchoCancellerUnavailable
    from omnidesk.audio.session import LiveSession, LiveSettings

    monkeypatch.setitem(sys.modules, "livekit", None)  # as if livekit were not installed
    with pytest.raises(EchoCancellerUnavailable, match="pip install livekit"):
        LiveSession(executor, LiveSettings()).start()
    session = LiveSession(executor, LiveSettings(headphones=True))
    session.start()
    try:
        assert session.aec is None
        wait_for(lambda: session.frames >= 25, 15, "the microphone stream to run")
    finally:
        session.close()


def test_a_pause_mid_sentence_is_waited_through_and_the_end_is_answered(pulse_server, executor):
    """Recorded human speech live (../shared/data/turns-human, read in place): a sentence cut at a
    word gap (turn_a05: "... with its"), 700 ms of the recording's own silence, then a finished
    sentence by the same speaker (turn_a20).  With the default end of turn (Smart Turn where it
    is installed) the pause is not answered; the finished sentence is, by the model."""
    from omnidesk.engine.smart_turn import SmartTurn

    human = Path(__file__).resolve().parents[2] / "shared" / "data" / "turns-human"
    if not (human / "labels.csv").is_file():
        pytest.skip(f"the recorded human turns are not here: {human}")
    if not SmartTurn.available():
        pytest.skip("Smart Turn is not installed (dev/setup.sh installs it)")
    labels = {r["file"]: r for r in csv.DictReader((human / "labels.csv").open(newline=""))}
    cut, rate = sf.read(str(human / "turn_a05.wav"), dtype="float32")
    finished, _ = sf.read(str(human / "turn_a20.wav"), dtype="float32")
    assert rate == REC_RATE
    cut = cut[: int((float(labels["turn_a05.wav"]["speech_end_s"]) + 0.7) * rate)]
    clip = np.concatenate([cut, finished])
    rec = Recorder()
    session = start_session(executor, rec, end_of_turn="auto")
    marks = {}

    def script():
        marks["start"] = time.monotonic()
        pulse_server.play_into_mic(clip, REC_RATE)
        marks["end"] = time.monotonic()

    try:
        audio, _ = pulse_server.record(clip.size / rate + 6.0, rate=REC_RATE, during=script)
        t_rec = pulse_server.last_recording_start
        wait_for(lambda: session.engine.idle and session.timeline.turns, 20, "the reply to finish")
    finally:
        session.close()
    turns = session.timeline.turns
    assert len(turns) == 1, [(t.user_speech_start, t.user_speech_end, t.endpoint, t.extra.get("end_of_turn"))
                             for t in turns]
    turn = turns[0]
    assert turn.extra["end_of_turn"]["ended_by"] == "model", turn.extra["end_of_turn"]
    # one turn over both parts: it began with the cut sentence and ended with the finished one
    assert turn.user_speech_end - turn.user_speech_start > cut.size / rate
    loud = audible_blocks(audio)
    assert loud.any(), "the finished sentence was not answered"
    onset_wall = t_rec + np.flatnonzero(loud)[0] * BLOCK / REC_RATE
    finished_end = marks["start"] + (cut.size / rate + float(labels["turn_a20.wav"]["speech_end_s"]))
    assert onset_wall > finished_end - 0.05, "a reply played before the finished sentence ended"
