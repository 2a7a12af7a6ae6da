"""The streaming engine end to end: talk CLI, barge-in, preemptive discard, 200 random interruptions."""

import asyncio
import gc
import json
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omnidesk.engine.engine import Engine, EngineConfig, TurnState
from omnidesk.engine.reply_pipeline import ReplyRun
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor
from omnidesk.engine.speaker import VirtualSpeaker
from omnidesk.engine.talk import Script, ScriptedEndpointer, run_script
from omnidesk.engine.timeline import EVENT_NAMES, Timeline, validate
from omnidesk.engine.vad import EndpointerConfig
from support import demo_dir, stack  # noqa: F401  (fixtures: the Qwen2.5-Omni demo, once per module)


def _wave(speech_like, seconds, seed=0):
    return speech_like(seconds, seed=seed).numpy().astype(np.float32)


def _executor(stack, **kw):
    return QwenOmniExecutor(stack, max_reply_tokens=kw.pop("max_reply_tokens", 24),
                            max_codec_tokens=kw.pop("max_codec_tokens", 150), **kw)


def test_talk_cli_writes_audio_and_a_complete_timeline(tmp_path, demo_dir):
    # real (synthetic) speech: `talk` detects it with webrtcvad, as the app does
    q = Path(__file__).parent / "fixtures" / "question.wav"
    out, tl = tmp_path / "out.wav", tmp_path / "t.json"
    env = {"XDG_CACHE_HOME": str(demo_dir.parent.parent / "cache"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "omnidesk", "talk", "--model", str(demo_dir), "--input", str(q),
                          "--output", str(out), "--timeline", str(tl), "--fast", "--greedy"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "noise" in res.stdout and "voice-to-voice" in res.stdout
    d = json.loads(tl.read_text())
    validate(d)
    turn = d["turns"][0]
    assert all(turn["events"][name] is not None for name in EVENT_NAMES), turn["events"]
    assert turn["user_speech_start"] < turn["user_speech_end"] < turn["endpoint"]
    assert turn["endpoint"] <= turn["events"]["playback_start"] + 1e-9  # held until the endpoint
    assert turn["played_audio_s"] == pytest.approx(turn["reply_audio_s"])
    audio, rate = sf.read(str(out))
    assert rate == 24000 and audio.size / rate >= turn["played_audio_s"]


def _run(stack, script, config=None, **kw):
    timeline = Timeline(model={}, device="cpu")
    ex = _executor(stack, **kw)
    engine, speaker = asyncio.run(run_script(ex, script, config or EngineConfig(), timeline, realtime=False))
    return engine, speaker, timeline, ex


def test_barge_in_cuts_the_reply_and_rolls_back(stack, speech_like):
    q, cut = _wave(speech_like, 1.2, 1), _wave(speech_like, 0.8, 2)
    engine, speaker, timeline, ex = _run(stack, Script([q], barge_in=(0.6, cut)))
    first = timeline.turns[0]
    assert first.interrupted and len(timeline.turns) == 2
    b = first.barge_in
    assert b.onset <= b.confirmed <= b.playback_stopped
    assert b.thinker_cache_after == b.thinker_cache_before - b.rolled_back_tokens
    assert first.played_audio_s == pytest.approx(b.heard_audio_s)
    assert 0.4 < b.heard_audio_s < 1.0
    # the speaker goes silent within the fade after the stop and stays silent until the next reply
    rec = speaker.recording()
    stop = int(round(b.playback_stopped * 24000)) + int(0.01 * 24000)
    nxt = int(round(timeline.turns[1].events["playback_start"] * 24000))
    assert nxt > stop and np.abs(rec[stop:nxt]).max() == 0.0
    assert np.abs(rec[int(first.events["playback_start"] * 24000):int(b.onset * 24000)]).max() > 0.05


def test_interrupt_after_cuts_the_reply_that_long_into_playback(stack, speech_like):
    # "interrupt after X ms" (the window's button, `talk --interrupt-after`): the stop-button path
    # at a reproducible point of the reply
    q = _wave(speech_like, 1.2, 1)
    engine, speaker, timeline, ex = _run(stack, Script([q], interrupt_after_s=0.6))
    turn = timeline.turns[0]
    assert turn.interrupted and engine.stats.barge_ins == 1 and engine.interrupt_after_s is None
    b = turn.barge_in
    started = turn.events["playback_start"]
    assert started + 0.6 <= b.onset == b.confirmed <= started + 0.6 + 0.04  # within the frame it fell due
    assert turn.played_audio_s == pytest.approx(b.heard_audio_s)
    assert 0.5 < b.heard_audio_s <= 0.64
    assert b.thinker_cache_after == b.thinker_cache_before - b.rolled_back_tokens


def test_preemptive_start_discarded_when_the_user_goes_on(stack, speech_like):
    a, b = _wave(speech_like, 0.9, 3), _wave(speech_like, 0.8, 4)
    gap = np.zeros(int(0.24 * 16000), np.float32)  # a pause long enough to preempt, short of the endpoint
    utterance = np.concatenate([a, gap, b])
    e1, _, t1, _ = _run(stack, Script([utterance]))
    e2, _, t2, _ = _run(stack, Script([utterance]), EngineConfig(preemptive=False))
    assert e1.stats.preemptive_discarded >= 1 and e1.stats.preemptive_used == 1
    assert t1.turns[0].prompt_token_ids == t2.turns[0].prompt_token_ids
    assert t1.turns[0].text_token_ids == t2.turns[0].text_token_ids
    assert t1.turns[0].codec_token_ids == t2.turns[0].codec_token_ids


def test_reply_steps_run_in_bursts_that_keep_the_thinker_lead_and_book_every_token(stack, speech_like):
    """The worker runs steps in bursts (reply_pipeline's module docstring): the thinker still leads
    the talker by at most ``thinker_lead`` tokens after every step, every token made reaches the
    turn, and a burst that made audio ended there."""
    ex = _executor(stack, max_reply_tokens=30, max_codec_tokens=80)
    lead, ahead, bursts = [0], [], []
    thinker_step, talker_step, burst = ex.thinker_step, ex.talker_step, Engine._pipeline_burst

    def spy_thinker():
        token = thinker_step()
        lead[0] += token is not None
        ahead.append(lead[0])
        return token

    def spy_talker():
        token = talker_step()
        lead[0] -= token is not None
        return token

    def spy_burst(self, reply, text_ahead):
        assert text_ahead == lead[0]  # the loop's count agrees with what the steps made
        out = burst(self, reply, text_ahead)
        bursts.append(out)
        return out

    ex.thinker_step, ex.talker_step = spy_thinker, spy_talker
    Engine._pipeline_burst = spy_burst
    try:
        timeline = Timeline(model={}, device="cpu")
        engine, _ = asyncio.run(run_script(ex, Script([_wave(speech_like, 1.0, 5)]), EngineConfig(thinker_lead=3),
                                           timeline, realtime=False))
    finally:
        Engine._pipeline_burst = burst
    turn = timeline.turns[0]
    assert max(ahead) <= 3 and len(turn.text_token_ids) > 3  # the lead was reached and held
    assert turn.text_token_ids == [t for b in bursts for t in b.text_tokens]
    assert turn.codec_token_ids == [t for b in bursts for t in b.codec_tokens]
    assert engine.stats.steps == sum(b.steps for b in bursts) > len(bursts)  # several steps per hand-off
    assert sum(c.size for b in bursts for c in b.audio) == round(turn.reply_audio_s * ex.sample_rate_out)
    assert turn.events["first_text_token"] <= turn.events["first_codec_token"] <= turn.events["first_audio_chunk"]


def test_a_stopped_reply_ends_its_burst_after_one_step(stack):
    async def main():
        ex = _executor(stack)
        engine = Engine(ex, ScriptedEndpointer(), VirtualSpeaker(24000))
        ex.begin_user_turn()
        ex.add_user_audio(np.zeros(16000, np.float32))
        ex.end_user_turn()
        ex.start_reply(None, 0)
        engine._turn = engine.timeline.new_turn()
        reply = ReplyRun(turn=engine._turn, held=True)
        reply.cancel()
        out = engine._pipeline_burst(reply, 0)
        engine.close()
        return out

    assert asyncio.run(main()).steps == 1


def test_200_random_interruptions(stack, speech_like):
    """Interrupt at random moments (during prefill, before and after the first chunk, while
    playing): nothing keeps running, the cache holds only the kept history, buffers stay bounded."""
    rng = random.Random(1234)
    utterances = [_wave(speech_like, 0.36 + 0.04 * i, seed=20 + i) for i in range(4)]

    async def main():
        ex = _executor(stack, capacity=2048, max_codec_tokens=48)
        # the invariants do not depend on the ODE's accuracy: fewer flow-matching steps keep the
        # 200 turns quick (restored below; the stack is shared by this module's tests)
        steps, ex.vocoder.num_steps = ex.vocoder.num_steps, 3
        endpointer = ScriptedEndpointer()
        speaker = VirtualSpeaker(capacity_s=3.0, record=False)
        engine = Engine(ex, endpointer, speaker, EngineConfig(preemptive=False, max_audio_ahead_s=0.5), Timeline(model={}, device="cpu"))
        t = 0.0
        silence = np.zeros(640, np.float32)
        phases = {"prefill": 0, "before_audio": 0, "playing": 0}
        sizes = []
        for i in range(200):
            if i % 10 == 0:
                ex.reset_conversation()
            history = ex.thinker_cache_length
            endpointer.begin()
            for j in range(0, utterances[i % 4].size, 640):
                speaker.tick()
                await engine.on_frame(utterances[i % 4][j:j + 640], t)
                t += 0.04
            endpointer.end()
            speaker.tick()
            await engine.on_frame(silence, t)
            t += 0.04
            # let the reply run a random while: nothing, a few loop turns, or some frames
            for _ in range(rng.choice([0, 0, 1, 2, 4, 8, 16])):
                speaker.tick()
                await engine.on_frame(silence, t)
                t += 0.04
                await engine.settle()
            turn = engine.timeline.turns[-1]
            phase = ("prefill" if turn.events["prefill_done"] is None else
                     "before_audio" if turn.events["playback_start"] is None else "playing")
            phases[phase] += 1
            assert speaker.buffered_samples <= speaker.capacity
            if engine._reply is None:  # the reply already ended: nothing to interrupt
                continue
            await engine.interrupt(onset=t, confirmed=t)
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
            running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task() and not task.done()]
            assert running == []
            assert engine.state == TurnState.LISTENING and engine._reply is None and ex._reply is None
            assert speaker.buffered_samples <= int(speaker.fade_ms * speaker.sample_rate // 1000)  # the fade-out tail
            b = turn.barge_in
            assert b is not None and b.thinker_cache_after == ex.thinker_cache_length == len(ex.ids)
            assert b.thinker_cache_after == history + len(turn.prompt_token_ids) + b.kept_text_tokens
            assert ex.talker_cache.length == ex.talker_context
            if i == 150:  # measure the last 50 interruptions (tracemalloc slows every allocation)
                gc.collect()
                tracemalloc.start()
                sizes.append(tracemalloc.get_traced_memory()[0])
        gc.collect()
        sizes.append(tracemalloc.get_traced_memory()[0])
        engine.close()
        ex.vocoder.num_steps = steps
        return phases, sizes

    try:
        phases, sizes = asyncio.run(main())
    finally:
        tracemalloc.stop()
    assert all(n > 5 for n in phases.values()), phases
    # 50 more turns of timeline records is all that may grow (a few KB each)
    assert sizes[1] - sizes[0] < 1e6, sizes


def test_engine_thread_runs_the_engine_off_the_caller_thread(stack, speech_like):
    """The app's arrangement: the engine's loop on its own thread; callers schedule work on it."""
    import threading

    from omnidesk.engine.engine import EngineThread
    from omnidesk.engine.vad import Endpointer, EnergyVAD

    thread = EngineThread()
    try:
        async def build_and_listen():
            ex = _executor(stack)
            engine = Engine(ex, Endpointer(EnergyVAD()), VirtualSpeaker(record=False))
            wave = _wave(speech_like, 0.6, 9)
            for i in range(0, wave.size, 640):
                await engine.on_frame(wave[i:i + 640], i / 16000)
            engine.close()
            return threading.current_thread().name, engine.state, len(engine.timeline.turns)

        name, state, turns = thread.call(build_and_listen()).result(timeout=120)
        assert name == "omnidesk-engine"
        assert state == TurnState.USER_SPEAKING and turns == 1
    finally:
        thread.stop()


def test_stop_during_a_held_preemptive_reply_then_the_endpoint_listens_again(stack, speech_like):
    """Stop pressed in the pause before the endpoint (the reply is computing, held): the endpoint
    must not wait for a reply that no longer exists; the next utterance gets its reply."""
    from omnidesk.engine.vad import Endpointer, EnergyVAD

    async def go():
        ex = _executor(stack)
        speaker = VirtualSpeaker(sample_rate=ex.sample_rate_out, block=960)
        engine = Engine(ex, Endpointer(EnergyVAD(), sample_rate=16000), speaker, EngineConfig(),
                        Timeline(model={}, device="cpu"))
        t = 0.0

        async def feed(wave):
            nonlocal t
            for i in range(0, wave.size - 639, 640):
                speaker.tick()
                await engine.on_frame(wave[i:i + 640], t)
                await engine.settle()
                t += 0.04

        await feed(_wave(speech_like, 1.0, 3))
        silence = np.zeros(640, np.float32)
        while engine.state != TurnState.PREEMPTING:
            await feed(silence)
        await engine.interrupt(onset=engine.now, confirmed=engine.now)  # the Stop button
        await feed(np.zeros(640 * 15, np.float32))  # past the endpoint
        stuck_state = engine.state
        await feed(_wave(speech_like, 1.0, 4))
        for _ in range(400):
            if engine.idle and len(engine.timeline.turns) == 2:
                break
            await feed(silence)
        engine.close()
        return stuck_state, engine

    stuck_state, engine = asyncio.run(go())
    assert stuck_state == TurnState.LISTENING
    first, second = engine.timeline.turns
    assert first.interrupted and second.events["reply_done"] is not None and second.codec_token_ids


class _AlwaysJudge:
    """An end-of-turn judge with one fixed verdict, ready at once (as ``blocking`` scoring is)."""

    name = "always"
    window_s = 8.0
    pending = False

    def __init__(self, p):
        self.p, self.seen = p, []

    def submit(self, audio):
        self.seen.append(audio.size)
        self._ready = (self.p, 2.0)

    def poll(self):
        ready, self._ready = getattr(self, "_ready", None), None
        return ready

    def discard(self):
        self._ready = None

    def score_after(self, event):
        self.after = event


def test_a_complete_verdict_plays_the_preemptive_reply_sooner_and_the_timeline_says_why(stack, speech_like):
    wave = _wave(speech_like, 1.2, 5)
    runs = {}
    for name, judge in (("fixed", None), ("model", _AlwaysJudge(0.95))):
        timeline = Timeline(model={}, device="cpu")
        # The energy detector here holds no speech past the voice, so the first look is set after
        # the preempt point, as it comes with webrtcvad (its 120 ms count from a last speech frame
        # ~85 ms past the voice): the reply then starts at the pause either way, on the same audio.
        look = EndpointerConfig(turn_min_silence_ms=EndpointerConfig.preempt_silence_ms + 10)
        asyncio.run(run_script(_executor(stack), Script([wave]), EngineConfig(), timeline, realtime=False,
                               judge=judge, endpointer_config=look))
        validate(timeline.to_dict())
        runs[name] = timeline.turns[0]
    fixed, model = runs["fixed"], runs["model"]
    assert fixed.extra["end_of_turn"] == {"detector": "fixed", "ended_by": "silence", "scores": []}
    record = model.extra["end_of_turn"]
    assert record["detector"] == "always" and record["ended_by"] == "model"
    assert [s["decision"] for s in record["scores"]] == ["complete"] and record["scores"][0]["cpu_ms"] == 2.0
    # the turn ended at the first score (110 ms of silence: the third 40 ms frame), not after 400 ms,
    # and the reply is the same one
    assert model.endpoint - model.user_speech_end == pytest.approx(0.12, abs=0.045)
    assert fixed.endpoint - fixed.user_speech_end == pytest.approx(0.40, abs=0.045)
    assert model.prompt_token_ids == fixed.prompt_token_ids and model.codec_token_ids == fixed.codec_token_ids
    v2v = {k: t.events["playback_start"] - t.user_speech_end for k, t in runs.items()}
    assert v2v["model"] < v2v["fixed"] - 0.15


class _ScoringJudge(_AlwaysJudge):
    """A judge whose verdict takes ``polls`` frames after it is asked (a score on a busy core);
    while it scores it records the reply's speech codes so far and whether its first audio exists."""

    def __init__(self, p, polls, timeline):
        super().__init__(p)
        self.polls, self.timeline, self.left, self.while_scoring = polls, timeline, 0, []

    @property
    def pending(self):
        return self.left > 0 or getattr(self, "_ready", None) is not None

    def submit(self, audio):
        self.seen.append(audio.size)
        self.left = self.polls
        self.waited_for_first_chunk = False

    def poll(self):
        if self.left > 0:
            turn = self.timeline.turns[-1]
            # the reply's event is set exactly when its first chunk exists
            assert self.after.is_set() == (turn.events.get("first_audio_chunk") is not None)
            self.waited_for_first_chunk |= self.after.is_set()
            self.while_scoring.append((turn.events.get("first_audio_chunk") is not None, len(turn.codec_token_ids)))
            self.left -= 1
            if self.left == 0:
                self._ready = (self.p, 30.0)
            return None
        return super().poll()


def test_a_held_reply_waits_after_its_first_chunk_while_the_judge_scores(stack, speech_like):
    """At a pause the end-of-turn score and the speculative reply's first chunk are both what the
    endpoint waits for; a held reply that has its first chunk makes nothing more until the verdict
    (on a busy machine the two share a core), then goes on: the same reply as without the wait."""
    wave = _wave(speech_like, 1.2, 5)
    look = EndpointerConfig(turn_min_silence_ms=EndpointerConfig.preempt_silence_ms + 10)
    turns = {}
    for name, polls in (("at once", 0), ("slow", 15)):
        timeline = Timeline(model={}, device="cpu")
        judge = _ScoringJudge(0.95, polls, timeline) if polls else _AlwaysJudge(0.95)
        asyncio.run(run_script(_executor(stack), Script([wave]), EngineConfig(), timeline, realtime=False,
                               judge=judge, endpointer_config=look))
        turns[name] = (timeline.turns[0], judge)
    slow, judge = turns["slow"]
    # the reply handed the judge what to wait for, and it said so once its first chunk was made
    assert judge.after.is_set() and judge.waited_for_first_chunk
    with_audio = [codes for has_audio, codes in judge.while_scoring if has_audio]
    # the 600 ms score outlasts the first chunk (made in a few frames of the session clock), and
    # meanwhile the reply stays at the codes that chunk needed
    assert len(judge.while_scoring) == 15 and with_audio and len(set(with_audio)) == 1
    assert with_audio[0] < len(slow.codec_token_ids)
    assert slow.extra["end_of_turn"]["ended_by"] == "model" and not slow.interrupted
    at_once = turns["at once"][0]
    assert slow.codec_token_ids == at_once.codec_token_ids and slow.text_token_ids == at_once.text_token_ids
    assert slow.reply_audio_s == at_once.reply_audio_s


def test_a_start_up_that_ran_dry_while_the_steps_compiled_sets_no_playout_delay(stack):
    """The adaptive playout delay learns from replies made with the steps as they will stay: a
    reply that started while they were still compiling ran next to the compile, so its gap is
    recorded but does not delay the next replies; the same gap once they are ready does."""
    from omnidesk.engine.timeline import TurnTimeline
    from omnidesk.engine.vad import EnergyVAD, Endpointer

    class Runner:  # a runner whose background compile is, or is over
        ready = False

    async def measure(compiling: bool) -> tuple[float, dict, bool]:
        ex = _executor(stack)
        ex.runner = Runner()
        ex.runner.ready = not compiling
        speaker = VirtualSpeaker()
        engine = Engine(ex, Endpointer(EnergyVAD()), speaker, EngineConfig())
        engine._turn = TurnTimeline()
        engine._start_reply(held=True)
        reply = engine._reply
        reply.task.cancel()
        reply.underruns_at_start = speaker.underruns
        speaker.underruns += 3  # the first 1.5 s ran dry for 3 blocks (under the 0.3 s cap)
        engine.now = 2.0
        engine._measure_startup(reply, started=0.0)
        engine._pool.shutdown()
        return engine.playout_delay, reply.turn.extra, reply.warming_up

    dry_s = 3 * VirtualSpeaker().block / VirtualSpeaker().sample_rate
    delay, extra, warming = asyncio.run(measure(compiling=True))
    assert warming and extra["decode_steps_warming_up"] is True
    assert extra["startup_dry_ms"] == round(dry_s * 1000) and delay == 0.0
    delay, extra, warming = asyncio.run(measure(compiling=False))
    assert not warming and "decode_steps_warming_up" not in extra
    assert extra["startup_dry_ms"] == round(dry_s * 1000) and delay == pytest.approx(dry_s)
