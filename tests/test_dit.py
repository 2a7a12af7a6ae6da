"""The token2wav DiT against transformers' Qwen2_5OmniToken2WavDiTModel (fp32, tiny config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiny
from support import ReadyStep
from omnidesk.models.checkpoint import ConfigError
from omnidesk.models.qwen2_5_omni.dit import DiT, DiTConfig

HUB_CONFIG = Path(__file__).parent / "data" / "qwen2_5_omni_7b" / "config.json"


@pytest.fixture(scope="module")
def models():
    """(reference, ours) with identical perturbed weights, fp32, eval."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavDiTModel

    torch.manual_seed(0)
    ref_cfg = tiny.build_config("a").token2wav_config.dit_config
    ref_cfg._attn_implementation = "sdpa"
    ref = Qwen2_5OmniToken2WavDiTModel(ref_cfg).float().eval()
    # Many weights start as exact zeros/ones (biases, AdaLN-Zero); perturb all of them so that a
    # missed bias, a swapped shift/scale or a wrong chunk order shows up.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ours = DiT(DiTConfig.from_dict(ref_cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _voice(cfg: DiTConfig, frames: int = 50, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.enc_emb_dim, generator=g), torch.randn(frames, cfg.mel_dim, generator=g)


def _codes(cfg: DiTConfig, n: int, seed: int) -> torch.Tensor:
    # Real codes are never 0 in practice; 0 is the unconditional branch's code.
    return torch.randint(1, cfg.num_embeds, (n,), generator=torch.Generator().manual_seed(seed))


def test_parameter_names_match_checkpoint(models):
    ref, ours = models
    assert set(ours.state_dict()) == set(ref.state_dict())
    assert "rotary_embed.inv_freq" not in ours.state_dict()  # non-persistent, like the reference


def test_velocity_matches_reference_forward(models):
    ref, ours = models
    cfg = ours.cfg
    spk, ref_mel = _voice(cfg)
    n_codes = 40
    code = _codes(cfg, n_codes, 4)
    x = torch.randn(n_codes * cfg.repeats, cfg.mel_dim, generator=torch.Generator().manual_seed(5))
    guidance = 0.5
    with torch.no_grad():
        out = ref(hidden_states=x[None], condition_vector=ref_mel[None],
                  speaker_embedding=spk[None, None].expand(1, x.shape[0], -1), quantized_code=code[None],
                  time_step=torch.tensor(0.3), apply_cfg=True)
        cond, uncond = out.chunk(2, dim=0)
        expected = (cond + (cond - uncond) * guidance)[0]
        feats = ours.speaker_features(ref_mel)
        got = ours.velocity(x, 0.3, code, spk, feats, guidance)
        # what a solve evaluates (the codes' and voice's tensors made once, velocity_fn) is the
        # batched forward that makes everything at every evaluation, to the bit
        f = ours.velocity_fn(code, spk, feats, guidance)
        for t in (0.3, 0.8):
            out = ours(torch.stack([x, x]), torch.tensor([t, t]), torch.stack([code, torch.zeros_like(code)]),
                       torch.stack([spk, torch.zeros_like(spk)]), torch.stack(feats))
            assert torch.equal(f(t, x), out[0] + (out[0] - out[1]) * guidance)
    # Measured 0.0 (bit-identical; fp32, CPU, torch 2.13), velocity magnitude ~1.
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n_codes", [30, 61])
def test_sample_matches_reference(models, n_codes):
    ref, ours = models
    cfg = ours.cfg
    spk, ref_mel = _voice(cfg)
    code = _codes(cfg, n_codes, n_codes)
    seed = 100 + n_codes
    with torch.no_grad():
        torch.manual_seed(seed)  # the reference draws its initial noise with torch.randn inside sample
        expected = ref.sample(spk[None], ref_mel[None], code[None])[0]
        torch.manual_seed(seed)
        noise = torch.randn(1, n_codes * cfg.repeats, cfg.mel_dim)[0]
        got = ours.sample(code, spk, ref_mel, noise)
    # Measured 0.0 for both lengths (bit-identical; fp32, CPU) over 9 RK4 steps = 36 DiT
    # evaluations, mel magnitude ~4; the bound leaves room for other BLAS builds.
    assert got.shape == (cfg.mel_dim, n_codes * cfg.repeats)
    assert (got - expected).abs().max().item() <= 1e-4


