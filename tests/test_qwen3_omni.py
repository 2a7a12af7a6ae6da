"""Qwen3-Omni end to end against transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``.

The checkpoint is written by transformers (tests/tiny_qwen3.py) and read by our loader; the
oracle is the same model in-process.  Greedy on both sides (``thinker_do_sample=False``,
``talker_do_sample=False``: the talker's repetition penalty 1.05 and its suppressed control ids
still apply, the code predictor follows the talker's do_sample), speaker Ethan (the default).

Limits, like with like: our executor emits at most N frames and never the talker's stop code;
the reference's ``talker_max_new_tokens=N + 1`` gives N expanded frames (the last code 0 it
chooses is never expanded), and a stop code at step k leaves k frames on both sides.  The
reference's frames are taken where it hands them to code2wav.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnidesk.engine.speaker import DEFAULT_FADE_MS
from omnidesk.features import log_mel
from omnidesk.models.qwen3_omni.executor import Qwen3OmniExecutor, talker_defaults, turn_roles
from omnidesk.models.qwen3_omni.loading import load_stack
from omnidesk.models.qwen3_omni.tools import generate_reply
from omnidesk.models.sampling import SamplingParams
from support import speech_like_wave as _wave

MAX_TEXT, FRAMES = 12, 36


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    """(checkpoint dir, transformers model): a tiny checkpoint whose talker never stops by itself
    (its stop code's head row is zero), so the frames run to the limit."""
    import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3")
    ref = tiny_qwen3.write_checkpoint(path)
    eos = ref.config.talker_config.codec_eos_token_id
    with torch.no_grad():
        ref.talker.codec_head.weight[eos] = 0
    ref.save_pretrained(path)
    return path, ref


@torch.inference_mode()
def reference_generate(ref, stack, prompt_ids: list[int], waves: list[torch.Tensor], max_text: int, frames: int):
    """transformers' generate on our prompt ids and the processor's features of ``waves`` (one
    per audio placeholder run, in order): (generated text ids, frames [n][groups], wave)."""
    feats = [log_mel(w, stack.features) for w in waves]
    length = max(f.shape[1] for f in feats)
    batch = torch.zeros(len(feats), feats[0].shape[0], length)
    mask = torch.zeros(len(feats), length, dtype=torch.long)
    for i, f in enumerate(feats):
        batch[i, :, :f.shape[1]], mask[i, :f.shape[1]] = f, 1
    captured = {}
    decode = ref.code2wav.chunked_decode

    def capture(codes, *args, **kwargs):
        captured["codes"] = codes.clone()
        return decode(codes, *args, **kwargs)

    ref.code2wav.chunked_decode = capture
    try:
        seq, wav = ref.generate(input_ids=torch.tensor([prompt_ids]),
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                input_features=batch, feature_attention_mask=mask,
                                thinker_max_new_tokens=max_text, thinker_do_sample=False,
                                thinker_eos_token_id=stack.config.im_end_id, talker_do_sample=False,
                                talker_max_new_tokens=frames + 1, speaker="Ethan")
    finally:
        ref.code2wav.chunked_decode = decode
    return seq[0, len(prompt_ids):].tolist(), captured["codes"][0].T.tolist(), wav.reshape(-1)


def _greedy(stack):
    return dict(thinker_sampling=SamplingParams(greedy=True), talker_sampling=talker_defaults(stack, greedy=True))


def test_reply_equals_transformers_generate(q3):
    """Text ids and every codebook of every frame equal, over FRAMES frames; code2wav of our frames,
    streamed one frame at a time, equals the reference's waveform."""
    path, ref = q3
    stack = load_stack(path)
    wave = _wave(1.6, seed=1)
    reply = generate_reply(stack, wave, max_text_tokens=MAX_TEXT, max_codec_tokens=FRAMES,
                           talker_sampling=talker_defaults(stack, greedy=True))
    text, frames, ref_wav = reference_generate(ref, stack, reply.prompt_ids, [wave], MAX_TEXT, FRAMES)
    assert len(set(text)) > 3  # varied text: a test of the feed, not of one repeated token
    assert reply.text_ids == text
    assert len(frames) == FRAMES >= 30
    assert len(reply.codec_frames[0]) == stack.config.talker.num_code_groups
    assert reply.codec_frames == frames
    assert reply.codec_ids == [f[0] for f in frames]
    stream = stack.code2wav.stream()
    with torch.inference_mode():
        ours = torch.cat([stream.push(torch.tensor(f)[:, None]) for f in reply.codec_frames])
        one_shot = stack.code2wav(torch.tensor(reply.codec_frames).T)
    assert ours.shape == ref_wav.shape == one_shot.shape
    assert float((ours - one_shot).abs().max()) <= 1e-5
    assert float((ours - ref_wav.float()).abs().max()) <= 1e-5


def _stop_early(ref, stack, wave):
    """Make <|im_end|> win where a mid-reply token first won (text that ends by itself)."""
    im_end = stack.config.im_end_id
    reply = generate_reply(stack, wave, max_text_tokens=MAX_TEXT, max_codec_tokens=1, speak=False)
    text = reply.text_ids
    j = next(i for i in range(4, MAX_TEXT) if text[i] not in text[:i])
    with torch.no_grad():
        ref.thinker.lm_head.weight[im_end] = ref.thinker.lm_head.weight[text[j]] * 1.05
    return j


def test_reply_that_ends_by_itself_equals_transformers_generate(q3, tmp_path):
    """The thinker's <|im_end|> ends the text mid-limit: the talker reads the reply up to it, then
    tts_eos, then tts_pad - as the reference's trailing text does."""
    import shutil

    path, ref = q3
    wave = _wave(1.4, seed=2)
    stack = load_stack(path)
    saved = ref.thinker.lm_head.weight.detach().clone()
    try:
        j = _stop_early(ref, stack, wave)
        ckpt = tmp_path / "stops"
        shutil.copytree(path, ckpt)
        ref.save_pretrained(ckpt)
        stack = load_stack(ckpt)
        reply = generate_reply(stack, wave, max_text_tokens=MAX_TEXT, max_codec_tokens=FRAMES,
                               talker_sampling=talker_defaults(stack, greedy=True))
        text, frames, _ = reference_generate(ref, stack, reply.prompt_ids, [wave], MAX_TEXT, FRAMES)
    finally:
        with torch.no_grad():
            ref.thinker.lm_head.weight.copy_(saved)
    assert text[-1] == stack.config.im_end_id and len(text) == j + 1 < MAX_TEXT
    assert reply.text_ids == text
    assert len(frames) == FRAMES and reply.codec_frames == frames


def test_second_turn_talker_reads_both_user_turns_not_the_reply(q3):
    """Turn two: the reference's talker reads every user turn and skips the system turn and the
    earlier reply; our talker cache holds the same rows, so its frames equal generate's on the
    whole conversation."""
    path, ref = q3
    stack = load_stack(path)
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=6, max_codec_tokens=FRAMES, **_greedy(stack))
    first, second = _wave(1.2, seed=3), _wave(1.0, seed=4)
    for i, w in enumerate((first, second)):
        ex.begin_user_turn()
        ex.add_user_audio(w.numpy())
        ex.end_user_turn()
        ex.start_reply()
        while not ex.thinker_done:
            ex.thinker_step()
        while not ex.talker_done:
            ex.talker_step()
        if i == 0:
            ex.finish_reply()
    history = ex.ids[:ex.prompt_end]
    text, frames, _ = reference_generate(ref, stack, history, [first, second], 6, FRAMES)
    assert ex.reply_text_ids == text
    assert ex.reply_codec_frames == frames
    user = stack.config.user_id
    # the talker's context: exactly the positions of the two user turns
    assert int(ex.context_used[:ex.prompt_end].sum()) == sum(1 for r in turn_roles(history, stack.config.im_start_id) if r == user)


