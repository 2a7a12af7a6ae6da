"""The built-in Qwen3-Omni demo: a tiny, seeded, random-weight checkpoint in the published layout.

It runs the whole Qwen3-Omni path out of the box on a CPU: the MoE thinker and
talker (8 experts), the code predictor (8 codebooks) and code2wav at its real
1920 samples per frame.  Its weights are random, so its replies are noise:
every place that uses it says so (DEMO_NOTICE).  The files have the layout of
the real repo (config.json in the hub's spelling, safetensors with one tensor
per expert, tokenizer files with the real special-token strings, preprocessor
and generation configs) and are read by the same loader.  Its token and codec
ids differ from the real model's, so an id written in code would break it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from ..cache_dir import user_cache_dir, write_checkpoint_dir
from ..omni_checkpoint import whisper_preprocessor, write_demo_files
from ..qwen2_5_omni.tokenizer import chat_template, write_tokenizer_files
from ..random_init import init_module_
from .config import Qwen3OmniConfig
from .loading import Qwen3OmniModel, weight_map

DEMO_NOTICE = ("Qwen3-Omni demo model: tiny and untrained (random weights) - its replies are noise, not speech. "
               "The real model is Qwen/Qwen3-Omni-30B-A3B-Instruct (about 79 GB of GPU memory in bf16: the "
               "loader's estimate at an 8k context).")

RECIPE_VERSION = 1
SEED = 20261203

# The real tokenizer's strings (Qwen3-Omni's tokenizer.json); the demo's ids are its own.
SPECIAL_TOKENS: "OrderedDict[str, str]" = OrderedDict([
    ("endoftext", "<|endoftext|>"), ("im_start", "<|im_start|>"), ("im_end", "<|im_end|>"),
    ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"), ("vision_pad", "<|vision_pad|>"),
    ("image_pad", "<|image_pad|>"), ("video_pad", "<|video_pad|>"),
    ("audio_start", "<|audio_start|>"), ("audio_end", "<|audio_end|>"), ("tts_pad", "<tts_pad>"),
    ("tts_bos", "<tts_text_bos>"), ("tts_eos", "<tts_text_eod>"), ("tts_bos_single", "<tts_text_bos_single>"),
    ("audio_pad", "<|audio_pad|>"),
])
MEDIA = {"audio_token": "audio_pad", "audio_bos_token": "audio_start", "audio_eos_token": "audio_end",
         "image_token": "image_pad", "video_token": "video_pad", "vision_bos_token": "vision_start",
         "vision_eos_token": "vision_end"}
TEMPLATE = chat_template(SPECIAL_TOKENS, audio_names=("audio_start", "audio_pad", "audio_end"),
                         image_names=("vision_start", "image_pad", "vision_end"),
                         video_names=("vision_start", "video_pad", "vision_end"))
# role names are single tokens in the real vocabulary: the talker finds user turns by them
ROLE_CORPUS = "system\nuser\nassistant\n" * 40

TOKENIZER_VOCAB = 1024
FIRST_SPECIAL_ID = 900  # real model: 151643+
CODEBOOK = 256  # real model: 2048
TALKER_VOCAB = CODEBOOK + 1024  # the reference suppresses the top 1024 ids (controls), as in the real 3072
CONTROL = CODEBOOK  # first control id (real: 2048; pad 2148, bos 2149, eos 2150, ...)
CODE_GROUPS = 8  # real model: 16


def demo_config(ids: dict[str, int], roles: dict[str, int]) -> dict:
    """config.json of the demo checkpoint (the hub file's layout, small sizes)."""
    hidden, talker_hidden = 128, 96
    rope = {"interleaved": True, "mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default",
            "type": "default"}
    text = dict(model_type="qwen3_omni_moe_text", vocab_size=TOKENIZER_VOCAB, hidden_size=hidden,
                intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=65536, rope_theta=1000000,
                rope_scaling=rope, attention_bias=False, use_qk_norm=True, decoder_sparse_step=1, mlp_only_layers=[],
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                shared_expert_intermediate_size=0, tie_word_embeddings=False, sliding_window=None,
                use_sliding_window=False)
    audio = dict(model_type="qwen3_omni_moe_audio_encoder", num_mel_bins=128, d_model=64, encoder_layers=2,
                 encoder_attention_heads=4, encoder_ffn_dim=128, num_hidden_layers=2, max_source_positions=1500,
                 n_window=50, n_window_infer=200, conv_chunksize=500, downsample_hidden_size=32, output_dim=hidden,
                 activation_function="gelu", scale_embedding=False)
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=talker_hidden, intermediate_size=192,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                       hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=65536, rope_theta=1000000,
                       rope_scaling={"interleaved": True, "mrope_section": [4, 4, 4], "rope_type": "default",
                                     "type": "default"},
                       attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[], num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                       shared_expert_intermediate_size=96, sliding_window=None, use_sliding_window=False)
    predictor = dict(model_type="qwen3_omni_moe_talker_code_predictor", vocab_size=CODEBOOK,
                     hidden_size=talker_hidden, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=24, hidden_act="silu", rms_norm_eps=1e-6,
                     max_position_embeddings=32768, rope_theta=1000000, rope_scaling=None, attention_bias=False,
                     num_code_groups=CODE_GROUPS, layer_types=["full_attention"] * 2, sliding_window=None,
                     use_sliding_window=False, tie_word_embeddings=False)
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "enable_audio_output": True,
        "dtype": "float32",
        "im_start_token_id": ids["im_start"], "im_end_token_id": ids["im_end"],
        "tts_pad_token_id": ids["tts_pad"], "tts_bos_token_id": ids["tts_bos"], "tts_eos_token_id": ids["tts_eos"],
        "system_token_id": roles["system"], "user_token_id": roles["user"], "assistant_token_id": roles["assistant"],
        "thinker_config": dict(
            model_type="qwen3_omni_moe_thinker", text_config=text, audio_config=audio,
            # no vision weights are written (OmniDesk hears only); a minimal vision config keeps
            # transformers from building a full-size one when a test reads this checkpoint
            vision_config=dict(model_type="qwen3_omni_moe_vision_encoder", depth=1, hidden_size=16,
                               intermediate_size=32, num_heads=2, out_hidden_size=hidden, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                               deepstack_visual_indexes=[0], num_position_embeddings=16),
            audio_token_id=ids["audio_pad"], audio_start_token_id=ids["audio_start"],
            audio_end_token_id=ids["audio_end"], image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
            vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
            user_token_id=roles["user"], position_id_per_seconds=13, seconds_per_chunk=2),
        "talker_config": dict(
            model_type="qwen3_omni_moe_talker", text_config=talker_text, code_predictor_config=predictor,
            num_code_groups=CODE_GROUPS, thinker_hidden_size=hidden, accept_hidden_layer=2,
            codec_pad_id=CONTROL + 100, codec_bos_id=CONTROL + 101, codec_eos_token_id=CONTROL + 102,
            codec_nothink_id=CONTROL + 107, codec_think_bos_id=CONTROL + 108, codec_think_eos_id=CONTROL + 109,
            speaker_id={"chelsie": CONTROL + 253, "ethan": CONTROL + 254, "aiden": CONTROL + 255},
            audio_token_id=ids["audio_pad"], audio_start_token_id=ids["audio_start"],
            audio_end_token_id=ids["audio_end"], image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
            vision_start_token_id=ids["vision_start"], position_id_per_seconds=13, seconds_per_chunk=2,
            spatial_merge_size=2),
        "code2wav_config": dict(
            model_type="", codebook_size=CODEBOOK, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, attention_bias=False, hidden_act="silu",
            layer_scale_initial_scale=0.01, max_position_embeddings=8000, rms_norm_eps=1e-5, rope_theta=10000,
            sliding_window=72, num_quantizers=CODE_GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
            decoder_dim=96),
        "omnidesk_demo": {"recipe": RECIPE_VERSION, "seed": SEED, "notice": DEMO_NOTICE},
    }


