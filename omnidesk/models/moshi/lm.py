"""Moshi's language model: temporal transformer + depth transformer, and its per-frame step.

Each 80 ms frame the **temporal transformer** takes one token per stream (the
text stream, Moshi's ``dep_q`` audio codebooks, the user's codebooks), sums
their embeddings and runs one step over a ring KV cache of ``context`` frames;
its normed output gives the text logits.  The **depformer** (depth
transformer) then expands that frame into Moshi's ``dep_q`` audio codes, one
small step per codebook: step k sees the temporal output through its own
input projection plus the embedding of the token chosen at step k - 1 (the
text token for k = 0), runs every layer with that step's own weight set and
reads the codebook's logits from its own head.

:class:`MoshiLMGen` is the per-frame step (the reference's ``LMGen.step``):
the stream delays, the initial tokens while a delayed stream has nothing yet,
and sampling.  All of its state (both KV caches, the token ring, the frame
counter, the random generator: :class:`MoshiState`) is preallocated and
explicit; ``reset()`` starts a new conversation in the same buffers.  The
whole frame runs on the device as one decode-runner step (eager, compiled, or
one CUDA graph per frame), without a host sync: the host draws the frame's
sampling noise before it and reads the text token after it.

Weight names of the published ``model.safetensors`` are mapped onto ours by
:func:`weight_map` (stacked per-codebook / per-step tensors become slices of
one parameter); :func:`load_moshi_lm` loads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import (DEFAULT_DEVICE_DTYPE, CheckpointError, MappingReport, Target, copy_tensors,
                          header_tensors, match_tensors, materialize, read_safetensors_header)
from ..kv_cache import RingKVCache
from ..layers import RMSNorm, attend_one, rotate_interleaved
from ..runner import DecodeRunner
from ..sampling import SamplingParams, sample
from .config import MoshiConfig, MoshiSampling


def _gated_silu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)  # the reference's linear_in holds the gate rows first
    return F.silu(gate) * up


# ---------------------------------------------------------------- caches

class DepformerCache:
    """Keys and values of the depformer's steps inside one frame (per layer [k|v, heads, dep_q, head_dim]).

    Step k writes slot k and reads slots 0..k, so nothing needs clearing between frames.  One tensor
    per layer, as the KV caches (omnidesk.models.kv_cache: a compiled step writes them in place)."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, steps: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kv = [torch.zeros((2, num_heads, steps, head_dim), dtype=dtype, device=device)
                   for _ in range(num_layers)]


# ---------------------------------------------------------------- temporal transformer

class TemporalLayer(nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        d, hidden = cfg.dim, cfg.ffn_hidden
        norm_upcast = "all" if cfg.norm == "rms_norm_f32" else "none"
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.attn_norm = RMSNorm(d, cfg.norm_eps, norm_upcast)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)  # the checkpoint's fused in_proj_weight
        self.wo = nn.Linear(d, d, bias=False)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, norm_upcast)
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)  # gate | up
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, cache: RingKVCache, layer: int) -> torch.Tensor:
        qkv = self.wqkv(self.attn_norm(x)).view(3, self.num_heads, self.head_dim)
        qk = rotate_interleaved(qkv[:2], rotation)  # q and k rotated in one go
        keys, values = cache.k[layer], cache.v[layer]
        keys.index_copy_(1, cache.slot, qk[1].unsqueeze(1))
        values.index_copy_(1, cache.slot, qkv[2].unsqueeze(1))
        x = x + self.wo(attend_one(qk[0].unsqueeze(1), keys, values, cache.bias, self.scale))
        return x + self.w2(_gated_silu(self.w13(self.ffn_norm(x))))


