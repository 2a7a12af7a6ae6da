"""One spoken turn, start to finish, with our modules (no streaming).

This is the plain sequential path - listen, think to the end, talk to the
end - used by ``omnidesk reply``, by the tests against transformers'
``generate`` and as the reference the streaming engine is checked against.
It follows the reference's rules exactly (see talker.py for the feeding rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .features import log_mel
from .loading import OmniStack
from .sampling import Sampler, SamplingParams
from .talker import ReplyFeed

# The system prompt the reference requires for speech output (FACTS.md).
SPEECH_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                        "perceiving auditory and visual inputs, as well as generating text and speech.")


def talker_defaults(stack: OmniStack, greedy: bool = False) -> SamplingParams:
    """The reference's talker decoding: top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05,
    codec bos suppressed; ``greedy`` keeps the penalty and suppression, as do_sample=False does."""
    cfg = stack.config.talker
    return SamplingParams(greedy=greedy, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                          suppress_ids=(cfg.codec_bos_id,))


def thinker_stop_ids(stack: OmniStack) -> tuple[int, ...]:
    """Thinker stop ids: generation_config.json's eos_token_id, else the tokenizer's end-of-turn tokens."""
    eos = stack.generation_config.get("eos_token_id")
    if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
    ids = stack.tokenizer.special_ids
    return tuple(ids[n] for n in ("im_end", "endoftext") if n in ids)


@dataclass
class Reply:
    prompt_ids: list[int]
    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)
    text: str = ""


def audio_prompt(stack: OmniStack, waveform: torch.Tensor, system_prompt: str = SPEECH_SYSTEM_PROMPT):
    """Features, audio tokens and the prompt ids for one user utterance (16 kHz mono float)."""
    thinker = stack.thinker
    feats = log_mel(waveform.float(), stack.features).to(stack.device, stack.dtype)
    audio_tokens = thinker.audio_encoder(feats)
    messages = [{"role": "system", "content": system_prompt},
                {"role": "user", "content": [{"type": "audio", "audio": "utterance"}]}]
    ids = stack.tokenizer.audio_turn_ids(messages, [audio_tokens.shape[0]])
    return torch.tensor(ids, dtype=torch.long, device=stack.device), audio_tokens


@torch.inference_mode()
def generate_reply(stack: OmniStack, waveform: torch.Tensor, voice: str | None = None,
                   thinker_sampling: SamplingParams = SamplingParams(greedy=True),
                   talker_sampling: SamplingParams | None = None, max_text_tokens: int = 256,
                   max_codec_tokens: int = 2048, generator: torch.Generator | None = None,
                   speak: bool = True, system_prompt: str = SPEECH_SYSTEM_PROMPT) -> Reply:
    thinker, talker = stack.thinker, stack.talker
    ids, audio_tokens = audio_prompt(stack, waveform, system_prompt)
    prompt_embeds = thinker.embed(ids, audio_tokens)
    cache = thinker.new_cache(ids.shape[0] + max_text_tokens + 1)
    hidden = thinker(prompt_embeds, cache)
    reply = Reply(prompt_ids=ids.tolist())

    stops = set(thinker_stop_ids(stack))
    sampler = Sampler(thinker_sampling, stack.config.thinker.text.vocab_size, stack.device, generator)
    sampler.observe(ids)
    # reply_vectors[j] = embedding + hidden of reply token j, available once the thinker has read it
    reply_vectors = []
    token = sampler.choose(thinker.logits(hidden[-1]))
    while True:
        reply.text_ids.append(token)
        if token in stops or len(reply.text_ids) >= max_text_tokens:
            break
        embed = thinker.embed_tokens.weight[token][None]
        h = thinker(embed, cache)
        reply_vectors.append(embed[0] + h[0])
        token = sampler.choose(thinker.logits(h[-1]))
    reply.text = stack.tokenizer.decode(reply.text_ids)
    if not speak or talker is None or not reply_vectors:
        return reply

    tcfg = stack.config.talker
    voice = voice or stack.default_voice
    if voice not in stack.voices:
        raise KeyError(f"voice '{voice}' is not in {stack.path / 'spk_dict.pt'} (have: {', '.join(stack.voices)})")
    embed = thinker.embed_tokens.weight
    feed = ReplyFeed(eos_vector=embed[tcfg.text_eos_id], pad_vector=embed[tcfg.text_pad_id])
    for vec in reply_vectors[1:]:
        feed.push(vec)
    feed.finish()
    audio_mask = ids == stack.config.thinker.audio_token_id
    inputs = talker.prompt_inputs(prompt_embeds, hidden, audio_mask, embed[stack.voices[voice].bos_token],
                                  reply_vectors[0])
    tcache = talker.new_cache(inputs.shape[0] + max_codec_tokens + 1)
    logits = talker(inputs, tcache)[-1]
    params = talker_sampling or talker_defaults(stack)
    codec_sampler = Sampler(params, tcfg.decoder.vocab_size, stack.device, generator)
    # the reference's prompt codec ids: a mask id per thinker position, then pad, bos
    codec_sampler.observe([tcfg.codec_mask_id, tcfg.codec_pad_id, tcfg.codec_bos_id])
    stop_codes = set(tcfg.stop_ids)
    while len(reply.codec_ids) < max_codec_tokens:
        code = codec_sampler.choose(logits)
        if code in stop_codes:
            break
        reply.codec_ids.append(code)
        logits = talker(talker.step_input(code, feed.next()), tcache)[-1]
    return reply
