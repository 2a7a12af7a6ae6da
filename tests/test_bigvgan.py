"""BigVGAN vocoder: equality with transformers' Qwen2_5OmniToken2WavBigVGANModel (bit for bit block by
block, within fp32 rounding with the fused stages inference runs), exact streaming.

All fp32 on the CPU except the dependency-tightness check, which uses fp64 gradients: the
outermost frames of the receptive field contribute ~1e-127 of an output (a product of many
filter-tail taps), far below fp32 rounding, so only a gradient in fp64 can see them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from omnidesk.models.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig, _FusedStage
from omnidesk.models.checkpoint import ConfigError
from support import ReadyStep

# Gain of the random conv weights (times 1/sqrt(fan_in)): transformers' own init makes the
# waveform ~1e-4, too small for an absolute tolerance to mean anything; 0.6 gives a std of
# ~0.1 with peaks ~0.4, i.e. a realistic range that the final clamp at +-1 does not hide.
WEIGHT_GAIN = 0.6
TOL = 1e-5

REAL_CONFIG = dict(mel_dim=80, upsample_initial_channel=1536, resblock_kernel_sizes=[3, 7, 11],
                   resblock_dilation_sizes=[[1, 3, 5]] * 3, upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These convolutions are small; with two OpenMP threads on a machine shared with other test
    runs, one preempted thread stalls the other at every barrier (observed 40x slowdowns)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def mel_like(frames: int, seed: int, mel_dim: int = 80) -> torch.Tensor:
    """Natural-log mel in the range the DiT produces (about -10 .. 2)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(mel_dim, frames, generator=g) * 2 - 4


