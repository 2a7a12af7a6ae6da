"""Qwen3-Omni thinker / talker / code predictor stacks against transformers (the oracle).

A tiny random Qwen3OmniMoeForConditionalGeneration is written with save_pretrained
(so the tensor names are the published, per-expert ones) and loaded into ours
through the weight maps.  Everything runs in fp32 on the CPU in a few seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf  # noqa: E402

from omnidesk.models.checkpoint import ConfigError  # noqa: E402
from omnidesk.models.qwen3_omni import decoder as dec  # noqa: E402
from omnidesk.models.qwen3_omni.decoder import DecoderConfig, MoE  # noqa: E402
from omnidesk.models.qwen3_omni.talker import Talker, greedy, talker_weight_map  # noqa: E402
from omnidesk.models.qwen3_omni.thinker import Thinker, thinker_weight_map  # noqa: E402

GROUPS = 5  # codes per frame in the tiny model (16 in the real one)
AUDIO_TOKEN = 90

THINKER_TEXT = dict(
    vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[4, 2, 2], interleaved=True))
TALKER_TEXT = dict(
    vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=16, norm_topk_prob=True, shared_expert_intermediate_size=24, decoder_sparse_step=1,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 1, 1], interleaved=True))
CODE_PREDICTOR = dict(
    vocab_size=20, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, num_code_groups=GROUPS,
    rope_parameters=dict(rope_type="default", rope_theta=1e6))


def _tiny_reference() -> hf.Qwen3OmniMoeForConditionalGeneration:
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=64, downsample_hidden_size=8, n_window=4, max_source_positions=50)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)
    code2wav = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=32, decoder_dim=16, codebook_size=20, num_quantizers=GROUPS)
    cfg = hf_config.Qwen3OmniMoeConfig(
        thinker_config=dict(text_config=THINKER_TEXT, audio_config=audio, vision_config=vision,
                            audio_token_id=AUDIO_TOKEN),
        talker_config=dict(text_config=TALKER_TEXT, code_predictor_config=CODE_PREDICTOR, num_code_groups=GROUPS,
                           thinker_hidden_size=64, spatial_merge_size=2),
        code2wav_config=code2wav)
    torch.manual_seed(0)
    model = hf.Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    # Weights big enough that routing, QK-norm gains and every projection matter.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(reference model, tensors as save_pretrained wrote them, config.json dict)."""
    from safetensors.torch import load_file

    model = _tiny_reference()
    path = tmp_path_factory.mktemp("qwen3-omni-tiny")
    model.save_pretrained(path)
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return model, tensors, json.loads((path / "config.json").read_text())


@dataclass(frozen=True)
class ThinkerCfg:  # the fields of config.ThinkerConfig the stacks read
    text: DecoderConfig
    audio_token_id: int


@dataclass(frozen=True)
class TalkerCfg:  # the fields of config.TalkerConfig the stacks read
    text: DecoderConfig
    code_predictor: DecoderConfig
    thinker_hidden_size: int
    num_code_groups: int


def _configs(config: dict) -> tuple[DecoderConfig, DecoderConfig, DecoderConfig]:
    talker = config["talker_config"]
    return (DecoderConfig.from_dict(config["thinker_config"]["text_config"], "thinker_config.text_config"),
            DecoderConfig.from_dict(talker["text_config"], "talker_config.text_config"),
            DecoderConfig.from_dict(talker["code_predictor_config"], "talker_config.code_predictor_config"))


def _stack_configs(config: dict) -> tuple[ThinkerCfg, TalkerCfg]:
    text, talker_text, cp = _configs(config)
    talker = config["talker_config"]
    return (ThinkerCfg(text, config["thinker_config"]["audio_token_id"]),
            TalkerCfg(talker_text, cp, talker["thinker_hidden_size"], talker["num_code_groups"]))


def _load(module: torch.nn.Module, wmap: dict, tensors: dict) -> None:
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, target in wmap.items():
            target.destination(params).copy_(tensors[name])


