"""Our AudioEncoder vs transformers' Qwen2_5OmniAudioEncoder on the tiny configs."""

from __future__ import annotations

import pytest
import torch

from omnidesk.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnidesk.models.qwen2_5_omni.config import AudioEncoderConfig
from tests.tiny import VARIANTS

LENGTHS = (150, 200, 437, 800)


def _audio_config_dict(variant: str) -> dict:
    try:
        from tests.tiny import build_config

        return build_config(variant).thinker_config.audio_config.to_dict()
    except ImportError:  # omnidesk.models.qwen2_5_omni.tokenizer not written yet: same values, built here
        v = VARIANTS[variant]
        return dict(num_mel_bins=128, max_source_positions=1500, n_window=100,
                    output_dim=v["text"]["hidden_size"], **v["audio"])


@pytest.fixture(scope="module", params=["a", "b"])
def pair(request):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    d = _audio_config_dict(request.param)
    ref_cfg = Qwen2_5OmniAudioEncoderConfig(**d)
    ref_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Qwen2_5OmniAudioEncoder(ref_cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases are zero and norms one at init: perturb everything
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = AudioEncoder(AudioEncoderConfig.from_dict(d, "audio_config")).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _features(n: int, seed: int) -> torch.Tensor:
    return torch.randn(128, n, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_state_dict_names(pair):
    ref, ours = pair
    assert set(ours.state_dict()) == set(ref.state_dict())
    assert "positional_embedding" not in ours.state_dict()


@torch.no_grad()
@pytest.mark.parametrize("n", LENGTHS)
def test_matches_reference(pair, n):
    ref, ours = pair
    x = _features(n, n)
    want = ref(input_features=x, feature_lens=torch.tensor([n])).last_hidden_state
    got = ours(x)
    _, ref_len = ref._get_feat_extract_output_lengths(torch.tensor([n]))
    assert got.shape == want.shape == (AudioEncoder.output_length(n), ours.cfg.output_dim)
    assert AudioEncoder.output_length(n) == int(ref_len)
    # Measured max abs diff (fp32, CPU, torch 2.13): 6.0e-7 over both variants and all lengths.
    assert (got - want).abs().max().item() <= 1e-4


def test_output_length_matches_reference(pair):
    ref, _ = pair
    lens = torch.arange(0, 3001)
    _, want = ref._get_feat_extract_output_lengths(lens)
    assert [AudioEncoder.output_length(int(n)) for n in lens] == want.clamp(min=0).tolist()


@torch.no_grad()
@pytest.mark.parametrize("n", LENGTHS)
def test_incremental_equals_whole(pair, n):
    _, ours = pair
    x = _features(n, 100 + n)
    b = ours.block_frames
    parts = [ours.encode_block(x[:, i:i + b]) for i in range(0, n, b)]
    for p, i in zip(parts, range(0, n, b)):
        if i + b <= n:
            assert p.shape[0] == b // 4
    inc = torch.cat(parts)
    whole = ours(x)
    assert inc.shape == whole.shape
    # Not asserted bit-equal: matmuls over different row counts may round differently.
    # Measured (fp32, CPU): 0.0 for most lengths, max 2.4e-7 (437 frames).
    assert (inc - whole).abs().max().item() <= 1e-6


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(pair, dtype):
    _, ours = pair
    import copy

    m = copy.deepcopy(ours).to(dtype)
    x = _features(437, 7)
    y = m(x)
    assert y.dtype == dtype and y.shape == (AudioEncoder.output_length(437), ours.cfg.output_dim)
    assert torch.isfinite(y).all()
    assert (y.float() - ours(x)).abs().max().item() < 0.1  # measured ≤ 0.014 (outputs ~1.7)


def test_rejects_bad_input(pair):
    _, ours = pair
    with pytest.raises(ValueError):
        ours(torch.zeros(80, 100))
    with pytest.raises(ValueError):
        ours.encode_block(torch.zeros(128, ours.block_frames + 1))
    assert ours(torch.zeros(128, 0)).shape == (0, ours.cfg.output_dim)
