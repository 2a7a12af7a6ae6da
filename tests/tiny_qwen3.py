"""Tiny random Qwen3-Omni checkpoints written by transformers (the test oracle).

A full ``Qwen3OmniMoeForConditionalGeneration`` saved with ``save_pretrained`` (experts one
tensor each, the published layout) plus tokenizer files with the real special-token strings and
a preprocessor config: what a user downloads, only small.  The sizes exercise what matters:
MoE routing (8 experts, top-2, renormalised; the talker's shared expert), GQA (4:2), interleaved
mrope sections, a code predictor with several codebooks, code2wav at its real 1920 samples per
frame.  The config is the demo recipe's (``omnidesk.models.qwen3_omni.demo.demo_config``) with
other token ids, written here by transformers, not by our code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_VOCAB = 1024
FIRST_SPECIAL_ID = 880  # the demo's is 900: an id written in code would break one of them


def write_checkpoint(path: Path, seed: int = 0, accept_hidden_layer: int = 2):
    """Write the checkpoint to ``path``; returns the transformers model (fp32, eval)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnidesk.models.qwen2_5_omni.tokenizer import Tokenizer, write_tokenizer_files
    from omnidesk.models.qwen3_omni import demo

    path = Path(path)
    ids = write_tokenizer_files(path, vocab_size=TOKENIZER_VOCAB, first_special_id=FIRST_SPECIAL_ID,
                                specials=demo.SPECIAL_TOKENS, media=demo.MEDIA, template=demo.TEMPLATE,
                                processor_class="Qwen3OmniMoeProcessor", extra_corpus=demo.ROLE_CORPUS)
    tok = Tokenizer.from_dir(path)
    roles = {r: tok.encode(r)[0] for r in ("system", "user", "assistant")}
    raw = demo.demo_config(ids, roles)
    raw.pop("omnidesk_demo")
    raw["talker_config"]["accept_hidden_layer"] = accept_hidden_layer
    config = Qwen3OmniMoeConfig(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
    # transformers 5 leaves some weights uninitialised (fused experts) and others at exact
    # zeros/ones (biases, norms): give every tensor seeded random values, so a missed bias or
    # norm weight shows up as a mismatch.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                # token embeddings at unit scale: with 0.02 every token looks alike and greedy text
                # repeats one id, which would test little
                scale = 1.0 if name.endswith("embed_tokens.weight") else 0.02 if p.dim() > 1 else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name and p.dim() == 1 else 0.0))
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(demo.PREPROCESSOR, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["im_end"], ids["endoftext"]],
                                                             "pad_token_id": ids["endoftext"]}, indent=2))
    return model


__all__ = ["write_checkpoint"]
