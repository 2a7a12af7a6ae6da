"""Qwen3-Omni AuT audio encoder vs transformers' Qwen3OmniMoeAudioEncoder (tiny random configs, fp32).

Also: the checkpoint names save_pretrained writes, block-by-block == whole-utterance
encoding, the token-count formula, the config reader, and the shared log-mel
features vs WhisperFeatureExtractor on the Qwen3-Omni preprocessor settings.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omnidesk.models.checkpoint import ConfigError
from omnidesk.features import FeatureConfig, log_mel
from omnidesk.models.qwen3_omni.audio_encoder import AudioEncoder, AudioEncoderConfig

PREFIX = "thinker.audio_tower."

# n_window must stay 50: the reference hard-codes 13 tokens per full chunk (see the module docstring).
BASE = dict(num_mel_bins=128, max_source_positions=1500, n_window=50, conv_chunksize=500,
            activation_function="gelu")
VARIANTS = {
    # 2 chunks per attention window: block 200 frames, 26 tokens.
    "a": dict(BASE, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
              downsample_hidden_size=8, output_dim=48, n_window_infer=200),
    # n_window_infer not a multiple of the chunk (rounds down to 3 chunks: 300 frames, 39 tokens);
    # tanh GELU; conv_chunksize 2 splits the convolution batch; eager reference attention.
    "b": dict(BASE, d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=96,
              downsample_hidden_size=4, output_dim=40, n_window_infer=350, conv_chunksize=2,
              activation_function="gelu_pytorch_tanh"),
    # One chunk per window: block 100 frames, 13 tokens; many windows.
    "c": dict(BASE, d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=48,
              downsample_hidden_size=4, output_dim=48, n_window_infer=100),
}
BLOCKS = {"a": (200, 26), "b": (300, 39), "c": (100, 13)}
LENGTHS = (1, 2, 7, 37, 99, 100, 101, 130, 199, 200, 201, 237, 299, 300, 301, 437, 600, 803, 1000)

# The published Qwen/Qwen3-Omni-30B-A3B-Instruct thinker_config.audio_config (fields we read).
PUBLISHED = {"activation_function": "gelu", "conv_chunksize": 500, "d_model": 1280, "downsample_hidden_size": 480,
             "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "encoder_layers": 32,
             "max_source_positions": 1500, "n_window": 50, "n_window_infer": 800, "num_mel_bins": 128,
             "output_dim": 2048, "scale_embedding": False, "dropout": 0, "attention_dropout": 0,
             "activation_dropout": 0, "model_type": "qwen3_omni_moe_audio_encoder"}


def _perturb(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # biases are zero and norms one at init: perturb everything
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _features(n: int, seed: int) -> torch.Tensor:
    return torch.randn(128, n, generator=torch.Generator().manual_seed(seed)) * 0.5


def _reference(ref, x: torch.Tensor) -> torch.Tensor:
    # As Qwen3OmniMoeThinkerForConditionalGeneration.get_audio_features calls the audio tower.
    return ref(input_features=x, feature_lens=torch.tensor([x.shape[1]]), return_dict=True).last_hidden_state


def _by_blocks(enc: AudioEncoder, x: torch.Tensor) -> torch.Tensor:
    """What the executor does: every finished block while the user speaks, then the tail."""
    b = enc.block_frames
    full = x.shape[1] // b
    parts = [enc.encode_block(x[:, i * b:(i + 1) * b], first=i == 0) for i in range(full)]
    parts.append(enc.encode_block(x[:, full * b:], first=full == 0))
    return torch.cat(parts)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    d = VARIANTS[request.param]
    ref_cfg = Qwen3OmniMoeAudioEncoderConfig(**d)
    if request.param == "b":
        ref_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Qwen3OmniMoeAudioEncoder(ref_cfg).float().eval()
    _perturb(ref, 1)
    with torch.no_grad():  # trained-size conv biases make the reference's tail padding visible
        for conv in (ref.conv2d1, ref.conv2d2, ref.conv2d3):
            conv.bias.add_(torch.randn(conv.bias.shape, generator=torch.Generator().manual_seed(2)) * 0.5)
    ours = AudioEncoder(AudioEncoderConfig.from_dict(d, "audio_config")).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return request.param, ref, ours


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny full Qwen3OmniMoeForConditionalGeneration written by save_pretrained: (dir, model)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    text = dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
                vocab_size=512)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                  deepstack_visual_indexes=[0])
    cfg = Qwen3OmniMoeConfig(thinker_config=dict(audio_config=VARIANTS["a"], text_config=text, vision_config=vision),
                             enable_audio_output=False)
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).float().eval()
    # transformers 5 holds it at thinker.model.audio_tower and writes thinker.audio_tower.* on save.
    tower = next(m for name, m in model.named_modules() if name.endswith("audio_tower"))
    _perturb(tower, 2)
    path = tmp_path_factory.mktemp("tiny-qwen3-omni")
    model.save_pretrained(path)
    return path, model


def _saved_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ------------------------------------------------------------------------- checkpoint names

def test_checkpoint_names_map_one_to_one(saved):
    path, _ = saved
    written = {k[len(PREFIX):]: v for k, v in _saved_tensors(path).items() if k.startswith(PREFIX)}
    assert written, "no thinker.audio_tower.* tensors written"
    d = json.loads((path / "config.json").read_text())["thinker_config"]["audio_config"]
    ours = AudioEncoder(AudioEncoderConfig.from_dict(d, "config.json: thinker_config.audio_config"))
    params = dict(ours.named_parameters())
    assert set(written) == set(params) == set(ours.state_dict())
    for name, t in written.items():
        assert tuple(t.shape) == tuple(params[name].shape), name
    assert "positional_embedding" not in ours.state_dict()  # non-persistent, as in the reference


@torch.no_grad()
def test_loaded_from_saved_checkpoint_matches_model(saved):
    path, model = saved
    d = json.loads((path / "config.json").read_text())["thinker_config"]["audio_config"]
    ours = AudioEncoder(AudioEncoderConfig.from_dict(d, "audio_config")).eval()
    ours.load_state_dict({k[len(PREFIX):]: v for k, v in _saved_tensors(path).items() if k.startswith(PREFIX)},
                         strict=True)
    x = _features(437, 3)
    want = model.thinker.get_audio_features(x[None], feature_attention_mask=torch.ones(1, 437, dtype=torch.long))
    assert (ours(x) - want.last_hidden_state).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------- numerics

@torch.no_grad()
@pytest.mark.parametrize("n", LENGTHS)
def test_forward_matches_reference(pair, n):
    _, ref, ours = pair
    x = _features(n, n)
    want = _reference(ref, x)
    got = ours(x)
    assert got.shape == want.shape == (ours.output_length(n), ours.cfg.output_dim)
    assert (got - want).abs().max().item() <= 1e-4  # measured <= 1.4e-7


@torch.no_grad()
@pytest.mark.parametrize("n", LENGTHS)
def test_blocks_then_tail_equal_forward_and_reference(pair, n):
    variant, ref, ours = pair
    assert (ours.block_frames, ours.block_tokens) == BLOCKS[variant]
    x = _features(n, 1000 + n)
    blocks = _by_blocks(ours, x)
    assert (blocks - ours(x)).abs().max().item() <= 1e-5
    assert (blocks - _reference(ref, x)).abs().max().item() <= 1e-4
    if n >= ours.block_frames:
        assert ours.encode_block(x[:, :ours.block_frames], first=True).shape[0] == ours.block_tokens


@torch.no_grad()
def test_tail_padding_flag_matters(pair):
    """A tail shorter than a conv chunk after earlier blocks is zero-padded by the reference; a short
    utterance alone is not.  (Small random weights make the effect small, but far above rounding.)"""
    _, ref, ours = pair
    b = ours.block_frames
    x = _features(b + 37, 7)
    want = _reference(ref, x)
    head = ours.encode_block(x[:, :b], first=True)
    right = (torch.cat([head, ours.encode_block(x[:, b:], first=False)]) - want).abs().max().item()
    wrong = (torch.cat([head, ours.encode_block(x[:, b:], first=True)]) - want).abs().max().item()
    assert right <= 1e-6 and wrong > 1e-5 and wrong > 100 * right
    short = x[:, :37]
    want = _reference(ref, short)
    right = (ours.encode_block(short, first=True) - want).abs().max().item()
    wrong = (ours.encode_block(short, first=False) - want).abs().max().item()
    assert right <= 1e-6 and wrong > 1e-5 and wrong > 100 * right


def test_encode_block_limits(pair):
    _, _, ours = pair
    with pytest.raises(ValueError):
        ours.encode_block(_features(ours.block_frames + 1, 0), first=True)
    with pytest.raises(ValueError):
        ours(torch.zeros(64, 10))
    assert ours.encode_block(torch.zeros(128, 0), first=False).shape == (0, ours.cfg.output_dim)
    assert ours(torch.zeros(128, 0)).shape == (0, ours.cfg.output_dim)


@torch.no_grad()
def test_bfloat16_close_to_reference(pair):
    variant, ref, ours = pair
    if variant != "a":
        pytest.skip("one variant is enough")
    ref16 = type(ref)(ref.config).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16 = ref16.to(torch.bfloat16)
    ours16 = AudioEncoder(ours.cfg).eval()
    ours16.load_state_dict(ours.state_dict())
    ours16 = ours16.to(torch.bfloat16)
    x = _features(437, 5)
    want = _reference(ref16, x.to(torch.bfloat16)).float()
    got = ours16(x).float()
    assert got.dtype == torch.float32 and ours16(x).dtype == torch.bfloat16
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@torch.no_grad()
def test_meta_build_then_materialize(pair):
    from omnidesk.models.checkpoint import materialize

    _, ref, ours = pair
    with torch.device("meta"):
        lazy = AudioEncoder(ours.cfg)
    materialize(lazy, "cpu", torch.float32)
    lazy.load_state_dict(ours.state_dict(), strict=True)
    lazy.eval()
    x = _features(301, 11)
    assert (lazy(x) - _reference(ref, x)).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------- token counts

def test_output_length_matches_reference_formula():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    cfg = AudioEncoderConfig.from_dict(PUBLISHED, "audio_config")
    n = torch.arange(0, 3201)
    want = _get_feat_extract_output_lengths(n, 50).tolist()
    assert [cfg.output_length(i) for i in range(3201)] == want
    for L in (30000, 30017, 48000 + 99):
        assert cfg.output_length(L) == int(_get_feat_extract_output_lengths(torch.tensor(L), 50))


def test_output_length_is_what_forward_gives(pair):
    _, _, ours = pair
    for n in LENGTHS:
        with torch.no_grad():
            assert ours(_features(n, 0)).shape[0] == ours.output_length(n)


def test_published_config_sizes():
    cfg = AudioEncoderConfig.from_dict(PUBLISHED, "config.json: thinker_config.audio_config")
    assert cfg.chunk_frames == 100 and cfg.chunk_tokens == 13
    assert cfg.window_frames == 800 and cfg.window_tokens == 104  # exact streaming block: 8 s -> 104 tokens
    assert cfg.output_length(100) == 13 and cfg.output_length(1000) == 130  # 13 tokens per second
    assert cfg.conv_out_features == 480 * 16
    with torch.device("meta"):
        enc = AudioEncoder(cfg)
    assert (enc.block_frames, enc.block_tokens) == (800, 104)
    params = sum(p.numel() for p in enc.parameters())
    assert 0.6e9 < params < 0.7e9  # FACTS: AuT audio encoder 0.65 B


# ------------------------------------------------------------------------- config reader

def test_config_errors_name_where_and_field():
    where = "config.json: thinker_config.audio_config"
    for field in ("d_model", "n_window_infer", "downsample_hidden_size", "activation_function", "conv_chunksize"):
        d = dict(PUBLISHED)
        del d[field]
        with pytest.raises(ConfigError, match=f"{where}: missing field '{field}'"):
            AudioEncoderConfig.from_dict(d, where)
    for field, bad in (("encoder_layers", 0), ("d_model", "1280"), ("n_window", True), ("output_dim", 2.5),
                       ("encoder_attention_heads", 7), ("activation_function", "tanh"), ("activation_function", 3),
                       ("n_window_infer", 99), ("max_source_positions", 12)):
        with pytest.raises(ConfigError, match=f"{where}: .*'{field}'"):
            AudioEncoderConfig.from_dict(dict(PUBLISHED, **{field: bad}), where)
    with pytest.raises(ConfigError, match="where: expected an object"):
        AudioEncoderConfig.from_dict([], "where")
    assert AudioEncoderConfig.from_dict(dict(PUBLISHED, d_model=1280.0), where).d_model == 1280


# ------------------------------------------------------------------------- features

SR = 16000


@pytest.fixture(scope="module")
def whisper_qwen3():
    """WhisperFeatureExtractor with the Qwen3-Omni preprocessor_config.json values."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128, sampling_rate=SR, hop_length=160, n_fft=400,
                                   chunk_length=300, n_samples=4800000, nb_max_frames=30000,
                                   padding_value=0.0, dither=0.0, return_attention_mask=True)


