"""The thinker: audio encoder + Qwen2 LLM with TMRoPE.

The thinker reads the conversation (text ids with audio placeholders filled by
encoder outputs) into its KV cache and decodes the reply text.  For each
position it yields the input embedding and the final (normed) hidden state;
their sum is what the talker speaks from.
"""

from __future__ import annotations

import torch
from torch import nn

from .audio_encoder import AudioEncoder
from .config import ThinkerConfig
from ..kv_cache import KVCache
from ..layers import fill_placeholders
from .decoder import Decoder


class Thinker(nn.Module):
    def __init__(self, cfg: ThinkerConfig):
        super().__init__()
        self.cfg = cfg
        text = cfg.text
        self.audio_encoder = AudioEncoder(cfg.audio)
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.decoder = Decoder(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)

    def new_cache(self, capacity: int) -> KVCache:
        return self.decoder.new_cache(capacity)

    def embed(self, ids: torch.Tensor, audio_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T] -> input embeddings [T, H]; audio placeholders take ``audio_tokens`` in order."""
        return fill_placeholders(self.embed_tokens(ids), ids == self.cfg.audio_token_id, audio_tokens)

    def forward(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Prefill or decode: embeds [T, H] appended to the cache -> normed hidden [T, H]."""
        return self.decoder(embeds.unsqueeze(0), cache)[0]

    def forward_static(self, embeds: torch.Tensor, cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
        """Static-shape variant of :meth:`forward` for graph capture (see decoder.Decoder)."""
        return self.decoder.forward_static(embeds.unsqueeze(0), cache, input_pos)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
