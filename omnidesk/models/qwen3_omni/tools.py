"""The unstreamed one-turn tools of Qwen3-Omni, as the registry hands them to the CLI
(``omnidesk reply``, ``omnidesk bench``, the terminal check turn)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..omni_executor import one_turn
from ..sampling import SamplingParams
from ..thinker_talker import Reply
from ..turn_bench import run as run_turn_bench
from .executor import SYSTEM_PROMPT, Qwen3OmniExecutor, talker_defaults
from .loading import Qwen3OmniStack


@torch.inference_mode()
def generate_reply(stack: Qwen3OmniStack, waveform: torch.Tensor, voice: str | None = None,
                   thinker_sampling: SamplingParams | None = None, talker_sampling: SamplingParams | None = None,
                   max_text_tokens: int = 256, max_codec_tokens: int = 1500, seed: int = 0, speak: bool = True,
                   system_prompt: str = SYSTEM_PROMPT, compile: str | None = "off") -> Reply:
    """One turn for a whole utterance (16 kHz mono); the thinker's sampling defaults to greedy.
    ``max_codec_tokens`` counts 80 ms frames."""
    return one_turn(Qwen3OmniExecutor, stack, waveform, voice, thinker_sampling, talker_sampling, max_text_tokens,
                    max_codec_tokens, seed, speak, system_prompt, compile)


@torch.inference_mode()
def speak(stack: Qwen3OmniStack, reply: Reply, voice_name: str | None = None,
          seed: int = 0) -> tuple[np.ndarray, int, list[str]]:
    """code2wav over a finished reply's frames, one frame at a time as the live path runs it:
    (audio, its rate, what it cost, in words).  The voice is in the codes already."""
    from .executor import SAMPLE_RATE_OUT

    stream = stack.code2wav.stream()
    t0 = time.perf_counter()
    parts, first = [], None
    for frame in reply.codec_frames:
        parts.append(stream.push(torch.tensor(frame, dtype=torch.long, device=stack.device)[:, None]).float().cpu())
        if first is None:
            first = time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    audio = torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)
    seconds = audio.size / SAMPLE_RATE_OUT
    notes = []
    if first is not None:
        notes.append(f"code2wav: first audio after 1 frame ({first * 1000:.1f} ms)")
    if seconds:
        notes.append(f"code2wav: {seconds:.2f} s of audio in {elapsed * 1000:.0f} ms (RTF {elapsed / seconds:.2f})")
    return audio, SAMPLE_RATE_OUT, notes


def transformers_side(stack: Qwen3OmniStack, audio: np.ndarray, max_text: int, max_codec: int) -> dict:
    """The same checkpoint and utterance through transformers' generate (thinker, talker, code2wav):
    its first audio is its whole run."""
    try:
        from transformers import Qwen3OmniMoeForConditionalGeneration
    except ImportError:
        return {"skipped": "transformers is not installed (pip install -e '.[test]')"}
    # only the prompt is wanted of it: no decode step runs, so nothing to compile or capture
    ex = Qwen3OmniExecutor(stack, max_reply_tokens=max_text, max_codec_tokens=max_codec, compile="off")
    ex.begin_user_turn()
    ex.add_user_audio(audio)
    prompt = ex.end_user_turn()
    from ...features import log_mel

    feats = log_mel(torch.from_numpy(audio), stack.features)
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(stack.path), dtype=torch.float32).eval()
    inputs = dict(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                  input_features=feats[None], feature_attention_mask=torch.ones(1, feats.shape[1], dtype=torch.long))
    times, wav = [], None
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.inference_mode():
            _, wav = ref.generate(**inputs, thinker_max_new_tokens=max_text, thinker_do_sample=False,
                                  talker_max_new_tokens=max_codec, talker_do_sample=False)
        times.append(time.perf_counter() - t0)
    from .executor import SAMPLE_RATE_OUT

    audio_s = wav.numel() / SAMPLE_RATE_OUT
    return {"generate_s": min(times), "first_audio_after_endpoint_ms": min(times) * 1e3, "audio_s": audio_s,
            "rtf": min(times) / audio_s if audio_s else None}


def run_bench(stack: Qwen3OmniStack, turns: int = 3, interrupts: int = 50, with_transformers: bool = True) -> dict:
    return run_turn_bench(Qwen3OmniExecutor, stack, turns=turns, interrupts=interrupts,
                          transformers_side=transformers_side if with_transformers else None, codes_per_second=12.5)


__all__ = ["generate_reply", "run_bench", "speak", "talker_defaults"]
