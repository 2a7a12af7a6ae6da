"""Mimi, Kyutai's streaming speech codec: 24 kHz audio <-> 12.5 Hz frames of codebook ids.

One 80 ms frame (1920 samples) goes through::

    encode: SEANet encoder (960x down, 25 Hz) -> causal transformer -> conv /2 (12.5 Hz) -> split RVQ -> codes
    decode: codes -> split RVQ sum -> transposed conv x2 (25 Hz) -> causal transformer -> SEANet decoder

Everything is causal, so :class:`Mimi` streams frame by frame with explicit,
preallocated state (batch 1): each causal conv keeps its left context, each
transposed conv its overlap-add tail, each transformer a ring of the last
``context`` steps of keys and values.  The encoder and decoder streams are
independent (in a duplex call one carries the user, the other the model).

The transformer context is defined the way Kyutai's streaming code runs it: at
each frame, a step sees the steps of the ring as it stands after that frame is
written, i.e. the last ``context`` steps up to the frame's last step.  The
frame's first step therefore sees ``context - 1`` past steps once the ring is
full; Kyutai's one-shot (non-streaming) call differs from its own streaming
there, ours does not: one-shot and frame-by-frame give the same result.

Weights load from the published checkpoint (``tokenizer-e351c8d8-checkpoint125.safetensors``
in kyutai/moshiko-pytorch-bf16) by :func:`load_mimi`, through :func:`weight_map`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import (CheckpointError, ConfigError, MappingReport, Target, copy_tensors, header_tensors,
                          match_tensors, read_safetensors_header)
from ..layers import rotate_interleaved
from .quantizer import Codebook, QuantizerConfig, SplitResidualVQ
from .seanet import CausalConv1d, CausalConvTranspose1d, SEANetConfig, SEANetDecoder, SEANetEncoder, reset_streaming

MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"


# ---------------------------------------------------------------- config

@dataclass(frozen=True)
class MimiTransformerConfig:
    """The causal transformer on each side of the quantizer (Kyutai's ``transformer`` kwargs)."""

    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    layer_scale: float | None = 0.01
    context: int = 250  # steps (at 25 Hz: 10 s) each step attends to; the KV ring's capacity
    max_period: float = 10_000.0  # RoPE
    input_dimension: int = 512  # a projection to/from d_model exists only when these differ from it
    output_dimension: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24_000
    frame_rate: float = 12.5
    channels: int = 1
    seanet: SEANetConfig = SEANetConfig()
    transformer: MimiTransformerConfig = MimiTransformerConfig()
    quantizer: QuantizerConfig = QuantizerConfig()
    # Codebooks encode() returns: a runtime choice, not a weight shape (Moshi uses 8 of the 32).
    num_codebooks: int = 8

    def __post_init__(self):
        q, t, s = self.quantizer, self.transformer, self.seanet
        if self.channels != 1 or s.channels != 1:
            raise ConfigError(f"mimi config: only mono audio is supported (channels {self.channels})")
        if self.sample_rate % self.frame_rate:
            raise ConfigError(f"mimi config: sample_rate {self.sample_rate} is not a whole number of "
                              f"frames at frame_rate {self.frame_rate}")
        if self.frame_size % s.hop_length:
            raise ConfigError(f"mimi config: frame size {self.frame_size} is not a multiple of the SEANet hop "
                              f"{s.hop_length} (ratios {list(s.ratios)})")
        if t.d_model % t.num_heads or t.head_dim % 2:
            raise ConfigError(f"mimi config: transformer d_model {t.d_model} must split into {t.num_heads} heads "
                              f"of even width")
        for name, dim in (("transformer.input_dimension", t.input_dimension),
                          ("transformer.output_dimensions", t.output_dimension),
                          ("quantizer.input_dimension", q.input_dimension),
                          ("quantizer.output_dimension", q.output_dimension)):
            if dim != s.dimension:
                raise ConfigError(f"mimi config: {name} {dim} differs from seanet.dimension {s.dimension}")
        if not q.n_q_semantic < q.n_q:
            raise ConfigError(f"mimi config: quantizer n_q {q.n_q} must exceed n_q_semantic {q.n_q_semantic}")
        if not q.n_q_semantic <= self.num_codebooks <= q.n_q:
            raise ConfigError(f"mimi config: num_codebooks {self.num_codebooks} must be in "
                              f"[{q.n_q_semantic}, {q.n_q}]")
        if t.context < 1:
            raise ConfigError(f"mimi config: transformer context must be >= 1, got {t.context}")

    @property
    def frame_size(self) -> int:
        """Samples per frame (1920 = 80 ms at 24 kHz)."""
        return int(self.sample_rate / self.frame_rate)

    @property
    def steps_per_frame(self) -> int:
        """Latent (transformer) steps per frame: the stride of the conv down/upsampling (2 for Mimi)."""
        return self.frame_size // self.seanet.hop_length

    @classmethod
    def from_dict(cls, d: dict, where: str = "mimi config", num_codebooks: int = 8) -> "MimiConfig":
        """Read a mimi config as Kyutai's ``loaders.get_mimi`` does (``sample_rate``, ``channels``,
        ``frame_rate`` and the ``seanet`` / ``transformer`` / ``quantizer`` kwargs).

        A missing key takes the reference constructor's default, as the reference would; a value
        our modules do not implement, or a key the reference does not know, is a ConfigError.
        """
        top = _Keys(d, where)
        sample_rate, channels, frame_rate = top.need("sample_rate"), top.need("channels"), top.need("frame_rate")
        sd = _Keys(top.section("seanet"), f"{where}: seanet")
        td = _Keys(top.section("transformer"), f"{where}: transformer")
        qd = _Keys(top.section("quantizer"), f"{where}: quantizer")
        top.done()

        s_kw = dict(channels=sd.get("channels", 1), dimension=sd.get("dimension", 128),
                    n_filters=sd.get("n_filters", 32), n_residual_layers=sd.get("n_residual_layers", 3),
                    ratios=tuple(sd.get("ratios", [8, 5, 4, 2])), kernel_size=sd.get("kernel_size", 7),
                    last_kernel_size=sd.get("last_kernel_size", 7),
                    residual_kernel_size=sd.get("residual_kernel_size", 3),
                    dilation_base=sd.get("dilation_base", 2), compress=sd.get("compress", 2),
                    elu_alpha=float(sd.get("activation_params", {"alpha": 1.0}).get("alpha", 1.0)))
        sd.require("causal", False, lambda v: v is True, "non-causal convolutions")
        s_kw["pad_mode"] = sd.require("pad_mode", "reflect", lambda v: v in ("constant", "replicate"),
                                      "this pad_mode")
        sd.require("activation", "ELU", lambda v: v == "ELU", "an activation other than ELU")
        sd.require("norm", "none", lambda v: v == "none", "convolution norms (weights must be pre-folded)")
        sd.require("true_skip", True, lambda v: v is True, "convolutional skip connections")
        sd.require("final_activation", None, lambda v: v is None, "a final activation")
        sd.require("trim_right_ratio", 1.0, lambda v: v == 1.0, "trim_right_ratio other than 1")
        sd.require("mask_fn", None, lambda v: v is None, "mask_fn")
        sd.ignore("disable_norm_outer_blocks", "norm_params", "mask_position", "final_activation_params")
        sd.done()

        outs = td.need("output_dimensions")
        if not isinstance(outs, (list, tuple)) or len(outs) != 1:
            raise ConfigError(f"{where}: transformer: output_dimensions must hold one dimension, got {outs!r}")
        t_kw = dict(d_model=td.need("d_model"), num_heads=td.need("num_heads"), num_layers=td.need("num_layers"),
                    dim_feedforward=td.get("dim_feedforward", 2048), layer_scale=td.get("layer_scale", None),
                    context=td.require("context", None, lambda v: isinstance(v, int), "an unbounded context"),
                    max_period=float(td.get("max_period", 10_000)), input_dimension=td.need("input_dimension"),
                    output_dimension=outs[0])
        td.require("causal", False, lambda v: v is True, "a non-causal transformer")
        td.require("conv_layout", False, lambda v: v is True, "conv_layout false (Mimi feeds [B, C, T])")
        td.require("positional_embedding", "sin", lambda v: v == "rope", "positional embeddings other than rope")
        td.require("norm", "layer_norm", lambda v: v == "layer_norm", "norms other than layer_norm")
        td.require("gating", "none", lambda v: v == "none", "a gated feed-forward")
        td.require("kv_repeat", 1, lambda v: v == 1, "grouped-query attention")
        td.require("weights_per_step", 0, lambda v: not v, "weights per step")
        td.require("cross_attention", False, lambda v: not v, "cross attention")
        td.require("skip_self_attn", False, lambda v: not v, "skip_self_attn")
        td.ignore("positional_scale", "betas", "checkpointing", "quantize")  # no effect with rope / at inference
        td.done()

        dim = qd.get("dimension", 128)
        q_kw = dict(dimension=dim, n_q=qd.get("n_q", 8), bins=qd.get("bins", 1024),
                    n_q_semantic=qd.get("n_q_semantic", 1), input_dimension=qd.get("input_dimension") or dim,
                    output_dimension=qd.get("output_dimension") or dim)
        # training-only knobs of the RVQ (dropout, EMA decay, dead-code replacement)
        qd.ignore("q_dropout", "no_quantization_rate", "decay", "threshold_usage_ratio", "replaced_usage_ratio")
        qd.done()
        try:
            return cls(sample_rate=int(sample_rate), channels=int(channels), frame_rate=float(frame_rate),
                       seanet=SEANetConfig(**s_kw), transformer=MimiTransformerConfig(**t_kw),
                       quantizer=QuantizerConfig(**q_kw),
                       num_codebooks=min(num_codebooks, q_kw["n_q"]))
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """This config in the reference's layout (what :meth:`from_dict` and ``get_mimi`` read)."""
        s, t, q = self.seanet, self.transformer, self.quantizer
        seanet = dict(channels=s.channels, dimension=s.dimension, causal=True, n_filters=s.n_filters,
                      n_residual_layers=s.n_residual_layers, activation="ELU",
                      activation_params={"alpha": s.elu_alpha}, compress=s.compress, dilation_base=s.dilation_base,
                      disable_norm_outer_blocks=0, kernel_size=s.kernel_size,
                      residual_kernel_size=s.residual_kernel_size, last_kernel_size=s.last_kernel_size,
                      norm="none", pad_mode=s.pad_mode, ratios=list(s.ratios), true_skip=True)
        transformer = dict(d_model=t.d_model, num_heads=t.num_heads, num_layers=t.num_layers, causal=True,
                           layer_scale=t.layer_scale, context=t.context, conv_layout=True, max_period=t.max_period,
                           gating="none", norm="layer_norm", positional_embedding="rope",
                           dim_feedforward=t.dim_feedforward, input_dimension=t.input_dimension,
                           output_dimensions=[t.output_dimension])
        quantizer = dict(dimension=q.dimension, n_q=q.n_q, bins=q.bins, input_dimension=q.input_dimension,
                         output_dimension=q.output_dimension)
        if q.n_q_semantic != 1:
            quantizer["n_q_semantic"] = q.n_q_semantic
        return dict(sample_rate=self.sample_rate, channels=self.channels, frame_rate=self.frame_rate,
                    seanet=seanet, transformer=transformer, quantizer=quantizer)


class _Keys:
    """Reads one section of a config dict, tracking which keys were used (unknown keys are errors)."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, found {type(d).__name__}")
        self.d, self.where, self.seen = d, where, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.d.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.d:
            raise ConfigError(f"{self.where}: missing field '{key}'")
        return self.get(key)

    def section(self, key: str) -> dict:
        return self.need(key)

    def require(self, key: str, default: Any, ok, what: str) -> Any:
        value = self.get(key, default)
        if not ok(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not supported ({what})")
        return value

    def ignore(self, *keys: str) -> None:
        self.seen.update(keys)

    def done(self) -> None:
        unknown = sorted(set(self.d) - self.seen)
        if unknown:
            raise ConfigError(f"{self.where}: unknown field(s) {', '.join(map(repr, unknown))}")


# The published Mimi (kyutai/moshiko-pytorch-bf16 and the other Moshi repos; the reference's built-in config).
MIMI = MimiConfig()

# The built-in demo codec: Mimi's structure (24 kHz, 1920-sample frames, SEANet ratios 8,6,5,4,
# transformers with the 250-step ring, split RVQ of 2048-entry codebooks: the LM's card) at toy
# width: 0.41 M numbers (1.6 MB in fp32), two thirds of them codebooks.  A frame is ~160 small ops
# each way, so it costs what eager PyTorch costs per op: measured 2.4-4.5 ms to encode and as much
# to decode (p50, one intra-op thread, on the shared 2-core dev VM; `python tests/test_mimi.py`),
# which leaves most of the 20 ms duplex step to the LM.  Random weights: its output is noise.
DEMO = MimiConfig(
    seanet=SEANetConfig(dimension=32, n_filters=4, n_residual_layers=1),
    transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=1, dim_feedforward=64, context=250,
                                      input_dimension=32, output_dimension=32),
    quantizer=QuantizerConfig(dimension=16, n_q=8, bins=2048, input_dimension=32, output_dimension=32),
    num_codebooks=8,
)

PRESETS = {"mimi": MIMI, "demo": DEMO}


# ---------------------------------------------------------------- transformer

class TransformerLayer(nn.Module):
    """Pre-norm layer: x + scale * attn(norm(x)), then x + scale * ffn(norm(x)); GELU FFN, no biases."""

    def __init__(self, cfg: MimiTransformerConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.num_heads
        self.num_heads, self.head_dim = h, cfg.head_dim
        self.attn_norm = nn.LayerNorm(d, eps=1e-5)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ffn_norm = nn.LayerNorm(d, eps=1e-5)
        self.w1 = nn.Linear(d, cfg.dim_feedforward, bias=False)
        self.w2 = nn.Linear(cfg.dim_feedforward, d, bias=False)
        scale = cfg.layer_scale
        self.attn_scale = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        self.ffn_scale = nn.Parameter(torch.full((d,), scale)) if scale is not None else None
        # the keys/values (after RoPE) of the last `context` steps, slot = position % context
        self.register_buffer("k_ring", torch.zeros(1, h, cfg.context, cfg.head_dim), persistent=False)
        self.register_buffer("v_ring", torch.zeros(1, h, cfg.context, cfg.head_dim), persistent=False)

    def reset(self) -> None:
        # zeros, not just "invalid": a masked garbage value (NaN) would still poison attention's sum
        self.k_ring.zero_()
        self.v_ring.zero_()

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, visible: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate_interleaved(q, rotation), rotate_interleaved(k, rotation)
        keys = torch.cat([self.k_ring, k], dim=2)
        values = torch.cat([self.v_ring, v], dim=2)
        keep = slots.shape[0]  # the newest steps, at most the ring's capacity
        self.k_ring.index_copy_(2, slots, k[:, :, t - keep:])
        self.v_ring.index_copy_(2, slots, v[:, :, t - keep:])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        out = self.wo(out.transpose(1, 2).reshape(b, t, d))
        x = x + (out if self.attn_scale is None else self.attn_scale * out)
        out = self.w2(F.gelu(self.w1(self.ffn_norm(x))))
        return x + (out if self.ffn_scale is None else self.ffn_scale * out)


class MimiTransformer(nn.Module):
    """Causal transformer on the 25 Hz latent, [1, C, T] in and out, streaming with a ring KV cache.

    State: the absolute position of the next step (``offset``, which drives RoPE),
    and the positions held by the ring's slots (-1: empty), shared by all layers.
    Any chunk of whole frames can be fed; the result does not depend on the chunking.
    """

    def __init__(self, cfg: MimiTransformerConfig, steps_per_frame: int):
        super().__init__()
        self.cfg, self.steps_per_frame = cfg, steps_per_frame
        d = cfg.d_model
        self.input_proj = nn.Linear(cfg.input_dimension, d, bias=False) if cfg.input_dimension != d else None
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = nn.Linear(d, cfg.output_dimension, bias=False) if cfg.output_dimension != d else None
        self.register_buffer("offset", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("ring_positions", torch.full((cfg.context,), -1, dtype=torch.long), persistent=False)

    def reset(self) -> None:
        self.offset.zero_()
        self.ring_positions.fill_(-1)
        for layer in self.layers:
            layer.reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        if t % self.steps_per_frame:
            raise ValueError(f"transformer input of {t} steps is not whole frames of {self.steps_per_frame}")
        cfg, context = self.cfg, self.cfg.context
        positions = self.offset + torch.arange(t, device=x.device)
        # Which keys (the ring's past steps, then this chunk's) each step sees: the last `context`
        # steps up to the end of its own frame, never a later step.
        key_positions = torch.cat([self.ring_positions, positions])
        frame_end = positions - positions % self.steps_per_frame + (self.steps_per_frame - 1)
        visible = ((key_positions[None] >= 0) & (key_positions[None] <= positions[:, None])
                   & (key_positions[None] > frame_end[:, None] - context))
        half = cfg.head_dim // 2
        freqs = torch.exp(torch.arange(half, device=x.device, dtype=torch.float32)
                          * (-math.log(cfg.max_period) * 2 / cfg.head_dim))
        angles = positions.float()[:, None] * freqs
        rotation = torch.polar(torch.ones_like(angles), angles)
        newest = positions[max(0, t - context):]
        slots = newest % context

        x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        for layer in self.layers:
            x = layer(x, rotation, visible, slots)
        if self.output_proj is not None:
            x = self.output_proj(x)
        self.ring_positions.index_copy_(0, slots, newest)
        self.offset.add_(t)
        return x.transpose(1, 2)


# ---------------------------------------------------------------- the codec

class Mimi(nn.Module):
    """The codec, with streaming state for one encoder stream and one decoder stream (batch 1).

    ``encode_frame`` / ``decode_frame`` advance a stream by one frame; ``encode`` /
    ``decode`` process a whole signal, restarting that stream first (its state
    afterwards is as if those frames had been streamed).  ``reset`` restarts both.
    ``num_codebooks`` (how many codes ``encode`` returns) can be changed at any time.
    """

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.num_codebooks = cfg.num_codebooks
        dim, stride = cfg.seanet.dimension, cfg.steps_per_frame
        self.encoder = SEANetEncoder(cfg.seanet)
        self.encoder_transformer = MimiTransformer(cfg.transformer, stride)
        # 25 Hz -> 12.5 Hz: a learnt strided conv; its first frame's left context repeats the first step
        self.downsample = (CausalConv1d(dim, dim, 2 * stride, stride=stride, bias=False, pad_mode="replicate")
                           if stride > 1 else None)
        self.quantizer = SplitResidualVQ(cfg.quantizer)
        # 12.5 Hz -> 25 Hz: depthwise (one filter per channel, as the published weights are)
        self.upsample = (CausalConvTranspose1d(dim, dim, 2 * stride, stride, groups=dim, bias=False)
                         if stride > 1 else None)
        self.decoder_transformer = MimiTransformer(cfg.transformer, stride)
        self.decoder = SEANetDecoder(cfg.seanet)

    @property
    def frame_size(self) -> int:
        return self.cfg.frame_size

    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    def _like(self) -> torch.Tensor:
        """A weight: inputs are moved to its device and dtype."""
        return self.quantizer.semantic.input_proj.weight

    # -- state
    def reset(self) -> None:
        """Restart both streams (zero left contexts and tails, empty KV rings, positions at 0)."""
        self.reset_encoder()
        self.reset_decoder()

    def reset_encoder(self) -> None:
        reset_streaming(self.encoder)
        self.encoder_transformer.reset()
        if self.downsample is not None:
            self.downsample.reset()

    def reset_decoder(self) -> None:
        if self.upsample is not None:
            self.upsample.reset()
        self.decoder_transformer.reset()
        reset_streaming(self.decoder)

    # -- encoder side
    def _encode(self, pcm: torch.Tensor) -> torch.Tensor:
        latent = self.encoder_transformer(self.encoder(pcm.to(self._like()).view(1, 1, -1)))
        if self.downsample is not None:
            latent = self.downsample(latent)
        return self.quantizer.encode(latent, self.num_codebooks)

    @torch.no_grad()
    def encode_frame(self, pcm: torch.Tensor) -> torch.Tensor:
        """Next frame of the encoder stream: pcm [frame_size] (float, -1..1) -> codes [num_codebooks] (int64)."""
        if pcm.shape != (self.frame_size,):
            raise ValueError(f"encode_frame takes one frame of {self.frame_size} samples, got {tuple(pcm.shape)}")
        return self._encode(pcm)[:, 0]

    @torch.no_grad()
    def encode(self, pcm: torch.Tensor, chunk_frames: int = 250) -> torch.Tensor:
        """A whole signal [T] -> codes [num_codebooks, ceil(T / frame_size)]; the last frame is zero-padded.

        Restarts the encoder stream.  Runs `chunk_frames` frames at a time to bound memory
        (activations and attention grow with the chunk); the codes do not depend on the chunking.
        """
        if pcm.dim() != 1 or pcm.shape[0] == 0:
            raise ValueError(f"encode takes a non-empty 1-D signal, got shape {tuple(pcm.shape)}")
        self.reset_encoder()
        pcm = F.pad(pcm, (0, -pcm.shape[0] % self.frame_size))
        return torch.cat([self._encode(chunk) for chunk in pcm.split(chunk_frames * self.frame_size)], dim=1)

    # -- decoder side
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        if not self.quantizer.n_q_semantic <= n <= self.cfg.quantizer.n_q:
            raise ValueError(f"decode needs between {self.quantizer.n_q_semantic} and {self.cfg.quantizer.n_q} "
                             f"codebooks, got {n}")
        latent = self.quantizer.decode(codes.to(self._like().device, torch.long))
        if self.upsample is not None:
            latent = self.upsample(latent)
        return self.decoder(self.decoder_transformer(latent)).view(-1).float()

    @torch.no_grad()
    def decode_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Next frame of the decoder stream: codes [K] -> pcm [frame_size] (float32)."""
        if codes.dim() != 1:
            raise ValueError(f"decode_frame takes the codes of one frame [K], got shape {tuple(codes.shape)}")
        return self._decode(codes[:, None])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, chunk_frames: int = 250) -> torch.Tensor:
        """codes [K, frames] -> pcm [frames * frame_size] (float32).

        Restarts the decoder stream; runs `chunk_frames` frames at a time, as :meth:`encode`.
        """
        if codes.dim() != 2:
            raise ValueError(f"decode takes codes [K, frames], got shape {tuple(codes.shape)}")
        self.reset_decoder()
        return torch.cat([self._decode(chunk) for chunk in codes.split(chunk_frames, dim=1)])