@pytest.fixture(scope="module")
def models():
    """(transformers reference, ours) with the same seeded random weights, fp32, eval."""
    import tiny
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    hf_cfg = tiny.build_config("a").token2wav_config.bigvgan_config
    torch.manual_seed(0)
    ref = Qwen2_5OmniToken2WavBigVGANModel(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            if p.dim() == 3:  # conv / transposed-conv weights
                p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_GAIN / p[0].numel() ** 0.5)
            else:  # biases, snake alpha/beta (log scale): move off transformers' zeros
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    ours = BigVGAN(BigVGANConfig.from_dict(hf_cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def whole150(models):
    mel = mel_like(150, seed=3)
    with torch.no_grad():
        return mel, models[1](mel)


def test_config_from_dict():
    cfg = BigVGANConfig.from_dict(REAL_CONFIG)
    assert cfg.hop_length == 240  # 24 kHz at 100 mel frames/s
    assert cfg.resblock_dilation_sizes == ((1, 3, 5),) * 3
    for key in REAL_CONFIG:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            BigVGANConfig.from_dict({k: v for k, v in REAL_CONFIG.items() if k != key})
    with pytest.raises(ConfigError, match="parity"):
        BigVGANConfig.from_dict({**REAL_CONFIG, "upsample_kernel_sizes": [10, 7, 4, 4, 4, 4]})


def test_names_and_meta_build(models):
    ref, ours = models
    assert list(ours.state_dict()) == list(ref.state_dict())  # filters are not checkpoint tensors
    with torch.device("meta"):
        meta = BigVGAN(BigVGANConfig.from_dict(REAL_CONFIG))
    assert all(p.is_meta for p in meta.parameters())
    # Computed filters are real even under the meta device, and equal the reference's.
    ref_filters = dict(ref.named_buffers())
    assert list(ref_filters) == [n for n, _ in meta.named_buffers()]
    for name, buf in meta.named_buffers():
        assert not buf.is_meta
        assert torch.equal(buf, ref_filters[name])  # same layout as the tiny config (6 stages x 3 blocks)
    # reset_buffers recomputes a clobbered filter.
    up = ours.activation_post.upsample
    saved = up.filter.clone()
    up.filter.zero_()
    up.reset_buffers()
    assert torch.equal(up.filter, saved)
    # Context of the released model (1536 channels), derived from the config alone.
    assert meta.context_frames() == (34, 34)
    # Inference fuses only its narrow stages (48 and 24 channels): the wide ones are bound by arithmetic.
    stages = [list(meta.resblocks[i * 3:(i + 1) * 3]) for i in range(6)]
    assert [_FusedStage.fits(blocks) for blocks in stages] == [False] * 4 + [True] * 2


@pytest.mark.parametrize("frames", [37, 150])
def test_matches_transformers(models, frames):
    ref, ours = models
    mel = mel_like(frames, seed=frames)
    with torch.no_grad():
        expected = ref(mel[None])
        got = ours(mel)  # inference: each stage's blocks fused into one (bigvgan._FusedStage)
        got_batched = ours(mel[None])
    with torch.enable_grad():
        block_by_block = ours(mel)  # the reference's own path (gradients need it)
    assert got.shape == (frames * ours.hop_length,)
    assert expected.abs().max() > 0.1 and (expected.abs() < 1).float().mean() > 0.99  # not trivial, not clamped
    # measured: 1.8e-7 / 1.2e-7 (the fused stages sum their convolutions in another order)
    assert (got - expected).abs().max().item() <= TOL
    assert torch.equal(block_by_block, expected)  # same operations in the same order: bit-identical
    assert torch.equal(got, got_batched)


def test_blocks_with_unequal_dilations_run_one_by_one():
    """A config whose residual blocks differ in dilations cannot be fused: those stages run block by
    block, still equal to transformers."""
    import tiny
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    hf_cfg = tiny.build_config("a").token2wav_config.bigvgan_config
    hf_cfg.resblock_dilation_sizes = [[1, 3, 5], [1, 2, 4], [1, 3, 5]]
    torch.manual_seed(0)
    ref = Qwen2_5OmniToken2WavBigVGANModel(hf_cfg).float().eval()
    ours = BigVGAN(BigVGANConfig.from_dict(hf_cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    mel = mel_like(40, seed=5)
    with torch.no_grad():
        expected, got = ref(mel[None]), ours(mel)
        assert all(stage is None for stage in ours._fused()[:-1])
    assert (got - expected).abs().max().item() <= TOL


def test_fused_stages_follow_the_parameters(models):
    """The fused stages are derived from the parameters: written in place (a load), replaced by
    inference tensors (a load under inference_mode) or converted (``.double()``), the next forward
    uses the new values."""
    _, ours = models
    model = copy.deepcopy(ours)
    mel = mel_like(30, seed=9)
    with torch.no_grad():
        before = model(mel)
        model.resblocks[4].convs1[1].weight.mul_(1.5)
        model.activation_post.act.alpha.add_(0.2)
        after = model(mel)
    with torch.enable_grad():
        block_by_block = model(mel)
    assert (after - before).abs().max().item() > 1e-3
    assert (after - block_by_block).abs().max().item() <= TOL
    # A model loaded under inference_mode holds inference tensors, which keep no write count.
    with torch.inference_mode():
        for module in model.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        assert model.activation_post.upsample.filter.is_inference()
        assert (model(mel) - after).abs().max().item() <= TOL
    model.double()
    with torch.no_grad():
        doubled = model(mel.double())
    assert doubled.dtype == torch.float64
    assert (doubled - block_by_block.double()).abs().max().item() <= TOL


def test_streaming_chunks_equal_whole(models, whole150):
    _, ours = models
    mel, whole = whole150
    L, R = ours.context_frames()
    frames, hop = mel.shape[-1], ours.hop_length
    bounds = [0, 12] + list(range(36, frames, 24)) + [frames]
    pieces = []
    with torch.no_grad():
        for a, b in zip(bounds[:-1], bounds[1:]):
            start, stop = max(0, a - L), min(frames, b + R)  # fewer frames only at the true edges
            piece = ours.forward_window(mel[:, start:stop], a - start, stop - b)
            assert piece.shape == ((b - a) * hop,)
            pieces.append(piece)
    streamed = torch.cat(pieces)
    # measured: ~2e-7 (conv rounding differs with the window length; exact in exact arithmetic)
    assert (streamed - whole).abs().max().item() <= TOL
    # Surplus context is trimmed, so extra frames change nothing.
    with torch.no_grad():
        a, b = 60, 84
        extra = ours.forward_window(mel[:, a - L - 5:b + R + 7], L + 5, R + 7)
        exact = ours.forward_window(mel[:, a - L:b + R], L, R)
    assert torch.equal(extra, exact)
    with pytest.raises(ValueError):
        ours.forward_window(mel[:, :10], 6, 5)


def test_context_is_sufficient_and_tight(models):
    _, ours = models
    L, R = ours.context_frames()
    assert (L, R) == (34, 34)  # tiny config: same geometry as the released model
    hop = ours.hop_length
    a, b = L + 3, L + 3 + 5
    frames = b + R + 3
    mel = mel_like(frames, seed=7)
    sl = slice(a * hop, b * hop)

    # Sufficient: replace every frame outside [a - L, b + R) at once (by other in-range values, so
    # the input normalisation's clamp hides nothing) -> samples of [a, b) unchanged.
    noisy = mel_like(frames, seed=8)
    noisy[:, a - L:b + R] = mel[:, a - L:b + R]
    with torch.no_grad():
        diff = (ours(noisy)[sl] - ours(mel)[sl]).abs().max().item()
    assert diff <= 1e-6  # measured: 0.0

    # Tight: d(samples of [a, b)) / d(mel) in fp64 is nonzero exactly on [a - L, b + R), so
    # shrinking L or R by even one frame would drop a real dependency.
    double = copy.deepcopy(ours).double()
    x = mel.double().requires_grad_(True)
    double(x)[sl].sum().backward()
    reach = (x.grad.abs().amax(0) > 0).nonzero().flatten()
    assert (reach.min().item(), reach.max().item()) == (a - L, b + R - 1)


def test_snake_resample_is_the_anti_aliased_activation(models):
    """SnakeResample (the compiled activation's function) computes what the fused activation's
    convolutions do, for every width and length a window has, down to one sample at the edges."""
    _, ours = models
    fused = ours._fused()
    snake = ours.snake_resample()
    g = torch.Generator().manual_seed(7)
    for act in [stage.steps[0][0] for stage in fused[:-1]] + [fused[-1]]:
        for length in (1, 2, 5, 37, 240):
            x = torch.randn(1, act.channels, length, generator=g) * 0.5
            with torch.no_grad():
                expected = act(x)
                got = snake(x, act.alpha, act.inv_beta)
            assert got.shape == expected.shape
            # measured: <= 7e-7 (the same products summed in another order)
            assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_a_ready_activation_step_runs_instead_of_the_convolutions(models, whole150):
    """Given a ready step, the fused stages' activations of more than one channel go through it, and
    the vocoder's samples stay those of the convolutions (streaming windows included)."""
    _, ours = models
    mel, whole = whole150
    step = ReadyStep(ours.snake_resample())
    with torch.no_grad():
        got = ours(mel, step)
        window = ours.forward_window(mel[:, 40:100], 20, 12, step)
        plain = ours.forward_window(mel[:, 40:100], 20, 12)
    widths = [stage.steps[0][0].channels for stage in ours._fused()[:-1] if stage is not None]
    assert step.calls == 2 * (6 * sum(1 for w in widths if w > 1) + (ours._fused()[-1].channels > 1))
    assert (got - whole).abs().max().item() <= TOL
    assert (window - plain).abs().max().item() <= TOL