def test_a_reply_token_is_read_by_the_talker_as_turn_roles_says(q3):
    """The decode step's rule for a reply token (_decode_used) is turn_roles' on the whole sequence (what
    a re-prefill decides): a reply token belongs to the assistant turn and is not read - unless the model
    opens a user turn itself (<|im_start|>user...), from that <|im_start|> on, until it opens another."""
    path, _ = q3
    stack = load_stack(path)
    cfg = stack.config
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=4, max_codec_tokens=2, **_greedy(stack))
    ex.begin_user_turn()
    ex.add_user_audio(_wave(0.6, seed=11).numpy())
    prompt = ex.end_user_turn()
    assert prompt[-3:-1] == [cfg.im_start_id, cfg.assistant_id]
    reply = [5, 6, cfg.im_end_id, cfg.im_start_id, cfg.user_id, 7, 8, cfg.im_start_id, cfg.assistant_id, 9]
    start = len(ex.ids)
    for token in reply:  # as thinker_step asks, before the token joins ``ids``
        ex.context_used[len(ex.ids)] = ex._decode_used(token)
        ex.ids.append(token)
    roles = turn_roles(ex.ids, cfg.im_start_id)[start:]  # what a prefill of the conversation decides
    used = ex.context_used[start:len(ex.ids)].tolist()
    assert used == [r == cfg.user_id for r in roles] == [False] * 3 + [True] * 4 + [False] * 3


