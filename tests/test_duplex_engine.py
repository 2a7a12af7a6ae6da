"""The full-duplex engine on a fake executor: the clock, segments, exchanges, stop, lag, failures.

The fake model is a small state machine that is easy to reason about: it
"hears" speech by the energy of its 24 kHz input frames and, two frames after
the user goes quiet, says something for ``reply_frames`` frames (a tone and a
non-pad text token per frame), then pads again.  That is enough to check the
engine's bookkeeping exactly; the real Moshi executor is tested against the
oracle elsewhere.
"""

import asyncio
import time

import numpy as np
import pytest

from omnidesk.engine.duplex import DuplexEngine, DuplexExecutor, DuplexStep, make_engine
from omnidesk.engine.engine import EngineConfig, TurnFailure
from omnidesk.engine.executor import stage
from omnidesk.engine.talk import Script, run_script
from omnidesk.engine.timeline import Timeline

PAD = 3


class FakeDuplex(DuplexExecutor):
    sample_rate_in = 24000
    sample_rate_out = 24000
    frame_samples_in = 1920
    frame_samples_out = 1920

    def __init__(self, reply_frames=6, slow_frames=(), fail_at=None):
        self.reply_frames = reply_frames
        self.slow_frames = set(slow_frames)
        self.fail_at = fail_at
        self.inputs = []
        self.text_tokens = []  # every step's, in order
        self.reset_conversation()

    def reset_conversation(self):
        self.heard_speech = False
        self.quiet = 0
        self.talking = 0
        self.frames = getattr(self, "frames", 0)
        self.resets = getattr(self, "resets", -1) + 1

    def step(self, frame):
        self.frames += 1
        self.inputs.append(frame.size)
        if self.frames in self.slow_frames:
            time.sleep(0.1)  # longer than the 80 ms frame
        if self.fail_at is not None and self.frames == self.fail_at:
            self.fail_at = None  # once
            with stage("encoder"):
                raise RuntimeError("injected duplex failure")
        loud = float(np.sqrt(np.mean(frame ** 2))) > 0.01
        if loud:
            self.heard_speech, self.quiet = True, 0
        elif self.heard_speech:
            self.quiet += 1
            if self.quiet == 2:
                self.talking, self.heard_speech = self.reply_frames, False
        if self.talking:
            self.talking -= 1
            t = np.arange(1920) / 24000
            self.text_tokens.append(100 + self.talking)
            return DuplexStep(audio=(0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), text_token=100 + self.talking)
        self.text_tokens.append(PAD)
        return DuplexStep(audio=np.zeros(1920, np.float32), text_token=PAD)

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def is_silent_text(self, token):
        return token is None or token == PAD


def _tone(seconds, rate=24000):
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def _audible_s(wave, block=240):
    """Seconds of 10 ms blocks louder than -30 dBFS."""
    n = wave.size // block * block
    rms = np.sqrt((wave[:n].reshape(-1, block).astype(np.float64) ** 2).mean(axis=1))
    return float((rms > 10 ** (-30 / 20)).sum() * block / 24000)


def _talk(ex, inputs, **script):
    timeline = Timeline(model={}, device="cpu")
    updates = []
    engine, speaker = asyncio.run(run_script(ex, Script(inputs, **script), EngineConfig(), timeline, realtime=False,
                                             on_update=lambda k, p: updates.append((k, p))))
    return engine, speaker, timeline, updates