PREPROCESSOR = whisper_preprocessor("Qwen3OmniMoeProcessor")

# A random code2wav is nearly silent; the demo's replies must be clearly audible, so the last
# convolution is scaled to this RMS on a calibration stream of random codes.
TARGET_RMS = 0.15


def default_demo_dir() -> Path:
    return user_cache_dir() / f"demo-qwen3-omni-r{RECIPE_VERSION}"


def make_demo(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write the demo checkpoint (atomically) and return its directory; reuses a complete one."""
    return write_checkpoint_dir(path, default_demo_dir(), _write_demo, force)


def _write_demo(root: Path) -> None:
    from ..qwen2_5_omni.tokenizer import Tokenizer

    ids = write_tokenizer_files(root, vocab_size=TOKENIZER_VOCAB, first_special_id=FIRST_SPECIAL_ID,
                                specials=SPECIAL_TOKENS, media=MEDIA, template=TEMPLATE,
                                processor_class="Qwen3OmniMoeProcessor", extra_corpus=ROLE_CORPUS)
    tok = Tokenizer.from_dir(root)
    roles = {}
    for role in ("system", "user", "assistant"):
        pieces = tok.encode(role)
        if len(pieces) != 1:  # the recipe trains them as single tokens; this guards the recipe
            raise RuntimeError(f"demo tokenizer: role '{role}' is {len(pieces)} tokens, expected one")
        roles[role] = pieces[0]
    raw = demo_config(ids, roles)
    cfg = Qwen3OmniConfig.from_dict(raw)
    g = torch.Generator().manual_seed(SEED)
    model = Qwen3OmniModel(cfg)
    init_module_(model, g)
    with torch.no_grad():
        codes = torch.randint(0, CODEBOOK, (CODE_GROUPS, 50), generator=g)
        wave = model.code2wav(codes)
        for p in model.code2wav.decoder[-1].parameters():  # the output conv (linear before the clamp)
            p.mul_(TARGET_RMS / float(wave.pow(2).mean().sqrt()))
    write_demo_files(root, raw, model, weight_map(cfg, model), ids, PREPROCESSOR)


def is_demo(config_raw: dict) -> bool:
    return "omnidesk_demo" in config_raw and config_raw.get("model_type") == "qwen3_omni_moe"


__all__ = ["DEMO_NOTICE", "default_demo_dir", "demo_config", "is_demo", "make_demo"]
