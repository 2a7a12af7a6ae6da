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

Parameter names equal the checkpoint's after its ``code2wav.`` prefix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError
from ..layers import RMSNorm, apply_rotary, attend_one

CHECKPOINT_PREFIX = "code2wav."

# Architecture constants of the reference modules (they are not in config.json).
CONV_KERNEL = 7  # decoder stem, residual units, output conv and the ConvNeXt depthwise conv
RESIDUAL_DILATIONS = (1, 3, 9)  # the three residual units of each decoder block
CONVNEXT_EXPANSION = 4  # ConvNeXt pointwise MLP width, in multiples of the hidden size
CONVNEXT_NORM_EPS = 1e-6
SNAKE_EPS = 1e-9  # keeps 1 / beta finite


# ---------------------------------------------------------------- config

def _get(d: dict, key: str, where: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{where}: missing field '{key}'")
    return d[key]


def _positive_int(d: dict, key: str, where: str) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where}: field '{key}' must be a positive integer, got {v!r}")
    return v


def _positive_ints(d: dict, key: str, where: str) -> tuple[int, ...]:
    v = _get(d, key, where)
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in v):
        raise ConfigError(f"{where}: field '{key}' must be a non-empty list of positive integers, got {v!r}")
    return tuple(v)


def _rope_theta(d: dict, where: str) -> float:
    # hub files write rope_theta; current transformers writes rope_parameters
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope type '{rope_type}' is not supported (code2wav uses default RoPE)")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{where}: missing field 'rope_theta' (or rope_parameters.rope_theta)")
    return float(theta)


