"""How the front ends get a Qwen-Omni executor for a loaded stack, and one unstreamed turn with it.

Both Qwen families build their executor the same way: the checkpoint's
generation_config.json samples the thinker (greedy on request), the family's
talker defaults sample the talker, and the demo checkpoints, which rarely say
"stop" (they are untrained), have their replies capped unless the caller sets
limits.  Only the executor class, the talker defaults and the caps differ.
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams
from .thinker_talker import Reply, ThinkerTalkerExecutor, generation_defaults, run_turn


def executor_with_limits(executor: type[ThinkerTalkerExecutor], stack, talker_sampling: SamplingParams,
                         demo_limits: dict[str, int] | None, greedy: bool = False,
                         max_text_tokens: int | None = None, max_codec_tokens: int | None = None,
                         compile: str | None = None) -> ThinkerTalkerExecutor:
    """``executor`` for ``stack``: ``demo_limits`` ({"max_reply_tokens", "max_codec_tokens"}; None for a real
    checkpoint) overridden by the caller's limits; the thinker samples as the checkpoint says (greedy
    with ``greedy``); ``compile``: the decode-step setting (omnidesk.models.runner.resolve_mode)."""
    limits = dict(demo_limits or {})
    if max_text_tokens:
        limits["max_reply_tokens"] = max_text_tokens
    if max_codec_tokens:
        limits["max_codec_tokens"] = max_codec_tokens
    return executor(
        stack, **limits,
        thinker_sampling=SamplingParams(greedy=True) if greedy else generation_defaults(stack.generation_config),
        talker_sampling=talker_sampling, compile=compile)


def one_turn(executor: type[ThinkerTalkerExecutor], stack, waveform: torch.Tensor, voice: str | None,
             thinker_sampling: SamplingParams | None, talker_sampling: SamplingParams | None,
             max_text_tokens: int, max_codec_tokens: int, seed: int, speak: bool, system_prompt: str,
             compile: str | None) -> Reply:
    """One turn for a whole utterance (16 kHz mono) through a fresh ``executor``; the thinker's
    sampling defaults to greedy."""
    ex = executor(stack, max_reply_tokens=max_text_tokens, max_codec_tokens=max_codec_tokens,
                  system_prompt=system_prompt, compile=compile,
                  thinker_sampling=thinker_sampling or SamplingParams(greedy=True),
                  talker_sampling=talker_sampling)
    ex.runner.wait_ready()  # compiling asked for (``compile``): one turn is all there is, so wait for it
    return run_turn(ex, waveform, voice, seed, speak)


__all__ = ["executor_with_limits", "one_turn"]