def _audio(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(n) / SR
    return (0.05 * g.standard_normal(n) + 0.4 * np.sin(2 * np.pi * 220 * t)
            + 0.2 * np.sin(2 * np.pi * 3100 * t)).astype(np.float32)


AUDIO_LENGTHS = (1000, 16000, 16080, 32013, 48160, 80037)


@pytest.mark.parametrize("n", AUDIO_LENGTHS)
def test_log_mel_equals_whisper_max_length_padding(whisper_qwen3, n):
    """The extractor padded to its fixed length (300 s of zeros behind the audio): equal."""
    x = _audio(n, n)
    out = whisper_qwen3(x, sampling_rate=SR, padding="max_length", return_attention_mask=True,
                        return_tensors="pt")
    frames = int(out["attention_mask"][0].sum())
    ours = log_mel(torch.from_numpy(x), FeatureConfig())
    assert ours.shape == (128, frames)
    assert (ours - out["input_features"][0][:, :frames]).abs().max().item() <= 1e-5  # measured <= 6e-8


def _processor_call(fe, x):
    # Qwen3OmniMoeProcessor.audio_kwargs: padding=True (to the longest audio of the call), truncation=False.
    out = fe(x, sampling_rate=SR, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt")
    return out["input_features"][0], int(out["attention_mask"][0].sum())


@pytest.mark.parametrize("n", AUDIO_LENGTHS)
def test_log_mel_vs_qwen3_processor_call_inner_frames(whisper_qwen3, n):
    """As the Qwen3-Omni processor calls it (one audio, padding=True): every frame whose STFT window
    lies inside the audio is equal; the reference has floor(n / hop) frames (ours ceil)."""
    x = _audio(n, n)
    ref, frames = _processor_call(whisper_qwen3, x)
    ours = log_mel(torch.from_numpy(x), FeatureConfig())
    assert frames == ref.shape[1] == n // 160
    assert ours.shape[1] == -(-n // 160)
    inner = (n - 200) // 160 + 1  # frames t with t * hop + n_fft / 2 <= n
    assert (ours[:, :inner] - ref[:, :inner]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n", AUDIO_LENGTHS)
def test_log_mel_equals_qwen3_processor_call(whisper_qwen3, n):
    """With pad_to_longest (what the Qwen3-Omni loader sets) every frame equals the processor's,
    the last one included (the end reflected, floor(n / hop) frames)."""
    x = _audio(n, n)
    ref, frames = _processor_call(whisper_qwen3, x)
    ours = log_mel(torch.from_numpy(x), FeatureConfig(pad_to_longest=True))
    assert ours.shape[1] == frames
    assert (ours - ref).abs().max().item() <= 1e-5