# ---------------------------------------------------------------- weights

# Checkpoint tensors recognised but not loaded, by name suffix, with the reason (for `models verify`).
UNUSED_SUFFIXES = {"._codebook._initialized": "codebook k-means initialisation flag (training only)"}


def _checkpoint_names(cfg: MimiConfig) -> tuple[dict[str, str], dict[str, str]]:
    """(checkpoint name -> our name, alias checkpoint name -> checkpoint name).

    Checkpoint names are Kyutai's MimiModel state-dict names, as published: SEANet layers
    are indexed in one ``nn.Sequential`` (ELUs take indices too), convs nest twice
    (``conv.conv``), and attention projections use the legacy ``in_proj_weight`` /
    ``out_proj.weight``.  The aliases are the spelling the moshi package's own
    ``state_dict()`` writes today (``in_projs.0.weight`` / ``out_projs.0.weight``).
    """
    s, q, t = cfg.seanet, cfg.quantizer, cfg.transformer
    names: dict[str, str] = {}
    aliases: dict[str, str] = {}

    def conv(ckpt: str, ours: str, kind: str = "conv") -> None:
        for p in ("weight", "bias"):
            names[f"{ckpt}.{kind}.{kind}.{p}"] = f"{ours}.{kind}.{p}"

    def residuals(ckpt: str, idx: int, ours: str) -> int:
        for j in range(s.n_residual_layers):
            conv(f"{ckpt}.{idx}.block.1", f"{ours}.residuals.{j}.conv1")
            conv(f"{ckpt}.{idx}.block.3", f"{ours}.residuals.{j}.conv2")
            idx += 1
        return idx

    # encoder: conv, [residuals, ELU, strided conv] per ratio, ELU, conv
    conv("encoder.model.0", "encoder.input_conv")
    idx = 1
    for i in range(len(s.ratios)):
        idx = residuals("encoder.model", idx, f"encoder.stages.{i}")
        conv(f"encoder.model.{idx + 1}", f"encoder.stages.{i}.downsample")
        idx += 2
    conv(f"encoder.model.{idx + 1}", "encoder.output_conv")
    # decoder: conv, [ELU, transposed conv, residuals] per ratio, ELU, conv
    conv("decoder.model.0", "decoder.input_conv")
    idx = 1
    for i in range(len(s.ratios)):
        conv(f"decoder.model.{idx + 1}", f"decoder.stages.{i}.upsample", kind="convtr")
        idx = residuals("decoder.model", idx + 2, f"decoder.stages.{i}")
    conv(f"decoder.model.{idx + 1}", "decoder.output_conv")

    for side in ("encoder", "decoder"):
        ckpt, ours = f"{side}_transformer", f"{side}_transformer"
        if t.input_dimension != t.d_model:
            names[f"{ckpt}.input_proj.weight"] = f"{ours}.input_proj.weight"
        if t.output_dimension != t.d_model:
            names[f"{ckpt}.output_projs.0.weight"] = f"{ours}.output_proj.weight"
        for i in range(t.num_layers):
            c, o = f"{ckpt}.transformer.layers.{i}", f"{ours}.layers.{i}"
            names[f"{c}.self_attn.in_proj_weight"] = f"{o}.wqkv.weight"
            names[f"{c}.self_attn.out_proj.weight"] = f"{o}.wo.weight"
            aliases[f"{c}.self_attn.in_projs.0.weight"] = f"{c}.self_attn.in_proj_weight"
            aliases[f"{c}.self_attn.out_projs.0.weight"] = f"{c}.self_attn.out_proj.weight"
            for norm, our_norm in (("norm1", "attn_norm"), ("norm2", "ffn_norm")):
                names[f"{c}.{norm}.weight"] = f"{o}.{our_norm}.weight"
                names[f"{c}.{norm}.bias"] = f"{o}.{our_norm}.bias"
            names[f"{c}.linear1.weight"] = f"{o}.w1.weight"
            names[f"{c}.linear2.weight"] = f"{o}.w2.weight"
            if t.layer_scale is not None:
                names[f"{c}.layer_scale_1.scale"] = f"{o}.attn_scale"
                names[f"{c}.layer_scale_2.scale"] = f"{o}.ffn_scale"

    if cfg.steps_per_frame > 1:
        names["downsample.conv.conv.conv.weight"] = "downsample.conv.weight"
        names["upsample.convtr.convtr.convtr.weight"] = "upsample.convtr.weight"

    for ckpt, ours, n in (("rvq_first", "semantic", q.n_q_semantic), ("rvq_rest", "acoustic", q.n_q - q.n_q_semantic)):
        for proj in ("input_proj", "output_proj"):
            names[f"quantizer.{ckpt}.{proj}.weight"] = f"quantizer.{ours}.{proj}.weight"
        for k in range(n):
            for buf in ("embedding_sum", "cluster_usage"):
                names[f"quantizer.{ckpt}.vq.layers.{k}._codebook.{buf}"] = f"quantizer.{ours}.codebooks.{k}.{buf}"
    return names, aliases


