"""What a spoken turn needs besides the modules: the speech system prompt, the
reference's decoding defaults and stop ids, and the prompt of one utterance.

The turn itself runs in the engine's executor (omnidesk/engine/executors);
``omnidesk.models.qwen2_5_omni.offline.generate_reply`` drives it start to finish.
"""

from __future__ import annotations

import torch

from ...features import log_mel
from ..sampling import SamplingParams
from .loading import OmniStack

# The system prompt the reference requires for speech output (FACTS.md).
SPEECH_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                        "perceiving auditory and visual inputs, as well as generating text and speech.")


def talker_suppressed_ids(stack: OmniStack) -> tuple[int, ...]:
    """Codec ids the talker must never choose: the codec bos, and every id the vocoder cannot take.

    transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` suppresses only the codec bos
    (``suppress_tokens=[talker.codec_bos_token]``) and stops on pad/end; any other id past the
    vocoder's codec table (``token2wav`` DiT ``num_embeds`` + 1 rows: 8194 in the published
    checkpoints, whose talker vocabulary has 8448 ids, specials at 8292-8296) would make its
    token2wav fail with an IndexError.  A trained talker rarely picks one, but sampling at
    temperature, a fine-tuned checkpoint or bf16 rounding can; so we also mask every id at or past
    the table except the stop ids.  For the published checkpoints that is ids 8194-8447 minus pad
    (8292) and end (8294); in-table ids are left exactly as the reference treats them.
    """
    cfg = stack.config.talker
    table = stack.vocoder.codec_table_size
    stops = set(cfg.stop_ids)
    beyond = [i for i in range(table, cfg.decoder.vocab_size) if i not in stops]
    return tuple(sorted({cfg.codec_bos_id, *beyond}))


def talker_defaults(stack: OmniStack, greedy: bool = False) -> SamplingParams:
    """The reference's talker decoding: top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05,
    codec bos suppressed (plus the ids the vocoder cannot take: :func:`talker_suppressed_ids`);
    ``greedy`` keeps the penalty and suppression, as do_sample=False does."""
    return SamplingParams(greedy=greedy, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                          suppress_ids=talker_suppressed_ids(stack))


def thinker_stop_ids(stack: OmniStack) -> tuple[int, ...]:
    """Thinker stop ids: generation_config.json's eos_token_id, else the tokenizer's end-of-turn tokens."""
    eos = stack.generation_config.get("eos_token_id")
    if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
    ids = stack.tokenizer.special_ids
    return tuple(ids[n] for n in ("im_end", "endoftext") if n in ids)


def audio_prompt(stack: OmniStack, waveform: torch.Tensor, system_prompt: str = SPEECH_SYSTEM_PROMPT):
    """Features, audio tokens and the prompt ids for one user utterance (16 kHz mono float)."""
    thinker = stack.thinker
    feats = log_mel(waveform.float(), stack.features).to(stack.device, stack.dtype)
    audio_tokens = thinker.audio_encoder(feats)
    messages = [{"role": "system", "content": system_prompt},
                {"role": "user", "content": [{"type": "audio", "audio": "utterance"}]}]
    ids = stack.tokenizer.audio_turn_ids(messages, [audio_tokens.shape[0]])
    return torch.tensor(ids, dtype=torch.long, device=stack.device), audio_tokens
