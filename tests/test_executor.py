"""The Qwen2.5-Omni executor: streaming == sequential, rollback == fresh history, preemption undo."""

import numpy as np
import pytest
import torch

from omnidesk.features import num_frames
from omnidesk.models.qwen2_5_omni.executor import QwenOmniExecutor
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.offline import generate_reply
from omnidesk.models.qwen2_5_omni.reply import talker_defaults
from omnidesk.models.sampling import SamplingParams


@pytest.fixture(scope="module")
def stack(tiny_checkpoints):
    return load_stack(tiny_checkpoints("a")[0])


def _executor(stack, greedy=True, **kw):
    return QwenOmniExecutor(stack, capacity=1024, max_reply_tokens=kw.pop("max_reply_tokens", 12),
                            max_codec_tokens=kw.pop("max_codec_tokens", 80),
                            thinker_sampling=SamplingParams(greedy=True) if greedy else
                            SamplingParams(temperature=0.8, top_p=0.9),
                            talker_sampling=talker_defaults(stack, greedy=greedy), **kw)


def _user_turn(ex, wave, block=None):
    ex.begin_user_turn()
    samples = wave.numpy()
    step = block or len(samples)
    for i in range(0, len(samples), step):
        ex.add_user_audio(samples[i:i + step])
    return ex.end_user_turn()


def _run_reply(ex, order="interleaved", seed=0):
    ex.start_reply(seed=seed)
    audio, text, codes = [], [], []
    if order == "sequential":
        while not ex.thinker_done:
            text.append(ex.thinker_step())
        while not ex.talker_done:
            c = ex.talker_step()
            if c is not None:
                codes.append(c)
        audio += ex.vocoder_step(final=True)
    else:
        while not (ex.thinker_done and ex.talker_done):
            if not ex.thinker_done:
                text.append(ex.thinker_step())
            c = ex.talker_step()
            if c is not None:
                codes.append(c)
                audio += ex.vocoder_step()
        audio += ex.vocoder_step(final=True)
    return text, codes, (np.concatenate(audio) if audio else np.zeros(0, np.float32))


def _assert_reply_equals_one_shot(stack, ex, wave, prompt):
    """The greedy reply after the streamed turn equals generate_reply on the whole utterance."""
    text, codes, _ = _run_reply(ex)
    ref = generate_reply(stack, wave, thinker_sampling=SamplingParams(greedy=True),
                         talker_sampling=talker_defaults(stack, greedy=True), max_text_tokens=12, max_codec_tokens=80)
    assert prompt == ref.prompt_ids
    assert text == ref.text_ids
    assert codes == ref.codec_ids


@torch.inference_mode()
def test_listening_in_frames_equals_the_whole_utterance(stack, speech_like):
    """Blocks prefilled while the user speaks (40 ms at a time) give the prompt and reply of the
    whole utterance given at once (what the transformers tests check against generate)."""
    wave = speech_like(2.3, seed=5)
    ex = _executor(stack)
    prompt = _user_turn(ex, wave, block=640)  # 40 ms frames, blocks prefilled while "speaking"
    _assert_reply_equals_one_shot(stack, ex, wave, prompt)


