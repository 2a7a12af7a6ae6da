"""Long conversations on a small thinker cache, as users meet them.

Dozens of turns of mixed lengths, barge-ins and discarded preemptive starts on a
cache that fills every few turns.  Every cache-full drop (old turns dropped, the
rest re-prefilled from the stored encoder outputs) must be recorded in the
timeline of the turn it happened in; after each one the thinker must hold what a
fresh prefill of the kept history gives; the stored audio must always match the
audio placeholders the cache holds; memory must stay flat.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omnidesk.engine.engine import Engine, EngineConfig, TurnState
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor
from omnidesk.engine.speaker import VirtualSpeaker
from omnidesk.engine.timeline import Timeline
from omnidesk.engine.vad import Endpointer, EndpointerConfig, EnergyVAD
from omnidesk.models.qwen2_5_omni.demo import make_demo
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.reply import talker_defaults
from omnidesk.models.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
FRAME = 640  # 40 ms at 16 kHz


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = load_stack(make_demo(tmp_path_factory.mktemp("demo") / "demo"))
    # the bookkeeping does not depend on the ODE's accuracy: fewer flow-matching steps keep the
    # many turns quick (this module's own stack)
    stack.vocoder.num_steps = 3
    return stack


def _executor(stack, capacity: int, **kw) -> QwenOmniExecutor:
    return QwenOmniExecutor(stack, capacity=capacity, max_reply_tokens=kw.pop("max_reply_tokens", 8),
                            max_codec_tokens=kw.pop("max_codec_tokens", 40),
                            thinker_sampling=SamplingParams(greedy=True),
                            talker_sampling=talker_defaults(stack, greedy=True), **kw)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Watcher:
    """Instruments one executor (its calls run on whatever thread the engine uses).

    After every conversation call it checks the bookkeeping: the ids match the cache length,
    the audio store covers exactly the audio placeholders the cache holds, with the very
    encoder rows first prefilled at those positions (a shadow copy keyed by position in the
    whole conversation), turn starts and heads are where the chat template puts them, the
    talker context is within the thinker's.  It logs every cache-full drop with the turn it
    happened in, and at the end of a user turn that saw a drop checks the thinker against a
    fresh prefill of exactly the ids and audio the executor now holds."""

    def __init__(self, ex: QwenOmniExecutor, turn_index=lambda: None):
        self.ex = ex
        self.turn_index = turn_index
        self.audio_id = ex.cfg.thinker.audio_token_id
        pieces = ex._turn_pieces
        self.first_head, self.later_heads = pieces["first_head"], (pieces["later_head"], pieces["later_head_closed"])
        self.shadow: dict[int, torch.Tensor] = {}
        self.drops: list[tuple[int | None, dict]] = []
        self.fresh_checks = 0
        self.max_logit_diff = 0.0
        self.rollbacks_across_drop = 0
        self._unchecked = False
        self._in_drop = False
        for name in ("begin_user_turn", "add_user_audio", "end_user_turn", "rollback", "interrupt",
                     "finish_reply", "_prefill", "_drop_turns"):
            setattr(ex, name, self._wrap(name, getattr(ex, name)))

    def _wrap(self, name, fn):
        ex = self.ex

        def call(*args):
            if name == "_prefill":
                return self._prefill(fn, *args)
            if name == "_drop_turns":
                self._in_drop = True
                try:
                    fn(*args)
                finally:
                    self._in_drop = False
                self.drops.append((self.turn_index(), ex.overflows[-1]))
                self._unchecked = True
                gone = ex._dropped + len(self.first_head)  # earlier positions of the whole conversation
                for v in [v for v in self.shadow if v < gone]:
                    del self.shadow[v]
                return None
            dropped = ex._dropped
            out = fn(*args)
            if name == "rollback" and args[0].dropped != dropped:
                self.rollbacks_across_drop += 1
            self.check()
            if name == "end_user_turn" and self._unchecked:
                self.fresh_check()
                self._unchecked = False
            return out

        return call

    def _prefill(self, fn, ids, audio_tokens=None):
        start = self.ex.thinker_cache_length + self.ex._dropped
        out = fn(ids, audio_tokens)
        if audio_tokens is not None and not self._in_drop:  # a re-prefill re-reads rows already recorded
            positions = [i for i, x in enumerate(ids) if x == self.audio_id]
            assert len(positions) == audio_tokens.shape[0]
            for i, row in zip(positions, audio_tokens):
                self.shadow[start + i] = row
        return out

    def check(self) -> None:
        ex = self.ex
        length = ex.thinker_cache_length
        assert len(ex.ids) == length <= ex.capacity
        placeholders = [i for i, x in enumerate(ex.ids) if x == self.audio_id]
        covered, end = [], 0
        for s, a in ex._audio_store:
            assert s >= end and a.shape[0] > 0, "audio store entries overlap or are empty"
            covered.extend(range(s, s + a.shape[0]))
            end = s + a.shape[0]
        assert covered == placeholders, "the stored audio does not cover exactly the audio placeholders"
        if placeholders:
            want = torch.stack([self.shadow[p + ex._dropped] for p in placeholders])
            assert torch.equal(ex._stored_audio(0, length), want), "stored audio rows moved"
        assert len(ex.turn_starts) == len(ex.head_lengths)
        assert ex.turn_starts == sorted(set(ex.turn_starts))
        if ex.ids:
            assert ex.turn_starts[0] == 0 and ex.head_lengths[0] == len(self.first_head)
            assert ex.ids[:len(self.first_head)] == self.first_head
        for s, h in zip(ex.turn_starts[1:], ex.head_lengths[1:]):
            assert ex.ids[s:s + h] in self.later_heads
        assert ex.talker_context <= length and ex.prompt_end <= length
        if ex._reply is None:
            assert ex.talker_cache.length == ex.talker_context

    @torch.inference_mode()
    def fresh_check(self) -> None:
        """A fresh cache, one prefill of exactly the ids + audio the executor holds: the same
        last-position logits, and the same talker context rows."""
        ex = self.ex
        ids = torch.tensor(ex.ids, device=ex.device)
        embeds = ex.thinker.embed(ids, ex._stored_audio(0, len(ex.ids)))
        hidden = ex.thinker(embeds, ex.thinker.new_cache(ex.capacity))
        diff = float((ex.thinker.logits(hidden[-1]) - ex.thinker.logits(ex._last_hidden)).abs().max())
        self.max_logit_diff = max(self.max_logit_diff, diff)
        assert diff <= 1e-4, diff
        rows = hidden + embeds.masked_fill((ids == self.audio_id)[:, None], 0.0)
        assert float((rows - ex.context_rows[:len(ex.ids)]).abs().max()) <= 1e-4
        self.fresh_checks += 1


def _wav(name: str) -> np.ndarray:
    audio, rate = sf.read(str(FIXTURES / name), dtype="float32")
    assert rate == 16000 and audio.ndim == 1
    return audio


# ---------------------------------------------------------------------- through the engine


class Talk:
    """Drives an engine frame by frame, not in real time: after each 40 ms frame the pipeline runs
    until it blocks.  Create it inside the running loop."""

    def __init__(self, ex: QwenOmniExecutor, timeline: Timeline):
        self.endpointer = Endpointer(EnergyVAD(), EndpointerConfig(), ex.sample_rate_in)
        self.speaker = VirtualSpeaker(sample_rate=ex.sample_rate_out, block=ex.sample_rate_out * FRAME // 16000,
                                      capacity_s=3.0, record=False)
        self.engine = Engine(ex, self.endpointer, self.speaker, EngineConfig(max_audio_ahead_s=1.0), timeline)
        self.timeline = timeline
        self.samples = 0

    async def tick(self, frame: np.ndarray, settle: bool = True) -> None:
        self.speaker.tick()
        await self.engine.on_frame(frame, self.samples / 16000)
        self.samples += frame.size
        if settle:
            await self.engine.settle()

    async def silent_until(self, done, limit_s: float = 30.0) -> None:
        silence = np.zeros(FRAME, np.float32)
        for _ in range(int(limit_s / 0.04)):
            if done():
                return
            await self.tick(silence)
        raise AssertionError("the engine did not get there in time")

    async def say(self, utterance: np.ndarray, cut: float | None = None, stop_at_pause: bool = False) -> None:
        """One utterance into the microphone.  ``cut``: seconds of the reply heard before the next
        utterance starts on top of it (a barge-in); None: the reply plays out, then a short gap.
        ``stop_at_pause``: press stop as soon as a reply starts preemptively, before it ran at all."""
        engine = self.engine
        padded = np.concatenate([utterance, np.zeros((-utterance.size) % FRAME, np.float32)])
        for j in range(0, padded.size, FRAME):
            await self.tick(padded[j:j + FRAME], settle=False)
            if stop_at_pause and engine.state is TurnState.PREEMPTING:
                await engine.interrupt(onset=engine.now, confirmed=engine.now)
                return
            await engine.settle()
        if cut is None:
            await self.silent_until(lambda: engine.idle)
            for _ in range(15):  # the gap before the next question
                await self.tick(np.zeros(FRAME, np.float32))
        else:
            turn = self.timeline.turns[-1]
            await self.silent_until(lambda: engine.idle or (turn.events["playback_start"] is not None
                                                            and engine.now >= turn.events["playback_start"] + cut))


def test_long_conversation_through_the_engine(stack, speech_like):
    """62 turns on a 600-token cache: short and long questions, barge-ins, preemptive starts
    discarded when the user goes on after a short pause."""
    waves = {
        "short": speech_like(0.7, seed=61).numpy(),
        "question": _wav("question.wav"),
        "mid": speech_like(3.4, seed=65).numpy(),  # one encoder block prefilled while speaking, and a tail
        "long": speech_like(6.3, seed=62).numpy(),  # three blocks prefilled while speaking, and a tail
        "second": _wav("second_question.wav"),
        # a pause long enough to start a reply preemptively, short of the endpoint
        # (the first part passes an encoder block, so the preemptive prefill may have to make room)
        "paused": np.concatenate([speech_like(2.5, seed=63).numpy(), np.zeros(int(0.24 * 16000), np.float32),
                                  speech_like(1.0, seed=64).numpy()]),
    }
    order = ["question", "short", "long", "second", "paused", "mid", "question", "paused", "short", "mid"]
    plan = []
    for i in range(62):
        cut = 0.1 if i % 5 == 3 else None  # the next question cuts in 0.1 s into this reply
        plan.append((waves[order[i % len(order)]], cut))

    ex = _executor(stack, capacity=600, max_codec_tokens=16)
    timeline = Timeline(model={}, device="cpu")
    watcher = Watcher(ex, turn_index=lambda: len(timeline.turns) - 1)
    rss: list[float] = []

    async def main():
        talk = Talk(ex, timeline)
        for _ in range(8):  # lead silence
            await talk.tick(np.zeros(FRAME, np.float32))
        for i, (utterance, cut) in enumerate(plan):
            await talk.say(utterance, cut)
            if i + 1 in (len(plan) - 30, len(plan)):  # memory over the last 30 turns
                await talk.silent_until(lambda: talk.engine.idle)
                gc.collect()
                rss.append(_rss_mb())
        talk.engine.close()
        return talk.engine

    engine = asyncio.run(main())

    assert getattr(engine, "failure", None) is None
    turns = timeline.turns
    stages = Counter(rec["at"] for _, rec in watcher.drops)
    print(f"\n{len(turns)} turns, {len(watcher.drops)} cache-full drops {dict(stages)}, "
          f"{engine.stats.barge_ins} barge-ins, {engine.stats.preemptive_discarded} preemptive starts discarded, "
          f"{watcher.rollbacks_across_drop} rollbacks across a drop, {watcher.fresh_checks} fresh-prefill checks "
          f"(max logit diff {watcher.max_logit_diff:.2e}); RSS {rss[0]:.1f} -> {rss[1]:.1f} MB over the last 30 turns")
    assert len(turns) >= 60
    assert engine.stats.barge_ins >= 8 and engine.stats.preemptive_discarded >= 8
    assert sum(t.interrupted for t in turns) == engine.stats.barge_ins
    # every drop is in the timeline, in the turn it happened in, and nothing else is
    for i, turn in enumerate(turns):
        assert turn.extra.get("cache_overflow", []) == [rec for j, rec in watcher.drops if j == i], i
    # (which calls make room depends on where each turn finds the cache: see the next test for each)
    assert len(watcher.drops) >= 10 and len(stages) >= 2
    assert all(rec["cache_after"] < rec["cache_before"] and rec["dropped_turns"] >= 1 for _, rec in watcher.drops)
    # each turn that saw a drop was checked against a fresh prefill when its prompt was complete
    assert watcher.fresh_checks >= len({j for j, _ in watcher.drops})
    # the conversation kept replying to the end
    assert all(t.text_token_ids for t in turns[-5:])
    assert rss[1] - rss[0] < 30, rss


def test_drops_at_each_stage_are_reported_in_the_turn_they_happen_in(stack, speech_like):
    """Make the cache just too small for the next call at each stage in turn: the turn's header
    (begin_user_turn), an audio block while the user speaks (add_user_audio), the end of the
    utterance (end_user_turn), the end of an utterance a preemptive start took that was then
    discarded (the user went on), and the stop button pressed while a preemptive start was
    still prefilling.  Each drop is in the timeline of its own turn (the last case's: see the
    next test)."""
    ex = _executor(stack, capacity=2000, max_codec_tokens=16)  # the preallocated cache; limits set below
    timeline = Timeline(model={}, device="cpu")
    watcher = Watcher(ex, turn_index=lambda: len(timeline.turns) - 1)
    p = ex._turn_pieces
    head, tail, block = len(p["later_head"]), len(p["tail"]), ex.block_tokens
    short = speech_like(0.8, seed=80).numpy()
    gap = np.zeros(int(0.24 * 16000), np.float32)
    paused = np.concatenate([speech_like(2.5, seed=81).numpy(), gap, speech_like(1.0, seed=82).numpy()])
    # limit: the cache length the limit is set from -> the limit
    cases = [
        ("begin_user_turn", short, lambda n: n + head + block + tail - 1, {}),
        ("add_user_audio", speech_like(4.6, seed=83).numpy(), lambda n: n + head + 2 * block + tail - 1, {}),
        ("end_user_turn", speech_like(3.0, seed=84).numpy(), lambda n: n + head + block + tail + 5, {}),
        ("end_user_turn", paused, lambda n: n + head + block + tail + 5, {}),
        ("end_user_turn", paused, lambda n: n + head + block + tail + 5, {"stop_at_pause": True}),
    ]

    async def main():
        talk = Talk(ex, timeline)
        for _ in range(8):
            await talk.tick(np.zeros(FRAME, np.float32))
        for stage, utterance, limit, how in cases:
            for _ in range(3):  # a history to drop from
                ex.capacity = 2000
                await talk.say(short)
            ex.capacity = limit(ex.thinker_cache_length)
            before = len(watcher.drops)
            await talk.say(utterance, **how)
            assert [r["at"] for _, r in watcher.drops[before:]][:1] == [stage], (stage, watcher.drops[before:])
        # (the stop case is the last: after a stop between the pause and the endpoint the engine's
        # endpoint handler goes to RESPONDING with no reply, and no further turn starts)
        talk.engine.close()
        return talk.engine

    engine = asyncio.run(main())
    assert getattr(engine, "failure", None) is None
    assert engine.stats.preemptive_discarded >= 1 and watcher.rollbacks_across_drop >= 1
    assert len({r["at"] for _, r in watcher.drops}) == 3
    assert timeline.turns[-1].interrupted
    for i, turn in enumerate(timeline.turns[:-1]):  # the last: see the next test
        assert turn.extra.get("cache_overflow", []) == [rec for j, rec in watcher.drops if j == i], i


def test_a_drop_made_by_a_turn_cut_during_its_prefill_is_reported_in_that_turn(stack, speech_like):
    ex = _executor(stack, capacity=2000, max_codec_tokens=16)
    timeline = Timeline(model={}, device="cpu")
    watcher = Watcher(ex, turn_index=lambda: len(timeline.turns) - 1)
    p = ex._turn_pieces
    short = speech_like(0.8, seed=80).numpy()
    paused = np.concatenate([speech_like(2.5, seed=81).numpy(), np.zeros(int(0.24 * 16000), np.float32),
                             speech_like(1.0, seed=82).numpy()])

    async def main():
        talk = Talk(ex, timeline)
        for _ in range(3):
            await talk.say(short)
        ex.capacity = ex.thinker_cache_length + len(p["later_head"]) + ex.block_tokens + len(p["tail"]) + 5
        await talk.say(paused, stop_at_pause=True)
        talk.engine.close()

    asyncio.run(main())
    assert watcher.drops and watcher.drops[-1][0] == len(timeline.turns) - 1
    assert timeline.turns[-1].interrupted
    assert timeline.turns[-1].extra.get("cache_overflow") == [watcher.drops[-1][1]]


# ---------------------------------------------------------------------- the executor directly


def _reply(ex: QwenOmniExecutor, seed: int = 0) -> tuple[list[int], list[int], torch.Tensor | None]:
    """Text and codes of a whole reply (no vocoder: the cache bookkeeping does not see it), and
    the talker's first logits."""
    ex.start_reply(seed=seed)
    text, codes, first = [], [], None
    while not (ex.thinker_done and ex.talker_done):
        if not ex.thinker_done:
            text.append(ex.thinker_step())
        c = ex.talker_step()
        if first is None and ex._reply.talker_logits is not None:
            first = ex._reply.talker_logits
        if c is not None:
            codes.append(c)
    return text, codes, first


