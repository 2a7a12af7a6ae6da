"""Moshi's language model against Kyutai's own code (the `moshi` package, installed
without its dependencies, is the oracle; runtime code never imports it).

Tiny random LMs are built with the oracle's classes, written to a safetensors
file in the published naming and loaded through our loader; our per-frame step
must give the oracle's ``LMGen`` tokens exactly (greedy) and its text logits
within 1e-4, over more frames than the ring cache holds.  The published 7B
tensor list (tests/data/moshi) must map completely onto our modules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from omnidesk.models.checkpoint import CheckpointError, ConfigError
from omnidesk.models.moshi.config import DEMO, MOSHI_7B, MoshiConfig, MoshiSampling
from omnidesk.models.moshi.lm import (MoshiLM, MoshiLMGen, TokenSampler, check_mapping, load_moshi_lm,
                                      weight_map)

moshi = pytest.importorskip("moshi", reason="the moshi package (test oracle) is not installed")
from moshi.models import loaders  # noqa: E402
from moshi.models.lm import LMGen  # noqa: E402

DATA = Path(__file__).parent / "data" / "moshi"
sys.path.insert(0, str(DATA))
from dump_lm_shapes import build_meta_7b, published_state_dict  # noqa: E402

FRAMES = 60


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_kwargs(**changes) -> dict:
    """The published LM kwargs at toy width: same streams and delays, 16-frame context."""
    kw = dict(loaders._lm_kwargs)
    kw.update(dim=64, text_card=100, card=40, num_heads=4, num_layers=2, context=16, depformer_dim=32,
              depformer_dim_feedforward=80, depformer_num_heads=2, depformer_num_layers=2)
    kw.update(changes)
    return kw


VARIANTS = {
    "published": tiny_kwargs(),
    # one shared depformer input projection, and delays of 2 frames on the acoustic codebooks
    "shared-in-delay2": tiny_kwargs(depformer_multi_linear=False, context=12,
                                    delays=[0, 0, 2, 2, 2, 2, 2, 2, 2, 0, 2, 2, 2, 2, 2, 2, 2]),
}


def build_reference(kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    ref = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 in the oracle: move them so a mapping slip shows
        for name, p in ref.named_parameters():
            if name.endswith("alpha"):
                p.add_(0.2 * torch.randn_like(p))
    return ref


def write_published(ref, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(published_state_dict({k: v.contiguous() for k, v in ref.state_dict().items()}), str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (oracle LMModel, our MoshiLM loaded from its published-layout file, path)."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            kwargs = VARIANTS[variant]
            ref = build_reference(kwargs)
            path = write_published(ref, tmp_path_factory.mktemp(f"moshi-{variant}") / "model.safetensors")
            cache[variant] = (ref, load_moshi_lm(path, MoshiConfig.from_dict(kwargs)), path)
        return cache[variant]

    return get


def user_codes(card: int, frames: int = FRAMES, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, card, (frames, 8), generator=torch.Generator().manual_seed(seed))


def run_ours(gen: MoshiLMGen, codes: torch.Tensor):
    out, logits = [], []
    for frame in codes:
        f = gen.step(frame)
        logits.append(gen.text_logits.clone())
        out.append(None if f is None else torch.cat([f.text[None], f.audio]).tolist())
    return out, logits


# ---------------------------------------------------------------- config

def test_preset_is_the_reference_7b_config():
    assert MoshiConfig.from_dict(loaders._lm_kwargs) == MOSHI_7B
    assert MoshiConfig.from_dict(MOSHI_7B.to_dict()) == MOSHI_7B
    assert MoshiConfig.from_dict(DEMO.to_dict()) == DEMO
    assert (MOSHI_7B.ffn_hidden, MOSHI_7B.depformer_ffn_hidden) == (11264, 2816)
    assert MOSHI_7B.is_text_padding(3) and MOSHI_7B.is_text_padding(0) and not MOSHI_7B.is_text_padding(5)
    s = MOSHI_7B.sampling
    assert (s.text_temperature, s.text_top_k, s.audio_temperature, s.audio_top_k) == (0.7, 25, 0.8, 250)


def test_checkpoint_without_config_uses_the_preset(tmp_path):
    assert MoshiConfig.for_checkpoint(tmp_path) is MOSHI_7B
    (tmp_path / "config.json").write_text(json.dumps(
        {**tiny_kwargs(), "moshi_name": "model.safetensors", "model_type": "moshi",
         "lm_gen_config": {"temp": 0.6, "temp_text": 0.5, "top_k": 100, "top_k_text": 10}}))
    cfg = MoshiConfig.for_checkpoint(tmp_path)
    assert cfg.dim == 64 and cfg.context == 16
    assert cfg.sampling == MoshiSampling(text_temperature=0.5, text_top_k=10, audio_temperature=0.6, audio_top_k=100)


@pytest.mark.parametrize("change, field, words", [
    ({"conditioners": {"description": {"type": "lut"}}}, "conditioners", "not supported"),
    ({"lora": True}, "lora", "LoRA"),
    ({"demux_second_text_stream": True}, "demux_second_text_stream", "second text stream"),
    ({"layer_scale": 0.01}, "layer_scale", "not supported"),
    ({"gating": "gelu"}, "gating", "silu"),
    ({"norm": "layer_norm"}, "norm", "rms_norm"),
    ({"context": None}, "context", "finite"),
    ({"delays": [0, 1]}, "delays", "17 values"),
    ({"depformer_weights_per_step": False}, "depformer_weights_per_step", "per-step"),
    ({"lm_gen_config": {"cfg_coef": 3.0}}, "cfg_coef", "guidance"),
    ({"model_type": "hibiki"}, "model_type", "moshi"),
    ({"frobnicate": 1}, "frobnicate", "unknown"),
    ({"dim": "wide"}, "dim", "expected a number"),
    ({"depformer_num_heads": 3}, "depformer_num_heads", "divisor"),
])
def test_config_refuses_what_we_do_not_implement(change, field, words):
    with pytest.raises(ConfigError) as e:
        MoshiConfig.from_dict({**tiny_kwargs(), **change}, "x/config.json")
    assert field in str(e.value) and words in str(e.value) and str(e.value).startswith("x/config.json")


# ---------------------------------------------------------------- weights

def _covered_exactly_once(cfg: MoshiConfig, model: MoshiLM):
    """Every parameter of ours has one source: a whole tensor, or each of its slices exactly once."""
    sources: dict[str, list] = {}
    for target in weight_map(cfg).values():
        sources.setdefault(target.param, []).append(target)
    params = dict(model.named_parameters())
    assert set(sources) == set(params)
    for name, targets in sources.items():
        p = params[name]
        if len(targets) == 1 and targets[0].index is None:
            assert torch.Size(targets[0].shape).numel() == p.numel(), name
        else:
            assert sorted(t.index for t in targets) == list(range(p.shape[0])), name
            assert all(torch.Size(t.shape).numel() == p[0].numel() for t in targets), name


def test_published_7b_tensors_map_completely():
    listed = json.loads((DATA / "moshiko_7b_tensors.json").read_text())["tensors"]
    # the stored list is what the oracle builds today
    ref, _ = build_meta_7b()
    rebuilt = {n: list(t.shape) for n, t in published_state_dict(ref.state_dict()).items()}
    assert rebuilt == listed
    report = check_mapping(MOSHI_7B, {n: {"dtype": "BF16", "shape": s} for n, s in listed.items()})
    assert report.ok, report.error("moshiko 7B")
    assert len(report.loaded) == len(listed) == 355
    with torch.device("meta"):
        ours = MoshiLM(MOSHI_7B)
    _covered_exactly_once(MOSHI_7B, ours)
    assert sum(p.numel() for p in ours.parameters()) == sum(torch.Size(s).numel() for s in listed.values())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_weights_map_completely(tiny, variant):
    ref, ours, _ = tiny(variant)
    _covered_exactly_once(ours.cfg, ours)
    # the oracle's tensors are exactly ours, slice by slice
    assert ours.depformer.input_proj.shape[0] == (8 if variant == "published" else 1)
    torch.testing.assert_close(ours.audio_emb[3], ref.emb[3].weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.depformer.layers[1].wqkv[5], ref.depformer.layers[1].self_attn.in_projs[5].weight,
                               rtol=0, atol=0)


def test_loader_names_the_file_and_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, ours, path = tiny("published")
    state = load_file(str(path))
    cfg = ours.cfg

    def fails(tensors, *words):
        bad = tmp_path / "model.safetensors"
        save_file(tensors, str(bad))
        with pytest.raises(CheckpointError) as e:
            load_moshi_lm(bad, cfg)
        assert str(bad) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)

    fails({k: v for k, v in state.items() if k != "linears.3.weight"}, "missing weights", "linears.3.weight")
    fails({**state, "depformer_in.0.weight": torch.zeros(3, 3)}, "depformer_in.0.weight", "[3, 3]", "[32, 64]")
    fails({**state, "extra_heads.0.weight": torch.zeros(6, 64)}, "unexpected weights", "extra_heads.0.weight")
    fails({**state, "text_linear.weight": torch.zeros(100, 64, dtype=torch.int8)}, "text_linear.weight", "I8")
    with pytest.raises(CheckpointError, match="missing file model.safetensors"):
        load_moshi_lm(tmp_path / "nothing" / "model.safetensors", cfg)


# ---------------------------------------------------------------- the per-frame step

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_steps_equal_the_reference_lmgen(tiny, variant):
    ref, ours, _ = tiny(variant)
    cfg = ours.cfg
    codes = user_codes(cfg.card)
    ref_logits = []
    lm_gen = LMGen(ref, use_sampling=False, on_text_logits_hook=lambda x: ref_logits.append(x[0, 0, 0].clone()))
    expected = []
    with lm_gen.streaming(1):
        for frame in codes:
            out = lm_gen.step(frame[None, :, None])
            expected.append(None if out is None else out[0, :, 0].tolist())
    gen = MoshiLMGen(ours, MoshiSampling(greedy=True))
    got, logits = run_ours(gen, codes)

    assert FRAMES > 3 * cfg.context  # the ring cache wraps several times
    assert got[:cfg.max_delay] == [None] * cfg.max_delay  # the delays have not filled yet
    assert got == expected
    assert len({tuple(x) for x in got[cfg.max_delay:]}) > FRAMES // 2  # not a constant stream
    for frame, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b.float(), rtol=0, atol=1e-4, msg=lambda m: f"frame {frame}: {m}")
    assert gen.cache.pos.item() == FRAMES


def test_reset_replays_the_same_conversation(tiny):
    _, ours, _ = tiny("published")
    codes = user_codes(ours.cfg.card, 30)
    for sampling in (MoshiSampling(greedy=True), MoshiSampling(text_top_k=5, audio_top_k=8)):
        gen = MoshiLMGen(ours, sampling, seed=3)
        first, first_logits = run_ours(gen, codes)
        gen.reset()
        again, again_logits = run_ours(gen, codes)
        assert again == first
        torch.testing.assert_close(torch.stack(again_logits), torch.stack(first_logits), rtol=0, atol=0)


def test_seeded_sampling_is_reproducible_and_respects_top_k(tiny):
    _, ours, _ = tiny("published")
    codes = user_codes(ours.cfg.card, 40)
    sampling = MoshiSampling(text_temperature=1.0, text_top_k=3, audio_temperature=1.0, audio_top_k=4)
    a, logits = run_ours(MoshiLMGen(ours, sampling, seed=7), codes)
    b, _ = run_ours(MoshiLMGen(ours, sampling, seed=7), codes)
    c, _ = run_ours(MoshiLMGen(ours, sampling, seed=8), codes)
    greedy, _ = run_ours(MoshiLMGen(ours, MoshiSampling(greedy=True)), codes)
    assert a == b
    assert a != c and a != greedy
    # frame t's text token was chosen at step t - 1 (the text stream is not delayed)
    for t in range(1, len(a)):
        assert a[t][0] in torch.topk(logits[t - 1], 3).indices.tolist()


def test_token_sampler_draws_only_from_the_top_k():
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    top = set(torch.topk(logits, 25).indices.tolist())
    sampler = TokenSampler(0.8, 25, greedy=False, generator=torch.Generator().manual_seed(1))
    draws = [int(sampler(logits)) for _ in range(300)]
    assert set(draws) <= top and len(set(draws)) > 5
    assert int(TokenSampler(0.0, 25, False, torch.Generator())(logits)) == int(logits.argmax())
    # with the full vocabulary the most likely token is drawn most often
    peaked = torch.zeros(50)
    peaked[7] = 4.0
    full = TokenSampler(1.0, 0, False, torch.Generator().manual_seed(2))
    counts = torch.bincount(torch.cat([full(peaked) for _ in range(400)]), minlength=50)
    assert int(counts.argmax()) == 7 and (counts > 0).sum() > 10


def test_token_sampler_first_used_under_inference_mode_keeps_working_outside_it():
    # a benchmark's warm-up ran under inference_mode, the engine's steps outside it: the sampler's
    # noise buffer must not become an inference tensor that a later in-place draw may not write
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    top = set(torch.topk(logits, 25).indices.tolist())
    sampler = TokenSampler(0.8, 25, greedy=False, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        first = int(sampler(logits))
    assert first in top and int(sampler(logits)) in top


def test_bf16_step_runs(tiny):
    _, _, path = tiny("published")
    cfg = MoshiConfig.from_dict(VARIANTS["published"])
    lm = load_moshi_lm(path, cfg, dtype=torch.bfloat16)
    gen = MoshiLMGen(lm, seed=0)
    frames = [gen.step(c) for c in user_codes(cfg.card, 20)]
    assert frames[0] is None and all(f is not None for f in frames[1:])
    assert all(0 <= f.text_id < cfg.text_card and 0 <= int(f.audio.min()) and int(f.audio.max()) < cfg.card
               for f in frames[1:])


def test_demo_preset_is_small():
    with torch.device("meta"):
        lm = MoshiLM(DEMO)
    assert sum(p.numel() for p in lm.parameters()) < 4_000_000  # < 8 MB in bf16
    gen = MoshiLMGen(MoshiLM(DEMO).init_random_(0), seed=0)
    assert [gen.step(torch.zeros(8, dtype=torch.long)) is None for _ in range(3)] == [True, False, False]
