"""BigVGAN vocoder of Qwen2.5-Omni's token2wav: log-mel frames -> 24 kHz waveform.

Parameter names equal the checkpoint's after removing the prefix
``token2wav.code2wav_bigvgan_model.``.  The anti-aliasing low-pass filters are
*not* checkpoint tensors (transformers registers them as non-persistent
buffers and recomputes them), so ours are non-persistent too and are built on
the CPU even under ``torch.device("meta")``.

Streaming
---------
The network is a stack of convolutions (plain, transposed, and the fixed
low-pass filters of the anti-aliased activations) with pointwise
non-linearities, so the samples of mel frames ``[a, b)`` depend only on frames
``[a - L, b + R)`` where ``(L, R) = model.context_frames()``.  L and R are
derived from the layer geometry by following the dependency cone of one
frame's samples backwards through every layer; a window must cover that cone
at *every* layer (not only at the input), otherwise the window's own edge
padding would leak into the samples of interest.

At the utterance edges the reference pads each layer (zeros for the
convolutions, edge replication for the resamplers).  A window that starts at
frame 0 has exactly those paddings at its start, so it is exact with fewer
than L context frames; likewise at the end.  Hence the caller's contract for
:meth:`BigVGAN.forward_window`: ``left < L`` means "the window starts at the
utterance start", ``right < R`` means "the window ends at the utterance end".

L and R are exact (tight) bounds: every frame in ``[a - L, b + R)`` has a nonzero
influence in exact arithmetic.  The outermost frames' influence is far below
fp32 rounding, though, so a caller trading exactness for latency can use less
context; how much less depends on the trained weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError

__all__ = ["BigVGANConfig", "BigVGAN", "kaiser_sinc_filter"]

# --- Fixed by the architecture (not in config.json) ------------------------------------------
# conv_pre / conv_post: kernel 7, "same" padding.
PRE_POST_KERNEL = 7
# Alias-free activations run the non-linearity at twice the rate: upsample x2, snake, downsample x2,
# both resamplers with a 12-tap Kaiser-windowed sinc (BigVGAN's 6 * ratio taps).
ANTI_ALIAS_RATIO = 2
ANTI_ALIAS_TAPS = 12
# Low-pass design relative to the resampling ratio: cutoff at the lower Nyquist, transition width.
LOWPASS_CUTOFF = 0.5
LOWPASS_HALF_WIDTH = 0.6
# Kaiser beta from the stop-band attenuation (Kaiser's empirical formulas, as in the reference).
KAISER_ATTEN_HIGH = 50.0
KAISER_ATTEN_LOW = 21.0
# SnakeBeta: guard against division by exp(beta) underflowing to zero.
SNAKE_EPS = 1e-9
# Mel preprocessing: natural-log amplitude -> dB (floored at MIN_DB), shifted by REF_DB, then
# mapped linearly from [MIN_DB, 0] dB onto [-MAX_ABS, MAX_ABS].
MIN_DB = -115.0
REF_DB = 20.0
MAX_ABS = 1.0
# Final waveform is clamped to the valid sample range.
WAVE_LIMIT = 1.0
# Widest upsampling stage whose residual blocks inference runs fused (see _FusedStage): all of the demo's,
# the released model's last two (48 and 24 channels).
FUSED_MAX_CHANNELS = 64


# --- Config ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BigVGANConfig:
    mel_dim: int
    upsample_initial_channel: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]

    def __post_init__(self):
        where = "bigvgan_config"
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ConfigError(f"{where}: upsample_rates and upsample_kernel_sizes differ in length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ConfigError(f"{where}: resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if not self.upsample_rates or not self.resblock_kernel_sizes:
            raise ConfigError(f"{where}: upsample_rates and resblock_kernel_sizes must not be empty")
        for s, k in zip(self.upsample_rates, self.upsample_kernel_sizes):
            # Transposed conv with padding (k - s) // 2 yields exactly s samples per input sample only then.
            if s < 1 or k < s or (k - s) % 2:
                raise ConfigError(f"{where}: upsample kernel {k} / rate {s}: need kernel >= rate, same parity")
        for k in self.resblock_kernel_sizes:
            if k % 2 == 0:  # "same" padding of a dilated conv is symmetric only for odd kernels
                raise ConfigError(f"{where}: resblock kernel size {k} must be odd")
        if self.upsample_initial_channel >> len(self.upsample_rates) < 1:
            raise ConfigError(f"{where}: upsample_initial_channel {self.upsample_initial_channel} is too small "
                              f"to halve {len(self.upsample_rates)} times")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "bigvgan_config") -> "BigVGANConfig":
        def get(key):
            if d.get(key) is None:
                raise ConfigError(f"{where}: missing field '{key}'")
            return d[key]

        return cls(
            mel_dim=int(get("mel_dim")),
            upsample_initial_channel=int(get("upsample_initial_channel")),
            resblock_kernel_sizes=tuple(int(k) for k in get("resblock_kernel_sizes")),
            resblock_dilation_sizes=tuple(tuple(int(x) for x in ds) for ds in get("resblock_dilation_sizes")),
            upsample_rates=tuple(int(r) for r in get("upsample_rates")),
            upsample_kernel_sizes=tuple(int(k) for k in get("upsample_kernel_sizes")),
        )

    @property
    def hop_length(self) -> int:
        """Waveform samples per mel frame (240 for the released model: 24 kHz at 100 frames/s)."""
        return math.prod(self.upsample_rates)

    def channels(self, stage: int) -> int:
        """Channels after ``stage`` upsampling layers (halved at each)."""
        return self.upsample_initial_channel // (2 ** stage)


# --- Receptive-field bookkeeping ----------------------------------------------------------------

@dataclass(frozen=True)
class _Cone:
    """Indices [lo, hi] (inclusive) at some layer that the samples of mel frame 0 depend on.

    ``per_frame`` is that layer's samples per mel frame; ``left``/``right`` are the most
    frames before/after frame 0 that any layer visited so far reached into.
    """

    lo: int
    hi: int
    per_frame: int
    left: int = 0
    right: int = 0

    def to(self, lo: int, hi: int, per_frame: int) -> "_Cone":
        return _Cone(lo, hi, per_frame,
                     max(self.left, -(lo // per_frame)), max(self.right, hi // per_frame))

    def union(self, other: "_Cone") -> "_Cone":
        assert self.per_frame == other.per_frame
        return _Cone(min(self.lo, other.lo), max(self.hi, other.hi), self.per_frame,
                     max(self.left, other.left), max(self.right, other.right))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _same_conv_cone(c: _Cone, conv: nn.Conv1d) -> _Cone:
    (k,), (d,), (p,) = conv.kernel_size, conv.dilation, conv.padding
    assert 2 * p == d * (k - 1), "symmetric 'same' padding expected"
    return c.to(c.lo - p, c.hi + p, c.per_frame)


def _transposed_conv_cone(c: _Cone, conv: nn.ConvTranspose1d) -> _Cone:
    # y[n] = sum over i, j with i * s + j - p == n (0 <= j < k) of x[i] w[j]
    (k,), (s,), (p,) = conv.kernel_size, conv.stride, conv.padding
    return c.to(_ceil_div(c.lo + p - k + 1, s), (c.hi + p) // s, c.per_frame // s)


# --- Building blocks ----------------------------------------------------------------------------

def kaiser_sinc_filter(cutoff: float, half_width: float, taps: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass ``[1, 1, taps]`` (fp32, CPU), normalised to unit DC gain.

    Same design as the reference so the fixed filters match bit for bit.
    """
    even = taps % 2 == 0
    half = taps // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > KAISER_ATTEN_HIGH:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= KAISER_ATTEN_LOW:
        beta = 0.5842 * (attenuation - KAISER_ATTEN_LOW) ** 0.4 + 0.07886 * (attenuation - KAISER_ATTEN_LOW)
    else:
        beta = 0.0
    # Explicit device: the module may be built under torch.device("meta"), but these are computed,
    # never loaded, so they must hold real values.
    window = torch.kaiser_window(taps, periodic=False, beta=beta, dtype=torch.float32, device="cpu")
    t = torch.arange(-half, half, device="cpu") + 0.5 if even else torch.arange(taps, device="cpu") - half
    if cutoff == 0:
        return torch.zeros((1, 1, taps), dtype=torch.float32, device="cpu")
    f = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    f /= f.sum()
    return f.view(1, 1, taps)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel; alpha/beta are stored in log scale."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + SNAKE_EPS)) * torch.pow(torch.sin(x * alpha), 2)


