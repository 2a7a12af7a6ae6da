"""Qwen3-Omni's ``code2wav_config``: the vocoder's sizes as config.json gives them, checked, and the
output lengths they imply (samples per frame, the reference's lookahead cut; see
:mod:`omnidesk.models.qwen3_omni.code2wav`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..checkpoint import ConfigError


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
