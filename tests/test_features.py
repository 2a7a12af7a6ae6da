"""Log-mel features vs transformers' WhisperFeatureExtractor (the Qwen2.5-Omni processor settings)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omnidesk.features import FeatureConfig, FeatureConfigError, log_mel, num_frames, utterance_floor
from tests.tiny import WHISPER_PREPROCESSOR

SR = 16000


@pytest.fixture(scope="module")
def reference():
    from transformers import WhisperFeatureExtractor

    # chunk_length 30 s (Whisper's default) instead of the Omni file's 300 s keeps the test fast;
    # the padding length does not change the valid frames.
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=SR, hop_length=160, n_fft=400,
                                 padding_value=0.0, dither=0.0, return_attention_mask=True)

    def run(x: np.ndarray):
        out = fe(x, sampling_rate=SR, padding="max_length", return_attention_mask=True, return_tensors="pt")
        return out["input_features"][0], int(out["attention_mask"][0].sum())

    return run


def _audio(seconds: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    n = int(round(seconds * SR))
    t = np.arange(n) / SR
    return (0.05 * g.standard_normal(n) + 0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 3100 * t)
            ).astype(np.float32)


def _loud_end() -> np.ndarray:
    # A click in the last samples, placed so a frame *past* the valid ones sees it nearest its
    # window centre: the reference's global maximum comes from that frame.
    x = _audio(1.0, 9) * 0.01
    x = np.concatenate([x, np.zeros(159, np.float32)])
    x[-3:] = [0.9, -0.9, 0.9]
    return x


CASES = [(_audio(s, i), f"{s}s") for i, s in enumerate([0.37, 1.0, 2.013, 4.5])] + [(_loud_end(), "loud_end")]


@pytest.mark.parametrize("x", [c[0] for c in CASES], ids=[c[1] for c in CASES])
def test_matches_whisper_feature_extractor(reference, x):
    ref, frames = reference(x)
    ours = log_mel(torch.from_numpy(x), FeatureConfig())
    assert frames == num_frames(len(x), FeatureConfig()) == ours.shape[1]
    assert ours.shape == (128, frames) and ours.dtype == torch.float32
    # Measured: 0.0 (bit-exact) on all these cases with torch 2.13 CPU.
    assert (ours - ref[:, :frames]).abs().max().item() <= 1e-4


def test_very_short_audio(reference):
    for n in (1, 80, 160, 161, 250):
        x = _audio(n / SR, n)
        ref, frames = reference(x)
        ours = log_mel(torch.from_numpy(x), FeatureConfig())
        assert ours.shape == (128, frames)
        assert (ours - ref[:, :frames]).abs().max().item() <= 1e-4  # measured ≤ 6e-8
    assert log_mel(torch.zeros(0), FeatureConfig()).shape == (128, 0)


def test_fixed_floor_streaming_prefix():
    cfg = FeatureConfig()
    x = torch.from_numpy(_audio(3.0, 5))
    floor = utterance_floor(x, cfg)
    whole = log_mel(x, cfg)
    assert torch.equal(whole, log_mel(x, cfg, floor=floor))
    half = cfg.n_fft // 2
    for p in (4000, 16000, 25123):
        prefix = log_mel(x[:p], cfg, floor=floor)
        inside = (p - half) // cfg.hop_length + 1  # frames t with t*hop + n_fft/2 <= p
        assert torch.equal(prefix[:, :inside], whole[:, :inside])
        # the default (per-prefix maximum) is the reference behaviour and may differ; a fixed floor never does
    quiet = x.clone()
    quiet[8000:] *= 1e-6  # loud prefix, quiet rest: the prefix's own max equals the whole's
    assert torch.equal(log_mel(quiet[:8000], cfg)[:, :40], log_mel(quiet, cfg)[:, :40])


def test_input_validation():
    cfg = FeatureConfig()
    with pytest.raises(ValueError):
        log_mel(torch.zeros(2, 100), cfg)
    with pytest.raises(TypeError):
        log_mel(torch.zeros(100, dtype=torch.float64), cfg)
    with pytest.raises(TypeError):
        log_mel(np.zeros(100, np.float32), cfg)


def test_from_preprocessor_config(tmp_path):
    p = tmp_path / "preprocessor_config.json"
    p.write_text(json.dumps(WHISPER_PREPROCESSOR))
    assert FeatureConfig.from_preprocessor_config(p) == FeatureConfig(16000, 400, 160, 128)
    assert FeatureConfig.from_preprocessor_config(tmp_path) == FeatureConfig(16000, 400, 160, 128)
    bad = dict(WHISPER_PREPROCESSOR)
    del bad["feature_size"]
    p.write_text(json.dumps(bad))
    with pytest.raises(FeatureConfigError, match=r"preprocessor_config\.json.*feature_size"):
        FeatureConfig.from_preprocessor_config(p)
    p.write_text(json.dumps(dict(WHISPER_PREPROCESSOR, hop_length="160")))
    with pytest.raises(FeatureConfigError, match="hop_length"):
        FeatureConfig.from_preprocessor_config(p)
    with pytest.raises(FeatureConfigError, match="not found"):
        FeatureConfig.from_preprocessor_config(tmp_path / "nope.json")
