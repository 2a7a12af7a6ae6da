"""Whisper-style log-mel features, computed in torch.

Equal to transformers' ``WhisperFeatureExtractor`` as Qwen2.5-Omni's processor
calls it (``padding="max_length"`` with zeros, ``return_attention_mask=True``,
dither 0), restricted to the valid frames: ``ceil(num_samples / hop_length)``
frames, i.e. what the attention mask keeps.

Pipeline (per frame, all local except one step):

1. periodic Hann window, STFT with ``center=True``: the start is reflect-padded
   by ``n_fft // 2``; the end sees *zeros* after the signal, because the
   reference zero-pads the audio to its fixed length before the STFT (its
   reflection at the far end then only mirrors zeros);
2. power spectrum ``|X|**2``, slaney-normalised mel filter bank on the slaney
   mel scale from 0 to 8000 Hz;
3. ``log10(max(mel, 1e-10))``;
4. **dynamic-range floor** ``max(log, floor)`` with ``floor = max(log) - 8``
   taken over the whole utterance: this is the single non-local step.  A
   streaming caller that wants features of a prefix to stay fixed passes its
   own ``floor`` (e.g. from :func:`utterance_floor`, or a value from earlier
   audio); with ``floor`` fixed, every frame depends only on the samples under
   its window;
5. ``(x + 4) / 4``.

The reference takes the maximum over all frames of its padded spectrogram,
including the one or two frames past the valid ones whose window still
overlaps the end of the signal; so do we.  (Audio longer than the reference's
padding length, 30 s for Whisper / ``chunk_length`` s in the Omni
preprocessor, would be truncated by the reference; we do not truncate.)

The sample rate is not checked here: whoever resamples must reject or convert
audio at another rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["FeatureConfig", "FeatureConfigError", "log_mel", "utterance_floor", "num_frames", "mel_filter_bank"]

LOG_CLAMP = 1e-10
DYNAMIC_RANGE = 8.0
MEL_FMIN = 0.0
MEL_FMAX = 8000.0  # fixed in Whisper, not sampling_rate / 2


class FeatureConfigError(ConfigError):
    """preprocessor_config.json is missing or has an unusable field; the message names the file and field."""


@dataclass(frozen=True)
class FeatureConfig:
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 128
    # How the processor pads one utterance: False = to 30 s with zeros (Qwen2.5-Omni's processor:
    # ceil(n / hop) valid frames, zeros after the end); True = to the longest audio of the batch,
    # i.e. not at all for one (Qwen3-Omni's processor calls the extractor with padding=True):
    # n // hop frames, the end reflected like the start.  Set by the family, not in the file.
    pad_to_longest: bool = False

    def __post_init__(self):
        for name in ("sampling_rate", "n_fft", "hop_length", "n_mels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise FeatureConfigError(f"FeatureConfig.{name} must be a positive integer, got {v!r}")
        if self.n_fft % 2:
            raise FeatureConfigError(f"FeatureConfig.n_fft must be even, got {self.n_fft}")

    @classmethod
    def from_preprocessor_config(cls, path: str | Path) -> "FeatureConfig":
        """Read ``preprocessor_config.json`` (a file, or a directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "preprocessor_config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FeatureConfigError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise FeatureConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise FeatureConfigError(f"{path}: expected a JSON object")
        values = {}
        for ours, theirs in (("sampling_rate", "sampling_rate"), ("n_fft", "n_fft"),
                             ("hop_length", "hop_length"), ("n_mels", "feature_size")):
            if theirs not in d or d[theirs] is None:
                raise FeatureConfigError(f"{path}: missing field '{theirs}'")
            v = d[theirs]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v <= 0:
                raise FeatureConfigError(f"{path}: field '{theirs}' must be a positive integer, got {v!r}")
            values[ours] = int(v)
        dither = d.get("dither", 0.0)
        if dither not in (None, 0, 0.0):
            raise FeatureConfigError(f"{path}: field 'dither' is {dither!r}; only 0 (no dither) is supported")
        try:
            return cls(**values)
        except FeatureConfigError as e:
            raise FeatureConfigError(f"{path}: {e}") from None


def num_frames(num_samples: int, cfg: FeatureConfig) -> int:
    """Valid frames for ``num_samples`` samples: ``ceil(num_samples / hop_length)``, or
    ``num_samples // hop_length`` when the utterance is not padded (``pad_to_longest``)."""
    if cfg.pad_to_longest:
        return int(num_samples) // cfg.hop_length
    return -(-int(num_samples) // cfg.hop_length)


# ---------------------------------------------------------------- filter bank

_MIN_LOG_HZ = 1000.0  # slaney scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above
_MIN_LOG_MEL = 15.0
_MELS_PER_LOG_HZ = 27.0 / math.log(6.4)


def _hz_to_mel_slaney(f) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    mel = 3.0 * f / 200.0
    log_part = _MIN_LOG_MEL + np.log(np.maximum(f, _MIN_LOG_HZ) / _MIN_LOG_HZ) * _MELS_PER_LOG_HZ
    return np.where(f >= _MIN_LOG_HZ, log_part, mel)


def _mel_to_hz_slaney(m) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    hz = 200.0 * m / 3.0
    log_part = _MIN_LOG_HZ * np.exp((np.maximum(m, _MIN_LOG_MEL) - _MIN_LOG_MEL) / _MELS_PER_LOG_HZ)
    return np.where(m >= _MIN_LOG_MEL, log_part, hz)


def mel_filter_bank(cfg: FeatureConfig) -> np.ndarray:
    """Slaney-normalised triangular filters on the slaney mel scale, 0-8000 Hz.

    Returns float64 ``[n_mels, n_fft // 2 + 1]`` (mel x frequency bin).
    """
    n_bins = cfg.n_fft // 2 + 1
    fft_hz = np.linspace(0.0, cfg.sampling_rate // 2, n_bins)
    mel_edges = np.linspace(_hz_to_mel_slaney(MEL_FMIN), _hz_to_mel_slaney(MEL_FMAX), cfg.n_mels + 2)
    edges_hz = _mel_to_hz_slaney(mel_edges)  # n_mels + 2 points: lower, centre, upper of each filter
    lower, centre, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    f = fft_hz[:, None]
    rising = (f - lower) / (centre - lower)
    falling = (upper - f) / (upper - centre)
    tri = np.maximum(0.0, np.minimum(rising, falling))  # [n_bins, n_mels]
    tri = tri * (2.0 / (upper - lower))[None, :]  # slaney: constant energy per filter
    return np.ascontiguousarray(tri.T)


_CONSTANTS: dict[tuple[FeatureConfig, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(cfg: FeatureConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hann window [n_fft], mel filters [n_mels, n_bins]) in float32 on ``device``, built once."""
    key = (cfg, device)
    c = _CONSTANTS.get(key)
    if c is None:
        window = torch.hann_window(cfg.n_fft, periodic=True, dtype=torch.float32, device=device)
        filters = torch.from_numpy(mel_filter_bank(cfg)).to(device=device, dtype=torch.float32)
        c = _CONSTANTS[key] = (window, filters)
    return c


# ---------------------------------------------------------------- features

def _check_waveform(waveform: torch.Tensor) -> None:
    if not isinstance(waveform, torch.Tensor):
        raise TypeError(f"waveform must be a torch.Tensor, got {type(waveform).__name__}")
    if waveform.dim() != 1:
        raise ValueError(f"waveform must be 1-D (mono samples), got shape {tuple(waveform.shape)}")
    if waveform.dtype != torch.float32:
        raise TypeError(f"waveform must be float32, got {waveform.dtype}")


def _log_spec(waveform: torch.Tensor, cfg: FeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """log10 mel of the valid frames [n_mels, T] and the reference's max over all frames (0-d)."""
    n = waveform.shape[0]
    hop, half = cfg.hop_length, cfg.n_fft // 2
    valid = num_frames(n, cfg)
    # Frames whose window [t*hop - half, t*hop + half) overlaps the signal; all later ones are
    # silent (log = log10(1e-10)) and cannot raise the maximum.
    total = max(valid, -(-(n + half) // hop))
    window, filters = _constants(cfg, waveform.device)
    if cfg.pad_to_longest and n > half:
        # Both ends reflected (STFT centre padding of the unpadded utterance); the reference
        # drops the last of its 1 + n // hop frames and takes the maximum over the rest.
        padded = torch.cat([waveform[1:half + 1].flip(0), waveform, waveform[-half - 1:-1].flip(0)])
        spec = torch.stft(padded, cfg.n_fft, cfg.hop_length, window=window, center=False, return_complex=True)
        log = (filters @ (spec.abs() ** 2)[:, :valid].contiguous()).clamp(min=LOG_CLAMP).log10()
        top = log.max() if log.numel() else torch.tensor(math.log10(LOG_CLAMP), device=log.device)
        return log, top
    # Start: reflection of the zero-padded signal (the reference reflects the padded audio, so a
    # signal shorter than half+1 samples reflects some zeros too).  End: zeros.
    need = (total - 1) * hop + cfg.n_fft - half  # samples after the left pad
    body = waveform if need <= n else torch.cat([waveform, waveform.new_zeros(need - n)])
    left = body[1:half + 1].flip(0)
    padded = torch.cat([left, body[:need]])
    spec = torch.stft(padded, cfg.n_fft, cfg.hop_length, window=window, center=False, return_complex=True)
    power = (spec.abs() ** 2).contiguous()  # [n_bins, total]
    log = (filters @ power).clamp(min=LOG_CLAMP).log10()
    top = log.max() if log.numel() else torch.tensor(math.log10(LOG_CLAMP), device=log.device)
    return log[:, :valid], top


def utterance_floor(waveform: torch.Tensor, cfg: FeatureConfig) -> float:
    """The dynamic-range floor (max log10 mel - 8) that :func:`log_mel` uses for this whole utterance."""
    _check_waveform(waveform)
    _, top = _log_spec(waveform, cfg)
    return float(top - DYNAMIC_RANGE)


def log_mel(waveform: torch.Tensor, cfg: FeatureConfig, floor: float | None = None) -> torch.Tensor:
    """Log-mel features ``[n_mels, ceil(len / hop_length)]`` (float32, on the waveform's device).

    ``waveform``: 1-D float32 samples at ``cfg.sampling_rate``.  ``floor``: the log10
    dynamic-range floor; ``None`` gives the reference behaviour (whole-utterance maximum
    minus 8, the one non-local step).  With a fixed ``floor`` each frame depends only on
    the samples under its window, so a prefix's frames that lie fully inside it equal
    the full utterance's frames.
    """
    _check_waveform(waveform)
    log, top = _log_spec(waveform, cfg)
    if floor is None:
        floor_t = top - DYNAMIC_RANGE
    else:
        floor_t = torch.tensor(float(floor), dtype=torch.float32, device=log.device)
    log = torch.maximum(log, floor_t)
    return (log + 4.0) / 4.0
