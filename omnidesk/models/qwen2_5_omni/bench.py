"""``omnidesk bench`` for Qwen2.5-Omni: the shared turn benchmark (:mod:`omnidesk.models.turn_bench`)
with this family's executor and its transformers reference."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..turn_bench import run as run_turn_bench
from .executor import QwenOmniExecutor
from .loading import OmniStack


def transformers_side(stack: OmniStack, audio: np.ndarray, max_text: int, max_codec: int) -> dict:
    if stack.quantization is not None and stack.quantization["format"] != "int8":
        return {"skipped": f"{stack.quantization['label']} weights: transformers would need gptqmodel/autoawq"}
    try:
        from transformers import Qwen2_5OmniForConditionalGeneration
    except ImportError:
        return {"skipped": "transformers is not installed (pip install -e '.[test]')"}
    from omnidesk.features import log_mel
    from omnidesk.models.qwen2_5_omni.reply import audio_prompt

    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(stack.path), dtype=torch.float32).eval()
    wave = torch.from_numpy(audio)
    ids, _ = audio_prompt(stack, wave)
    feats = log_mel(wave, stack.features)
    pad = torch.tensor([stack.tokenizer.special_ids.get("endoftext", 0)])
    inputs = dict(input_ids=torch.cat([pad, ids])[None],
                  attention_mask=torch.cat([torch.zeros(1, dtype=torch.long), torch.ones(ids.numel(), dtype=torch.long)])[None],
                  input_features=feats[None], feature_attention_mask=torch.ones(1, feats.shape[1], dtype=torch.long))
    talker = stack.config.talker
    times = []
    wav = None
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.inference_mode():
            _, wav = ref.generate(**inputs, thinker_max_new_tokens=max_text, thinker_do_sample=False,
                                  talker_max_new_tokens=max_codec, talker_eos_token_id=list(talker.stop_ids))
        times.append(time.perf_counter() - t0)
    audio_s = wav.numel() / (stack.vocoder.hop_length * 100)
    return {"generate_s": min(times), "first_audio_after_endpoint_ms": min(times) * 1e3, "audio_s": audio_s,
            "rtf": min(times) / audio_s if audio_s else None}


def run(stack: OmniStack, turns: int = 3, interrupts: int = 50, with_transformers: bool = True) -> dict:
    result = run_turn_bench(QwenOmniExecutor, stack, turns=turns, interrupts=interrupts,
                            transformers_side=transformers_side if with_transformers else None, codes_per_second=50.0)
    result["quantization"] = stack.quantization  # None: float weights; else format and matmul paths
    return result
