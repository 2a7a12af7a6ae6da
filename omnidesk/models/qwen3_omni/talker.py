"""The talker (codec group 0, MoE decoder) and its code predictor (groups 1..G-1, dense).

A speech frame is ``num_code_groups`` (G = 16) codes.  Per frame, as the
reference's ``Qwen3OmniMoeTalkerForConditionalGeneration`` generates it:

1. the talker's step gives its final-normed hidden state h (last position) and,
   through ``codec_head``, code 0 (vocabulary ``talker vocab_size``);
2. :meth:`Talker.expand`: the code predictor prefills [h, talker_codec_embedding(code 0)]
   into a fresh cache (positions 0, 1) and its ``lm_head[0]`` gives code 1; then step
   g = 2..G-1 feeds ``code_predictor.codec_embedding[g-2](code g-1)`` at position g
   and ``lm_head[g-1]`` gives code g;
3. the next talker input is :meth:`Talker.frame_embedding` (the sum of the G code
   embeddings: code 0 through the talker's table, code g >= 1 through the predictor's
   ``codec_embedding[g-1]``) plus the next text row (the caller adds it: the
   projected reply token, then tts_eos, then tts_pad).

Text enters through ``text_projection`` and thinker hidden states (audio
positions) through ``hidden_projection``: both 2-layer MLPs with biases,
thinker width -> talker ``intermediate_size`` -> talker width, SiLU between.

Steps 2 and 3 also exist in static form (:meth:`CodePredictor.expand_static`,
:meth:`Talker.forward_static`): codes stay on the device and every position is a
tensor or a constant, so a frame is one compiled or captured decode step
(omnidesk.models.runner) with no host sync; the numbers are those of the eager form.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError, Target
from ..kv_cache import KVCache, KVSpan
from .decoder import Decoder, DecoderConfig, _join, decoder_weight_map

# choose(logits [V] fp32, group) -> code; ``group`` is the code group being chosen (1..G-1)
Choose = Callable[[torch.Tensor, int], int]
# the same on the device: -> code [1] (long), no host sync
ChooseOnDevice = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, group: int) -> int:
    """The reference's choice with do_sample=False."""
    return int(torch.argmax(logits))


class TalkerShape(Protocol):
    """What the talker needs of its config (config.TalkerConfig has it)."""

    text: DecoderConfig
    code_predictor: DecoderConfig
    thinker_hidden_size: int
    num_code_groups: int


