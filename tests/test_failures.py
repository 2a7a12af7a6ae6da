"""A failure in any stage ends its turn as failed, is reported once, and the conversation goes on.

Each case injects an exception into one stage of the second of three turns, at
its first call or part-way through the reply, on the real engine and demo
model.  Checked: the error reaches ``on_update`` once and soon (no hang), the
timeline records it (stage + message) and stays valid, the third turn gets a
reply, and the thinker cache then equals a fresh one-shot prefill of the kept
history (turns one and three: the failed turn left nothing behind).
"""

import asyncio
import time

import numpy as np
import pytest
import torch

from omnidesk.engine.engine import EngineConfig, TurnFailure
from omnidesk.models.qwen2_5_omni.executor import executor_for
from omnidesk.engine.speaker import VirtualSpeaker
from omnidesk.engine.talk import Script, run_script
from omnidesk.engine.timeline import Timeline, validate
from omnidesk.models.qwen2_5_omni.bigvgan import BigVGAN
from omnidesk.features import log_mel
from support import demo_dir, stack  # noqa: F401  (fixtures: the Qwen2.5-Omni demo, once per module)

FRAME = 640  # 40 ms at 16 kHz: the scripted microphone pads each utterance to whole frames
ERROR_WITHIN_S = 5.0  # from the injected exception to the "error" update; a hang would be minutes


class Injector:
    """Raises on the ``nth`` qualifying call made while the timeline is at turn ``turn``."""

    def __init__(self, timeline: Timeline, turn: int, nth: int, when=None):
        self.timeline, self.turn, self.nth, self.when = timeline, turn, nth, when
        self.calls = 0
        self.raised_at: float | None = None

    def check(self, *args) -> None:
        if self.raised_at is not None or len(self.timeline.turns) != self.turn:
            return
        if self.when is not None and not self.when(*args):
            return
        self.calls += 1
        if self.calls == self.nth:
            self.raised_at = time.monotonic()
            raise RuntimeError(f"injected failure (call {self.nth})")

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.check(*args)
            return fn(*args, **kwargs)
        return wrapped


def _padded(wave: np.ndarray) -> np.ndarray:
    return np.concatenate([wave, np.zeros((-wave.size) % FRAME, np.float32)])


def _conversation(stack, speech_like, patch, config=None, on_update=None):
    """Three no-VAD turns (1.0 s, 2.6 s, 1.2 s) with ``patch(timeline)`` armed; returns what happened."""
    waves = [_padded(speech_like(s, seed=50 + i).numpy().astype(np.float32)) for i, s in enumerate((1.0, 2.6, 1.2))]
    ex = executor_for(stack, greedy=True, max_text_tokens=12, max_codec_tokens=120)
    timeline = Timeline(model={}, device="cpu")
    injector = patch(timeline)
    updates = []

    def record(kind, payload):
        updates.append((time.monotonic(), kind, payload))
        if on_update is not None:
            on_update(kind, payload)

    engine, speaker = asyncio.run(run_script(ex, Script(waves, no_vad=True, stop_on_failure=False),
                                             config or EngineConfig(), timeline, realtime=False, on_update=record))
    return ex, waves, timeline, injector, updates, engine


def _assert_failed_then_recovered(stack, ex, waves, timeline, injector, updates, engine, stage,
                                  expect="injected failure"):
    errors = [(t, p) for t, kind, p in updates if kind == "error"]
    assert len(errors) == 1, f"expected one error update, got {[str(p) for _, p in errors]}"
    t_error, failure = errors[0]
    assert isinstance(failure, TurnFailure) and failure.stage == stage and failure.conversation_kept
    assert f"failed in the {stage}" in str(failure) and expect in str(failure)
    if injector is not None:
        assert injector.raised_at is not None
        assert t_error - injector.raised_at < ERROR_WITHIN_S
        print(f"{stage}: error update {1000 * (t_error - injector.raised_at):.1f} ms after the exception")
    assert engine.failure is failure and engine.stats.failed_turns == 1
    assert len(timeline.turns) == 3
    first, failed, third = timeline.turns
    assert "error" not in first.extra and "error" not in third.extra
    record = failed.extra["error"]
    assert record["stage"] == stage and expect in record["message"] and record["t"] >= 0
    assert first.events["reply_done"] is not None and third.events["reply_done"] is not None
    assert third.codec_token_ids and third.reply_audio_s > 0 and third.played_audio_s > 0
    validate(timeline.to_dict())

    # the failed turn left nothing behind: the cache equals a fresh prefill of turns one and three
    ids = torch.tensor(ex.ids)
    audio_id = stack.config.thinker.audio_token_id
    with torch.inference_mode():
        audio = torch.cat([stack.thinker.audio_encoder(log_mel(torch.from_numpy(w), stack.features))
                           for w in (waves[0], waves[2])])
        assert int((ids == audio_id).sum()) == audio.shape[0]
        fresh = stack.thinker.new_cache(len(ex.ids) + 8)
        hidden = stack.thinker(stack.thinker.embed(ids, audio), fresh)
        diff = (stack.thinker.logits(hidden[-1]) - stack.thinker.logits(ex._last_hidden)).abs().max()
    assert diff <= 1e-4, f"cache differs from a fresh prefill of the kept history by {diff}"