def _fresh_copy(stack, ex: QwenOmniExecutor) -> QwenOmniExecutor:
    """A new executor that prefills the kept history in one go (what a fresh conversation of
    exactly these turns would hold)."""
    fresh = _executor(stack, ex.capacity, max_codec_tokens=ex.max_codec_tokens)
    fresh._prefill(list(ex.ids), ex._stored_audio(0, len(ex.ids)))
    fresh.turn_starts, fresh.head_lengths = list(ex.turn_starts), list(ex.head_lengths)
    fresh.prompt_end = ex.prompt_end
    return fresh


@torch.inference_mode()
def test_long_conversation_executor_reprefills_equal_a_fresh_history(stack, speech_like):
    """60 turns straight on the executor: preemptive starts rolled back (also across a drop made
    by their own end_user_turn), cuts during the prefill and mid-reply, replies played out.  After
    each drop, that turn's reply and the next turn's equal those of a fresh executor holding
    the same history (thinker text, talker codes and first talker logits)."""
    rng = random.Random(11)
    waves = [speech_like(s, seed=70 + i).numpy() for i, s in enumerate((0.5, 1.1, 2.3, 4.4, 0.8))]
    ex = _executor(stack, capacity=330, max_codec_tokens=24)
    turn_no = {"i": 0}
    watcher = Watcher(ex, turn_index=lambda: turn_no["i"])
    compared = 0
    compare_next = False
    ends = Counter()
    for i in range(60):
        turn_no["i"] = i
        drops_before = len(watcher.drops)
        wave = waves[rng.randrange(len(waves))]
        preempt_at = rng.choice([None, None, 0.3, 0.6])
        ex.begin_user_turn()
        step = 4000
        for j in range(0, wave.size, step):
            ex.add_user_audio(wave[j:j + step])
            if preempt_at is not None and j <= preempt_at * wave.size < j + step:
                mark = ex.mark()
                ex.end_user_turn()  # the user paused: reply preemptively...
                ex.start_reply(seed=i)
                for _ in range(rng.randrange(0, 6)):
                    ex.thinker_step()
                    ex.talker_step()
                ex.rollback(mark)  # ...then went on
        ending = rng.choice(["finish", "finish", "cut", "cut", "prefill"])
        ends[ending] += 1
        if ending == "prefill":  # cut before the reply began: the user's words stay, no reply
            ex.interrupt(0)
            continue
        ex.end_user_turn()
        dropped_now = len(watcher.drops) > drops_before
        if dropped_now or compare_next:
            fresh = _fresh_copy(stack, ex)
            ft, fc, fl = _reply(fresh, seed=i)
        text, codes, logits = _reply(ex, seed=i)
        if dropped_now or compare_next:
            assert (text, codes) == (ft, fc), i
            assert (logits is None) == (fl is None) and (logits is None or (logits - fl).abs().max() <= 1e-3)
            compared += 1
        compare_next = dropped_now
        if ending == "finish":
            ex.finish_reply()
        else:
            heard = int(rng.random() * len(codes) * ex.samples_per_code)
            rb = ex.interrupt(heard)
            assert rb.thinker_cache_after == ex.thinker_cache_length
        ex.take_overflows()  # what the engine collects each turn
    stages = Counter(rec["at"] for _, rec in watcher.drops)
    print(f"\n{len(watcher.drops)} drops {dict(stages)}, {watcher.rollbacks_across_drop} rollbacks across a "
          f"drop, {compared} replies compared with a fresh history, endings {dict(ends)}, "
          f"max logit diff {watcher.max_logit_diff:.2e}")
    assert len(stages) >= 2 and len(watcher.drops) >= 12 and compared >= 12
    assert watcher.fresh_checks >= len({j for j, _ in watcher.drops})