def _start_reply(ex: Qwen3OmniExecutor, seconds: float, seed: int) -> None:
    """One user turn of ``seconds`` of test speech, then the reply begins."""
    ex.begin_user_turn()
    ex.add_user_audio(_wave(seconds, seed=seed).numpy())
    ex.end_user_turn()
    ex.start_reply()


def test_cut_in_next_turn_equals_fresh_prefill_of_the_heard_history(q3):
    """After an interruption the next turn's thinker logits and talker frames equal an executor
    that read the heard history from scratch."""
    path, _ = q3
    stack = load_stack(path)
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=10, max_codec_tokens=12, **_greedy(stack))
    _start_reply(ex, 1.2, seed=5)
    for _ in range(8):
        ex.thinker_step()
        ex.talker_step()
    rollback = ex.interrupt(heard_samples=6 * ex.samples_per_code)
    assert 0 < rollback.kept_text_tokens < 8
    second = _wave(1.0, seed=6).numpy()

    def next_turn(executor):
        executor.begin_user_turn()
        executor.add_user_audio(second)
        executor.end_user_turn()
        logits = executor.thinker.logits(executor._last_hidden)
        executor.start_reply()
        while not executor.thinker_done:
            executor.thinker_step()
        while not executor.talker_done:
            executor.talker_step()
        return logits, executor.reply_codec_frames

    heard = list(ex.ids)
    audio = ex._stored_audio(0, len(heard))
    fresh = Qwen3OmniExecutor(stack, max_reply_tokens=10, max_codec_tokens=12, **_greedy(stack))
    fresh._prefill(heard, audio)
    fresh.turn_starts, fresh.head_lengths = list(ex.turn_starts), list(ex.head_lengths)
    fresh.prompt_end = ex.prompt_end
    got_logits, got_frames = next_turn(ex)
    want_logits, want_frames = next_turn(fresh)
    assert float((got_logits - want_logits).abs().max()) <= 1e-4
    assert got_frames == want_frames and len(got_frames) == 12


def test_streamed_audio_equals_one_shot_code2wav(q3):
    """vocoder_step hands out each frame's audio as it exists; together they equal code2wav run on
    the whole reply, and the first comes with the first frame."""
    path, _ = q3
    stack = load_stack(path)
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=8, max_codec_tokens=10, **_greedy(stack))
    _start_reply(ex, 1.0, seed=7)
    chunks, first_at = [], None
    while not (ex.thinker_done and ex.talker_done):
        if not ex.thinker_done:
            ex.thinker_step()
        code = ex.talker_step()
        got = ex.vocoder_step(final=ex.talker_done) if code is not None or ex.talker_done else []
        if got and first_at is None:
            first_at = len(ex.reply_codec_frames)
        chunks += got
    assert first_at == 1
    with torch.inference_mode():
        one_shot = stack.code2wav(torch.tensor(ex.reply_codec_frames).T).numpy()
    ours = np.concatenate(chunks)
    assert ours.shape == one_shot.shape
    assert np.abs(ours - one_shot).max() <= 1e-5


