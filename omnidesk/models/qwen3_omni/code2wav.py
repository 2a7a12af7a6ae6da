"""Qwen3-Omni's code2wav: 16 codebooks per 80 ms frame -> 24 kHz audio, one-shot or streamed exactly.

Per frame the talker emits ``num_quantizers`` codes.  Their embeddings are
averaged, an 8-layer sliding-window transformer mixes the frames, two causal
(transposed conv + ConvNeXt) stages upsample x2 each, and a SnakeBeta decoder
of causal transposed convs (x8, x5, x4, x3 in the real model) turns that into
``samples_per_frame`` (1920) samples per frame.

Causality.  Everything is causal except one detail of the reference's
transposed convs: it cuts ``kernel - stride`` samples from BOTH ends of each
one.  For the upsampling stages (kernel == stride) that cuts nothing.  For the
decoder blocks (kernel == 2 * stride) the left cut shifts the signal one input
step early, so output step ``i`` needs input steps ``i`` and ``i + 1``, and
the right cut drops the last step (it would need an input that never comes).
The reference therefore returns ``frames * samples_per_frame -
lookahead_samples`` samples (555 fewer for the real model, 23 ms), and those
samples are exactly a causal network's output with the first ``stride``
samples of each decoder transposed conv dropped (the convs after it then pad
with zeros in their place, as the reference does).  So exact streaming still
works: a stream carries each transposed conv's overlap-add tail and skips the
first ``kernel - stride`` samples it produces; each push returns every sample
that its frames make final (the first push ``lookahead_samples`` fewer), and
the pushes concatenated equal :meth:`Code2Wav.forward` on all the frames.  The
last ``lookahead_samples`` of a reply are never produced, as in the reference.

Here: the sliding-window transformer, the vocoder and its exact stream; the conv stack after the
transformer, with each layer's streaming state, is :mod:`omnidesk.models.qwen3_omni.code2wav_convs`,
the config :mod:`omnidesk.models.qwen3_omni.code2wav_config`.  Parameter names equal the
checkpoint's after its ``code2wav.`` prefix.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import RMSNorm, apply_rotary, attend_one
from .code2wav_config import Code2WavConfig
from .code2wav_convs import CONV_KERNEL, CausalConv, DecoderBlock, SnakeBeta, UpsampleStage

CHECKPOINT_PREFIX = "code2wav."


# ---------------------------------------------------------------- transformer

class _KVWindow:
    """Keys and values of the frames still inside the sliding window, for every layer.

    One linear buffer per stream ``[layers, kv_heads, capacity, head_dim]``: a push writes its
    frames after the ``length`` stored ones and attends to the last ``window - 1`` stored frames plus
    itself; when the next push does not fit, the last ``window - 1`` frames move to the front (one
    copy every ``capacity - window + 1`` frames).  Keys are stored rotated, so RoPE never reruns.
    A push larger than any before grows the buffer once."""

    def __init__(self, cfg: Code2WavConfig, device, dtype, frames: int):
        self.keep_max = cfg.sliding_window - 1
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, self.keep_max + frames, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # frames stored in the buffer
        self.pos = 0  # frames seen since reset (RoPE position of the next frame)

    def make_room(self, n: int) -> int:
        """Prepare a write of ``n`` frames; returns how many stored frames they attend to."""
        keep = min(self.length, self.keep_max)
        if self.length + n > self.k.shape[2]:
            start = self.length - keep
            if keep + n > self.k.shape[2]:
                k, v = self.k, self.v
                shape = (k.shape[0], k.shape[1], self.keep_max + n, k.shape[3])
                with torch.inference_mode(False):  # see Code2WavStream.__init__
                    self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
                self.k[:, :, :keep] = k[:, :, start:self.length]
                self.v[:, :, :keep] = v[:, :, start:self.length]
            else:  # the source may overlap the front: clone first
                self.k[:, :, :keep] = self.k[:, :, start:self.length].clone()
                self.v[:, :, :keep] = self.v[:, :, start:self.length].clone()
            self.length = keep
        return keep

    def reset(self) -> None:
        self.length = self.pos = 0  # stale entries are never read again: attention reads [.., :length+n]


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = d ** -0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> rotated q [H, T, D], rotated k and v [KV, T, D]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [H, T, D] over k/v [KV, N, D] (mask [T, N] bool, None = all) -> [T, hidden] after o_proj."""
        if self.kv_heads != self.heads:
            groups = self.heads // self.kv_heads
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        if q.shape[1] == 1 and mask is None:
            out = attend_one(q, k, v, None, self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out = out.transpose(0, 1).reshape(q.shape[1], -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """Sliding-window causal transformer over the averaged code embeddings (``pre_transformer``)."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # computed tables are made on the CPU explicitly, also when the module is built on the
        # meta device for loading (materialize moves them)
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float, device=cpu)
                                             / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, start: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, device=self.inv_freq.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _window_mask(self, queries: int, stored: int, device) -> torch.Tensor:
        """[queries, stored + queries] bool: query i (after ``stored`` frames) sees keys j with
        i + stored - window < j <= i + stored."""
        q = torch.arange(queries, device=device)[:, None] + stored
        j = torch.arange(stored + queries, device=device)[None, :]
        return (j <= q) & (j > q - self.window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], all frames at once."""
        cos, sin = self.rotary(0, x.shape[0], x.dtype)
        mask = self._window_mask(x.shape[0], 0, x.device)
        for layer in self.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = layer.finish(x, layer.self_attn.attend(q, k, v, mask))
        return self.norm(x)

    def step(self, x: torch.Tensor, cache: _KVWindow) -> torch.Tensor:
        """x [n, hidden] for the next n frames -> [n, hidden], attending to the cached window."""
        n = x.shape[0]
        keep = cache.make_room(n)
        start, end = cache.length - keep, cache.length + n
        cos, sin = self.rotary(cache.pos, n, x.dtype)
        # one new frame sees every stored frame (at most window - 1): no mask needed
        mask = None if n == 1 else self._window_mask(n, keep, x.device)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            cache.k[i, :, cache.length:end] = k
            cache.v[i, :, cache.length:end] = v
            attn = layer.self_attn.attend(q, cache.k[i, :, start:end], cache.v[i, :, start:end], mask)
            x = layer.finish(x, attn)
        cache.length, cache.pos = end, cache.pos + n
        return self.norm(x)


# ---------------------------------------------------------------- the vocoder

class Code2Wav(nn.Module):
    """Codes [num_quantizers, T] -> 24 kHz wave, equal to transformers' ``Qwen3OmniMoeCode2Wav``."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.cfg = cfg
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        self.register_buffer("code_offset", torch.arange(cfg.num_quantizers, device=torch.device("cpu"))[:, None]
                             * cfg.codebook_size, persistent=False)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.hidden_size, r) for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv(cfg.hidden_size, cfg.decoder_dim, CONV_KERNEL),
            *(DecoderBlock(dims[i], rate) for i, rate in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv(dims[-1], 1, CONV_KERNEL),
        ])

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    @property
    def lookahead_samples(self) -> int:
        return self.cfg.lookahead_samples

    def _conv_layers(self) -> list[nn.Module]:
        """Every layer after the transformer, in order, each with forward / new_state / step."""
        layers: list[nn.Module] = [m for stage in self.upsample for m in stage]
        for m in self.decoder:
            layers.extend(m.block if isinstance(m, DecoderBlock) else [m])
        return layers

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [Q, T] -> the mean of the Q code embeddings [T, hidden]."""
        q, size = self.cfg.num_quantizers, self.cfg.codebook_size
        if codes.dim() != 2 or codes.shape[0] != q:
            raise ValueError(f"code2wav expects codes [{q}, frames], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"code2wav codes must lie in [0, {size}), got {int(codes.min())}..{int(codes.max())}")
        return self.code_embedding(codes + self.code_offset).mean(0)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [Q, T] -> wave [cfg.output_samples(T)] in [-1, 1] (``T * samples_per_frame -
        lookahead_samples``: the reference's length)."""
        x = self.pre_transformer(self._embed(codes)).t()[None]  # [1, hidden, T]
        for layer in self._conv_layers():
            x = layer(x)
        return x.clamp(-1, 1).view(-1)

    def stream(self) -> "Code2WavStream":
        """A fresh exact stream (all state zero); cheap enough to create per reply."""
        return Code2WavStream(self)


class Code2WavStream:
    """Frame-by-frame decoding whose pushes concatenate to :meth:`Code2Wav.forward` on all frames.

    State, all explicit and reset in place by :meth:`reset`: the transformer's sliding-window KV
    cache and RoPE position; per causal conv its left context; per transposed conv its overlap-add
    tail and pending left cut.  Each frame's work is done once: nothing to the left is recomputed."""

    def __init__(self, model: Code2Wav, frames_capacity: int | None = None):
        self.model = model
        p = model.code_embedding.weight
        device, dtype = p.device, p.dtype
        self._layers = model._conv_layers()
        with torch.inference_mode(False):  # normal tensors: a push outside inference_mode writes them in place
            self.kv = _KVWindow(model.cfg, device, dtype, frames_capacity or model.cfg.sliding_window)
            self.states = [layer.new_state(device, dtype) for layer in self._layers]
        self.frames = 0

    def reset(self) -> None:
        """Back to the start of a new utterance (no allocation)."""
        self.kv.reset()
        for s in self.states:
            if s is not None:
                s.reset()
        self.frames = 0

    @torch.no_grad()
    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [Q, n] for the next n frames -> the wave samples they make final.

        That is ``n * samples_per_frame`` samples, except on the first push after creation or
        :meth:`reset`, which returns ``lookahead_samples`` fewer (the reference's own cut)."""
        model = self.model
        if codes.shape[-1] == 0:
            return model.code_embedding.weight.new_zeros(0)
        x = model.pre_transformer.step(model._embed(codes), self.kv).t()[None]
        self.frames += codes.shape[-1]
        for layer, state in zip(self._layers, self.states):
            if x.shape[-1] == 0:  # the left cut took everything so far; later layers see nothing yet
                break
            x = layer.step(x, state)
        return x.clamp(-1, 1).reshape(-1)


def measure_push_ms(model: Code2Wav, frames: int = 50, frames_per_push: int = 1, warmup: int = 5) -> float:
    """Mean wall time of a stream push per frame, in ms (random codes; for benchmarks by hand)."""
    cfg = model.cfg
    device = model.code_embedding.weight.device
    codes = torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, frames), device=device)
    stream = model.stream()
    for _ in range(warmup):  # past the first push's shorter shapes and any first-call costs
        stream.push(codes[:, :frames_per_push])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, frames, frames_per_push):
        stream.push(codes[:, i:i + frames_per_push])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / frames


__all__ = ["CHECKPOINT_PREFIX", "Code2Wav", "Code2WavConfig", "Code2WavStream", "measure_push_ms"]
