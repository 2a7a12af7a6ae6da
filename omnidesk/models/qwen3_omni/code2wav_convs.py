"""The causal conv stack of Qwen3-Omni's code2wav (after its transformer): the upsampling stages
(transposed conv + ConvNeXt) and the SnakeBeta decoder blocks, one-shot and streamed.

Every layer has ``forward`` (all frames at once, as the reference) and ``new_state`` / ``step``
(the next frames, carrying explicit state): a causal conv keeps its left context
(:class:`_ConvState`), a transposed conv its overlap-add tail and the part of the reference's
left cut not yet dropped (:class:`_TransConvState`); see :mod:`omnidesk.models.qwen3_omni.code2wav`
for why that streams exactly.  On the CPU the few steps of a streamed frame run as matrix
products, where PyTorch's conv kernels are slow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Architecture constants of the reference modules (they are not in config.json).
CONV_KERNEL = 7  # decoder stem, residual units, output conv and the ConvNeXt depthwise conv
RESIDUAL_DILATIONS = (1, 3, 9)  # the three residual units of each decoder block
CONVNEXT_EXPANSION = 4  # ConvNeXt pointwise MLP width, in multiples of the hidden size
CONVNEXT_NORM_EPS = 1e-6
SNAKE_EPS = 1e-9  # keeps 1 / beta finite


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