class ResizeMLP(nn.Module):
    """thinker width -> talker width: linear_fc1 (bias), SiLU, linear_fc2 (bias)."""

    def __init__(self, in_size: int, inner: int, out_size: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Dense decoder that completes a frame: codes 1..G-1 from the talker's hidden state and code 0."""

    def __init__(self, cfg: DecoderConfig, num_code_groups: int):
        super().__init__()
        if num_code_groups < 2:
            raise ConfigError(f"num_code_groups must be at least 2, got {num_code_groups}")
        self.cfg, self.num_code_groups = cfg, num_code_groups
        self.vocab_size = cfg.vocab_size
        self.decoder = Decoder(cfg)
        n = num_code_groups - 1
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(n))
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(n))

    def new_cache(self, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """Room for one frame: the 2-position prefill and G-2 one-code steps."""
        return self.decoder.new_cache(self.num_code_groups, dtype, device)

    def expand(self, talker_hidden: torch.Tensor, code0: int, talker: "Talker", choose: Choose = greedy,
               cache: KVCache | None = None) -> list[int]:
        """The whole frame [code 0, code 1, ..., code G-1] from the talker's last hidden state [H]
        and its code 0 (embedded through ``talker``'s table).

        ``cache`` (one frame's worth, :meth:`new_cache`) is reset and reused: the executor owns
        one, so no frame allocates.  Without it a fresh one is made: the module keeps no state (a
        cache made under ``torch.inference_mode`` could not be written outside it later)."""
        if cache is None:
            cache = self.new_cache(talker_hidden.dtype, talker_hidden.device)
        cache.reset()
        x = torch.stack((talker_hidden, talker.codec_embed(code0).to(talker_hidden.dtype)))
        codes = [int(code0)]
        for group in range(1, self.num_code_groups):
            hidden = self.decoder(x, cache)[-1]
            code = int(choose(self.lm_head[group - 1](hidden).float(), group))
            codes.append(code)
            if group < self.num_code_groups - 1:
                x = self.codec_embedding[group - 1].weight[code].unsqueeze(0)
        return codes

    def expand_static(self, talker_hidden: torch.Tensor, code0: torch.Tensor, talker: "Talker",
                      cache: KVCache, positions: torch.Tensor, choose: ChooseOnDevice
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`expand` as a static-shape computation for a decode step: code 0 [1] on the device
        -> (the frame's codes [G] long, the frame's code embeddings summed [H], as
        :meth:`Talker.frame_embedding` gives them).  ``cache`` (:meth:`new_cache`) is overwritten
        from position 0 (its stale entries are masked by position, so it needs no reset);
        ``positions`` is ``arange(G)`` on the device; ``choose`` picks each code on the device."""
        first = talker.codec_embed(code0).to(talker_hidden.dtype)
        hidden = self.decoder.forward_static(torch.cat((talker_hidden[None], first)), cache, positions[:2])[-1]
        codes, rows = [code0], [first]
        for group in range(1, self.num_code_groups):
            code = choose(self.lm_head[group - 1](hidden).float(), group)
            codes.append(code)
            rows.append(self.codec_embedding[group - 1](code))
            if group < self.num_code_groups - 1:
                # code g is read at position g + 1 (the prefill took 0 and 1)
                hidden = self.decoder.forward_static(rows[-1], cache, positions[group + 1:group + 2])[-1]
        # summed like frame_embedding (and the reference): one reduction over the stacked rows
        return torch.cat(codes), torch.cat(rows).sum(dim=0)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerShape):
        super().__init__()
        text, cp = cfg.text, cfg.code_predictor
        if cp.hidden_size != text.hidden_size:
            raise ConfigError(f"code predictor hidden_size {cp.hidden_size} differs from the talker's "
                              f"{text.hidden_size} (Qwen3-Omni feeds the talker's hidden state in directly)")
        self.cfg = cfg
        self.num_code_groups = cfg.num_code_groups
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        self.decoder = Decoder(text)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cp, cfg.num_code_groups)

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        return self.decoder.new_cache(capacity, dtype, device)

    def codec_embed(self, codec_id: int | torch.Tensor) -> torch.Tensor:
        """Talker table (code group 0 and the codec specials: pad, bos, speakers, think ids)."""
        if isinstance(codec_id, int):
            return self.codec_embedding.weight[codec_id]
        return self.codec_embedding(codec_id)

    def forward(self, embeds: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, H] (talker width) appended to the cache -> (final-normed hidden [T, H],
        code-0 logits [T, V] in fp32)."""
        hidden = self.decoder(embeds, cache)
        return hidden, self.codec_head(hidden).float()

    def forward_static(self, embeds: torch.Tensor, cache: KVCache | KVSpan, input_pos: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` as a static-shape step: embeds [T, H] written at ``input_pos`` [T]
        (:meth:`Decoder.forward_static`; ``cache.length`` is the caller's)."""
        hidden = self.decoder.forward_static(embeds, cache, input_pos)
        return hidden, self.codec_head(hidden).float()

    def expand(self, talker_hidden: torch.Tensor, code0: int, choose: Choose = greedy) -> list[int]:
        """The whole frame [code0, code1, ..., code G-1] from the talker's last hidden state [H]."""
        return self.code_predictor.expand(talker_hidden, code0, self, choose)

    def frame_embedding(self, codes: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Sum of the frame's G code embeddings [H] (the next talker input, before the text row)."""
        codes = [int(c) for c in codes]
        if len(codes) != self.num_code_groups:
            raise ValueError(f"a frame has {self.num_code_groups} codes, got {len(codes)}")
        tables = self.code_predictor.codec_embedding
        rows = [self.codec_embedding.weight[codes[0]]] + [tables[g - 1].weight[c] for g, c in enumerate(codes) if g]
        return torch.stack(rows).sum(dim=0)


def talker_weight_map(cfg: TalkerShape, ours: str = "talker") -> dict[str, Target]:
    """Every ``talker.*`` tensor of the published checkpoint -> our Talker named ``ours``."""
    text, code_predictor = cfg.text, cfg.code_predictor
    h, v = text.hidden_size, text.vocab_size
    cp, ch, cv = _join(ours, "code_predictor"), code_predictor.hidden_size, code_predictor.vocab_size
    out = decoder_weight_map("talker.model", _join(ours, "decoder"), text)
    out.update(decoder_weight_map("talker.code_predictor.model", f"{cp}.decoder", code_predictor))
    out["talker.model.codec_embedding.weight"] = Target(_join(ours, "codec_embedding.weight"), (v, h))
    out["talker.codec_head.weight"] = Target(_join(ours, "codec_head.weight"), (v, h))
    inner, thinker_hidden = text.intermediate_size, cfg.thinker_hidden_size
    for proj in ("text_projection", "hidden_projection"):
        p = _join(ours, proj)
        out[f"talker.{proj}.linear_fc1.weight"] = Target(f"{p}.linear_fc1.weight", (inner, thinker_hidden))
        out[f"talker.{proj}.linear_fc1.bias"] = Target(f"{p}.linear_fc1.bias", (inner,))
        out[f"talker.{proj}.linear_fc2.weight"] = Target(f"{p}.linear_fc2.weight", (h, inner))
        out[f"talker.{proj}.linear_fc2.bias"] = Target(f"{p}.linear_fc2.bias", (h,))
    for g in range(cfg.num_code_groups - 1):
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = \
            Target(f"{cp}.codec_embedding.{g}.weight", (cv, ch))
        out[f"talker.code_predictor.lm_head.{g}.weight"] = Target(f"{cp}.lm_head.{g}.weight", (cv, ch))
    return out


__all__ = ["Choose", "ChooseOnDevice", "CodePredictor", "ResizeMLP", "Talker", "TalkerShape", "greedy",
           "talker_weight_map"]
