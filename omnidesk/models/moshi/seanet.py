"""Mimi's convolutional halves: causal (transposed) convolutions with streaming state, and SEANet.

Every convolution here is causal, so a stream can be cut into frames and
processed frame by frame with the same result as in one piece, provided each
convolution remembers what it needs from the previous frame:

* a causal conv keeps its *left context*, the last ``(kernel-1)*dilation+1-stride``
  input samples (zeros after :meth:`reset`, which is the one-shot zero padding);
* a causal transposed conv keeps its *overlap-add tail*, the last
  ``kernel-stride`` output samples, which the next frame's output completes.

Both are preallocated buffers (batch 1) updated in place, so a frame's shapes
never change.  A one-shot call is the same code fed a longer chunk right after
:meth:`reset`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SEANetConfig:
    """SEANet encoder/decoder shape (the keys of Kyutai's ``seanet`` kwargs)."""

    channels: int = 1
    dimension: int = 512  # latent width at the encoder output / decoder input
    n_filters: int = 64  # width of the first (encoder) / last (decoder) block; doubles per stage
    n_residual_layers: int = 1
    ratios: tuple[int, ...] = (8, 6, 5, 4)  # decoder (upsampling) order; the encoder uses them reversed
    kernel_size: int = 7  # first conv
    last_kernel_size: int = 3  # last conv
    residual_kernel_size: int = 3
    dilation_base: int = 2  # residual layer j uses dilation dilation_base**j
    compress: int = 2  # residual branches are dim // compress wide
    pad_mode: str = "constant"  # left context before the first frame: zeros, or "replicate" the first sample
    elu_alpha: float = 1.0

    def __post_init__(self):
        if self.pad_mode not in ("constant", "replicate"):
            raise ValueError(f"seanet pad_mode must be 'constant' or 'replicate', got {self.pad_mode!r}")

    @property
    def hop_length(self) -> int:
        """Audio samples per latent step (960 for Mimi: 24 kHz -> 25 Hz)."""
        return math.prod(self.ratios)


class CausalConv1d(nn.Module):
    """A Conv1d that sees only the past, streaming with its left context as state (batch 1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, groups=groups,
                              bias=bias)
        self.stride = stride
        self.replicate = pad_mode == "replicate"
        self.context = (kernel_size - 1) * dilation + 1 - stride
        self.register_buffer("history", torch.zeros(1, in_channels, self.context), persistent=False)
        # "replicate" pads the stream's first chunk with copies of its first sample: needs to know it is first
        self.register_buffer("fresh", torch.ones((), dtype=torch.bool), persistent=False)

    def reset(self) -> None:
        self.history.zero_()
        self.fresh.fill_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [1, C, T] with T a multiple of the stride; returns [1, C_out, T // stride]."""
        if x.shape[-1] % self.stride:
            raise ValueError(f"conv input length {x.shape[-1]} is not a multiple of its stride {self.stride}")
        if self.context == 0:
            return self.conv(x)
        history = self.history
        if self.replicate:
            history = torch.where(self.fresh, x[..., :1].expand_as(history), history)
            self.fresh.fill_(False)
        x = torch.cat([history, x], dim=-1)
        self.history.copy_(x[..., -self.context:])
        return self.conv(x)


class CausalConvTranspose1d(nn.Module):
    """A ConvTranspose1d cut causally, streaming with its overlap-add tail as state (batch 1).

    Each input step writes ``kernel`` output samples starting at ``step*stride``;
    the last ``kernel-stride`` of a chunk belong to steps that have not arrived
    yet, so they wait in the tail (without bias, which the next chunk adds).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int = 1,
                 bias: bool = True):
        super().__init__()
        self.convtr = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        self.overlap = kernel_size - stride
        self.register_buffer("tail", torch.zeros(1, out_channels, self.overlap), persistent=False)

    def reset(self) -> None:
        self.tail.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [1, C, T]; returns [1, C_out, T * stride]."""
        y = self._convtr_as_matmul(x) if x.device.type == "cpu" and x.shape[-1] <= 4 else self.convtr(x)
        if self.overlap == 0:
            return y
        y = torch.cat([y[..., :self.overlap] + self.tail, y[..., self.overlap:]], dim=-1)
        tail = y[..., -self.overlap:]
        if self.convtr.bias is not None:
            tail = tail - self.convtr.bias[:, None]
        self.tail.copy_(tail)
        return y[..., :-self.overlap]

    def _convtr_as_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The same transposed conv as a product (each input step times the weight) and an
        overlap-add.  PyTorch's CPU kernel is slow for a few input steps: the real decoder's first
        layer (2 steps, 1024 -> 512, kernel 16) takes 120 ms there and 8 ms here; the demo's
        depthwise upsampling (1 step) 130 us and 40 us."""
        convtr = self.convtr
        c_in, per_group, k = convtr.weight.shape
        s, t = convtr.stride[0], x.shape[-1]
        if convtr.groups == 1:
            # x^T W, not W^T x: the weight streams row by row (W^T x is 10x slower for 2 steps)
            cols = torch.mm(x[0].t(), convtr.weight.reshape(c_in, per_group * k)).t()  # [C_out * K, T]
        elif convtr.groups == c_in and per_group == 1:  # depthwise: one filter per channel
            cols = (convtr.weight.reshape(c_in, k, 1) * x[0][:, None, :]).reshape(c_in * k, t)
        else:
            return convtr(x)
        y = F.fold(cols[None], (1, (t - 1) * s + k), (1, k), stride=(1, s)).view(1, -1, (t - 1) * s + k)
        return y if convtr.bias is None else y + convtr.bias[:, None]


class ResidualUnit(nn.Module):
    """x + conv1x1(elu(conv_k,dilated(elu(x)))), the branch ``dim // compress`` wide."""

    def __init__(self, dim: int, cfg: SEANetConfig, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.alpha = cfg.elu_alpha
        self.conv1 = CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode)
        self.conv2 = CausalConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x, self.alpha)), self.alpha))


