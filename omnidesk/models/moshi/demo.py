"""The built-in Moshi demo: a tiny, seeded, random-weight checkpoint in the published layout.

Files, as in kyutai/moshiko-pytorch-bf16 plus the config.json of the newer repos:
``model.safetensors`` (the LM under the published tensor names, per-codebook
and per-step tensors written unstacked, as the loader expects them),
``tokenizer-e351c8d8-checkpoint125.safetensors`` (a toy-width Mimi),
``tokenizer_spm_32k_3.model`` (a tiny SentencePiece model trained on the
spot), ``config.json`` (the DEMO LM kwargs, ``mimi_config_name`` and the
OmniDesk mark in ``model_id``) and ``mimi_config.json`` (the codec's config).
Its weights are random: what it says is noise (DEMO_NOTICE).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..cache_dir import user_cache_dir, write_checkpoint_dir
from .config import DEMO as LM_DEMO
from .config import MIMI_NAME, MOSHI_NAME, TOKENIZER_NAME
from .lm import MoshiLM, weight_map
from .mimi import Mimi, checkpoint_state_dict, init_random_
from .mimi_config import DEMO as MIMI_DEMO
from .tokenizer import write_demo_tokenizer

NAME = "moshi-demo"  # what names it wherever a model is asked for
DEMO_NOTICE = ("Moshi demo model: tiny and untrained (random weights) - what it says is noise, not speech. "
               "Real Moshi weights: kyutai/moshiko-pytorch-bf16 (needs a CUDA GPU with ~18 GB)")
MARK = "omnidesk_demo"  # key in config.json's model_id
MIMI_CONFIG_NAME = "mimi_config.json"

# Bump when the recipe changes: a demo made by an older recipe is rebuilt.
RECIPE_VERSION = 1
SEED = 20261203


def default_demo_dir() -> Path:
    return user_cache_dir() / f"demo-moshi-r{RECIPE_VERSION}"


def demo_config() -> dict:
    """config.json of the demo (the reference's layout: LM kwargs + file names + model_id)."""
    d = LM_DEMO.to_dict()
    d["mimi_config_name"] = MIMI_CONFIG_NAME
    d["model_id"] = {MARK: {"recipe": RECIPE_VERSION, "seed": SEED, "notice": DEMO_NOTICE}}
    return d


def is_moshi_demo(config: dict | None) -> bool:
    """Whether a raw config.json is the Moshi demo's."""
    model_id = (config or {}).get("model_id")
    return isinstance(model_id, dict) and MARK in model_id


def make_moshi_demo(dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write the demo checkpoint (atomically) and return its directory; reuses a complete one."""
    return write_checkpoint_dir(dir, default_demo_dir(), _write_demo, force)


def lm_checkpoint_tensors(lm: MoshiLM) -> dict[str, torch.Tensor]:
    """Our LM's weights under the published names: the inverse of the loader (a stacked parameter's
    slice ``index`` becomes its own tensor, reshaped to the checkpoint's shape, e.g. the norms'
    [1, 1, dim] and the depformer's row-stacked attention projections)."""
    params = dict(lm.named_parameters())
    out = {}
    for name, target in weight_map(lm.cfg).items():
        t = params[target.param]
        if target.index is not None:
            t = t[target.index]
        out[name] = t.detach().reshape(target.shape).contiguous().clone()
    return out


def _write_demo(root: Path) -> None:
    from safetensors.torch import save_file

    raw = demo_config()
    lm = MoshiLM(LM_DEMO).init_random_(SEED)
    save_file(lm_checkpoint_tensors(lm), str(root / MOSHI_NAME), metadata={"format": "pt"})
    mimi = init_random_(Mimi(MIMI_DEMO), torch.Generator().manual_seed(SEED + 1))
    save_file({k: v.contiguous() for k, v in checkpoint_state_dict(mimi).items()}, str(root / MIMI_NAME),
              metadata={"format": "pt"})
    tokenizer = write_demo_tokenizer(root / TOKENIZER_NAME)
    import sentencepiece as spm

    pieces = spm.SentencePieceProcessor(model_file=str(tokenizer)).GetPieceSize()
    assert pieces <= LM_DEMO.text_card, (pieces, LM_DEMO.text_card)  # the LM must be able to say every piece
    (root / MIMI_CONFIG_NAME).write_text(json.dumps(MIMI_DEMO.to_dict(), indent=2))
    (root / "config.json").write_text(json.dumps(raw, indent=2))


__all__ = ["DEMO_NOTICE", "NAME", "RECIPE_VERSION", "default_demo_dir", "demo_config", "is_moshi_demo",
           "lm_checkpoint_tensors", "make_moshi_demo"]
