"""The thinker: the AuT audio encoder + token embeddings + Qwen3-MoE decoder + (untied) LM head.

The audio encoder's output rows fill the audio placeholder positions in
:meth:`Thinker.embed` (the encoder is built when the config has an ``audio``
part; the decoder tests build the language model alone).  For the talker
the thinker yields, per position, its input embedding and the hidden state
after layer ``accept_hidden_layer`` (``forward(..., hidden_layer=k)``).
"""

from __future__ import annotations

import torch
from torch import nn

from typing import Protocol

from ..checkpoint import Target
from ..kv_cache import KVCache, KVSpan
from ..layers import fill_placeholders
from .audio_encoder import AudioEncoder
from .decoder import Decoder, DecoderConfig, _join, decoder_weight_map


class ThinkerShape(Protocol):
    """What the thinker needs of its config (config.ThinkerConfig has it)."""

    text: DecoderConfig
    audio_token_id: int


class Thinker(nn.Module):
    def __init__(self, cfg: ThinkerShape):
        super().__init__()
        self.cfg = cfg
        text = cfg.text
        self.audio_token_id = cfg.audio_token_id
        audio = getattr(cfg, "audio", None)
        self.audio_encoder = AudioEncoder(audio) if audio is not None else None
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.decoder = Decoder(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        return self.decoder.new_cache(capacity, dtype, device)

    def embed(self, ids: torch.Tensor, audio_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T] -> input embeddings [T, H]; audio placeholders take ``audio_tokens`` rows in order."""
        return fill_placeholders(self.embed_tokens(ids), ids == self.audio_token_id, audio_tokens)

    def forward(self, embeds: torch.Tensor, cache: KVCache, hidden_layer: int | None = None):
        """Prefill or decode: embeds [T, H] appended to the cache -> final-normed hidden [T, H]
        (and the hidden state after layer ``hidden_layer``, see Decoder.forward)."""
        return self.decoder(embeds, cache, hidden_layer)

    def forward_static(self, embeds: torch.Tensor, cache: KVCache | KVSpan, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step in static form: embeds [T, H] written at ``input_pos`` [T] -> final-normed
        hidden [T, H], without a host sync (Decoder.forward_static)."""
        return self.decoder.forward_static(embeds, cache, input_pos)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def thinker_weight_map(cfg: ThinkerShape, ours: str = "thinker") -> dict[str, Target]:
    """``thinker.model.*`` (text model) and ``thinker.lm_head.weight`` -> our Thinker named ``ours``.

    The audio tower (``thinker.audio_tower.*``) and vision tower (``thinker.visual.*``) are not here."""
    text = cfg.text
    h, v = text.hidden_size, text.vocab_size
    out = decoder_weight_map("thinker.model", _join(ours, "decoder"), text)
    out["thinker.model.embed_tokens.weight"] = Target(_join(ours, "embed_tokens.weight"), (v, h))
    out["thinker.lm_head.weight"] = Target(_join(ours, "lm_head.weight"), (v, h))
    return out


__all__ = ["Thinker", "ThinkerShape", "thinker_weight_map"]