@pytest.fixture(scope="module")
def ours(published):
    _, tensors, config = published
    thinker_cfg, talker_cfg = _stack_configs(config)
    thinker = Thinker(thinker_cfg).eval()
    _load(thinker, thinker_weight_map(thinker_cfg, ours=""), tensors)
    talker = Talker(talker_cfg).eval()
    _load(talker, talker_weight_map(talker_cfg, ours=""), tensors)
    return thinker, talker


# ---------------------------------------------------------------- config

HUB_THINKER_TEXT = {  # as the published config.json spells it (trimmed)
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 768, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": {"interleaved": True, "mrope_interleaved": True, "mrope_section": [24, 20, 20],
                     "rope_type": "default", "type": "default"},
    "shared_expert_intermediate_size": 0, "use_qk_norm": True, "use_sliding_window": False, "sliding_window": None,
    "attention_bias": False, "vocab_size": 152064}
HUB_TALKER_TEXT = {
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
    "mlp_only_layers": [], "moe_intermediate_size": 384, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 128, "num_experts_per_tok": 6, "num_hidden_layers": 20, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default", "type": "default"},
    "shared_expert_intermediate_size": 768, "sliding_window": None, "use_sliding_window": False, "vocab_size": 3072}
HUB_CODE_PREDICTOR = {
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "layer_types": ["full_attention"] * 5, "max_window_layers": 28, "num_attention_heads": 16, "num_code_groups": 16,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "sliding_window": None,
    "use_sliding_window": False, "vocab_size": 2048}


def test_config_reads_the_published_values():
    text = DecoderConfig.from_dict(HUB_THINKER_TEXT, "thinker_config.text_config")
    assert (text.num_layers, text.num_heads, text.num_kv_heads, text.head_dim) == (48, 32, 4, 128)
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (128, 8, 768)
    assert text.norm_topk_prob and text.shared_expert_intermediate_size == 0 and text.rope_theta == 1e6
    assert text.mrope_section == (24, 20, 20) and text.mrope_interleaved
    assert all(text.is_sparse(i) for i in range(48))
    talker = DecoderConfig.from_dict(HUB_TALKER_TEXT, "talker_config.text_config")
    assert (talker.num_experts_per_tok, talker.shared_expert_intermediate_size, talker.head_dim) == (6, 768, 128)
    assert talker.norm_topk_prob and all(talker.is_sparse(i) for i in range(20))
    # transformers 5 writes the talker's expert count back as num_local_experts
    respelled = {k: v for k, v in HUB_TALKER_TEXT.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert DecoderConfig.from_dict(respelled, "t") == talker
    cp = DecoderConfig.from_dict(HUB_CODE_PREDICTOR, "talker_config.code_predictor_config")
    assert cp.num_experts == 0 and cp.intermediate_size == 3072 and cp.mrope_section == ()
    assert not any(cp.is_sparse(i) for i in range(5))


@pytest.mark.parametrize("field", ["norm_topk_prob", "num_experts_per_tok", "hidden_size", "rms_norm_eps",
                                   "decoder_sparse_step", "vocab_size",
                                   "num_key_value_heads", "num_hidden_layers", "moe_intermediate_size"])
def test_config_missing_field_is_named(field):
    d = {k: v for k, v in HUB_THINKER_TEXT.items() if k != field}
    with pytest.raises(ConfigError, match=rf"thinker_config\.text_config.*{field}"):
        DecoderConfig.from_dict(d, "thinker_config.text_config")


@pytest.mark.parametrize("change", [{"rope_theta": None, "rope_scaling": None}, {"norm_topk_prob": "yes"},
                                    {"attention_bias": True}, {"hidden_act": "gelu"}, {"num_experts_per_tok": 0},
                                    {"rope_scaling": {"rope_type": "yarn"}}, {"use_sliding_window": True}])
def test_config_bad_values(change):
    with pytest.raises(ConfigError, match=r"thinker_config\.text_config"):
        DecoderConfig.from_dict(HUB_THINKER_TEXT | change, "thinker_config.text_config")


def test_config_rejects_sliding_layers():
    with pytest.raises(ConfigError, match=r"talker_config\.code_predictor_config: sliding"):
        DecoderConfig.from_dict(HUB_CODE_PREDICTOR | {"layer_types": ["sliding_attention"] * 5},
                                "talker_config.code_predictor_config")


@pytest.mark.parametrize("step,only", [(1, []), (2, []), (1, [0, 2]), (3, [1])])
def test_sparse_layers_follow_the_reference(step, only):
    d = dict(THINKER_TEXT, num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=only)
    ref = hf.Qwen3OmniMoeThinkerTextModel(hf_config.Qwen3OmniMoeTextConfig(**d))
    expected = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.layers]
    cfg = DecoderConfig.from_dict(json.loads(json.dumps(d)), "t")
    assert [cfg.is_sparse(i) for i in range(4)] == expected
    # the talker's layers are sparse whatever these fields say, as in the reference
    talker = DecoderConfig.from_dict(dict(TALKER_TEXT, decoder_sparse_step=step, mlp_only_layers=only), "t")
    assert all(talker.is_sparse(i) for i in range(4))