@torch.inference_mode()
def test_preemptive_start_that_made_room_rolls_back_into_the_new_layout(stack, speech_like):
    """The user pauses, the preemptive start's end_user_turn drops old turns to make room, then
    the user goes on: the rollback keeps the drop (it was reported) and brings this turn back to
    the pause in the re-prefilled layout; the turn then ends and replies as a fresh history would."""
    ex = _executor(stack, capacity=400, max_codec_tokens=24)
    watcher = Watcher(ex)
    wave = speech_like(3.8, seed=95).numpy()
    first_part = ex.block_samples + 24000  # one encoder block prefilled while speaking, then the pause
    for i in range(20):
        # a short turn, to shift where the next one finds the cache
        ex.begin_user_turn()
        ex.add_user_audio(speech_like(0.3 + 0.1 * i, seed=96 + i).numpy())
        ex.end_user_turn()
        _reply(ex)
        ex.finish_reply()
        ex.begin_user_turn()
        ex.add_user_audio(wave[:first_part])
        mark = ex.mark()
        said = ex.ids[ex.turn_starts[-1] + ex.head_lengths[-1]:]
        ex.end_user_turn()
        ex.start_reply()
        for _ in range(3):
            ex.thinker_step()
            ex.talker_step()
        ex.rollback(mark)
        assert ex._turn_open and ex.ids[ex.turn_starts[-1] + ex.head_lengths[-1]:] == said
        ex.add_user_audio(wave[first_part:])
        ex.end_user_turn()
        if watcher.rollbacks_across_drop:
            break
        _reply(ex)
        ex.finish_reply()
    else:
        raise AssertionError("no preemptive start had to make room")
    assert watcher.rollbacks_across_drop >= 1 and any(r["at"] == "end_user_turn" for _, r in watcher.drops)
    assert "end_user_turn" in [o["at"] for o in ex.take_overflows()]  # reported, not undone
    watcher.fresh_check()
    fresh = _fresh_copy(stack, ex)
    assert _reply(ex)[:2] == _reply(fresh)[:2]


