"""Qwen3-Omni on the live path: the demo model on real (virtual) audio devices, as test_live.py
runs Qwen2.5-Omni's: a question gets a spoken reply after it ends, and speech during the reply
interrupts it and rolls the conversation back to what was heard.  The engine, the audio layer and
these checks are the ones the other family uses; only the executor differs."""

from __future__ import annotations

import pytest

from audio_harness import pulse_server  # noqa: F401  (fixture)
from omnidesk.engine.timeline import validate
from test_live import audible_blocks, barge_in, check_interrupted, run_turn


@pytest.fixture(scope="module")
def executor():
    from omnidesk.models.qwen3_omni.demo import make_demo
    from omnidesk.models.qwen3_omni.executor import executor_for
    from omnidesk.models.qwen3_omni.loading import load_stack

    return executor_for(load_stack(make_demo(), device="cpu"))


def test_qwen3_question_gets_reply_after_it_ends(pulse_server, executor):  # noqa: F811
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor)
    turns = session.timeline.turns
    assert len(turns) == 1, [t.to_dict()["events"] for t in turns]
    turn = turns[0]
    validate(session.timeline.to_dict())
    assert not turn.interrupted and turn.codec_token_ids
    assert turn.user_speech_end < turn.endpoint <= turn.events["playback_start"]
    assert turn.played_audio_s == pytest.approx(turn.reply_audio_s, abs=0.05)
    loud = audible_blocks(audio)
    assert loud.sum() * 160 / 16000 > 0.8 * turn.reply_audio_s  # the reply reached the speaker


def test_qwen3_speech_during_reply_interrupts_it(pulse_server, executor):  # noqa: F811
    session, rec, audio, t_rec, marks = run_turn(pulse_server, executor, during_reply=barge_in(pulse_server),
                                                 rec_seconds=16.0)
    check_interrupted(session, audio, t_rec, marks)