# stage, where the exception is raised, the call it fails on, which calls count
CASES = [
    ("encoder", "encoder", 1, None),  # while the user speaks: the first 2-s block
    ("encoder", "encoder", 2, None),  # at the endpoint: the tail block, in the reply's first step
    ("thinker", "thinker", 1, None),  # the turn's header prefill, when the user starts speaking
    ("thinker", "thinker.forward_static", 5, None),  # the 5th reply token (a decode step)
    ("talker", "talker", 1, None),  # the talker's prefill: it reads the turn's first block while the user speaks
    ("talker", "talker.forward_static", 10, None),  # mid-reply (a decode step)
    ("vocoder", "bigvgan", 1, None),  # the first audio chunk
    ("vocoder", "bigvgan", 2, None),  # the second chunk, while the first plays
    ("speaker", "speaker", 1, None),  # handing the first chunk to the speaker
    ("speaker", "speaker", 3, None),  # mid-reply
]


@pytest.mark.parametrize("stage,where,nth,when", CASES, ids=[f"{c[0]}-call{c[2]}" for c in CASES])
def test_a_failed_stage_ends_its_turn_and_the_next_turn_works(stack, speech_like, monkeypatch, stage, where, nth, when):
    def patch(timeline):
        inj = Injector(timeline, turn=2, nth=nth, when=when)
        if where == "encoder":
            enc = stack.thinker.audio_encoder
            monkeypatch.setattr(enc, "encode_block", inj.wrap(enc.encode_block))
        elif where.split(".")[0] in ("thinker", "talker"):
            module, _, method = where.partition(".")
            module, method = getattr(stack, module), method or "forward"
            monkeypatch.setattr(module, method, inj.wrap(getattr(module, method)))
        elif where == "bigvgan":
            monkeypatch.setattr(BigVGAN, "forward", inj.wrap(BigVGAN.forward))
        elif where == "speaker":
            original = VirtualSpeaker.write
            monkeypatch.setattr(VirtualSpeaker, "write", lambda self, chunk: (inj.check(), original(self, chunk))[1])
        return inj

    result = _conversation(stack, speech_like, patch)
    _assert_failed_then_recovered(stack, *result, stage=stage)


@pytest.mark.parametrize("where", ["thinker", "talker"])
def test_nan_logits_end_the_turn_in_one_line_and_the_next_turn_works(stack, speech_like, monkeypatch, where):
    """Non-finite logits (a weight that overflowed, a damaged tensor the loader did not see) in the middle
    of turn 2's reply: the step's token says so, the turn ends with one error naming the stage, and turn
    3 is answered from a cache holding turns 1 and 3 only."""
    calls = []

    def patch(timeline):
        head = stack.thinker.lm_head if where == "thinker" else stack.talker.codec_head
        original = head.forward

        def poisoned(x):
            out = original(x)
            if len(timeline.turns) == 2 and (x.dim() == 1 or x.shape[0] == 1):  # one position, in turn 2
                calls.append(1)
                if len(calls) >= 5:
                    return out * float("nan")
            return out

        monkeypatch.setattr(head, "forward", poisoned)

    result = _conversation(stack, speech_like, patch)
    _assert_failed_then_recovered(stack, *result, stage=where, expect="produced NaN or Inf values")


def test_a_missing_voice_fails_the_turn_and_the_next_turn_works(stack, speech_like):
    config = EngineConfig()
    turns = []

    def on_turn(kind, payload):  # turn 2 asks for a voice the checkpoint does not have
        if kind == "turn":
            turns.append(payload)
            config.voice = "Nobody" if len(turns) == 2 else None

    result = _conversation(stack, speech_like, lambda timeline: None, config=config, on_update=on_turn)
    _assert_failed_then_recovered(stack, *result, stage="voice", expect="'Nobody' is not in")
    failure = result[-1].failure
    assert "spk_dict.pt" in failure.message and "Chelsie" in failure.message


def test_talk_exits_non_zero_soon_after_a_vocoder_failure_with_the_timeline_so_far(
        demo_dir, speech_like, tmp_path, monkeypatch, capsys):
    import json

    import soundfile as sf

    from omnidesk.cli import main

    question = tmp_path / "q.wav"
    sf.write(question, speech_like(1.2, seed=4).numpy(), 16000)
    raised, calls = [], []
    original = BigVGAN.forward

    def failing(self, *args, **kwargs):  # the first reply's second chunk, while the first one plays
        calls.append(1)
        if len(calls) == 2:
            raised.append(time.monotonic())
            raise RuntimeError("injected vocoder failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BigVGAN, "forward", failing)
    out, timeline = tmp_path / "out.wav", tmp_path / "t.json"
    code = main(["talk", "--model", str(demo_dir), "--no-vad", "--greedy", "--fast", "--input", str(question),
                 "--input", str(question), "--input", str(question), "--max-codec-tokens", "60",
                 "--output", str(out), "--timeline", str(timeline)])
    returned = time.monotonic()
    err = capsys.readouterr().err
    assert code != 0
    assert "error: the reply failed in the vocoder" in err and "injected vocoder failure" in err
    assert raised and returned - raised[0] < ERROR_WITHIN_S
    data = json.loads(timeline.read_text())
    assert [("error" in t) for t in data["turns"]] == [True]  # the script stopped at the failure
    assert data["turns"][0]["error"]["stage"] == "vocoder" and out.is_file()