def weight_map(cfg: MimiConfig, model: Mimi | None = None) -> dict[str, Target]:
    """Checkpoint tensor name -> destination, for every tensor we load (canonical published names)."""
    if model is None:
        with torch.device("meta"):
            model = Mimi(cfg)
    ours = model.state_dict()
    names, _ = _checkpoint_names(cfg)
    return {ckpt: Target(param, tuple(ours[param].shape)) for ckpt, param in names.items()}


def _unused(name: str) -> str | None:
    return next((r for suffix, r in UNUSED_SUFFIXES.items() if name.endswith(suffix)), None)


def check_mimi_tensors(cfg: MimiConfig, found: dict[str, tuple[tuple[int, ...], str | None]],
                       model: Mimi | None = None) -> MappingReport:
    """Compare a checkpoint's tensors (name -> (shape, safetensors dtype or None)) with what our modules expect."""
    _, aliases = _checkpoint_names(cfg)
    return match_tensors(weight_map(cfg, model), found, _unused, aliases)


def load_mimi(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              config: MimiConfig | None = None, num_codebooks: int | None = None) -> Mimi:
    """Load the codec from a Mimi safetensors file (or a directory holding ``MIMI_NAME``).

    ``config`` defaults to the published Mimi (:data:`MIMI`).  fp32 is the default, as Kyutai
    runs Mimi.  Raises :class:`CheckpointError` naming the file and tensor for a missing file,
    a damaged header, or a missing / unexpected / misshapen tensor.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MIMI_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file (the Mimi codec weights)")
    cfg = config or MIMI
    if num_codebooks is not None:
        cfg = replace(cfg, num_codebooks=num_codebooks)
    header = read_safetensors_header(path)
    with torch.device("meta"):
        model = Mimi(cfg)
    report = check_mimi_tensors(cfg, header_tensors(header), model)
    if not report.ok:
        raise CheckpointError(report.error(str(path)))
    model = model.to(dtype).to_empty(device=torch.device(device))
    _, aliases = _checkpoint_names(cfg)
    copy_tensors({name: path for name in report.loaded}, report.loaded, weight_map(cfg, model),
                 model.state_dict(keep_vars=True), aliases)
    with torch.no_grad():
        model.quantizer.refresh()
        model.reset()
    model.requires_grad_(False)
    return model.eval()


def checkpoint_state_dict(model: Mimi) -> dict[str, torch.Tensor]:
    """Our weights under the published checkpoint names (what a demo checkpoint writes), including
    the ``_initialized`` flags the reference's strict loader expects."""
    ours = model.state_dict()
    names, _ = _checkpoint_names(model.cfg)
    out = {ckpt: ours[param] for ckpt, param in names.items()}
    for ckpt in list(out):
        if ckpt.endswith("._codebook.cluster_usage"):
            out[ckpt.replace("cluster_usage", "_initialized")] = torch.ones(1, dtype=out[ckpt].dtype)
    return out