def test_talk_no_vad_greedy_equals_transformers_generate(q3, tmp_path):
    """``omnidesk talk --no-vad --greedy`` (the whole streamed path, as a subprocess): the prompt,
    text and codebook-0 ids in its timeline, and the reply it played (which carries every codebook),
    equal transformers' generate."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import soundfile as sf

    path, ref = q3
    stack = load_stack(path)
    wave = _wave(1.6, seed=8)
    sf.write(str(tmp_path / "q.wav"), wave.numpy(), 16000, subtype="FLOAT")
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "omnidesk", "talk", "--model", str(path), "--input", str(tmp_path / "q.wav"),
           "--no-vad", "--greedy", "--fast", "--max-text-tokens", str(MAX_TEXT), "--max-codec-tokens", str(FRAMES),
           "--output", str(tmp_path / "out.wav"), "--timeline", str(tmp_path / "t.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"omnidesk talk failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    turns = json.loads((tmp_path / "t.json").read_text())["turns"]
    assert len(turns) == 1 and not turns[0]["interrupted"]
    turn = turns[0]
    text, frames, ref_wav = reference_generate(ref, stack, turn["prompt_token_ids"], [wave], MAX_TEXT, FRAMES)
    assert turn["text_token_ids"] == text
    assert turn["codec_token_ids"] == [f[0] for f in frames] and len(frames) == FRAMES
    played, rate = sf.read(str(tmp_path / "out.wav"), dtype="float32")
    assert rate == 24000
    ref_wav = ref_wav.float().numpy()
    start = int(np.flatnonzero(np.abs(played) > 0)[0]) - int(np.flatnonzero(np.abs(ref_wav) > 0)[0])
    reply = played[start:start + ref_wav.size]
    assert reply.size == ref_wav.size
    # the WAV is 16-bit (steps of 3e-5), and the speaker fades the reply's last 5 ms out (no hard edge)
    fade = int(DEFAULT_FADE_MS * rate / 1000)
    assert np.abs(reply[:-fade] - ref_wav[:-fade]).max() <= 1e-4


def test_engine_steps_after_an_inference_mode_reply_on_the_same_model(q3):
    """`omnidesk reply` / the check turn run under torch.inference_mode; the engine's worker
    thread does not.  Nothing made in the first may be written in place by the second (a
    predictor cache kept on the module was: "Inplace update to inference tensor")."""
    path, _ = q3
    stack = load_stack(path)
    generate_reply(stack, _wave(0.8, seed=9), max_text_tokens=4, max_codec_tokens=3)
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=4, max_codec_tokens=3, **_greedy(stack))
    _start_reply(ex, 0.8, seed=10)
    while not (ex.thinker_done and ex.talker_done):
        ex.thinker_step()
        ex.talker_step()
    assert len(ex.reply_codec_frames) == 3


def test_the_real_model_is_refused_on_a_cpu_without_the_ram(tmp_path):
    """The published config (about 130 GiB in fp32) on this machine's CPU: a clear refusal before
    any weight is read, naming the need, what is free and what to do."""
    import shutil
    from pathlib import Path

    from omnidesk.models.checkpoint import ModelTooLargeError
    from omnidesk.models.memory import available_ram

    shutil.copy(Path(__file__).parent / "data" / "qwen3_omni" / "config.json", tmp_path / "config.json")
    if available_ram() > 200 * 2**30:
        pytest.skip("this machine has the RAM to try")
    with pytest.raises(ModelTooLargeError) as e:
        load_stack(tmp_path, device="cpu")
    msg = str(e.value)
    assert str(tmp_path) in msg and "RAM" in msg and "GiB" in msg and "--device cuda" in msg


def _fresh_rows(ex: Qwen3OmniExecutor):
    """A fresh executor's prefill of exactly the ids + audio ``ex`` holds: (last logits, context
    rows, which rows the talker reads)."""
    fresh = Qwen3OmniExecutor(ex.stack, capacity=ex.capacity, max_reply_tokens=ex.max_reply_tokens,
                              max_codec_tokens=ex.max_codec_tokens, **_greedy(ex.stack))
    fresh._prefill(list(ex.ids), ex._stored_audio(0, len(ex.ids)))
    n = len(ex.ids)
    return fresh.thinker.logits(fresh._last_hidden), fresh.context_rows[:n], fresh.context_used[:n]


def test_long_conversation_drops_old_turns_and_the_talker_reads_what_a_fresh_prefill_gives(q3):
    """Turns until the thinker cache fills several times (cut-ins and finished replies mixed): each
    drop re-prefills the kept turns, and then the thinker, the talker's rows and which of them it
    reads equal a fresh prefill of the same history; the talker cache holds exactly the user rows."""
    path, _ = q3
    stack = load_stack(path)
    ex = Qwen3OmniExecutor(stack, capacity=160, max_reply_tokens=8, max_codec_tokens=6, **_greedy(stack))
    drops = 0
    for turn in range(14):
        ex.begin_user_turn()
        ex.add_user_audio(_wave(0.9 + 0.1 * (turn % 3), seed=20 + turn).numpy())
        ex.end_user_turn()
        drops += len(ex.take_overflows())
        logits, rows, used = _fresh_rows(ex)  # the prompt as read, after any drop it needed
        assert float((logits - ex.thinker.logits(ex._last_hidden)).abs().max()) <= 1e-4
        assert float((rows - ex.context_rows[:len(ex.ids)]).abs().max()) <= 1e-4
        assert torch.equal(used, ex.context_used[:len(ex.ids)])
        ex.start_reply()
        while not (ex.thinker_done and ex.talker_done):
            ex.thinker_step()
            ex.talker_step()
        if turn % 3 == 2:
            ex.interrupt(heard_samples=3 * ex.samples_per_code)
        else:
            ex.finish_reply()
        drops += len(ex.take_overflows())
        assert len(ex.ids) == ex.thinker_cache_length <= ex.capacity
        assert ex.talker_cache.length == int(ex.context_used[:ex.talker_context].sum())
    assert drops >= 3


def test_a_failure_mid_reply_forgets_the_turn_and_the_conversation_goes_on(q3):
    """The vocoder fails mid-reply (a frame of codes it cannot take): abandon_turn puts the thinker
    and the talker back where the turn began, and the next turn equals one on a fresh executor."""
    path, _ = q3
    stack = load_stack(path)
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=8, max_codec_tokens=6, **_greedy(stack))
    _start_reply(ex, 1.0, seed=40)
    while not ex.talker_done:
        ex.thinker_step()
        ex.talker_step()
    ex.finish_reply()
    before = (list(ex.ids), ex.talker_cache.length)
    _start_reply(ex, 1.0, seed=41)
    for _ in range(3):
        ex.thinker_step()
        ex.talker_step()
    ex._reply.codes[-1] = [stack.config.code2wav.codebook_size] * stack.config.talker.num_code_groups
    with pytest.raises(ValueError, match="code2wav codes must lie in"):
        ex.vocoder_step()
    assert ex.abandon_turn()
    assert (list(ex.ids), ex.talker_cache.length) == before
    ex.begin_user_turn()
    ex.add_user_audio(_wave(1.0, seed=42).numpy())
    ex.end_user_turn()
    logits, rows, used = _fresh_rows(ex)
    assert float((logits - ex.thinker.logits(ex._last_hidden)).abs().max()) <= 1e-4
    assert torch.equal(used, ex.context_used[:len(ex.ids)])


@torch.inference_mode()
@pytest.mark.parametrize("past_block", [1, 180, 300])
def test_turn_ending_past_a_block_encodes_as_the_whole_utterance(q3, past_block):
    """Heard in 40 ms frames, a turn that ends a few samples past a block (inside the STFT margin
    the streamed encoder waits for) gives the audio tokens of the one-shot encoder."""
    stack = load_stack(q3[0])
    ex = Qwen3OmniExecutor(stack, capacity=1024, max_reply_tokens=4, **_greedy(stack))
    wave = _wave(2.0 * ex.block_samples / 16000 + 1, seed=3)[: ex.block_samples + past_block]
    ex.begin_user_turn()
    for i in range(0, len(wave), 640):
        ex.add_user_audio(wave[i:i + 640].numpy())
    ex.end_user_turn()
    streamed = torch.cat([a for _, a in ex._audio_store])
    one_shot = stack.thinker.audio_encoder(log_mel(wave, stack.features))
    assert streamed.shape == one_shot.shape
    assert float((streamed - one_shot).abs().max()) <= 1e-4
