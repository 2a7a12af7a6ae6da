"""The talker: turns the thinker's reply into codec (speech) tokens.

Its inputs live in the thinker's embedding space and are projected down by
``thinker_to_talker_proj``:

* prompt: for every thinker prompt position, thinker hidden + thinker input
  embedding (audio positions contribute the hidden state only), then the
  voice's text-bos embedding + codec pad, then the first reply position +
  codec bos;
* each step: the embedding of the previous codec token + the next thinker
  reply position (:class:`~omnidesk.models.thinker_talker.ReplyFeed`): one reply position per step, then the
  thinker's text_eos embedding once, then text_pad for as long as speech goes on.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TalkerConfig
from ..kv_cache import KVCache
from .decoder import Decoder


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.decoder
        self.thinker_to_talker_proj = nn.Linear(d.embedding_size, d.hidden_size, bias=True)
        self.embed_tokens = nn.Embedding(d.vocab_size, d.embedding_size)  # codec ids -> thinker space
        self.decoder = Decoder(d)
        self.codec_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)

    def new_cache(self, capacity: int) -> KVCache:
        return self.decoder.new_cache(capacity)

    def codec_embed(self, codec_id: int | torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        if isinstance(codec_id, int):
            return w[codec_id]
        return self.embed_tokens(codec_id)

    def prompt_inputs(self, thinker_embeds: torch.Tensor, thinker_hidden: torch.Tensor, audio_mask: torch.Tensor,
                      voice_bos_embed: torch.Tensor, first_reply: torch.Tensor) -> torch.Tensor:
        """The talker prompt [P + 2, E] in thinker space (see module docstring)."""
        context = thinker_hidden + thinker_embeds.masked_fill(audio_mask[:, None], 0.0)
        bos_row = voice_bos_embed + self.codec_embed(self.cfg.codec_pad_id)
        first_row = first_reply + self.codec_embed(self.cfg.codec_bos_id)
        return torch.cat([context, bos_row[None], first_row[None]], dim=0)

    def step_input(self, codec_id: int | torch.Tensor, reply: torch.Tensor) -> torch.Tensor:
        return (self.codec_embed(codec_id) + reply).reshape(1, -1)

    def forward(self, inputs: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """inputs [T, E] (thinker space) appended to the cache -> codec logits [T, V] (fp32)."""
        h = self.decoder(self.thinker_to_talker_proj(inputs).unsqueeze(0), cache)[0]
        return self.codec_head(h).float()

    def forward_static(self, inputs: torch.Tensor, cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
        h = self.decoder.forward_static(self.thinker_to_talker_proj(inputs).unsqueeze(0), cache, input_pos)[0]
        return self.codec_head(h).float()