@torch.inference_mode()
def test_truncation_inside_a_run_of_audio_keeps_exactly_the_audio_before_it(stack, speech_like):
    """After a drop, a kept turn's audio blocks are re-prefilled as one run; a truncation that
    falls inside it keeps exactly the rows before the cut, and what is left re-prefills to the
    same logits as a fresh prefill."""
    ex = _executor(stack, capacity=420)
    wave = speech_like(4.3, seed=90).numpy()  # two encoder blocks and a tail
    for _ in range(3):
        ex.begin_user_turn()
        ex.add_user_audio(wave)
        ex.end_user_turn()
        _reply(ex)
        ex.finish_reply()
    assert ex.take_overflows()
    s, a = ex._audio_store[0]  # the first kept turn: its blocks were one run of the re-prefill
    assert a.shape[0] > 2 * ex.block_tokens
    before = ex._stored_audio(0, len(ex.ids)).clone()
    cut = s + a.shape[0] // 2
    ex._truncate_thinker(cut)
    assert [(e[0], e[1].shape[0]) for e in ex._audio_store] == [(s, cut - s)]
    assert torch.equal(ex._stored_audio(0, cut), before[:cut - s])
    assert ex.ids.count(ex.cfg.thinker.audio_token_id) == cut - s
    # one more (text) token on the truncated cache vs a fresh prefill of the same ids
    logits = ex.thinker.logits(ex.thinker(ex.thinker.embed(torch.tensor([ex.im_end_id])), ex.thinker_cache)[-1])
    fresh = ex.thinker.new_cache(ex.capacity)
    hidden = ex.thinker(ex.thinker.embed(torch.tensor(ex.ids + [ex.im_end_id]), ex._stored_audio(0, cut)), fresh)
    assert (ex.thinker.logits(hidden[-1]) - logits).abs().max() <= 1e-4
