"""Qwen2.5-Omni token2wav DiT: codec codes -> mel spectrogram by flow matching.

Parameter names equal the checkpoint's after removing ``token2wav.code2wav_dit_model.``.

The model predicts a velocity field over mel frames; :meth:`DiT.sample`
integrates it from Gaussian noise (t = 0) to a mel spectrogram (t = 1) with a
fixed-step RK4 (3/8 rule) on a "sway"-warped time grid, using classifier-free
guidance (CFG) against an unconditional branch whose speaker vector and
reference mel are zeros and whose codes are all 0.

Pieces of one velocity evaluation for ``N`` frames (``N = repeats * codes``):

    x [N, mel] + ECAPA(ref_mel) + codec_embed(code) repeated + speaker cond
        -> input proj -> DiT layers (AdaLN-Zero, block-local attention) -> AdaLN -> proj_out

Attention locality: frames are grouped in blocks of ``block_size`` frames
counted from the first frame of the sequence that is passed in.  Layer ``i``
lets block ``b`` see blocks ``b-1`` (if ``i`` is in ``look_backward_layers``),
``b`` and ``b+1`` (if ``i`` is in ``look_ahead_layers``).  One velocity
evaluation therefore makes the frames of block ``b`` depend on input blocks
``[b - reach_back, b + reach_ahead]`` only (:attr:`DiTConfig.reach_back` /
:attr:`DiTConfig.reach_ahead`: the number of layers with look-back /
look-ahead).  Rotary positions also count from the first frame, but RoPE
scores depend on position differences only, so a window that starts on a block
boundary computes the same function as the full sequence, up to rounding, for
blocks further than the reach from both window edges.  The ODE compounds the
reach: every RK4 step chains 4 evaluations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError
from ..layers import apply_rotary

__all__ = ["DiTConfig", "DiT", "DEFAULT_NUM_STEPS", "DEFAULT_GUIDANCE_SCALE", "DEFAULT_SWAY_COEFFICIENT"]

# Sampling defaults of the reference ``Qwen2_5OmniToken2WavDiTModel.sample`` (and of Qwen's release).
DEFAULT_NUM_STEPS = 10
DEFAULT_GUIDANCE_SCALE = 0.5
DEFAULT_SWAY_COEFFICIENT = -1.0
# Below this guidance the reference skips the unconditional branch (one forward of batch 1).
MIN_GUIDANCE_SCALE = 1e-5

# Fixed architecture constants of the released DiT that the config does not carry.
TIME_FREQ_DIM = 256  # width of the sinusoidal timestep features fed to time_mlp
TIME_SCALE = 1000.0  # t in [0, 1] is scaled like a diffusion step index before the sinusoids
TIME_MAX_PERIOD = 10000.0  # longest sinusoid period of the timestep features
NORM_EPS = 1e-6  # LayerNorm eps of every (AdaLN) norm in the DiT
ASP_EPS = 1e-12  # variance floor of the speaker encoder's attentive statistics pooling


def _field(d: dict, where: str, *names: str, default: Any = ...):
    """First present key among ``names`` (newer spelling first, then the hub file's legacy one)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is ...:
        raise ConfigError(f"{where}: missing field '{names[0]}'"
                          + (f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""))
    return default


def _ints(value, where: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: field '{name}' must be a list of integers, got {value!r}") from None


@dataclass(frozen=True)
class DiTConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    ff_mult: int
    emb_dim: int  # codec embedding width
    num_embeds: int  # codec vocabulary (the table has one row more; code 0 is the CFG "no code")
    repeats: int  # mel frames per codec code
    mel_dim: int
    enc_emb_dim: int  # width of a voice's ``cond`` speaker vector (spk_dict.pt)
    enc_dim: int  # width of the ECAPA speaker encoder output
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int
    block_size: int
    look_ahead_layers: tuple[int, ...]
    look_backward_layers: tuple[int, ...]
    rope_theta: float
    max_position_embeddings: int

    def __post_init__(self):
        if not (len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations)):
            raise ConfigError("dit_config: enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if len(self.enc_channels) < 2:
            raise ConfigError("dit_config: enc_channels needs an input TDNN and an aggregation layer (>= 2 entries)")
        for c in self.enc_channels[:-1]:
            if c % self.enc_res2net_scale:
                raise ConfigError(f"dit_config: enc_channels {c} is not a multiple of enc_res2net_scale "
                                  f"{self.enc_res2net_scale}")
        if self.head_dim % 2:
            raise ConfigError(f"dit_config: head_dim {self.head_dim} must be even for rotary embeddings")
        if self.block_size <= 0 or self.repeats <= 0:
            raise ConfigError("dit_config: block_size and repeats must be positive")

    @classmethod
    def from_dict(cls, d: dict, where: str = "token2wav_config.dit_config") -> "DiTConfig":
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{where}: rope type '{rope_type}' is not supported (only default)")
        return cls(
            # The released config.json spells these dim/depth/heads; current transformers writes the long names.
            hidden_size=int(_field(d, where, "hidden_size", "dim")),
            num_layers=int(_field(d, where, "num_hidden_layers", "depth")),
            num_heads=int(_field(d, where, "num_attention_heads", "heads")),
            head_dim=int(_field(d, where, "head_dim")),
            ff_mult=int(_field(d, where, "ff_mult")),
            emb_dim=int(_field(d, where, "emb_dim")),
            num_embeds=int(_field(d, where, "num_embeds")),
            repeats=int(_field(d, where, "repeats")),
            mel_dim=int(_field(d, where, "mel_dim")),
            enc_emb_dim=int(_field(d, where, "enc_emb_dim")),
            enc_dim=int(_field(d, where, "enc_dim")),
            enc_channels=_ints(_field(d, where, "enc_channels"), where, "enc_channels"),
            enc_kernel_sizes=_ints(_field(d, where, "enc_kernel_sizes"), where, "enc_kernel_sizes"),
            enc_dilations=_ints(_field(d, where, "enc_dilations"), where, "enc_dilations"),
            enc_attention_channels=int(_field(d, where, "enc_attention_channels")),
            enc_res2net_scale=int(_field(d, where, "enc_res2net_scale")),
            enc_se_channels=int(_field(d, where, "enc_se_channels")),
            # The hub config.json omits the next five; the defaults mirror the reference
            # Qwen2_5OmniDiTConfig class defaults, which is what transformers uses for the release.
            block_size=int(_field(d, where, "block_size", default=24)),
            look_ahead_layers=_ints(_field(d, where, "look_ahead_layers", default=(10,)), where, "look_ahead_layers"),
            look_backward_layers=_ints(_field(d, where, "look_backward_layers", default=(0, 20)), where,
                                       "look_backward_layers"),
            rope_theta=float(rope.get("rope_theta", _field(d, where, "rope_theta", default=10000.0))),
            max_position_embeddings=int(_field(d, where, "max_position_embeddings", default=32768)),
        )

    def layer_reach(self, i: int) -> tuple[int, int]:
        """(blocks back, blocks ahead) that layer ``i`` attends to (the reference's ``i in ...`` test)."""
        return int(i in self.look_backward_layers), int(i in self.look_ahead_layers)

    @property
    def reach_back(self) -> int:
        """Blocks before block b that one velocity evaluation of block b reads."""
        return sum(self.layer_reach(i)[0] for i in range(self.num_layers))

    @property
    def reach_ahead(self) -> int:
        """Blocks after block b that one velocity evaluation of block b reads."""
        return sum(self.layer_reach(i)[1] for i in range(self.num_layers))


# ---------------------------------------------------------------------------------------------
# ECAPA-TDNN speaker encoder (reads the voice's reference mel)


class TimeDelayNetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        # "same" length with reflected edges, as trained.
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation,
                              padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channel groups processed in a chain: group i (i >= 1) convolves itself plus group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]  # the first group passes through unchanged
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, kernel_size=1)
        self.conv2 = nn.Conv1d(se_channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int,
                 kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x [B, C, T] under weights w (summing to 1 over T)."""
    mean = (w * x).sum(2)
    std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(ASP_EPS))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    """Per-channel attention over time, conditioned on the utterance's global mean/std -> [mean, std]."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[2]
        # Uniform weights written as the reference's (mask / total) so the sums round the same way.
        uniform = torch.full((1, 1, length), 1.0 / length, dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: mel [B, T, mel_dim] -> [B, enc_dim] utterance-level speaker features."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [TimeDelayNetBlock(cfg.mel_dim, ch[0], ks[0], dil[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SqueezeExcitationRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels,
                                                        ks[i], dil[i]))
        self.blocks = nn.ModuleList(blocks)
        # Multi-layer feature aggregation over the SE-Res2Net outputs; the released config makes
        # ch[-1] equal to their summed width.
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, kernel_size=1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim + cfg.enc_dim + cfg.enc_emb_dim + cfg.emb_dim, cfg.hidden_size)
        self.spk_encoder = SpeakerEncoder(cfg)

    def forward(self, x, speaker_feat, code_embed, spk_cond) -> torch.Tensor:
        """x [B, N, mel], speaker_feat [B, enc_dim], code_embed [B, N, emb], spk_cond [B, enc_emb] -> [B, N, D]."""
        n = x.shape[1]
        # Concatenation order of the trained projection: noisy mel, speaker features, codes, voice vector.
        parts = (x, speaker_feat[:, None].expand(-1, n, -1), code_embed, spk_cond[:, None].expand(-1, n, -1))
        return self.proj(torch.cat(parts, dim=-1))


class CodecEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.repeats = cfg.repeats
        self.codec_embed = nn.Embedding(cfg.num_embeds + 1, cfg.emb_dim)

    def forward(self, code: torch.Tensor) -> torch.Tensor:
        """code [B, n] -> [B, n * repeats, emb_dim] (each code covers ``repeats`` mel frames)."""
        return torch.repeat_interleave(self.codec_embed(code), self.repeats, dim=1)


# ---------------------------------------------------------------------------------------------
# Transformer


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [B] float32 in [0, 1] -> [B, dim] in the weights' dtype."""
        half = TIME_FREQ_DIM // 2
        step = math.log(TIME_MAX_PERIOD) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        angle = TIME_SCALE * t.float().unsqueeze(1) * freqs.unsqueeze(0)
        feats = torch.cat((angle.sin(), angle.cos()), dim=-1)
        return self.time_mlp(feats.to(self.time_mlp[0].weight.dtype))


class Rotary(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        # Built on the CPU explicitly so that the module can be constructed under
        # torch.device("meta"); the loader moves it (or calls reset_buffers()).
        # Not persistent: the hub files carry an inv_freq that transformers does not write.
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.theta ** exponent)

    def forward(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] for positions 0..length-1 (half-split layout)."""
        pos = torch.arange(length, device=self.inv_freq.device).float()
        freqs = pos[:, None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the checkpoint was trained with
    interleaved-pair RoPE; permuting q and k alike leaves q.k unchanged and lets the half-split
    rotation do the same thing."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        inner = cfg.num_heads * cfg.head_dim
        self.to_q = nn.Linear(cfg.hidden_size, inner)
        self.to_k = nn.Linear(cfg.hidden_size, inner)
        self.to_v = nn.Linear(cfg.hidden_size, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, cfg.hidden_size)])  # index 0 as in the checkpoint

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        # The released model was trained with RoPE on the first head only; keep it that way.
        q = torch.cat([apply_rotary(_deinterleave(q[:, :1]), cos, sin), q[:, 1:]], dim=1)
        k = torch.cat([apply_rotary(_deinterleave(k[:, :1]), cos, sin), k[:, 1:]], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](o.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        inner = cfg.hidden_size * cfg.ff_mult
        # Index 2 is the training-time dropout; Identity keeps the checkpoint names ff.0 / ff.3.
        self.ff = nn.Sequential(nn.Linear(cfg.hidden_size, inner), nn.GELU(approximate="tanh"), nn.Identity(),
                                nn.Linear(inner, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class AdaLayerNormZero(nn.Module):
    """LayerNorm whose shift/scale (and the residual gates) come from the timestep embedding."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(m[:, None] for m in torch.chunk(self.linear(F.silu(temb)), self.chunks, dim=1))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * (1 + scale) + shift