@torch.inference_mode()
def test_turn_ending_just_past_a_block_equals_the_whole_utterance(stack, speech_like):
    """A turn that ends inside the STFT margin after a block: the block is still unencoded when
    the turn ends, and the rest is a block plus a frame or so (CI's turn-taking bench hit it)."""
    ex = _executor(stack)
    margin = stack.features.n_fft // 2
    wave = speech_like(2.5, seed=11)[: ex.block_samples + margin // 2]
    assert num_frames(len(wave), stack.features) > ex.block_frames  # a block and a bit
    prompt = _user_turn(ex, wave, block=640)
    _assert_reply_equals_one_shot(stack, ex, wave, prompt)


@torch.inference_mode()
def test_the_talker_reads_the_turn_while_the_user_speaks_and_replies_as_if_it_read_it_at_the_start(
        stack, speech_like, monkeypatch):
    """Block by block, as the thinker prefills them, the talker reads the turn's rows (a reply's start
    then prefills only the turn's end): the reply is the one of a talker that read the whole turn at
    the reply's start, and a discarded preemptive start leaves the talker's reading where it was."""
    wave = speech_like(3.2, seed=12)
    ex = _executor(stack)
    ex.begin_user_turn()
    ex.add_user_audio(wave[:40000].numpy())  # one 2-s block and a half
    assert ex.talker_context == ex.thinker_cache_length > 0
    assert ex.talker_cache.length == ex._talker_context_length(ex.talker_context) > 0
    mark, read = ex.mark(), ex.talker_cache.length
    ex.end_user_turn()
    ex.start_reply()
    for _ in range(4):
        ex.thinker_step()
        ex.talker_step()
    ex.rollback(mark)  # the user went on talking
    assert ex.talker_cache.length == read and ex.talker_context == mark.talker_context
    ex.add_user_audio(wave[40000:].numpy())
    prompt = ex.end_user_turn()
    assert ex.talker_context < ex.prompt_end  # the turn's end is left to the reply's start
    text, codes, audio = _run_reply(ex)

    at_start = _executor(stack)
    monkeypatch.setattr(at_start, "_talker_reads_turn", lambda: None)
    assert _user_turn(at_start, wave, block=40000) == prompt and at_start.talker_context == 0
    assert (text, codes) == _run_reply(at_start)[:2] and len(codes) > 0
    # the same context in the talker's cache, read in other pieces (float sums in another order)
    n = ex._talker_context_length(ex.prompt_end)
    for k1, k2 in zip(ex.talker_cache.k, at_start.talker_cache.k):
        torch.testing.assert_close(k1[..., :n, :], k2[..., :n, :], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_streamed_equals_unstreamed_for_same_seed(stack, speech_like):
    wave = speech_like(1.4, seed=6)
    runs = []
    for order in ("sequential", "interleaved"):
        ex = _executor(stack, greedy=False, max_codec_tokens=120)
        _user_turn(ex, wave)
        runs.append(_run_reply(ex, order=order, seed=7))
    (t1, c1, a1), (t2, c2, a2) = runs
    assert t1 == t2 and c1 == c2
    assert len(c1) > 0 and a1.shape == a2.shape == (len(c1) * 480,)
    assert np.array_equal(a1, a2)


@torch.inference_mode()
def test_interrupt_keeps_heard_part_and_next_turn_equals_fresh_history(stack, speech_like):
    q1, q2 = speech_like(1.2, seed=8), speech_like(0.9, seed=9)
    ex = _executor(stack, max_reply_tokens=20, max_codec_tokens=200)
    _user_turn(ex, q1)
    text, codes, audio = _run_reply(ex)
    heard = audio.size // 3
    before = ex.thinker_cache_length
    rb = ex.interrupt(heard)
    assert rb.thinker_cache_before == before
    assert rb.thinker_cache_after == ex.thinker_cache_length == before - rb.rolled_back_tokens
    assert 0 < rb.kept_text_tokens < len(text)
    history = list(ex.ids)
    assert history[-rb.kept_text_tokens:] == text[:rb.kept_text_tokens]
    _user_turn(ex, q2)
    # the cut reply is closed with <|im_end|> by the next turn's prefix
    assert ex.ids[rb.thinker_cache_after] == ex.im_end_id
    logits = ex.thinker.logits(ex._last_hidden)

    # a fresh conversation whose history holds only the heard part
    fresh = _executor(stack)
    fresh.thinker_cache.reset()
    t = torch.tensor(ex.ids)
    audio_pos = (t == stack.config.thinker.audio_token_id).nonzero().flatten()
    assert audio_pos.numel() > 0
    # rebuild the same ids with the same audio tokens, in one prefill
    tokens = ex.thinker.embed(t, _audio_tokens(stack, [q1, q2]))
    hidden = fresh.thinker(tokens, fresh.thinker_cache)
    assert (fresh.thinker.logits(hidden[-1]) - logits).abs().max() <= 1e-4


def _audio_tokens(stack, waves):
    from omnidesk.features import log_mel

    return torch.cat([stack.thinker.audio_encoder(log_mel(w, stack.features)) for w in waves])


@torch.inference_mode()
def test_preemptive_start_discarded_leaves_cache_as_before(stack, speech_like):
    wave = speech_like(2.6, seed=10)
    ex = _executor(stack)
    ex.begin_user_turn()
    ex.add_user_audio(wave[:20000].numpy())
    mark = ex.mark()
    length, ids, k = ex.thinker_cache_length, list(ex.ids), torch.stack(ex.thinker_cache.k)
    # the user paused: reply preemptively...
    ex.end_user_turn()
    ex.start_reply()
    for _ in range(4):
        ex.thinker_step()
        ex.talker_step()
    # ...then kept talking
    ex.rollback(mark)
    assert ex.thinker_cache_length == length and ex.ids == ids
    assert torch.equal(torch.stack(ex.thinker_cache.k)[..., :length, :], k[..., :length, :])
    ex.add_user_audio(wave[20000:].numpy())
    prompt = ex.end_user_turn()
    straight = _executor(stack)
    assert prompt == _user_turn(straight, wave, block=20000)
    assert torch.equal(ex.thinker.logits(ex._last_hidden), straight.thinker.logits(straight._last_hidden))


@torch.inference_mode()
def test_cache_full_drops_oldest_turns_and_reprefills(stack, speech_like):
    ex = _executor(stack, max_reply_tokens=6, max_codec_tokens=10)
    ex.capacity = 260  # the preallocated cache is larger; the executor honours this limit
    turns = [speech_like(1.0 + 0.1 * i, seed=30 + i) for i in range(4)]
    for wave in turns:
        _user_turn(ex, wave)
        _run_reply(ex, order="sequential")
        ex.finish_reply()
    overflows = ex.take_overflows()
    assert overflows and all(o["dropped_turns"] >= 1 for o in overflows)
    assert ex.thinker_cache_length <= 260 and ex.thinker_cache_length == len(ex.ids)
    # the conversation now starts with the system prompt and the first kept turn
    first_head = ex._turn_pieces["first_head"]
    assert ex.ids[:len(first_head)] == first_head and ex.turn_starts[0] == 0
    # the re-prefilled cache equals a fresh prefill of the kept conversation
    audio = torch.cat([a for _, a in ex._audio_store])
    fresh = stack.thinker.new_cache(400)
    hidden = stack.thinker(stack.thinker.embed(torch.tensor(ex.ids), audio), fresh)
    assert (stack.thinker.logits(hidden[-1]) - stack.thinker.logits(ex._last_hidden)).abs().max() <= 1e-4
    # and it keeps talking
    _user_turn(ex, speech_like(0.8, seed=40))
    text, codes, _ = _run_reply(ex)
    assert text and codes
