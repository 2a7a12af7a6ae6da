"""Thinker and talker against transformers (the oracle) on checkpoints transformers wrote.

Tolerances are for fp32 on the CPU.  Measured on the dev machine (2 cores,
torch 2.13 CPU): thinker logits max |diff| 3.0e-7 (variant a) and 5.1e-7 (b)
over prefill + 20 decode steps; talker logits 2.1e-7 / 2.2e-7 over its prompt
and 14 steps; greedy text and codec ids identical.
"""

import pytest
import torch

from omnidesk.features import log_mel
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.offline import generate_reply
from omnidesk.models.qwen2_5_omni.reply import audio_prompt, talker_defaults
from omnidesk.models.sampling import SamplingParams

TOL = 1e-4

VARIANTS = ["a", "b"]


def _reference_inputs(stack, waveform):
    """The reference's inputs for one utterance, left-padded by one token.

    Why the pad: transformers 5.24's generate() drops an all-ones attention
    mask, and its talker adds the codec pad/bos embeddings to the end of its
    prompt only when it receives a mask - so an unpadded single input would
    run the talker without them, which is not how the model is meant to run
    (FACTS.md: the talker prompt ends with codec [pad, bos]).  With one left
    pad the mask survives and the reference takes its designed path; the
    masked pad position changes nothing else (positions come from the mask).
    """
    ids, _ = audio_prompt(stack, waveform)
    feats = log_mel(waveform, stack.features)
    pad = torch.tensor([stack.tokenizer.special_ids["endoftext"]])
    return dict(
        input_ids=torch.cat([pad, ids])[None],
        attention_mask=torch.cat([torch.zeros(1, dtype=torch.long), torch.ones(ids.shape[0], dtype=torch.long)])[None],
        input_features=feats[None],
        feature_attention_mask=torch.ones(1, feats.shape[1], dtype=torch.long),
    )


@pytest.fixture(scope="module", params=VARIANTS)
def loaded(request, tiny_checkpoints):
    path, ref = tiny_checkpoints(request.param)
    return load_stack(path), ref


@torch.inference_mode()
def test_thinker_logits_prefill_and_decode(loaded, speech_like):
    stack, ref = loaded
    wave = speech_like(2.6, seed=1)
    inputs = _reference_inputs(stack, wave)
    stop = stack.tokenizer.special_ids["im_end"]
    out = ref.thinker.generate(**inputs, max_new_tokens=21, min_new_tokens=21, do_sample=False,
                               output_logits=True, return_dict_in_generate=True, eos_token_id=stop)
    ref_ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()

    thinker = stack.thinker
    ids, audio_tokens = audio_prompt(stack, wave)
    cache = thinker.new_cache(256)
    hidden = thinker(thinker.embed(ids, audio_tokens), cache)
    logits = thinker.logits(hidden[-1])
    diffs = []
    for step, ref_logits in enumerate(out.logits):
        diffs.append((logits - ref_logits[0]).abs().max().item())
        token = ref_ids[step]
        logits = thinker.logits(thinker(thinker.embed_tokens.weight[token][None], cache)[-1])
    assert len(diffs) == 21  # prefill + 20 decode steps
    print(f"max |logit diff| over {len(diffs)} steps: {max(diffs):.2e}")
    assert max(diffs) <= TOL, diffs


def _reference_generate(stack, ref, inputs, **kwargs):
    """transformers' full generate; returns (text ids, codec ids before the stop id, talker logits per step)."""
    captured = {"logits": []}
    orig_generate = ref.talker.generate

    def spy(*args, **kw):
        result = orig_generate(*args, **kw)
        captured["codes"] = result[0, kw["input_ids"].shape[1]:].tolist()
        return result

    hook = ref.talker.register_forward_hook(lambda m, a, o: captured["logits"].append(o.logits[0, -1].clone()))
    ref.talker.generate = spy
    try:
        seq, _wav = ref.generate(**inputs, thinker_do_sample=False, talker_do_sample=False,
                                 thinker_eos_token_id=stack.tokenizer.special_ids["im_end"],
                                 talker_eos_token_id=list(stack.config.talker.stop_ids), **kwargs)
    finally:
        ref.talker.generate = orig_generate
        hook.remove()
    stops = set(stack.config.talker.stop_ids)
    codes = captured["codes"]
    codes = codes[:next((i for i, c in enumerate(codes) if c in stops), len(codes))]
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), codes, captured["logits"]


@torch.inference_mode()
def test_greedy_thinker_and_talker_ids_equal_reference(loaded, speech_like):
    stack, ref = loaded
    wave = speech_like(1.7, seed=2)
    ref_text, ref_codes, _ = _reference_generate(stack, ref, _reference_inputs(stack, wave), speaker="Ethan",
                                                 thinker_max_new_tokens=12, talker_max_new_tokens=30)
    reply = generate_reply(stack, wave, voice="Ethan", thinker_sampling=SamplingParams(greedy=True),
                           talker_sampling=talker_defaults(stack, greedy=True), max_text_tokens=12,
                           max_codec_tokens=30)
    assert reply.text_ids == ref_text
    assert len(reply.codec_ids) > 0
    assert reply.codec_ids == ref_codes


@torch.inference_mode()
def test_talker_logits_match_reference(loaded, speech_like):
    """Talker logits for the prompt and each step, fed the same codes as the reference."""
    stack, ref = loaded
    wave = speech_like(1.1, seed=3)
    tcfg = stack.config.talker
    text_ids, codes, ref_logits = _reference_generate(stack, ref, _reference_inputs(stack, wave),
                                                      thinker_max_new_tokens=8, talker_max_new_tokens=15,
                                                      talker_min_new_tokens=15)

    # Rebuild the talker inputs with our modules from the same thinker run.
    thinker, talker = stack.thinker, stack.talker
    ids, audio_tokens = audio_prompt(stack, wave)
    embeds = thinker.embed(ids, audio_tokens)
    cache = thinker.new_cache(256)
    hidden = thinker(embeds, cache)
    vectors = []
    for token in text_ids[:-1]:
        e = thinker.embed_tokens.weight[token][None]
        vectors.append(e[0] + thinker(e, cache)[0])
    from omnidesk.models.thinker_talker import ReplyFeed

    w = thinker.embed_tokens.weight
    feed = ReplyFeed(w[tcfg.text_eos_id], w[tcfg.text_pad_id])
    for v in vectors[1:]:
        feed.push(v)
    feed.finish()
    voice = stack.voices[stack.default_voice]
    prompt = talker.prompt_inputs(embeds, hidden, ids == stack.config.thinker.audio_token_id, w[voice.bos_token],
                                  vectors[0])
    tcache = talker.new_cache(prompt.shape[0] + 32)
    logits = talker(prompt, tcache)[-1]
    diffs = [(logits - ref_logits[0]).abs().max().item()]
    for step, code in enumerate(codes[:len(ref_logits) - 1]):
        logits = talker(talker.step_input(code, feed.next()), tcache)[-1]
        diffs.append((logits - ref_logits[step + 1]).abs().max().item())
    assert len(diffs) >= 10
    print(f"max |logit diff| over {len(diffs)} steps: {max(diffs):.2e}")
    assert max(diffs) <= TOL, diffs