def test_interleaved_mrope_with_equal_axes_is_plain_rope():
    """Text/audio positions are equal on the three axes: the reference's interleaved
    mrope then gives exactly our plain RoPE table (real head_dim and sections)."""
    cfg = hf_config.Qwen3OmniMoeTextConfig(**dict(
        THINKER_TEXT, hidden_size=256, num_attention_heads=2, head_dim=128,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], interleaved=True)))
    rotary = hf.Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg)
    pos = torch.arange(50, 3000, 7)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))
    ours = dec.Rotary(128, 1e6)
    our_cos, our_sin = ours.table(3000, torch.float32)
    torch.testing.assert_close(cos[0], our_cos[pos], rtol=0, atol=0)
    torch.testing.assert_close(sin[0], our_sin[pos], rtol=0, atol=0)


# ---------------------------------------------------------------- names

def test_every_published_tensor_has_one_destination(published, ours):
    model, tensors, config = published
    thinker, talker = ours
    thinker_cfg, talker_cfg = _stack_configs(config)
    tmap = thinker_weight_map(thinker_cfg)
    kmap = talker_weight_map(talker_cfg)
    assert not set(tmap) & set(kmap)
    wmap = tmap | kmap
    # transformers 5 fuses experts in memory and writes them back one tensor per expert
    assert "thinker.model.layers.0.mlp.experts.7.down_proj.weight" in tensors
    assert "talker.model.layers.1.mlp.shared_expert_gate.weight" in tensors
    ours_names = {n for n in tensors if not n.startswith(("thinker.audio_tower.", "thinker.visual.", "code2wav."))}
    assert ours_names == set(wmap)
    for name, target in wmap.items():
        assert tuple(tensors[name].shape) == target.shape, name
    # every element of every parameter of ours is written by exactly one checkpoint tensor
    for module, prefix in ((thinker, "thinker"), (talker, "talker")):
        hits = {f"{prefix}.{n}": torch.zeros_like(p) for n, p in module.named_parameters()}
        for target in wmap.values():
            if target.param.startswith(prefix + "."):
                target.destination(hits).add_(1)
        for name, count in hits.items():
            assert torch.all(count == 1), f"{name}: {int((count == 0).sum())} unset, {int((count > 1).sum())} twice"


# ---------------------------------------------------------------- thinker