class TemporalTransformer(nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TemporalLayer(cfg) for _ in range(cfg.num_layers))
        # Made on the CPU explicitly, also when the model is built on the meta device; the loader moves it.
        half = cfg.head_dim // 2
        steps = torch.arange(half, dtype=torch.float32, device="cpu")
        inv_freq = torch.exp(steps * (-math.log(cfg.max_period) * 2 / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, cache: RingKVCache) -> torch.Tensor:
        """x [1, dim]: the frame at ``cache.pos``; advances the cache by one frame."""
        angles = cache.pos.float() * self.inv_freq  # fp32, as the reference computes them
        rotation = torch.polar(torch.ones_like(angles), angles)
        cache.prepare()
        for i, layer in enumerate(self.layers):
            x = layer(x, rotation, cache, i)
        cache.advance()
        return x


# ---------------------------------------------------------------- depth transformer

class DepformerLayer(nn.Module):
    """A depformer layer holding one weight set per step: step k uses slice k of each parameter."""

    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        d, hidden, sets = cfg.depformer_dim, cfg.depformer_ffn_hidden, cfg.dep_q
        norm_upcast = "all" if cfg.norm == "rms_norm_f32" else "none"
        self.num_heads, self.head_dim = cfg.depformer_num_heads, cfg.depformer_head_dim
        self.scale = self.head_dim ** -0.5
        self.attn_norm = RMSNorm(d, cfg.norm_eps, norm_upcast)
        self.wqkv = nn.Parameter(torch.empty(sets, 3 * d, d))
        self.wo = nn.Parameter(torch.empty(sets, d, d))
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, norm_upcast)
        self.w13 = nn.Parameter(torch.empty(sets, 2 * hidden, d))
        self.w2 = nn.Parameter(torch.empty(sets, d, hidden))

    def forward(self, x: torch.Tensor, step: int, cache: DepformerCache, layer: int) -> torch.Tensor:
        qkv = F.linear(self.attn_norm(x), self.wqkv[step]).view(3, self.num_heads, 1, self.head_dim)
        kv = cache.kv[layer]
        kv[:, :, step:step + 1] = qkv[1:]  # k and v in one copy
        # no positional embedding: step order is known from the per-step weights
        seen = kv[:, :, :step + 1]
        x = x + F.linear(attend_one(qkv[0], seen[0], seen[1], None, self.scale), self.wo[step])
        return x + F.linear(_gated_silu(F.linear(self.ffn_norm(x), self.w13[step])), self.w2[step])


class Depformer(nn.Module):
    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.depformer_dim
        self.input_proj = nn.Parameter(torch.empty(cfg.depformer_in_count, d, cfg.dim))  # depformer_in[k]
        self.text_emb = nn.Embedding(cfg.text_card + 1, d)  # input of step 0: the frame's text token
        self.audio_emb = nn.Parameter(torch.empty(cfg.dep_q - 1, cfg.card + 1, d))  # input of step k: code k - 1
        self.layers = nn.ModuleList(DepformerLayer(cfg) for _ in range(cfg.depformer_num_layers))
        self.heads = nn.Parameter(torch.empty(cfg.dep_q, cfg.card, d))  # linears[k]: codebook k's logits

    def new_cache(self) -> DepformerCache:
        p = self.heads
        return DepformerCache(self.cfg.depformer_num_layers, self.cfg.depformer_num_heads,
                              self.cfg.depformer_head_dim, self.cfg.dep_q, p.dtype, p.device)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The temporal output [1, dim] through every step's input projection at once -> [n, depformer_dim]."""
        n, d, _ = self.input_proj.shape
        return F.linear(hidden, self.input_proj.view(n * d, -1)).view(n, d)

    def forward(self, step: int, projected: torch.Tensor, prev_token: torch.Tensor,
                cache: DepformerCache) -> torch.Tensor:
        """Logits [1, card] of codebook ``step``; prev_token [1] is the text token (step 0) or code step - 1."""
        x = projected[step if projected.shape[0] > 1 else 0].unsqueeze(0)
        table = self.text_emb.weight if step == 0 else self.audio_emb[step - 1]
        x = x + table.index_select(0, prev_token)  # index_select: the cheapest lookup for one row
        for i, layer in enumerate(self.layers):
            x = layer(x, step, cache, i)
        return F.linear(x, self.heads[step])


# ---------------------------------------------------------------- the model