def test_velocity_block_locality(models):
    """One velocity evaluation of block b reads input blocks [b - reach_back, b + reach_ahead] only."""
    _, ours = models
    cfg = ours.cfg
    bs, blocks = cfg.block_size, 8
    assert (cfg.reach_back, cfg.reach_ahead) == (1, 1)  # tiny config: layer 0 looks back, layer 1 ahead
    n = blocks * bs
    g = torch.Generator().manual_seed(6)
    spk, ref_mel = _voice(cfg)
    feats = ours.speaker_features(ref_mel)
    x = torch.randn(n, cfg.mel_dim, generator=g)
    code = _codes(cfg, n // cfg.repeats, 7)

    def changed(first_block: int, last_block: int):
        """x and code with frames of blocks outside [first_block, last_block] replaced."""
        keep = torch.zeros(n, dtype=torch.bool)
        keep[first_block * bs:(last_block + 1) * bs] = True
        x2 = torch.where(keep[:, None], x, torch.randn(n, cfg.mel_dim, generator=g))
        keep_code = keep[::cfg.repeats]
        code2 = torch.where(keep_code, code, _codes(cfg, n // cfg.repeats, 8))
        return x2, code2

    def velocity(xx, cc):
        return ours.velocity(xx, 0.3, cc, spk, feats)

    base = velocity(x, code)
    b = 4
    frames = slice(b * bs, (b + 1) * bs)
    x2, code2 = changed(b - cfg.reach_back, b + cfg.reach_ahead)
    # Masked keys get exactly zero weight, so the frames of block b are unchanged; measured 0.
    assert (velocity(x2, code2)[frames] - base[frames]).abs().max().item() <= 1e-7
    # The reach is tight: dropping one more block on either side changes block b (measured
    # ~2e-5 with these small random weights; far above the 0 of the unchanged case).
    for lo, hi in ((b - cfg.reach_back + 1, b + cfg.reach_ahead), (b - cfg.reach_back, b + cfg.reach_ahead - 1)):
        x3, code3 = changed(lo, hi)
        assert (velocity(x3, code3)[frames] - base[frames]).abs().max().item() > 1e-6


def test_window_on_block_boundary_matches_full_sequence(models):
    """Blocks are counted from the window start and RoPE is relative, so a window that starts on a
    block boundary reproduces the full sequence's velocity for blocks beyond the reach of its edges."""
    _, ours = models
    cfg = ours.cfg
    bs, blocks = cfg.block_size, 8
    n = blocks * bs
    spk, ref_mel = _voice(cfg)
    feats = ours.speaker_features(ref_mel)
    x = torch.randn(n, cfg.mel_dim, generator=torch.Generator().manual_seed(9))
    code = _codes(cfg, n // cfg.repeats, 10)
    full = ours.velocity(x, 0.7, code, spk, feats)
    first, end = 2, 7  # window = blocks [2, 7)
    win = ours.velocity(x[first * bs:end * bs], 0.7, code[first * bs // cfg.repeats:end * bs // cfg.repeats],
                        spk, feats)
    lo, hi = first + cfg.reach_back, end - cfg.reach_ahead
    diff = (win[(lo - first) * bs:(hi - first) * bs] - full[lo * bs:hi * bs]).abs().max().item()
    assert diff <= 1e-5  # measured 3e-8: only rotary angles of other absolute positions round differently


def test_hub_spelling_parses_like_transformers_spelling():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniDiTConfig

    hub = json.loads(HUB_CONFIG.read_text())["token2wav_config"]["dit_config"]
    assert {"dim", "depth", "heads"} <= hub.keys() and "block_size" not in hub and "hidden_size" not in hub
    ours_hub = DiTConfig.from_dict(hub)
    written = Qwen2_5OmniDiTConfig(**hub).to_dict()  # what transformers writes for the same values
    assert {"hidden_size", "num_hidden_layers", "num_attention_heads", "block_size"} <= written.keys()
    assert DiTConfig.from_dict(written) == ours_hub
    assert (ours_hub.hidden_size, ours_hub.num_layers, ours_hub.num_heads) == (1024, 22, 16)
    assert (ours_hub.block_size, ours_hub.look_ahead_layers, ours_hub.look_backward_layers) == (24, (10,), (0, 20))
    assert (ours_hub.rope_theta, ours_hub.reach_back, ours_hub.reach_ahead) == (10000.0, 2, 1)

    missing = {k: v for k, v in hub.items() if k != "depth"}
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        DiTConfig.from_dict(missing)


def test_builds_on_meta_device(models):
    _, ours = models
    with torch.device("meta"):
        meta = DiT(ours.cfg)
    assert meta.proj_out.weight.is_meta
    inv = meta.rotary_embed.inv_freq
    assert inv.device.type == "cpu" and torch.equal(inv, ours.rotary_embed.inv_freq)
    meta.to_empty(device="cpu")
    meta.reset_buffers()
    assert torch.equal(meta.rotary_embed.inv_freq, ours.rotary_embed.inv_freq)


@pytest.mark.parametrize("guidance", [0.5, 0.0])
def test_a_solve_through_the_step_function_is_the_same_solve(models, guidance):
    """``DiT.solve_step`` (what the decode runner compiles) is one RK4 step of ``velocity``: a solve
    through it, eager, is bit-identical to the plain solve, guided or not."""
    _, ours = models
    cfg = ours.cfg
    spk, ref_mel = _voice(cfg)
    code = _codes(cfg, 24, 5)
    noise = torch.randn(24 * cfg.repeats, cfg.mel_dim, generator=torch.Generator().manual_seed(9))
    step = ReadyStep(ours.solve_step)
    with torch.no_grad():
        plain = ours.sample(code, spk, ref_mel, noise, num_steps=4, guidance_scale=guidance)
        stepped = ours.sample(code, spk, ref_mel, noise, num_steps=4, guidance_scale=guidance, step=step)
    assert step.calls == 3
    assert torch.equal(plain, stepped)