@torch.no_grad()
def init_random_(model: Mimi, generator: torch.Generator | None = None) -> Mimi:
    """Seeded random weights for a demo or a benchmark: conv/linear weights ~ N(0, 1/fan_in)
    (the decoder's last conv 10x smaller), biases 0, norms 1, layer scales as configured,
    codewords ~ N(0, 1) with unit usage.
    Unit-variance layers keep the signal finite through the stack: the decoded noise is bounded.
    ``generator`` must be on the model's device."""
    for module in model.modules():
        if isinstance(module, nn.Conv1d):
            fan_in = module.in_channels // module.groups * module.kernel_size[0]
        elif isinstance(module, nn.ConvTranspose1d):  # each output sample sums kernel/stride input steps
            fan_in = module.in_channels // module.groups * module.kernel_size[0] // module.stride[0]
        elif isinstance(module, nn.Linear):
            fan_in = module.in_features
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
            continue
        elif isinstance(module, Codebook):
            module.embedding_sum.normal_(0.0, 1.0, generator=generator)
            module.cluster_usage.fill_(1.0)
            continue
        else:
            continue
        module.weight.normal_(0.0, fan_in ** -0.5, generator=generator)
        if module.bias is not None:
            module.bias.zero_()
    # the last conv 10x quieter: the decoded noise plays at about -20 dBFS instead of clipping
    model.decoder.output_conv.conv.weight.mul_(0.1)
    for layer in model.modules():
        if isinstance(layer, TransformerLayer) and layer.attn_scale is not None:
            layer.attn_scale.fill_(model.cfg.transformer.layer_scale)
            layer.ffn_scale.fill_(model.cfg.transformer.layer_scale)
    model.quantizer.refresh()
    model.reset()
    return model


__all__ = ["DEMO", "MIMI", "MIMI_NAME", "PRESETS", "Mimi", "MimiConfig", "MimiTransformerConfig", "QuantizerConfig",
           "SEANetConfig", "UNUSED_SUFFIXES", "check_mimi_tensors", "checkpoint_state_dict", "init_random_",
           "load_mimi", "weight_map"]