class MoshiLM(nn.Module):
    """Embeddings, temporal transformer, text head and depformer of one Moshi checkpoint."""

    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.cfg = cfg
        self.text_emb = nn.Embedding(cfg.text_card + 1, cfg.dim)
        # one table per input codebook, stacked so a frame's n_q lookups are one gather
        self.audio_emb = nn.Parameter(torch.empty(cfg.n_q, cfg.card + 1, cfg.dim))
        self.temporal = TemporalTransformer(cfg)
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps, "all" if cfg.norm == "rms_norm_f32" else "none")
        self.text_head = nn.Linear(cfg.dim, cfg.text_card, bias=False)
        self.depformer = Depformer(cfg)
        offsets = torch.arange(cfg.n_q, device="cpu") * (cfg.card + 1)
        self.register_buffer("audio_offsets", offsets, persistent=False)

    def new_cache(self, context: int | None = None) -> RingKVCache:
        c, p = self.cfg, self.text_head.weight
        return RingKVCache(c.num_layers, c.num_heads, c.head_dim, context or c.context, p.dtype, p.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n_q + 1] (text, then every audio codebook) -> the frame's summed embedding [1, dim]."""
        table = self.audio_emb.view(-1, self.cfg.dim)
        audio = table.index_select(0, tokens[1:] + self.audio_offsets).sum(0, keepdim=True)
        return audio + self.text_emb.weight.index_select(0, tokens[:1])

    def temporal_step(self, tokens: torch.Tensor, cache: RingKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame through the temporal transformer -> (normed hidden [1, dim], text logits [1, text_card])."""
        hidden = self.out_norm(self.temporal(self.embed(tokens), cache))
        return hidden, self.text_head(hidden)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "MoshiLM":
        """Random weights (norms at 1, the rest N(0, 1/fan_in)) for demos and benchmarks: the output is noise."""
        g = torch.Generator(device=self.text_head.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        return self


# ---------------------------------------------------------------- sampling

class TokenSampler:
    """Moshi's choice of one kind of token (the text token, or a frame's dep_q audio codes):
    temperature + top-k, no repetition penalty, made by the shared
    :func:`~omnidesk.models.sampling.sample` (the argmax of probs / Exp(1) noise) on the device,
    without a host sync.

    State: ``noise`` [rows, vocab_size], one row per token chosen in a frame, drawn in one go by
    :meth:`draw` with ``generator`` *before* a frame step (a torch.Generator cannot run inside a
    compiled or captured step); the step reads row ``row`` through :meth:`choose`.  Greedy (or a
    temperature <= 0) is the argmax and has no noise.  Called on logits [V], it is the eager
    one-token form: draw, then choose (the buffer is made at the first call's vocabulary when
    ``vocab_size`` is not given)."""

    def __init__(self, temperature: float, top_k: int, greedy: bool, generator: torch.Generator,
                 vocab_size: int | None = None, rows: int = 1, device: torch.device | str | None = None):
        greedy = greedy or temperature <= 0
        # SamplingParams refuses a temperature <= 0 when sampling; the argmax never reads it
        self.params = SamplingParams(greedy=greedy, temperature=temperature if temperature > 0 else 1.0, top_k=top_k)
        self.generator, self.rows = generator, rows
        self.noise: torch.Tensor | None = None
        if vocab_size is not None:
            self._allocate(vocab_size, device)

    def _allocate(self, vocab_size: int, device) -> None:
        if self.params.greedy:
            return
        # a normal tensor even when made under inference_mode: a later draw outside it writes it in place
        with torch.inference_mode(False):
            self.noise = torch.empty((self.rows, vocab_size), dtype=torch.float32, device=device)

    def draw(self) -> None:
        """Fresh Exp(1) noise for every row (one ``exponential_``; nothing when greedy)."""
        if self.noise is not None:
            self.noise.exponential_(generator=self.generator)

    def choose(self, logits: torch.Tensor, row: int = 0) -> torch.Tensor:
        """logits [V] -> token [1] (long) with noise row ``row``: pure, what a frame step calls."""
        return sample(logits, self.params, noise=None if self.noise is None else self.noise[row])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> token [1] (long): a fresh draw, then the choice."""
        if not self.params.greedy and (self.noise is None or self.noise.shape[-1] != logits.shape[-1]
                                       or self.noise.device != logits.device):
            self._allocate(logits.shape[-1], logits.device)
        self.draw()
        return self.choose(logits)


# ---------------------------------------------------------------- the per-frame step

@dataclass
class MoshiFrame:
    """Moshi's output for one frame: its text token and its dep_q audio codes (tensors on the model's device)."""

    text: torch.Tensor  # [] long
    audio: torch.Tensor  # [dep_q] long

    @property
    def text_id(self) -> int:
        return int(self.text)