class DiTLayer(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        # Chunks: shift/scale/gate for attention, then shift/scale/gate for the MLP.
        self.attn_norm = AdaLayerNormZero(cfg.hidden_size, 6)
        self.attn = Attention(cfg)
        self.ff = FeedForward(cfg)

    def forward(self, x, temb, cos, sin, mask) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.attn_norm.modulation(temb)
        x = x + gate_a * self.attn(_modulate(x, shift_a, scale_a), cos, sin, mask)
        return x + gate_m * self.ff(_modulate(x, shift_m, scale_m))


class FinalNorm(AdaLayerNormZero):
    def __init__(self, dim: int):
        super().__init__(dim, 2)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(temb)  # this order (scale first) is the checkpoint's
        return _modulate(x, shift, scale)


class DiT(nn.Module):
    """Codec codes + voice -> mel spectrogram (see the module docstring).

    Usage for one voice: ``feats = speaker_features(ref_mel)`` once, then
    :meth:`velocity` per ODE evaluation, or :meth:`sample` for a whole utterance.
    Runs in the weights' dtype (the reference runs fp32); the ODE state and the
    returned velocity keep the dtype of ``x``/``noise``.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.hidden_size)
        self.text_embed = CodecEmbedding(cfg)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = Rotary(cfg)
        self.transformer_blocks = nn.ModuleList(DiTLayer(cfg) for _ in range(cfg.num_layers))
        self.norm_out = FinalNorm(cfg.hidden_size)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.mel_dim)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rotary frequencies (non-persistent, float32) on the weights' device."""
        rot = self.rotary_embed
        rot.inv_freq = rot._inv_freq(self.proj_out.weight.device)

    @property
    def _weight(self) -> torch.Tensor:
        return self.proj_out.weight

    def block_masks(self, length: int, device) -> list[torch.Tensor]:
        """Per-layer boolean attention masks [length, length] (True = may attend).

        Blocks are counted from frame 0 of the sequence passed in, as in the reference.
        """
        block = torch.arange(length, device=device) // self.cfg.block_size
        diff = block[None, :] - block[:, None]  # key block - query block
        cache: dict[tuple[int, int], torch.Tensor] = {}
        masks = []
        for i in range(self.cfg.num_layers):
            back, ahead = self.cfg.layer_reach(i)
            if (back, ahead) not in cache:
                cache[(back, ahead)] = (diff >= -back) & (diff <= ahead)
            masks.append(cache[(back, ahead)])
        return masks

    def forward(self, x: torch.Tensor, t: torch.Tensor, code: torch.Tensor, spk_cond: torch.Tensor,
                speaker_feat: torch.Tensor) -> torch.Tensor:
        """One batched DiT evaluation without guidance.

        x [B, N, mel_dim], t [B] (float32), code [B, N / repeats] long, spk_cond [B, enc_emb_dim],
        speaker_feat [B, enc_dim] (speaker-encoder output) -> velocity [B, N, mel_dim].
        """
        w = self._weight
        n = x.shape[1]
        self._check_codes(code, n)
        cos, sin = self.rotary_embed(n, w.dtype)
        return self._evaluate(x, t, self.text_embed(code), spk_cond.to(w.dtype), speaker_feat.to(w.dtype),
                              cos, sin, self.block_masks(n, x.device))

    def _check_codes(self, code: torch.Tensor, n: int) -> None:
        if code.shape[1] * self.cfg.repeats != n:
            raise ValueError(f"{n} frames need {n / self.cfg.repeats:g} codes ({self.cfg.repeats} frames each), "
                             f"got {code.shape[1]}")

    def _evaluate(self, x, t, code_embed, spk_cond, speaker_feat, cos, sin, masks) -> torch.Tensor:
        """:meth:`forward` given what depends only on the codes, the voice and the length."""
        w = self._weight
        temb = self.time_embed(t)
        h = self.input_embed(x.to(w.dtype), speaker_feat, code_embed, spk_cond)
        for layer, mask in zip(self.transformer_blocks, masks):
            h = layer(h, temb, cos, sin, mask)
        return self.proj_out(self.norm_out(h, temb))

    @torch.no_grad()
    def speaker_features(self, ref_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ref_mel [T, mel_dim] -> (cond_feat, uncond_feat), each [enc_dim].

        The speaker-encoder outputs for the voice's reference mel and for zeros of
        the same shape (the CFG branch).  They depend on nothing else, so compute
        them once per voice and reuse them for every ODE evaluation and chunk.
        """
        w = self._weight
        mel = ref_mel.to(w.device, w.dtype)
        # One batch of two, exactly as the reference's CFG forward runs the encoder.
        feats = self.input_embed.spk_encoder(torch.stack([mel, torch.zeros_like(mel)]))
        return feats[0], feats[1]

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, t: float | torch.Tensor, code: torch.Tensor, spk_cond: torch.Tensor,
                 speaker_feats: tuple[torch.Tensor, torch.Tensor],
                 guidance_scale: float = DEFAULT_GUIDANCE_SCALE) -> torch.Tensor:
        """The CFG-combined ODE function: ``cond + (cond - uncond) * guidance_scale``.

        x [N, mel_dim], t float or 0-d tensor in [0, 1], code [N / repeats] long,
        spk_cond [enc_emb_dim] (the voice's ``cond``), speaker_feats from
        :meth:`speaker_features` -> [N, mel_dim] in x's dtype.  Both branches run as
        one forward of batch 2; the unconditional one has zero voice vector, the
        zero-mel speaker features and code 0 everywhere.  Below
        ``MIN_GUIDANCE_SCALE`` only the conditional branch runs, as in the reference.
        """
        return self.velocity_fn(code, spk_cond, speaker_feats, guidance_scale)(t, x)

    @torch.no_grad()
    def velocity_fn(self, code: torch.Tensor, spk_cond: torch.Tensor, speaker_feats: tuple[torch.Tensor, torch.Tensor],
                    guidance_scale: float = DEFAULT_GUIDANCE_SCALE):
        """``f(t, x)`` = :meth:`velocity` with these codes and voice, for the evaluations of one
        ODE solve (4 per RK4 step): the batched conditioning, the codes' embedding, the rotary
        table and the attention masks are made once (:meth:`_conditioning`) instead of at every
        evaluation (~12% of a chunk's DiT time on the CPU demo).  Same operations on the same
        values: same result."""
        return self._velocity_of(code, self._conditioning(code, spk_cond, speaker_feats, guidance_scale),
                                 guidance_scale)

    def _conditioning(self, code, spk_cond, speaker_feats, guidance_scale: float) -> tuple:
        """What every evaluation of one solve shares: (code_embed, spk, feats, cos, sin, masks), the
        first three batched with the unconditional branch when guided."""
        w = self._weight
        n = code.shape[0] * self.cfg.repeats
        cond_feat, uncond_feat = speaker_feats
        if guidance_scale >= MIN_GUIDANCE_SCALE:
            codes = torch.stack([code, torch.zeros_like(code)])
            spk = torch.stack([spk_cond, torch.zeros_like(spk_cond)])
            feats = torch.stack([cond_feat, uncond_feat])
        else:
            codes, spk, feats = code[None], spk_cond[None], cond_feat[None]
        cos, sin = self.rotary_embed(n, w.dtype)
        return self.text_embed(codes), spk.to(w.dtype), feats.to(w.dtype), cos, sin, self.block_masks(n, code.device)

    def _velocity_of(self, code: torch.Tensor, inputs: tuple, guidance_scale: float):
        def f(t: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            self._check_codes(code[None], x.shape[0])
            t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(())
            return self._guided(t, x, *inputs, guidance_scale)

        return f

    def _guided(self, t, x, code_embed, spk, feats, cos, sin, masks, guidance_scale: float) -> torch.Tensor:
        """The velocity at 0-d time ``t`` from the batched conditioning of :meth:`velocity_fn`."""
        guided = guidance_scale >= MIN_GUIDANCE_SCALE
        xb = torch.cat([x[None], x[None]]) if guided else x[None]
        out = self._evaluate(xb, t.expand(code_embed.shape[0]), code_embed, spk, feats, cos, sin, masks)
        if not guided:
            return out[0].to(x.dtype)
        cond, uncond = out[0], out[1]
        return (cond + (cond - uncond) * guidance_scale).to(x.dtype)

    def solve_step(self, x, t0, t1, code_embed, spk, feats, cos, sin, masks, guidance_scale: float) -> torch.Tensor:
        """One RK4 step's increment as one function of tensors (what :meth:`sample` adds per step), to
        compile: the decode runner's ``vocoder_flow`` step.  Compiled as a whole (4 evaluations and
        their combination), a flow solve on the CPU demo takes 8 instead of 16 ms for the first chunk
        (48 frames, 4 time points) and 53 instead of 94 for a steady window (144 frames, 10 points),
        the same values to ~5e-7 (inductor reorders float sums)."""
        return rk4_step(lambda t, y: self._guided(t, y, code_embed, spk, feats, cos, sin, masks, guidance_scale),
                        t0, t1, x)

    @staticmethod
    def time_points(num_steps: int = DEFAULT_NUM_STEPS, sway_coefficient: float | None = DEFAULT_SWAY_COEFFICIENT,
                    device=None) -> torch.Tensor:
        """The reference's ODE time grid: ``num_steps`` points from 0 to 1 (float32), warped by
        ``t + s * (cos(pi/2 t) - 1 + t)``; s = -1 gives ``1 - cos(pi/2 t)`` (small steps near the noise)."""
        t = torch.linspace(0, 1, num_steps, device=device, dtype=torch.float32)
        if sway_coefficient is not None:
            t += sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return t

    @torch.no_grad()
    def sample(self, code: torch.Tensor, spk_cond: torch.Tensor, ref_mel: torch.Tensor, noise: torch.Tensor,
               num_steps: int = DEFAULT_NUM_STEPS, guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
               sway_coefficient: float | None = DEFAULT_SWAY_COEFFICIENT,
               speaker_feats: tuple[torch.Tensor, torch.Tensor] | None = None, step=None) -> torch.Tensor:
        """Offline flow matching: code [n] long, spk_cond [enc_emb_dim], ref_mel [T, mel_dim],
        noise [n * repeats, mel_dim] (the t = 0 state) -> mel [mel_dim, n * repeats].

        Defaults (10 steps, guidance 0.5, sway -1.0) are the reference's.  Equals the
        reference ``sample`` given the same initial noise: (num_steps - 1) RK4 steps
        of 4 velocity evaluations each.  ``speaker_feats`` may be passed to skip the
        speaker encoder (see :meth:`speaker_features`).  ``step``: the decode runner's compiled
        :meth:`solve_step`; once it is ready each RK4 step runs through it.
        """
        n = code.shape[0] * self.cfg.repeats
        if n > self.cfg.max_position_embeddings:
            raise ValueError(f"{n} mel frames exceed max_position_embeddings {self.cfg.max_position_embeddings}")
        if tuple(noise.shape) != (n, self.cfg.mel_dim):
            raise ValueError(f"noise must be [{n}, {self.cfg.mel_dim}], got {tuple(noise.shape)}")
        times = self.time_points(num_steps, sway_coefficient, device=noise.device)
        if bool((times[1:] < times[:-1]).any()):
            # The reference's solver then reports interpolated, not integrated, states.
            raise ValueError(f"sway_coefficient {sway_coefficient} makes the time grid non-monotonic")
        feats = self.speaker_features(ref_mel) if speaker_feats is None else speaker_feats

        inputs = self._conditioning(code, spk_cond, feats, guidance_scale)
        f = self._velocity_of(code, inputs, guidance_scale)
        x = noise
        for t0, t1 in zip(times[:-1], times[1:]):
            if step is not None and step.ready:
                x = x + step(x, t0, t1, *inputs, guidance_scale)
            else:
                x = x + rk4_step(f, t0, t1, x)
        return x.transpose(0, 1)


def rk4_step(f, t0: torch.Tensor, t1: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
    """Increment of one RK4 step by the 3/8 rule, with the reference solver's exact arithmetic order
    (so that fp32 results match it closely)."""
    one_third, two_thirds = 1 / 3, 2 / 3
    h = t1 - t0
    k1 = f(t0, y0)
    k2 = f(t0 + h * one_third, y0 + h * k1 * one_third)
    k3 = f(t0 + h * two_thirds, y0 + h * (k2 - k1 * one_third))
    k4 = f(t1, y0 + h * (k1 - k2 + k3))
    return (k1 + 3 * (k2 + k3) + k4) * h / 8