def _replicate_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``F.pad(x, (left, right), mode="replicate")`` on the last dim, as one concatenation (the same
    values; 3-5x faster on the CPU than the pad kernel for these shapes, called ~70 times per window)."""
    return torch.cat([x[..., :1].expand(*x.shape[:-1], left), x, x[..., -1:].expand(*x.shape[:-1], right)], dim=-1)


class _Resampler(nn.Module):
    """Holds the fixed low-pass filter (computed, non-persistent, fp32 on the CPU until moved)."""

    def __init__(self, ratio: int, taps: int):
        super().__init__()
        self.ratio = ratio
        self.taps = taps
        self.register_buffer("filter", self._design(), persistent=False)

    def _design(self) -> torch.Tensor:
        return kaiser_sinc_filter(LOWPASS_CUTOFF / self.ratio, LOWPASS_HALF_WIDTH / self.ratio, self.taps)

    def reset_buffers(self) -> None:
        self.filter = self._design().to(self.filter.device)

    def _filter_for(self, x: torch.Tensor) -> torch.Tensor:
        # One filter per channel (depthwise); cast because the model may run in bf16 while the
        # filter stays fp32 (it is computed, so loaders that cast only parameters leave it alone).
        return self.filter.to(x.dtype).expand(x.shape[1], -1, -1)


class UpSample1d(_Resampler):
    """Zero-stuffing upsampler with the low-pass as a transposed depthwise conv; length x ratio."""

    def __init__(self, ratio: int, taps: int):
        super().__init__(ratio, taps)
        # Replicate-pad the input so the filter sees no artificial step at the edges, then crop
        # the transposed conv's output back to exactly ratio * T samples, centred.
        self.pad = taps // ratio - 1
        self.crop_left = self.pad * ratio + (taps - ratio) // 2
        self.crop_right = self.pad * ratio + (taps - ratio + 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _replicate_pad(x, self.pad, self.pad)
        y = self.ratio * F.conv_transpose1d(x, self._filter_for(x), stride=self.ratio, groups=x.shape[1])
        return y[..., self.crop_left: y.shape[-1] - self.crop_right]

    def cone(self, c: _Cone) -> _Cone:
        # y[n] = z[n + crop_left]; z[m] uses padded x[i] with i * ratio + j == m; x index = i - pad.
        lo = _ceil_div(c.lo + self.crop_left - self.taps + 1, self.ratio) - self.pad
        hi = (c.hi + self.crop_left) // self.ratio - self.pad
        return c.to(lo, hi, c.per_frame // self.ratio)


class DownSample1d(_Resampler):
    """Low-pass then keep every ratio-th sample (strided depthwise conv); length / ratio."""

    def __init__(self, ratio: int, taps: int):
        super().__init__(ratio, taps)
        even = taps % 2 == 0
        self.pad_left = taps // 2 - int(even)
        self.pad_right = taps // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _replicate_pad(x, self.pad_left, self.pad_right)
        return F.conv1d(x, self._filter_for(x), stride=self.ratio, groups=x.shape[1])

    def cone(self, c: _Cone) -> _Cone:
        # y[n] = sum_j padded x[n * ratio + j] f[j]; x index = padded index - pad_left.
        lo = c.lo * self.ratio - self.pad_left
        hi = c.hi * self.ratio + self.taps - 1 - self.pad_left
        return c.to(lo, hi, c.per_frame * self.ratio)


class AntiAliasedActivation1d(nn.Module):
    """Snake at twice the sample rate so its harmonics above the original Nyquist are filtered out."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d(ANTI_ALIAS_RATIO, ANTI_ALIAS_TAPS)
        self.downsample = DownSample1d(ANTI_ALIAS_RATIO, ANTI_ALIAS_TAPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))

    def cone(self, c: _Cone) -> _Cone:
        return self.upsample.cone(self.downsample.cone(c))  # backwards: last op first


