"""Qwen3-Omni code2wav vs transformers' Qwen3OmniMoeCode2Wav (tiny random configs, fp32, seeded).

Checks: one-shot forward == the reference forward (and its chunked_decode where that is exact);
streaming one frame at a time and in random uneven chunks == one-shot over 48 frames, with reset;
the checkpoint names save_pretrained writes == our parameter names, and the published tensor list
(tests/data/qwen3_omni) == our parameters at the real config; the config reader.

Tolerance: 1e-5 absolute on waves whose pre-clamp std is scaled to ~0.3 (the output is clamped to
[-1, 1], so that is ~3e-5 of the signal scale).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from omnidesk.models.checkpoint import ConfigError
from omnidesk.models.qwen3_omni.code2wav import CHECKPOINT_PREFIX, Code2Wav, Code2WavConfig

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig  # noqa: E402
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav  # noqa: E402

ATOL = 1e-5
FRAMES = 48

DATA = Path(__file__).parent / "data" / "qwen3_omni"
# The published Qwen/Qwen3-Omni-30B-A3B-Instruct code2wav_config, as config.json spells it.
PUBLISHED = json.loads((DATA / "config.json").read_text())["code2wav_config"]

# Same structure as the real model (2 upsampling stages, 4 decoder blocks), tiny widths; a window of 4
# frames (slid over 48); grouped-query attention (4 q / 2 kv heads).  96 samples per frame, lookahead 42.
TINY = dict(PUBLISHED, codebook_size=32, num_quantizers=3, hidden_size=32, intermediate_size=48,
            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, sliding_window=4,
            decoder_dim=32, upsample_rates=[2, 3, 2, 2], upsampling_ratios=[2, 2], rope_theta=1000.0)


def _randomize(ref: torch.nn.Module, seed: int) -> None:
    """Every parameter random (at init the layer scales, gammas and Snake parameters are trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("alpha", "beta")):
                p.copy_(0.3 * r)
            elif name.endswith(("layer_scale.scale", "gamma")):
                p.copy_(0.5 * r)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * r)
            elif "code_embedding" in name:
                p.copy_(r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            else:
                p.add_(0.1 * p.std() * r)


@pytest.fixture(scope="module")
def models():
    """(reference, ours, codes [Q, FRAMES]) with the same random weights."""
    torch.manual_seed(0)
    ref = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**TINY)).eval()
    _randomize(ref, seed=1)
    codes = torch.randint(0, TINY["codebook_size"], (TINY["num_quantizers"], FRAMES),
                          generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # scale the last (linear) conv so the wave has a meaningful size
        head = ref.decoder[-1].conv
        raw = head(torch.nn.functional.pad(_pre_head(ref, codes), (6, 0)))
        k = 0.3 / raw.std()
        head.weight.mul_(k)
        head.bias.sub_(raw.mean()).mul_(k)  # and centre it
    ours = Code2Wav(Code2WavConfig.from_dict(json.loads(ref.config.to_json_string()), "tiny")).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours, codes


def _pre_head(ref, codes: torch.Tensor) -> torch.Tensor:
    hidden = ref.code_embedding(codes[None] + ref.code_offset).mean(1)
    x = ref.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in ref.upsample:
        for block in blocks:
            x = block(x)
    for block in ref.decoder[:-1]:
        x = block(x)
    return x


def _reference(ref, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(codes[None])[0, 0]


def _ours(model: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(codes)


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- one-shot

def test_forward_matches_reference(models):
    ref, ours, codes = models
    cfg = ours.cfg
    assert (cfg.samples_per_frame, cfg.lookahead_samples) == (96, 2 * 12 + 3 * 4 + 2 * 2 + 2)
    for frames in (1, 2, 5, FRAMES):
        expected = _reference(ref, codes[:, :frames])
        got = _ours(ours, codes[:, :frames])
        assert got.shape[0] == cfg.output_samples(frames) == frames * 96 - 42
        _assert_close(got, expected)
    wave = _ours(ours, codes)
    assert 0.1 < wave.std() < 0.6 and (wave.abs() < 1).float().mean() > 0.9  # a real signal, mostly unclamped


def test_forward_matches_chunked_decode_where_exact(models):
    """chunked_decode is exact when one chunk holds everything, and, with every chunk's left context
    reaching back to frame 0, its chunks are our one-shot output less the lookahead samples the
    reference cuts at each chunk's end.  (With its defaults, 25 frames of context, it is not exact:
    the real transformer alone sees 8 * 71 frames back.)"""
    ref, ours, codes = models
    spf, la = ours.samples_per_frame, ours.lookahead_samples
    whole = _ours(ours, codes)
    with torch.no_grad():
        _assert_close(ref.chunked_decode(codes[None], chunk_size=FRAMES)[0, 0], whole)
        chunked = ref.chunked_decode(codes[None], chunk_size=16, left_context_size=FRAMES)[0, 0]
    pieces = [whole[s * spf:(s + 16) * spf - la] for s in range(0, FRAMES, 16)]
    _assert_close(chunked, torch.cat(pieces))


# ---------------------------------------------------------------- streaming

def test_stream_one_frame_at_a_time(models):
    ref, ours, codes = models
    stream = ours.stream()
    pushes = [stream.push(codes[:, i:i + 1]) for i in range(FRAMES)]
    assert [p.shape[0] for p in pushes] == [96 - 42] + [96] * (FRAMES - 1)
    wave = torch.cat(pushes)
    _assert_close(wave, _ours(ours, codes))
    _assert_close(wave, _reference(ref, codes))
    # the sliding-window cache never grew: window - 1 kept frames + its initial room
    assert stream.kv.k.shape[2] == 2 * TINY["sliding_window"] - 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_uneven_chunks(models, seed):
    _, ours, codes = models
    whole = _ours(ours, codes)
    rng = random.Random(seed)
    stream = ours.stream()
    for _ in range(2):  # the second round after reset() must give the same wave
        pushes, i = [], 0
        while i < FRAMES:
            n = rng.choice([1, 1, 2, 3, 5, 7, 11])  # 7 and 11 exceed the cache's initial room
            pushes.append(stream.push(codes[:, i:i + n]))
            i += n
        _assert_close(torch.cat(pushes), whole)
        stream.reset()


def test_stream_empty_push_and_inference_mode(models):
    _, ours, codes = models
    stream = ours.stream()
    assert stream.push(codes[:, :0]).shape == (0,)
    with torch.inference_mode():
        first = stream.push(codes[:, :3])
    rest = stream.push(codes[:, 3:])  # state written under inference_mode is still writable outside it
    _assert_close(torch.cat([first, rest]), _ours(ours, codes))


def test_bad_codes_are_rejected(models):
    _, ours, codes = models
    with pytest.raises(ValueError, match="codes"):
        ours(codes[:2])
    bad = codes.clone()
    bad[1, 3] = TINY["codebook_size"]
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        ours(bad)


# ---------------------------------------------------------------- checkpoint names

def test_checkpoint_names_match_parameters(models, tmp_path):
    from safetensors import safe_open

    ref, ours, _ = models
    ref.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert written == mine
    # in the full checkpoint the same names sit under the prefix
    assert CHECKPOINT_PREFIX == "code2wav."
    assert dict(ours.named_parameters()).keys() == mine.keys()  # no buffer is a checkpoint tensor


def test_published_tensor_list_matches_parameters():
    """The real checkpoint's code2wav tensors (tests/data/qwen3_omni/tensors.json, as save_pretrained
    of the full model writes them) == our parameters at the published config, names and shapes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qwen3_dump_shapes", DATA / "dump_shapes.py")
    dump_shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump_shapes)
    published = {k[len(CHECKPOINT_PREFIX):]: tuple(v) for k, v in dump_shapes.load_tensors().items()
                 if k.startswith(CHECKPOINT_PREFIX)}
    with torch.device("meta"):
        model = Code2Wav(Code2WavConfig.from_dict(PUBLISHED, "config.json code2wav_config"))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == published
    assert len(published) == 230


# ---------------------------------------------------------------- config

def test_published_config():
    cfg = Code2WavConfig.from_dict(PUBLISHED, "config.json code2wav_config")
    assert cfg.samples_per_frame == 1920 and cfg.lookahead_samples == 555
    assert cfg.output_samples(1) == 1365 and cfg.output_samples(0) == 0
    assert (cfg.head_dim, cfg.sliding_window, cfg.rope_theta, cfg.num_hidden_layers) == (64, 72, 10000.0, 8)
    assert cfg.upsample_rates == (8, 5, 4, 3) and cfg.upsampling_ratios == (2, 2)
    # what current transformers writes instead of rope_theta
    alt = {k: v for k, v in PUBLISHED.items() if k != "rope_theta"}
    alt["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert Code2WavConfig.from_dict(alt, "x") == cfg


@pytest.mark.parametrize("field", ["codebook_size", "hidden_size", "num_quantizers", "sliding_window",
                                   "upsample_rates", "decoder_dim", "rope_theta", "num_key_value_heads",
                                   "rms_norm_eps", "attention_bias", "hidden_act"])
def test_missing_field_is_named(field):
    d = {k: v for k, v in PUBLISHED.items() if k != field}
    with pytest.raises(ConfigError, match=rf"config\.json code2wav_config: .*'{field}'"):
        Code2WavConfig.from_dict(d, "config.json code2wav_config")


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"upsample_rates": []}, "upsample_rates"),
    ({"upsampling_ratios": [2, 0]}, "upsampling_ratios"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope type"),
    ({"decoder_dim": 8}, "decoder_dim"),
])
def test_bad_config_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        Code2WavConfig.from_dict(dict(PUBLISHED, **change), "code2wav_config")
