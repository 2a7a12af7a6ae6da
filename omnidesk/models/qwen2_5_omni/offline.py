"""One spoken turn start to finish, without streaming (see :func:`~omnidesk.models.thinker_talker.run_turn`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..omni_executor import one_turn
from ..sampling import SamplingParams
from ..thinker_talker import Reply
from .executor import QwenOmniExecutor
from .loading import OmniStack
from .reply import SPEECH_SYSTEM_PROMPT


@torch.inference_mode()
def generate_reply(stack: OmniStack, waveform: torch.Tensor, voice: str | None = None,
                   thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                   max_text_tokens: int = 256, max_codec_tokens: int = 2048, seed: int = 0, speak: bool = True,
                   system_prompt: str = SPEECH_SYSTEM_PROMPT, compile: str | None = "off") -> Reply:
    """One turn for a whole utterance (16 kHz mono); the thinker's sampling defaults to greedy."""
    return one_turn(QwenOmniExecutor, stack, waveform, voice, thinker_sampling, talker_sampling, max_text_tokens,
                    max_codec_tokens, seed, speak, system_prompt, compile)


def speak(stack: OmniStack, reply: Reply, voice_name: str, seed: int = 0) -> tuple[np.ndarray, int, list[str]]:
    """The streaming vocoder over a finished reply: (audio, its rate, what it cost, in words)."""
    v = stack.voices[voice_name]
    stream = stack.vocoder.stream(stack.vocoder.voice(v.cond, v.ref_mel), seed=seed)
    t0 = time.perf_counter()
    chunks, first = [], None
    for code in reply.codec_ids:
        ready = stream.push([code])
        if ready and first is None:
            first = (len(stream.codes), time.perf_counter() - t0)
        chunks += ready
    chunks += stream.flush()
    elapsed = time.perf_counter() - t0
    audio = np.concatenate([c.numpy() for c in chunks])
    rate = stack.vocoder.hop_length * 100  # 100 mel frames per second
    seconds = audio.size / rate
    notes = [f"vocoder: first chunk after {first[0]} speech tokens ({first[1] * 1000:.0f} ms)"] if first else []
    notes.append(f"vocoder: {seconds:.2f} s of audio in {elapsed * 1000:.0f} ms (RTF {elapsed / seconds:.2f})")
    return audio, rate, notes


__all__ = ["Reply", "generate_reply", "speak"]