class AMPBlock(nn.Module):
    """Residual block: per dilation, x += conv2(act(conv1_dilated(act(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2)
            for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations)
        # Checkpoint order interleaves them: activations[2i] before convs1[i], [2i+1] before convs2[i].
        self.activations = nn.ModuleList(AntiAliasedActivation1d(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            h = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](h))
        return x

    def cone(self, c: _Cone) -> _Cone:
        for i in reversed(range(len(self.convs1))):
            branch = _same_conv_cone(c, self.convs2[i])
            branch = self.activations[2 * i + 1].cone(branch)
            branch = _same_conv_cone(branch, self.convs1[i])
            branch = self.activations[2 * i].cone(branch)
            c = c.union(branch)  # the residual path needs the same indices as the output
        return c


# --- One stage's residual blocks as one (the inference path) --------------------------------------

class SnakeResample:
    """The anti-aliased activation (upsample, snake, downsample) as sums of shifted slices, for
    ``torch.compile``: inductor makes it one loop over the samples, where the convolutions of
    :class:`_FusedActivation` are three passes and two oneDNN depthwise calls that cost 100-850 us
    each at the demo's sizes (few channels, long rows).  Measured on one core, a 48-frame window of
    the demo's BigVGAN: 32 -> 24 ms; a steady 118-frame one: 65 -> 46 ms.  Eager it is slower than the
    convolutions (24 small ops): it is only run compiled (the decode runner's ``vocoder_activation``
    step, passed to :meth:`BigVGAN.forward`).

    The same arithmetic as the convolutions in another summation order: equal to ~1e-6.  Output
    sample ``ratio * n + p`` of the upsampler is the sum over the taps ``k`` of its phase ``p`` of
    ``ratio * f[k] * x[n + offset(k, p)]``, the input replicated past its edges (as the upsampler's
    padding does); the downsampler's sample ``n`` is the sum of ``g[k] * y[ratio * n + k - pad_left]``.
    The taps are constants of the architecture (computed filters, not checkpoint tensors)."""

    def __init__(self, up: "UpSample1d", down: "DownSample1d"):
        r, f = up.ratio, up.filter.reshape(-1).tolist()
        # phase p, tap k: x index n + (p + crop_left - k) / ratio - pad (where that is whole)
        self.phases = [[(r * f[k], (p + up.crop_left - k) // r - up.pad)
                        for k in range(up.taps) if (p + up.crop_left - k) % r == 0] for p in range(r)]
        offsets = [d for phase in self.phases for _, d in phase]
        self.up_left, self.up_right = -min(offsets), max(offsets)
        self.ratio = r
        self.down = [(g, k) for k, g in enumerate(down.filter.reshape(-1).tolist())]
        self.down_left, self.down_right, self.down_ratio = down.pad_left, down.pad_right, down.ratio

    def __call__(self, x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        """``x [B, C, L]``, ``alpha`` = e^alpha and ``inv_beta`` = 1 / (e^beta + eps) as ``[1, C, 1]``."""
        n = x.shape[-1]
        xe = _replicate_pad(x, self.up_left, self.up_right)
        phases = [sum(c * xe[..., self.up_left + d: self.up_left + d + n] for c, d in phase) for phase in self.phases]
        y = torch.stack(phases, dim=-1).reshape(x.shape[0], x.shape[1], self.ratio * n)
        s = torch.sin(y * alpha)
        y = y + inv_beta * (s * s)
        ye = _replicate_pad(y, self.down_left, self.down_right)
        m, r = self.ratio * n, self.down_ratio
        return sum(g * ye[..., k: k + m - r + 1: r] for g, k in self.down)


class _FusedActivation:
    """Anti-aliased activations of several channel groups run as one, with what they derive from their
    parameters computed once: snake's ``e^alpha`` and ``1 / (e^beta + eps)``, and the resampling
    filters expanded per channel (the upsampler's gain of 2 folded into its filter: exact).  With a
    compiled :class:`SnakeResample` (``step``, ready) that runs instead of the convolutions, on
    fp32 CPU rows of more than one channel (a dimension of 1 would need a graph of its own)."""

    def __init__(self, acts: list[AntiAliasedActivation1d]):
        self.up, self.down = acts[0].upsample, acts[0].downsample
        alpha = torch.cat([a.act.alpha for a in acts])
        self.alpha = alpha.exp()[None, :, None]
        self.inv_beta = (1.0 / (torch.cat([a.act.beta for a in acts]).exp() + SNAKE_EPS))[None, :, None]
        self.channels = alpha.numel()
        self.up_filter = (self.up.ratio * self.up.filter.to(alpha.dtype)).expand(self.channels, -1, -1).contiguous()
        self.down_filter = self.down.filter.to(alpha.dtype).expand(self.channels, -1, -1).contiguous()

    def __call__(self, x: torch.Tensor, step=None) -> torch.Tensor:
        if step is not None and step.ready and x.shape[1] > 1 and x.dtype == torch.float32 and not x.is_cuda:
            return step(x, self.alpha, self.inv_beta)
        up, down = self.up, self.down
        y = F.conv_transpose1d(_replicate_pad(x, up.pad, up.pad), self.up_filter, stride=up.ratio,
                               groups=self.channels)
        y = y[..., up.crop_left: y.shape[-1] - up.crop_right]
        s = torch.sin(y * self.alpha)
        y = y + self.inv_beta * (s * s)
        y = _replicate_pad(y, down.pad_left, down.pad_right)
        return F.conv1d(y, self.down_filter, stride=down.ratio, groups=self.channels)


class _FusedStage:
    """The residual blocks of one upsampling stage (kernels 3, 7, 11) run side by side as one block of
    ``n x C`` channels: their activations as one, their convolutions as one grouped convolution, the
    smaller kernels zero-padded to the largest (same taps, same offsets).

    Why: at the demo's sizes (64 channels and fewer) BigVGAN is bound by the number of calls, not by
    arithmetic (a stage of 32 channels x 240 samples costs what one of 1 x 11520 does); this makes 3x
    fewer of them (a 48-frame window: 72 -> 34 ms on one core) for 1.57x the convolutions'
    multiply-adds.  The result equals the block-by-block one up to fp32 rounding (~1e-7,
    tests/test_bigvgan.py).  Only stages of at most :data:`FUSED_MAX_CHANNELS` channels whose blocks
    share their dilations (every published config does) are fused: wider ones are bound by arithmetic,
    and their padded weight copy would cost memory (the released model's first stage has 768 channels:
    ~470 MB); :meth:`BigVGAN._fused` leaves those to the blocks."""

    def __init__(self, blocks: list[AMPBlock]):
        self.n = len(blocks)
        self.channels = blocks[0].convs1[0].in_channels
        self.kernel = max(b.convs1[0].kernel_size[0] for b in blocks)
        self.steps = []
        for i in range(len(blocks[0].convs1)):
            dilation = blocks[0].convs1[i].dilation[0]
            self.steps.append((_FusedActivation([b.activations[2 * i] for b in blocks]),
                               self._weight([b.convs1[i] for b in blocks]), dilation,
                               _FusedActivation([b.activations[2 * i + 1] for b in blocks]),
                               self._weight([b.convs2[i] for b in blocks])))

    @staticmethod
    def fits(blocks: list[AMPBlock]) -> bool:
        dilations = {tuple(c.dilation[0] for c in b.convs1) for b in blocks}
        # (convs2 are undilated by construction: AMPBlock)
        return blocks[0].convs1[0].in_channels <= FUSED_MAX_CHANNELS and len(dilations) == 1

    def _weight(self, convs: list[nn.Conv1d]) -> tuple[torch.Tensor, torch.Tensor]:
        def centred(w):
            side = (self.kernel - w.shape[-1]) // 2
            return F.pad(w, (side, side))

        return torch.cat([centred(c.weight) for c in convs]), torch.cat([c.bias for c in convs])

    def __call__(self, x: torch.Tensor, step=None) -> torch.Tensor:
        k, n, c = self.kernel, self.n, self.channels
        xs = x.repeat(1, n, 1)
        for act1, (w1, b1), dilation, act2, (w2, b2) in self.steps:
            h = F.conv1d(act1(xs, step), w1, b1, padding=dilation * (k - 1) // 2, dilation=dilation, groups=n)
            xs = xs + F.conv1d(act2(h, step), w2, b2, padding=(k - 1) // 2, groups=n)
        out = xs[:, :c]  # the blocks' sum in the reference's order, then the mean
        for j in range(1, n):
            out = out + xs[:, j * c:(j + 1) * c]
        return out / n


def _written(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's values live and how often they were written in place.  A tensor made under
    ``torch.inference_mode`` (a model loaded there) keeps no write count: only its storage counts."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


# --- The vocoder --------------------------------------------------------------------------------

class BigVGAN(nn.Module):
    def __init__(self, config: BigVGANConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.conv_pre = nn.Conv1d(cfg.mel_dim, cfg.channels(0), PRE_POST_KERNEL, padding=PRE_POST_KERNEL // 2)
        # Each transposed conv sits in a one-element ModuleList: checkpoint names are ups.{i}.0.*
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(cfg.channels(i), cfg.channels(i + 1), k, s, padding=(k - s) // 2)])
            for i, (s, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        # Flat list, stage-major: resblocks[stage * num_kernels + j].
        self.resblocks = nn.ModuleList(
            AMPBlock(cfg.channels(i + 1), k, d)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        last = cfg.channels(len(cfg.upsample_rates))
        self.activation_post = AntiAliasedActivation1d(last)
        self.conv_post = nn.Conv1d(last, 1, PRE_POST_KERNEL, padding=PRE_POST_KERNEL // 2, bias=False)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    # -- preprocessing ------------------------------------------------------------------------
    @staticmethod
    def normalize_mel(mel: torch.Tensor) -> torch.Tensor:
        """Natural-log mel (the DiT's output) -> clamped dB scale in [-MAX_ABS, MAX_ABS], pointwise."""
        floor = torch.tensor(MIN_DB / 20.0 * math.log(10), device=mel.device, dtype=mel.dtype).exp()
        db = 20 * torch.log10(torch.clamp(mel.exp(), min=floor)) - REF_DB
        return torch.clamp((2 * MAX_ABS) * ((db - MIN_DB) / (-MIN_DB)) - MAX_ABS, -MAX_ABS, MAX_ABS)

    def _as_batch(self, mel: torch.Tensor) -> torch.Tensor:
        if mel.dim() == 2:
            mel = mel[None]
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.config.mel_dim:
            raise ValueError(f"mel must be [{self.config.mel_dim}, F] or [1, {self.config.mel_dim}, F], "
                             f"got {list(mel.shape)}")
        return mel

    # -- whole sequence -----------------------------------------------------------------------
    def forward(self, mel: torch.Tensor, activation=None) -> torch.Tensor:
        """mel ``[mel_dim, F]`` or ``[1, mel_dim, F]`` (natural log) -> waveform ``[F * hop_length]``.

        Without gradients (inference) each stage runs as one fused block (:class:`_FusedStage`);
        with them, block by block as the reference does (same summation order: bit-identical).
        ``activation``: a decode-runner step over :meth:`snake_resample`; once it is ready (compiled)
        the fused stages' activations run through it, else as convolutions."""
        x = self.conv_pre(self.normalize_mel(self._as_batch(mel)))
        fused = None if torch.is_grad_enabled() else self._fused()
        for i, (up,) in enumerate(self.ups):
            x = up(x)
            if fused is not None and fused[i] is not None:
                x = fused[i](x, activation)
            else:
                blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
                # Same summation order as the reference (Python sum from 0) so fp32 rounding matches.
                x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(fused[-1](x, activation) if fused is not None else self.activation_post(x))
        return torch.clamp(x, -WAVE_LIMIT, WAVE_LIMIT)[0, 0]

    def _fused(self) -> list:
        """Per stage its :class:`_FusedStage` (None where :meth:`_FusedStage.fits` says no: the stage
        runs block by block), then the final activation.  Built from the parameters when first
        needed, and again after any of them was written in place (loading) or converted (``.to()``:
        see :meth:`_apply`)."""
        plan = self.__dict__.get("_fused_plan")
        if plan is None or plan[0] != [_written(t) for t in plan[1]]:
            sources = [*self.parameters(), *self.buffers()]
            with torch.no_grad():
                stages = []
                for i in range(len(self.ups)):
                    blocks = list(self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels])
                    stages.append(_FusedStage(blocks) if _FusedStage.fits(blocks) else None)
                stages.append(_FusedActivation([self.activation_post]))
            plan = self.__dict__["_fused_plan"] = ([_written(t) for t in sources], sources, stages)
        return plan[2]

    def snake_resample(self) -> SnakeResample:
        """The fused stages' activation as :class:`SnakeResample` (to compile; every resampler of the
        network has the same filters)."""
        return SnakeResample(self.activation_post.upsample, self.activation_post.downsample)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_fused_plan", None)  # a conversion may put new tensors in place of the old
        return super()._apply(fn, *args, **kwargs)

    # -- streaming ----------------------------------------------------------------------------
    def context_frames(self) -> tuple[int, int]:
        """(L, R): mel frames before/after a chunk that determine its samples exactly."""
        if not hasattr(self, "_context"):
            hop = self.hop_length
            c = _Cone(0, hop - 1, hop)  # the samples of frame 0
            c = _same_conv_cone(c, self.conv_post)
            c = self.activation_post.cone(c)
            for i in reversed(range(len(self.ups))):
                blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
                c_in = None
                for block in blocks:
                    b = block.cone(c)
                    c_in = b if c_in is None else c_in.union(b)
                c = _transposed_conv_cone(c_in, self.ups[i][0])
            c = _same_conv_cone(c, self.conv_pre)
            assert c.per_frame == 1
            self._context = (c.left, c.right)
        return self._context

    def forward_window(self, mel_window: torch.Tensor, left: int, right: int, activation=None) -> torch.Tensor:
        """Samples of the frames ``[left, W - right)`` of a ``W``-frame window: ``[(W-left-right) * hop]``.

        Exact (equal to the same samples of the whole-utterance forward) when ``left >= L``
        and ``right >= R`` (``context_frames()``).  Fewer context frames signal an utterance
        edge: ``left < L`` asserts that the window starts at the utterance's first frame,
        ``right < R`` that it ends at its last frame.  Surplus context is trimmed first.
        """
        mel = self._as_batch(mel_window)
        width = mel.shape[-1]
        if left < 0 or right < 0 or left + right > width:
            raise ValueError(f"left={left}, right={right} do not fit a window of {width} frames")
        ctx_left, ctx_right = self.context_frames()
        trim_left, trim_right = max(0, left - ctx_left), max(0, right - ctx_right)
        mel = mel[..., trim_left: width - trim_right]
        left, right = left - trim_left, right - trim_right
        if mel.shape[-1] == left + right:
            return mel.new_zeros(0)
        wave = self.forward(mel, activation)
        hop = self.hop_length
        return wave[left * hop: wave.shape[-1] - right * hop]