def test_every_input_frame_gets_one_output_frame_played_at_once():
    ex = FakeDuplex()
    engine, speaker, timeline, updates = _talk(ex, [_tone(1.0), _tone(0.6)])
    assert isinstance(engine, DuplexEngine)
    # the 24 kHz input as it is, in whole 80 ms frames
    assert set(ex.inputs) == {1920}
    session_s = speaker.clock_samples / speaker.sample_rate
    assert len(engine.steps_ms) == ex.frames and abs(ex.frames * 0.08 - session_s) <= 0.16
    # the output covers the whole input plus the tail, and holds both replies
    out = speaker.recording()
    assert out.size == speaker.clock_samples and session_s > 0.3 + 1.0 + 0.6 + 2.0
    d = timeline.to_dict()["duplex"]
    assert len(d["user_speech"]) == 2 and all(e is not None for s in d["user_speech"] for e in s)
    assert len(d["assistant_speech"]) == 2 and d["assistant_speech"][0]["text"].startswith("w105")
    assert len(d["exchanges"]) == 2
    for x in d["exchanges"]:
        # the fake answers two frames after it stops hearing speech; the VAD's speech end and
        # frame boundaries put that 0.1-0.45 s after the user's last speech frame
        assert 0.1 <= x["delay_s"] <= 0.45 and x["assistant_speech_start"] > x["user_speech_end"]
    assert _audible_s(out) == pytest.approx(2 * 6 * 0.08, abs=0.05)
    assert d["late_frames"] == 0 and d["dropped_frames"] == 0 and len(d["step_ms"]) == ex.frames
    views = [p for k, p in updates if k == "duplex"]
    assert views and views[-1].frames == ex.frames and views[-1].delays_s == tuple(x["delay_s"] for x in d["exchanges"])
    # every step's text token; per assistant segment the tokens it said
    assert d["step_text_token_ids"] == ex.text_tokens
    assert [s["text_token_ids"] for s in d["assistant_speech"]] == [list(range(105, 99, -1))] * 2
    # the last utterance as the model heard it, at its rate (repeat last question plays it back)
    last, second = engine.last_utterance, _tone(0.6)
    start = int(np.flatnonzero(last)[0]) - 1  # the tone starts at sin(0) = 0
    np.testing.assert_array_equal(last[start:start + second.size], second)
    assert 0.15 <= start / 24000 <= 0.25  # after the detector's 200 ms of pre-roll


def test_stop_flushes_and_mutes_until_the_text_goes_quiet():
    ex = FakeDuplex(reply_frames=25)  # a 2-s reply
    engine, speaker, timeline, _ = _talk(ex, [_tone(0.8)], interrupt_after_s=0.4)
    d = timeline.to_dict()["duplex"]
    assert len(d["stops"]) == 1
    stop = d["stops"][0]
    assert stop["unmuted"] is not None and stop["unmuted"] > stop["t"]
    reply = d["assistant_speech"][0]
    assert reply["end"] - reply["start"] == pytest.approx(0.4, abs=0.09)  # cut ~0.4 s in
    assert _audible_s(speaker.recording()) < 0.6  # not the whole 2 s
    assert engine.stats.barge_ins == 1


def test_slow_steps_are_reported_not_hidden():
    ex = FakeDuplex(slow_frames={5, 6, 7})
    engine, _, timeline, _ = _talk(ex, [_tone(0.5)])
    d = timeline.to_dict()["duplex"]
    assert d["late_frames"] == 3
    assert sorted(d["step_ms"])[-3] >= 80.0


def test_lag_past_the_bound_drops_the_oldest_input_frames():
    async def go():
        ex = FakeDuplex()
        from omnidesk.engine.speaker import VirtualSpeaker
        from omnidesk.engine.vad import Endpointer, EnergyVAD

        engine = make_engine(ex, Endpointer(EnergyVAD(), sample_rate=16000), VirtualSpeaker(sample_rate=24000))
        engine.duplex_config.max_lag_s = 0.4  # 5 frames
        blocker = asyncio.Event()
        engine._task = asyncio.ensure_future(blocker.wait())  # the worker is "busy": frames pile up
        for i in range(40):  # 1.6 s of 24 kHz input = 20 model frames, nothing held back
            await engine.on_frame(np.zeros(960, np.float32), i * 0.04)
        assert len(engine._queue) == 5 and engine.dropped_frames == 15
        dropped = engine.dropped_frames
        blocker.set()
        await asyncio.sleep(0)
        engine._task = None
        await engine.on_frame(np.zeros(960, np.float32), 1.6)
        await engine.settle()
        engine.close()
        return engine, ex, dropped

    engine, ex, dropped = asyncio.run(go())
    assert ex.frames == 5 and engine.timeline.extra["duplex"]["dropped_frames"] == dropped


def test_a_failed_step_is_reported_once_and_the_stream_restarts():
    ex = FakeDuplex(fail_at=10)
    engine, speaker, timeline, updates = _talk(ex, [_tone(1.0)], stop_on_failure=False)
    errors = [p for k, p in updates if k == "error"]
    assert len(errors) == 1 and isinstance(errors[0], TurnFailure) and errors[0].stage == "encoder"
    assert "injected duplex failure" in str(errors[0])
    assert ex.resets == 1 and ex.frames > 20  # it went on after the reset
    assert timeline.to_dict()["duplex"]["errors"][0]["stage"] == "encoder"
    # talk stops at the failure (exit non-zero in the CLI)
    ex = FakeDuplex(fail_at=10)
    engine, _, _, _ = _talk(ex, [_tone(1.0)])
    assert engine.failure is not None and ex.frames == 10