def test_thinker_matches_reference(published, ours):
    model, _, _ = published
    thinker, _ = ours
    lm, head = model.thinker.model.language_model, model.thinker.lm_head
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 80, (32,), generator=g)
    prefill, steps = 12, 20
    with torch.no_grad():
        embeds = thinker.embed(ids)
        torch.testing.assert_close(embeds, lm.embed_tokens(ids), rtol=0, atol=0)
        ref_cache = DynamicCache(config=lm.config)
        ref = lm(inputs_embeds=embeds[None, :prefill], cache=ref_cache, use_cache=True, output_hidden_states=True)
        cache = thinker.new_cache(64)
        n = len(thinker.decoder.layers)
        for k in range(n + 1):
            cache.reset()
            hidden, picked = thinker(embeds[:prefill], cache, hidden_layer=k)
            torch.testing.assert_close(picked, ref.hidden_states[k][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden, ref.last_hidden_state[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(thinker.logits(hidden), head(ref.last_hidden_state)[0], rtol=1e-4, atol=1e-4)
        assert cache.length == prefill
        for t in range(prefill, prefill + steps):
            ref = lm(inputs_embeds=embeds[None, t:t + 1], cache=ref_cache, use_cache=True, output_hidden_states=True)
            hidden, picked = thinker(embeds[t:t + 1], cache, hidden_layer=2)
            torch.testing.assert_close(picked, ref.hidden_states[2][0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden, ref.last_hidden_state[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(thinker.logits(hidden), head(ref.last_hidden_state)[0], rtol=1e-4, atol=1e-4)
        assert cache.length == prefill + steps
        # rollback: truncate and re-run the same steps gives the same numbers
        cache.truncate(prefill)
        again = thinker(embeds[prefill:prefill + steps], cache)
        torch.testing.assert_close(again[-1], hidden[-1], rtol=1e-4, atol=1e-4)


def test_thinker_hidden_layers_as_generate_reads_them(published, ours):
    """The full thinker forward (input ids, its own position ids) is what generate() records:
    hidden_states[k] there is our hidden_layer=k."""
    model, _, _ = published
    thinker, _ = ours
    ids = torch.randint(0, 80, (1, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model.thinker(input_ids=ids, output_hidden_states=True)
        assert len(ref.hidden_states) == len(thinker.decoder.layers) + 1
        for k, expected in enumerate(ref.hidden_states):
            hidden, picked = thinker(thinker.embed(ids[0]), thinker.new_cache(16), hidden_layer=k)
            torch.testing.assert_close(picked, expected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(thinker.logits(hidden), ref.logits[0], rtol=1e-4, atol=1e-4)


def test_thinker_bf16_as_close_to_fp32_as_the_reference(published, ours):
    """In bf16 we stray from the fp32 result no more than transformers' own bf16 run does."""
    import copy

    model, _, _ = published
    lm32 = model.thinker.model.language_model
    lm16 = copy.deepcopy(lm32).to(torch.bfloat16)
    thinker = copy.deepcopy(ours[0]).to(torch.bfloat16)
    ids = torch.randint(0, 80, (20,), generator=torch.Generator().manual_seed(7))
    ours_err = ref_err = 0.0
    with torch.no_grad():
        embeds = thinker.embed(ids)
        c32, c16, cache = DynamicCache(config=lm32.config), DynamicCache(config=lm32.config), thinker.new_cache(32)
        for lo, hi in [(0, 12)] + [(t, t + 1) for t in range(12, 20)]:
            exact = lm32(inputs_embeds=embeds[None, lo:hi].float(), cache=c32, use_cache=True).last_hidden_state[0]
            ref = lm16(inputs_embeds=embeds[None, lo:hi], cache=c16, use_cache=True).last_hidden_state[0]
            hidden = thinker(embeds[lo:hi], cache)
            assert hidden.dtype == torch.bfloat16
            ours_err = max(ours_err, (hidden.float() - exact).abs().max().item())
            ref_err = max(ref_err, (ref.float() - exact).abs().max().item())
    assert ours_err <= 1.5 * ref_err + 1e-3, (ours_err, ref_err)


def test_thinker_embed_fills_audio_placeholders(ours):
    thinker, _ = ours
    ids = torch.tensor([1, AUDIO_TOKEN, AUDIO_TOKEN, 5, AUDIO_TOKEN])
    audio = torch.randn(3, 64)
    embeds = thinker.embed(ids, audio)
    torch.testing.assert_close(embeds[[1, 2, 4]], audio)
    torch.testing.assert_close(embeds[[0, 3]], thinker.embed_tokens(ids[[0, 3]]))
    with pytest.raises(ValueError, match="3 audio placeholders but 2"):
        thinker.embed(ids, audio[:2])


@pytest.mark.parametrize("which", ["thinker", "talker"])
def test_grouped_experts_equal_gathered(ours, which):
    thinker, talker = ours
    moe = (thinker.decoder.layers[0] if which == "thinker" else talker.decoder.layers[1]).mlp
    assert isinstance(moe, MoE)
    x = torch.randn(12, moe.gate.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        grouped, gathered = moe(x, grouped=True), moe(x, grouped=False)
        one_by_one = torch.cat([moe(x[i:i + 1]) for i in range(12)])
    torch.testing.assert_close(grouped, gathered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-5)
    assert 12 > dec.GATHER_MAX_TOKENS >= 1  # off the CPU a long prefill groups, a decode step gathers


def _static_steps(decoder_step, eager_step, embeds: torch.Tensor, prefill: int, cache, static_cache, span: bool):
    """Prefill both caches eagerly, then each later row as a static step (at a tensor position, over
    the whole cache or a KVSpan of the used positions) and as an eager step: (static, eager) outputs."""
    eager_step(embeds[:prefill], cache)
    eager_step(embeds[:prefill], static_cache)
    got, want = [], []
    for t in range(prefill, embeds.shape[0]):
        pos = torch.tensor([t])
        arg = static_cache.span(t + 1) if span else static_cache
        got.append(decoder_step(embeds[t:t + 1], arg, pos))
        static_cache.length = t + 1
        want.append(eager_step(embeds[t:t + 1], cache))
    return got, want


@pytest.mark.parametrize("span", [False, True], ids=["whole-cache", "span"])
def test_thinker_static_step_equals_eager(ours, span):
    """forward_static (index_copy_ at input_pos, a position mask, experts without a host sync) gives
    the eager forward's hidden states, attending over the whole capacity or a span of the used part."""
    thinker, _ = ours
    ids = torch.randint(0, 80, (24,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        embeds = thinker.embed(ids)
        got, want = _static_steps(thinker.forward_static, lambda e, c: thinker(e, c), embeds, 10,
                                  thinker.new_cache(40), thinker.new_cache(40), span)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["thinker", "talker"])
def test_static_experts_equal_grouped(ours, which):
    """A decode step's expert path (grouped_mm on the CPU: no host sync) equals the grouped one."""
    thinker, talker = ours
    moe = (thinker.decoder.layers[0] if which == "thinker" else talker.decoder.layers[1]).mlp
    x = torch.randn(3, moe.gate.in_features, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        for t in (1, 3):
            torch.testing.assert_close(moe.forward_static(x[:t]), moe(x[:t], grouped=True), rtol=1e-5, atol=1e-5)
    assert dec.grouped_mm_works(torch.float32) == hasattr(torch.nn.functional, "grouped_mm")


# ---------------------------------------------------------------- talker

def test_talker_matches_reference(published, ours):
    model, _, _ = published
    _, talker = ours
    ref_talker = model.talker
    g = torch.Generator().manual_seed(4)
    thinker_rows = torch.randn(14, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(talker.text_projection(thinker_rows), ref_talker.text_projection(thinker_rows),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(talker.hidden_projection(thinker_rows),
                                   ref_talker.hidden_projection(thinker_rows), rtol=1e-5, atol=1e-5)
        embeds = talker.text_projection(thinker_rows)
        ref_cache = DynamicCache(config=ref_talker.config.text_config)
        cache = talker.new_cache(32)
        chunks = [(0, 8)] + [(t, t + 1) for t in range(8, 14)]
        for lo, hi in chunks:
            ref = ref_talker.model(inputs_embeds=embeds[None, lo:hi], cache=ref_cache, use_cache=True)
            hidden, logits = talker(embeds[lo:hi], cache)
            torch.testing.assert_close(hidden, ref.last_hidden_state[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits, ref_talker.codec_head(ref.last_hidden_state)[0], rtol=1e-4, atol=1e-4)


def test_code_predictor_expand_matches_reference(published, ours):
    model, _, _ = published
    _, talker = ours
    predictor = model.talker.code_predictor
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for code0 in (3, 17, 39):
            hidden = torch.randn(32, generator=g)
            inputs = torch.stack((hidden, model.talker.get_input_embeddings().weight[code0]))[None]
            ref = predictor.generate(inputs_embeds=inputs, max_new_tokens=GROUPS - 1, do_sample=False,
                                     output_hidden_states=True, return_dict_in_generate=True)
            codes = talker.expand(hidden, code0, greedy)
            assert codes == [code0] + ref.sequences[0].tolist()
            # the reference's next talker input: code 0 embedding, the predictor's step inputs, the last code's
            mids = [h[0] for h in ref.hidden_states[1:]]
            last = predictor.get_input_embeddings()[-1](ref.sequences[..., -1:])
            expected = torch.cat([inputs[:, 1:]] + mids + [last], dim=1).sum(1)[0]
            torch.testing.assert_close(talker.frame_embedding(codes), expected, rtol=1e-5, atol=1e-5)


def test_static_frame_equals_eager_expand_and_talker_step(ours):
    """A frame in static form (expand_static + Talker.forward_static: codes on the device, the
    predictor's cache overwritten from position 0 each frame) gives the eager frames, codes and
    talker states alike, frame after frame."""
    _, talker = ours
    g = torch.Generator().manual_seed(13)
    predictor = talker.code_predictor

    def argmax(logits, group):
        return logits.argmax(-1, keepdim=True)

    with torch.no_grad():
        prompt = talker.text_projection(torch.randn(9, 64, generator=g))
        rows = talker.text_projection(torch.randn(5, 64, generator=g))
        eager_cache, static_cache = talker.new_cache(32), talker.new_cache(32)
        hidden, logits = talker(prompt, eager_cache)
        talker(prompt, static_cache)
        s_hidden, s_code0 = hidden[-1], logits[-1].argmax(-1, keepdim=True)
        frame_cache, positions = predictor.new_cache(), torch.arange(GROUPS)
        for step in range(rows.shape[0]):
            codes = predictor.expand(hidden[-1], greedy(logits[-1], 0), talker, greedy)
            frame, embedding = predictor.expand_static(s_hidden, s_code0, talker, frame_cache, positions, argmax)
            assert frame.tolist() == codes
            torch.testing.assert_close(embedding, talker.frame_embedding(codes), rtol=1e-6, atol=1e-6)
            hidden, logits = talker((talker.frame_embedding(codes) + rows[step])[None], eager_cache)
            pos = torch.tensor([static_cache.length])
            s_h, s_logits = talker.forward_static((embedding + rows[step])[None], static_cache, pos)
            static_cache.length += 1
            torch.testing.assert_close(s_h, hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s_logits, logits, rtol=1e-5, atol=1e-5)
            s_hidden, s_code0 = s_h[-1], s_logits[-1].argmax(-1, keepdim=True)


def test_talker_generation_matches_reference(published, ours):
    """Several frames of the reference's greedy talker.generate, replayed with our pieces."""
    model, _, _ = published
    _, talker = ours
    ref_talker = model.talker
    g = torch.Generator().manual_seed(6)
    frames = 6
    with torch.no_grad():
        prompt = ref_talker.text_projection(torch.randn(9, 64, generator=g))
        trailing = ref_talker.text_projection(torch.randn(3, 64, generator=g))  # reply text rows, then pad
        pad = ref_talker.text_projection(torch.randn(64, generator=g))
        ref = ref_talker.generate(inputs_embeds=prompt[None], trailing_text_hidden=trailing[None],
                                  tts_pad_embed=pad[None, None], max_new_tokens=frames + 1, do_sample=False,
                                  output_hidden_states=True, return_dict_in_generate=True, eos_token_id=None,
                                  pad_token_id=0)
        ref_frames = [step[-1][0].tolist() for step in ref.hidden_states if step[-1] is not None]
        assert len(ref_frames) == frames

        cache = talker.new_cache(32)
        hidden, logits = talker(prompt, cache)
        got = []
        for step in range(frames):
            codes = talker.code_predictor.expand(hidden[-1], greedy(logits[-1], 0), talker, greedy)
            got.append(codes)
            text_row = trailing[step] if step < trailing.shape[0] else pad
            hidden, logits = talker((talker.frame_embedding(codes) + text_row)[None], cache)
    assert got == ref_frames
    assert ref.sequences[0].tolist()[:frames] == [f[0] for f in got]