@dataclass(frozen=True)
class Code2WavConfig:
    """``code2wav_config`` of a Qwen3-Omni config.json (field names as the file spells them)."""

    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    attention_bias: bool
    sliding_window: int  # a frame attends to itself and the sliding_window - 1 frames before it
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float  # only an initial value (random init); the checkpoint holds the scales
    upsampling_ratios: tuple[int, ...]  # transposed conv + ConvNeXt stages right after the transformer
    upsample_rates: tuple[int, ...]  # SnakeBeta decoder blocks, each halving the width
    decoder_dim: int

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Code2WavConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
        act = _get(d, "hidden_act", where)
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (code2wav uses silu)")
        hidden = _positive_int(d, "hidden_size", where)
        heads = _positive_int(d, "num_attention_heads", where)
        kv_heads = _positive_int(d, "num_key_value_heads", where)
        if heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
        if d.get("head_dim") is not None:  # the reference reads head_dim when present, else hidden // heads
            head_dim = _positive_int(d, "head_dim", where)
        elif hidden % heads:
            raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(f"{where}: head_dim {head_dim} must be even (rotary embedding)")
        bias = _get(d, "attention_bias", where)
        if not isinstance(bias, bool):
            raise ConfigError(f"{where}: field 'attention_bias' must be true or false, got {bias!r}")
        rates = _positive_ints(d, "upsample_rates", where)
        decoder_dim = _positive_int(d, "decoder_dim", where)
        if decoder_dim // 2 ** len(rates) < 1:
            raise ConfigError(f"{where}: decoder_dim {decoder_dim} is too small to halve "
                              f"{len(rates)} times (upsample_rates {list(rates)})")
        return cls(
            codebook_size=_positive_int(d, "codebook_size", where),
            num_quantizers=_positive_int(d, "num_quantizers", where),
            hidden_size=hidden,
            num_hidden_layers=_positive_int(d, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive_int(d, "intermediate_size", where),
            attention_bias=bias,
            sliding_window=_positive_int(d, "sliding_window", where),
            rope_theta=_rope_theta(d, where),
            rms_norm_eps=float(_get(d, "rms_norm_eps", where)),
            layer_scale_initial_scale=float(_get(d, "layer_scale_initial_scale", where)),
            upsampling_ratios=_positive_ints(d, "upsampling_ratios", where),
            upsample_rates=rates,
            decoder_dim=decoder_dim,
        )

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per code frame: the product of all upsampling factors (1920 = 80 ms at 24 kHz)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def lookahead_samples(self) -> int:
        """Samples of the last frame that need the next frame (555 for the real model; see the module doc).

        Each decoder block's transposed conv (kernel 2 * rate) is cut ``rate`` samples early, i.e. by
        one input step, worth ``rate * (later rates)`` output samples; the upsampling stages cut none."""
        rates = self.upsample_rates
        return sum(r * math.prod(rates[i + 1:]) for i, r in enumerate(rates))

    def output_samples(self, frames: int) -> int:
        """Length of the reference's (and :meth:`Code2Wav.forward`'s) output for ``frames`` frames."""
        return max(0, frames * self.samples_per_frame - self.lookahead_samples)


# ---------------------------------------------------------------- streaming state of the conv layers

class _ConvState:
    """The left context of one causal conv: its last ``(kernel-1)*dilation`` inputs.

    That is exactly what its one-shot zero padding stands for, so it starts as zeros.  It lives at
    the front of a work buffer ``[1, C, context + n]``; a push copies its ``n`` new inputs behind it
    (or the producer writes them there), convolves the whole buffer without padding and keeps the
    last ``context`` columns.  The buffer is reallocated only when ``n`` changes, so frame-by-frame
    pushes reuse it; it is sized exactly so that the conv reads a contiguous tensor."""

    def __init__(self, channels: int, context: int, device: torch.device, dtype: torch.dtype):
        self.context = context
        self.buf = torch.zeros(1, channels, context, device=device, dtype=dtype)

    def slot(self, n: int) -> torch.Tensor:
        """Where the next ``n`` inputs go (a view of the buffer)."""
        c = self.context
        if self.buf.shape[-1] != c + n:
            with torch.inference_mode(False):  # see Code2WavStream.__init__
                grown = self.buf.new_empty(1, self.buf.shape[1], c + n)
            grown[..., :c].copy_(self.buf[..., :c])
            self.buf = grown
        return self.buf[..., c:]

    def advance(self) -> None:
        """Keep the last ``context`` inputs (after the conv has read the buffer)."""
        c, n = self.context, self.buf.shape[-1] - self.context
        src = self.buf[..., n:]
        self.buf[..., :c].copy_(src if n >= c else src.clone())  # copy_ refuses overlapping memory

    def reset(self) -> None:
        self.buf.zero_()


class _TransConvState:
    """Overlap-add tail and pending left cut of one transposed conv.

    Input step ``i`` writes ``kernel`` output samples from ``i * stride`` on, so after a push of ``n``
    steps the last ``kernel - stride`` samples still wait for step ``n``'s contribution: they are
    kept (without bias, which is added once a sample is final) and added to the next push's first
    samples.  ``skip`` counts the samples of the reference's left cut not yet dropped."""

    def __init__(self, channels: int, overlap: int, cut: int, device: torch.device, dtype: torch.dtype):
        self.tail = torch.zeros(1, channels, overlap, device=device, dtype=dtype)
        self.cut = cut
        self.skip = cut

    def reset(self) -> None:
        self.tail.zero_()
        self.skip = self.cut


# ---------------------------------------------------------------- conv layers

class CausalConv(nn.Module):
    """Reference ``CausalConvNet`` (stride 1): zero left padding of ``(kernel-1)*dilation``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.context, 0)))

    def new_state(self, device, dtype) -> _ConvState | None:
        return _ConvState(self.conv.in_channels, self.context, device, dtype) if self.context else None

    def step(self, x: torch.Tensor | None, state: _ConvState | None) -> torch.Tensor:
        """Convolve the inputs already written into ``state.slot(n)`` (``x`` None) or ``x`` [1, C, n]."""
        if state is None:
            return self.conv(x)
        if x is not None:
            state.slot(x.shape[-1]).copy_(x)
        buf = state.buf
        if buf.device.type == "cpu" and self.conv.groups == 1 and buf.shape[-1] - self.context <= _MATMUL_MAX_STEPS:
            y = _conv_as_matmul(buf, self.conv)
        else:
            y = self.conv(buf)
        state.advance()
        return y


# Below this many output steps a CPU conv runs as one matrix product: oneDNN's kernel is several
# times slower there (the decoder stem, 1024 -> 1536 channels, 4 steps per frame: 7-18 ms vs 3.5).
_MATMUL_MAX_STEPS = 16


def _conv_as_matmul(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """An unpadded stride-1 Conv1d (groups 1) of x [1, C_in, L] as im2col and one matrix product."""
    c_out, c_in, k = conv.weight.shape
    d = conv.dilation[0]
    cols = x[0].unfold(1, (k - 1) * d + 1, 1)[:, :, ::d]  # [C_in, n, K]
    cols = cols.permute(0, 2, 1).reshape(c_in * k, -1)  # rows ordered like the weight's (C_in, K)
    w = conv.weight.view(c_out, c_in * k)
    y = torch.mm(w, cols) if conv.bias is None else torch.addmm(conv.bias[:, None], w, cols)
    return y[None]


class CausalTransConv(nn.Module):
    """Reference ``CausalTransConvNet``: a ConvTranspose1d cut by ``kernel - stride`` at both ends."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        if kernel_size % stride:
            raise ValueError(f"transposed conv kernel {kernel_size} is not a multiple of its stride {stride}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.cut = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.cut:y.shape[-1] - self.cut]

    def new_state(self, device, dtype) -> _TransConvState:
        return _TransConvState(self.conv.out_channels, self.cut, self.cut, device, dtype)

    def step(self, x: torch.Tensor, state: _TransConvState) -> torch.Tensor:
        """x [1, C_in, n] -> the ``n * stride`` samples these steps make final, less any left cut pending."""
        n, s = x.shape[-1], self.stride
        y = _transposed_conv(x, self.conv.weight, s)  # [1, C_out, n*s + overlap], no bias
        overlap = state.tail.shape[-1]
        if overlap:
            y[..., :overlap] += state.tail
            state.tail.copy_(y[..., n * s:])
        y = y[..., :n * s]
        if self.conv.bias is not None:
            y += self.conv.bias[:, None]
        if state.skip:
            cut = min(state.skip, y.shape[-1])
            state.skip -= cut
            y = y[..., cut:]
        return y


def _transposed_conv(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """ConvTranspose1d without bias, [1, C_in, n] -> [1, C_out, (n-1)*stride + K], for K a multiple of
    the stride (K = stride or 2 * stride here).

    As one matrix product (each input step times the weight) and an overlap-add of the K / stride
    shifted pieces: PyTorch's CPU kernel is slow for the few input steps a streamed frame has."""
    c_in, c_out, k = weight.shape
    n, m = x.shape[-1], k // stride
    cols = torch.mm(x[0].t(), weight.reshape(c_in, c_out * k))  # [n, C_out * K]
    taps = cols.view(n, c_out, m, stride).permute(2, 1, 0, 3)  # [m, C_out, n, stride]
    y = x.new_empty(1, c_out, (n - 1 + m) * stride)
    y[0, :, :n * stride] = taps[0].reshape(c_out, n * stride)
    y[0, :, n * stride:] = 0
    for j in range(1, m):
        y[0, :, j * stride:(j + n) * stride] += taps[j].reshape(c_out, n * stride)
    return y


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel, in the reference's operation order."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``, if given, receives the result; it must not overlap ``x`` (read again at the end)."""
        alpha = self.alpha.exp()[:, None]
        inv_beta = 1.0 / (self.beta.exp()[:, None] + SNAKE_EPS)
        y = torch.mul(x, alpha, out=out)
        return y.sin_().pow_(2).mul_(inv_beta).add_(x)

    def new_state(self, device, dtype) -> None:
        return None

    def step(self, x: torch.Tensor, state: None) -> torch.Tensor:
        return self(x)


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(conv7_dilated(snake(x))))."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, CONV_KERNEL, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def new_state(self, device, dtype) -> _ConvState:
        return self.conv1.new_state(device, dtype)

    def step(self, x: torch.Tensor, state: _ConvState) -> torch.Tensor:
        self.act1(x, out=state.slot(x.shape[-1]))  # written straight behind conv1's left context
        h = self.conv1.step(None, state)
        return self.conv2(self.act2(h)).add_(x)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv, LayerNorm, pointwise MLP (GELU), per-channel gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, CONV_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, CONVNEXT_EXPANSION * dim)
        self.pwconv2 = nn.Linear(CONVNEXT_EXPANSION * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def _mlp(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x, self.dwconv(x))

    def new_state(self, device, dtype) -> _ConvState:
        return self.dwconv.new_state(device, dtype)

    def step(self, x: torch.Tensor, state: _ConvState) -> torch.Tensor:
        return self._mlp(x, self.dwconv.step(x, state))


class UpsampleStage(nn.ModuleList):
    """[transposed conv (kernel = stride = ratio), ConvNeXt block] (checkpoint ``upsample.{i}.{0,1}``)."""

    def __init__(self, dim: int, ratio: int):
        super().__init__([CausalTransConv(dim, dim, ratio, ratio), ConvNeXtBlock(dim)])


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv (kernel 2 * rate) halving the width, three dilated residual units."""

    def __init__(self, in_dim: int, rate: int):
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in RESIDUAL_DILATIONS)])


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
