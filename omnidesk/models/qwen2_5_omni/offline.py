"""One spoken turn start to finish, without streaming: listen, think to the end, talk to the end.

The same executor the engine streams with, driven sequentially: used by
``omnidesk reply``, by the tests against transformers' ``generate``, and as
the unstreamed run that the streamed one must equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...engine.executor import stage
from ..sampling import SamplingParams
from .executor import QwenOmniExecutor
from .loading import OmniStack
from .reply import SPEECH_SYSTEM_PROMPT


@dataclass
class Reply:
    prompt_ids: list[int]
    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)
    text: str = ""


@torch.inference_mode()
def generate_reply(stack: OmniStack, waveform: torch.Tensor, voice: str | None = None,
                   thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                   max_text_tokens: int = 256, max_codec_tokens: int = 2048, seed: int = 0, speak: bool = True,
                   system_prompt: str = SPEECH_SYSTEM_PROMPT) -> Reply:
    """One turn for a whole utterance (16 kHz mono); the thinker's sampling defaults to greedy.

    A failure raises :class:`~omnidesk.engine.executor.StageError` naming its stage."""
    ex = QwenOmniExecutor(stack, max_reply_tokens=max_text_tokens, max_codec_tokens=max_codec_tokens,
                          system_prompt=system_prompt,
                          thinker_sampling=thinker_sampling or SamplingParams(greedy=True),
                          talker_sampling=talker_sampling)
    with stage("thinker"):  # the encoder and the voice tag their own failures
        ex.begin_user_turn()
        ex.add_user_audio(waveform.detach().cpu().float().numpy())
        reply = Reply(prompt_ids=list(ex.end_user_turn()))
        ex.start_reply(voice, seed)
        while not ex.thinker_done:
            ex.thinker_step()
    with stage("talker"):
        while speak and not ex.talker_done:
            ex.talker_step()
    reply.text_ids, reply.codec_ids = ex.reply_text_ids, ex.reply_codec_ids
    reply.text = stack.tokenizer.decode(reply.text_ids)
    return reply