class MoshiState:
    """One conversation's device state, everything a frame step reads and writes: both KV caches,
    the token ring, the frame counter on the device, the last text logits and the samplers' noise.

    Allocated once; :meth:`reset` restarts it in place (pointer moves and fills, the same buffers),
    so compiled code and captured CUDA graphs of the frame step keep serving it.  A second one of
    the same shapes is what the step is compiled on in the background (:meth:`MoshiLMGen.scratch`)."""

    def __init__(self, lm: "MoshiLM", sampling: MoshiSampling, capacity: int, generator: torch.Generator):
        cfg = lm.cfg
        device = lm.text_head.weight.device
        self.cache = lm.new_cache(capacity)
        self.depformer_cache = lm.depformer.new_cache()
        self.generator = generator
        s = sampling
        self.text_sampler = TokenSampler(s.text_temperature, s.text_top_k, s.greedy, generator, cfg.text_card,
                                         device=device)
        self.audio_sampler = TokenSampler(s.audio_temperature, s.audio_top_k, s.greedy, generator, cfg.card,
                                          rows=cfg.dep_q, device=device)

        def longs(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        streams = cfg.n_q + 1
        generated = 1 + cfg.dep_q  # text + Moshi's codebooks; the rest are the user's
        self.delays = longs(cfg.delays)
        self.initial = longs([cfg.text_initial_id] + [cfg.audio_initial_id] * cfg.n_q)
        # Token ring: column t % width holds every stream's token for frame t.  A step reads frame t,
        # the user writes up to t + max_delay, generation t + 1.  The step addresses it flat
        # (row * width + column): index_copy_ / index_select, one kernel each.
        width = cfg.max_delay + 2
        self.ring = self.initial[:, None].repeat(1, width)
        self.user_cells = longs(range(generated, streams)) * width  # where each user row starts
        self.user_delays = self.delays[generated:]
        self.generated_cells = longs(range(generated)) * width
        self.generated_delays = self.delays[:generated]
        self.offset = longs([0])  # frame counter on the device (the host keeps MoshiLMGen.frame)
        self.text_logits = torch.zeros(cfg.text_card, dtype=torch.float32, device=device)  # last frame's

    def draw(self) -> None:
        """The frame's sampling noise: the text token's, then all dep_q codebooks' (outside the step)."""
        self.text_sampler.draw()
        self.audio_sampler.draw()

    def reset(self, seed: int) -> None:
        """A new conversation in the same buffers: caches and delays emptied, the generator re-seeded."""
        self.generator.manual_seed(seed)
        self.cache.reset()
        self.ring.copy_(self.initial[:, None].expand_as(self.ring))
        self.offset.zero_()


class MoshiLMGen:
    """Moshi's per-frame generation step: user codes in, Moshi's text token and audio codes out.

    Equivalent to the reference's ``LMGen.step`` for batch 1.  Stream s (text,
    Moshi's dep_q codebooks, the user's codebooks) is delayed by
    ``cfg.delays[s]`` frames: at frame t the temporal transformer reads the
    token each stream had at frame t - delay, or the stream's initial token
    while t <= delay.  The output of frame t re-aligns the streams, so
    ``step`` returns None for the first ``max_delay`` frames and afterwards
    the frame ``max_delay`` behind.

    The whole frame on the device (ring bookkeeping, temporal transformer, text
    choice, the depformer's dep_q sub-steps and their choices) is one step of a
    :class:`~omnidesk.models.runner.DecodeRunner` (``runner``; eager when none is
    given), so it runs eagerly, compiled or as one CUDA graph per frame; the host
    only draws the frame's noise before it and counts frames.

    State (both KV caches, the token ring, the frame counters, the random
    generator: :class:`MoshiState`) is allocated once here; ``reset()`` starts a
    new conversation in the same buffers and re-seeds, so the same inputs give
    the same outputs again.
    """

    def __init__(self, lm: MoshiLM, sampling: MoshiSampling | None = None, seed: int | None = None,
                 context: int | None = None, runner: DecodeRunner | None = None):
        """``sampling`` defaults to the checkpoint's (``cfg.sampling``); ``seed`` None draws one;
        ``context`` (frames) shortens the attention span and the KV cache below ``cfg.context``;
        ``runner`` runs the frame step (its ``warm_up`` is the caller's to start)."""
        self.cfg = lm.cfg
        self.lm = lm
        self.sampling = sampling or self.cfg.sampling
        self.device = lm.text_head.weight.device
        self.capacity = context or self.cfg.context
        self.generator = torch.Generator(device=self.device)
        self.seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.state = MoshiState(lm, self.sampling, self.capacity, self.generator)
        self.runner = runner or DecodeRunner("eager", self.device)
        self._frame_step = self.runner.step("moshi_frame", self._frame, example=self.scratch)
        self.frame = 0
        self.reset()

    # the conversation's state, under the names the tests and benches read
    @property
    def cache(self) -> RingKVCache:
        return self.state.cache

    @property
    def text_logits(self) -> torch.Tensor:
        """The last frame's text logits [text_card] (float32)."""
        return self.state.text_logits

    def reset(self, seed: int | None = None) -> None:
        """Start a new conversation (caches and delays emptied; generator re-seeded with ``seed`` or the last one).
        The same buffers: nothing compiled or captured is invalidated."""
        if seed is not None:
            self.seed = seed
        self.state.reset(self.seed)
        self.frame = 0

    def scratch(self) -> tuple[MoshiState, torch.Tensor]:
        """Inputs of the frame step's shapes on a private state (its own caches, ring and generator):
        what the step is compiled on in the background while the conversation runs on ``state``."""
        with torch.inference_mode(False):
            state = MoshiState(self.lm, self.sampling, self.capacity, torch.Generator(device=self.device))
            state.reset(0)
            state.draw()
            user = torch.zeros(self.cfg.user_codebooks, dtype=torch.long, device=self.device)
        return state, user

    def _frame(self, state: MoshiState, user: torch.Tensor) -> torch.Tensor:
        """One frame on the device, the runner's step: the user's codes [user_codebooks] in; every
        generated stream's token of the frame ``max_delay`` behind, realigned [1 + dep_q], out (valid
        once the delays have filled, which the host's frame counter tells).  Writes ``state`` in
        place and never ``user``; no host sync and no branch on a tensor."""
        cfg, lm = self.cfg, self.lm
        ring, offset = state.ring, state.offset
        width = ring.shape[1]
        cells = ring.view(-1)
        cells.index_copy_(0, state.user_cells + (offset + state.user_delays) % width, user)
        current = ring.index_select(1, offset % width).squeeze(1)
        tokens = torch.where(offset <= state.delays, state.initial, current)

        hidden, text_logits = lm.temporal_step(tokens, state.cache)
        state.text_logits.copy_(text_logits[0])
        chosen = [state.text_sampler.choose(text_logits[0])]
        projected = lm.depformer.project(hidden)
        for k in range(cfg.dep_q):
            logits = lm.depformer(k, projected, chosen[-1], state.depformer_cache)
            chosen.append(state.audio_sampler.choose(logits[0], k))

        offset.add_(1)
        cells.index_copy_(0, state.generated_cells + offset % width, torch.cat(chosen))
        # realign: the stream delayed by d was generated d frames after the undelayed ones
        return cells.index_select(0, state.generated_cells + (offset - cfg.max_delay + state.generated_delays) % width)

    @torch.no_grad()
    def step(self, user_codes) -> MoshiFrame | None:
        """Feed one frame of the user's codes ([n_q - dep_q] ints in [0, card); extra codebooks are
        ignored, as the reference does); returns Moshi's frame ``max_delay`` frames back, None until
        there is one.  Nothing here waits for the device: read ``text_id`` when the text is needed."""
        cfg = self.cfg
        user = torch.as_tensor(user_codes, dtype=torch.long, device=self.device).reshape(-1)
        if user.numel() < cfg.user_codebooks:
            raise ValueError(f"expected {cfg.user_codebooks} user codes per frame, got {user.numel()}")
        self.state.draw()  # the generator runs here, outside the (compiled or captured) step
        out = self._frame_step(self.state, user[:cfg.user_codebooks])
        self.frame += 1
        if self.frame <= cfg.max_delay:
            return None
        return MoshiFrame(text=out[0], audio=out[1:])


# ---------------------------------------------------------------- weights

def weight_map(cfg: MoshiConfig) -> dict[str, Target]:
    """Checkpoint tensor name (published ``model.safetensors``) -> destination, for every tensor."""
    d, dd, h, hd = cfg.dim, cfg.depformer_dim, cfg.ffn_hidden, cfg.depformer_ffn_hidden
    sets = cfg.dep_q
    out = {
        "text_emb.weight": Target("text_emb.weight", (cfg.text_card + 1, d)),
        "text_linear.weight": Target("text_head.weight", (cfg.text_card, d)),
        "out_norm.alpha": Target("out_norm.weight", (1, 1, d)),
        "depformer_text_emb.weight": Target("depformer.text_emb.weight", (cfg.text_card + 1, dd)),
    }
    for k in range(cfg.n_q):
        out[f"emb.{k}.weight"] = Target("audio_emb", (cfg.card + 1, d), index=k)
    for i in range(cfg.num_layers):
        c, o = f"transformer.layers.{i}", f"temporal.layers.{i}"
        out[f"{c}.self_attn.in_proj_weight"] = Target(f"{o}.wqkv.weight", (3 * d, d))
        out[f"{c}.self_attn.out_proj.weight"] = Target(f"{o}.wo.weight", (d, d))
        out[f"{c}.norm1.alpha"] = Target(f"{o}.attn_norm.weight", (1, 1, d))
        out[f"{c}.norm2.alpha"] = Target(f"{o}.ffn_norm.weight", (1, 1, d))
        out[f"{c}.gating.linear_in.weight"] = Target(f"{o}.w13.weight", (2 * h, d))
        out[f"{c}.gating.linear_out.weight"] = Target(f"{o}.w2.weight", (d, h))
    for k in range(cfg.depformer_in_count):
        out[f"depformer_in.{k}.weight"] = Target("depformer.input_proj", (dd, d), index=k)
    for k in range(cfg.dep_q - 1):
        out[f"depformer_emb.{k}.weight"] = Target("depformer.audio_emb", (cfg.card + 1, dd), index=k)
    for i in range(cfg.depformer_num_layers):
        c = o = f"depformer.layers.{i}"
        # attention projections of all steps are stored stacked along the rows
        out[f"{c}.self_attn.in_proj_weight"] = Target(f"{o}.wqkv", (sets * 3 * dd, dd))
        out[f"{c}.self_attn.out_proj.weight"] = Target(f"{o}.wo", (sets * dd, dd))
        out[f"{c}.norm1.alpha"] = Target(f"{o}.attn_norm.weight", (1, 1, dd))
        out[f"{c}.norm2.alpha"] = Target(f"{o}.ffn_norm.weight", (1, 1, dd))
        # ... and the gated FFNs as one module per step
        for s in range(sets):
            out[f"{c}.gating.{s}.linear_in.weight"] = Target(f"{o}.w13", (2 * hd, dd), index=s)
            out[f"{c}.gating.{s}.linear_out.weight"] = Target(f"{o}.w2", (dd, hd), index=s)
    for k in range(cfg.dep_q):
        out[f"linears.{k}.weight"] = Target("depformer.heads", (cfg.card, dd), index=k)
    return out


def check_mapping(cfg: MoshiConfig, header: dict[str, dict]) -> MappingReport:
    """Compare a safetensors header (name -> {dtype, shape}) with what our modules expect."""
    return match_tensors(weight_map(cfg), header_tensors(header))


def load_moshi_lm(path: str | Path, config: MoshiConfig, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> MoshiLM:
    """Load Moshi's ``model.safetensors`` (published naming) into a :class:`MoshiLM`.

    dtype defaults to fp32 on the CPU and bf16 on CUDA; every tensor is cast to
    it (as the reference does).  Raises :class:`CheckpointError` naming the file
    and tensor: missing, unexpected, wrong shape or non-float tensors, or a
    damaged file.
    """
    path = Path(path)
    device = torch.device(device)
    dtype = dtype or DEFAULT_DEVICE_DTYPE.get(device.type, torch.float32)
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: missing file {path.name}")
    header = read_safetensors_header(path)
    report = check_mapping(config, header)
    if not report.ok:
        raise CheckpointError(report.error(str(path)))
    with torch.device("meta"):
        lm = MoshiLM(config)
    materialize(lm, device, dtype)
    copy_tensors({name: path for name in report.loaded}, report.loaded, weight_map(config),
                 dict(lm.named_parameters()))
    return lm.eval()


__all__ = ["DepformerCache", "MoshiFrame", "MoshiLM", "MoshiLMGen", "MoshiState", "TokenSampler", "check_mapping",
           "load_moshi_lm", "weight_map"]