class EncoderStage(nn.Module):
    """Residual units at one width, then a strided conv that divides time by `ratio` and doubles width."""

    def __init__(self, width: int, ratio: int, cfg: SEANetConfig):
        super().__init__()
        self.alpha = cfg.elu_alpha
        self.residuals = nn.ModuleList(ResidualUnit(width, cfg, cfg.dilation_base ** j)
                                       for j in range(cfg.n_residual_layers))
        self.downsample = CausalConv1d(width, 2 * width, 2 * ratio, stride=ratio, pad_mode=cfg.pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.residuals:
            x = unit(x)
        return self.downsample(F.elu(x, self.alpha))


class DecoderStage(nn.Module):
    """A transposed conv that multiplies time by `ratio` and halves width, then residual units."""

    def __init__(self, width: int, ratio: int, cfg: SEANetConfig):
        super().__init__()
        self.alpha = cfg.elu_alpha
        self.upsample = CausalConvTranspose1d(width, width // 2, 2 * ratio, stride=ratio)
        self.residuals = nn.ModuleList(ResidualUnit(width // 2, cfg, cfg.dilation_base ** j)
                                       for j in range(cfg.n_residual_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.upsample(F.elu(x, self.alpha))
        for unit in self.residuals:
            x = unit(x)
        return x


class SEANetEncoder(nn.Module):
    """Waveform [1, channels, T] -> latent [1, dimension, T / hop_length]."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        self.alpha = cfg.elu_alpha
        nf = cfg.n_filters
        self.input_conv = CausalConv1d(cfg.channels, nf, cfg.kernel_size, pad_mode=cfg.pad_mode)
        self.stages = nn.ModuleList(EncoderStage(nf * 2 ** i, ratio, cfg)
                                    for i, ratio in enumerate(reversed(cfg.ratios)))
        self.output_conv = CausalConv1d(nf * 2 ** len(cfg.ratios), cfg.dimension, cfg.last_kernel_size,
                                        pad_mode=cfg.pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_conv(x)
        for stage in self.stages:
            x = stage(x)
        return self.output_conv(F.elu(x, self.alpha))


class SEANetDecoder(nn.Module):
    """Latent [1, dimension, T] -> waveform [1, channels, T * hop_length]."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        self.alpha = cfg.elu_alpha
        nf = cfg.n_filters
        top = nf * 2 ** len(cfg.ratios)
        self.input_conv = CausalConv1d(cfg.dimension, top, cfg.kernel_size, pad_mode=cfg.pad_mode)
        self.stages = nn.ModuleList(DecoderStage(top // 2 ** i, ratio, cfg) for i, ratio in enumerate(cfg.ratios))
        self.output_conv = CausalConv1d(nf, cfg.channels, cfg.last_kernel_size, pad_mode=cfg.pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_conv(x)
        for stage in self.stages:
            x = stage(x)
        return self.output_conv(F.elu(x, self.alpha))


def reset_streaming(module: nn.Module) -> None:
    """Clear the streaming state of every causal (transposed) conv inside `module`."""
    for m in module.modules():
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
            m.reset()
