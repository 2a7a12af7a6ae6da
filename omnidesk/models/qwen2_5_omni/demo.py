"""The built-in demo model: a tiny, seeded, random-weight Qwen2.5-Omni checkpoint.

It makes the whole app run out of the box on a CPU.  Its weights are random,
so its replies are noise: every place that uses it says so (DEMO_NOTICE).
The files have exactly the layout of a real checkpoint (config.json,
safetensors, spk_dict.pt with two voices in the published batched shapes,
tokenizer files, preprocessor and generation configs) and are read by the same
loader.  Its special token ids differ from the real model's, so an id written
in code would break it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..cache_dir import user_cache_dir, write_checkpoint_dir
from ..omni_checkpoint import whisper_preprocessor, write_demo_files
from .config import OmniConfig
from .loading import OmniModel, VoiceDims, voice_from_entry, weight_map
from ..random_init import init_module_
from .tokenizer import SPECIAL_TOKENS, write_tokenizer_files

DEMO_NOTICE = ("Demo model: tiny and untrained (random weights) - its replies are noise, not speech. "
               "Get real weights with: omnidesk models download Qwen/Qwen2.5-Omni-3B")

# Bump when the recipe changes: a demo made by an older recipe is rebuilt.
RECIPE_VERSION = 7  # 7: voices in the published spk_dict.pt layout
SEED = 20261202

VOICE_REF_FRAMES = 400  # the published voices' reference mel length
TOKENIZER_VOCAB = 1024
FIRST_SPECIAL_ID = 900  # real model: 151643+
CODEC_VOCAB = 1040  # real model: 8448 with specials at 8292-8296


def demo_config() -> dict:
    """config.json of the demo checkpoint (the hub file's layout)."""
    ids = {name: FIRST_SPECIAL_ID + i for i, name in enumerate(SPECIAL_TOKENS)}
    hidden = 128
    text = dict(model_type="qwen2_5_omni_text", vocab_size=TOKENIZER_VOCAB, hidden_size=hidden, intermediate_size=344,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
                rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1000000.0,
                rope_scaling={"mrope_section": [4, 4, 8], "rope_type": "default", "type": "default"}, use_sliding_window=False,
                tie_word_embeddings=False)
    audio = dict(model_type="qwen2_5_omni_audio_encoder", num_mel_bins=128, d_model=64, encoder_layers=2,
                 encoder_attention_heads=4, encoder_ffn_dim=128, max_source_positions=1500, n_window=100,
                 output_dim=hidden, activation_function="gelu")
    talker = dict(model_type="qwen2_5_omni_talker", vocab_size=CODEC_VOCAB, embedding_size=hidden, hidden_size=96,
                  intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=32768,
                  rope_theta=1000000.0, rope_scaling={"mrope_section": [4, 4, 4], "rope_type": "default", "type": "default"},
                  use_sliding_window=False,
                  tts_codec_start_token_id=CODEC_VOCAB - 15, tts_codec_end_token_id=CODEC_VOCAB - 14,
                  tts_codec_pad_token_id=CODEC_VOCAB - 16, tts_codec_mask_token_id=CODEC_VOCAB - 12,
                  tts_text_start_token_id=ids["tts_text_bos"], tts_text_end_token_id=ids["tts_text_eod"],
                  tts_text_pad_token_id=ids["tts_text_pad"], audio_token_index=ids["audio"],
                  audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"],
                  image_token_index=ids["image_pad"], video_token_index=ids["video_pad"],
                  vision_start_token_id=ids["vision_bos"], vision_end_token_id=ids["vision_eos"])
    return {
        "architectures": ["Qwen2_5OmniModel"],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": True,
        "torch_dtype": "float32",
        "thinker_config": dict(model_type="qwen2_5_omni_thinker", text_config=text, audio_config=audio,
                               # no vision weights are written (OmniDesk hears only); a minimal
                               # vision config keeps transformers from building a full-size one
                               vision_config=dict(model_type="qwen2_5_omni_vision_encoder", depth=1, hidden_size=16,
                                                  intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                                                  fullatt_block_indexes=[0], window_size=28, patch_size=14,
                                                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
                               audio_token_index=ids["audio"], audio_start_token_id=ids["audio_bos"],
                               audio_end_token_id=ids["audio_eos"], image_token_index=ids["image_pad"],
                               video_token_index=ids["video_pad"], vision_start_token_id=ids["vision_bos"],
                               vision_end_token_id=ids["vision_eos"], user_token_id=ids["im_start"],
                               position_id_per_seconds=25, seconds_per_chunk=2, tie_word_embeddings=False),
        "talker_config": talker,
        "token2wav_config": {
            "model_type": "qwen2_5_omni_token2wav",
            # A small DiT with the real block structure.  Spelled as transformers reads it: it ignores
            # the hub file's dim/depth/heads (the real model only loads because its sizes equal
            # transformers' defaults), and `omnidesk bench` runs this checkpoint through transformers.
            "dit_config": dict(model_type="qwen2_5_omni_dit", hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=2, head_dim=32, ff_mult=2,
                               emb_dim=32, repeats=2, num_embeds=CODEC_VOCAB, mel_dim=80, enc_emb_dim=192,
                               enc_dim=32, enc_channels=[64, 64, 64, 64, 192], enc_kernel_sizes=[5, 3, 3, 3, 1],
                               enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=2,
                               enc_se_channels=16, block_size=24, look_ahead_layers=[1], look_backward_layers=[0],
                               dropout=0.0),
            "bigvgan_config": dict(model_type="qwen2_5_omni_bigvgan", mel_dim=80, upsample_initial_channel=64,
                                   resblock_kernel_sizes=[3, 7, 11],
                                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                                   upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]),
        },
        "omnidesk_demo": {"recipe": RECIPE_VERSION, "seed": SEED, "notice": DEMO_NOTICE},
    }


PREPROCESSOR = whisper_preprocessor("Qwen2_5OmniProcessor")


# A random BigVGAN is nearly silent (RMS ~1e-6 of full scale); the demo's replies must be
# clearly audible, so its output convolution is scaled to this RMS on a calibration reply.
TARGET_RMS = 0.15


def default_demo_dir() -> Path:
    return user_cache_dir() / f"demo-qwen2.5-omni-r{RECIPE_VERSION}"


def make_demo(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write the demo checkpoint (atomically) and return its directory; reuses a complete one."""
    return write_checkpoint_dir(path, default_demo_dir(), _write_demo, force)


def _write_demo(root: Path) -> None:
    raw = demo_config()
    cfg = OmniConfig.from_dict(raw)
    g = torch.Generator().manual_seed(SEED)
    model = OmniModel(cfg)
    init_module_(model, g)
    dims = VoiceDims.of(cfg)
    voices = {}
    for i, name in enumerate(("Chelsie", "Ethan")):
        # the published layout: batched, a 400-frame reference mel
        voices[name] = {"bos_token": FIRST_SPECIAL_ID + list(SPECIAL_TOKENS).index(f"speaker_{i}"),
                        "cond": torch.randn(1, dims.cond, generator=g),
                        "ref_mel": torch.randn(1, VOICE_REF_FRAMES, dims.mel, generator=g) - 5.0}
    with torch.no_grad():
        vocoder = model.vocoder
        codes = torch.randint(0, CODEC_VOCAB - 16, (100,), generator=g)
        chelsie = voice_from_entry("Chelsie", voices["Chelsie"], dims, "demo voices")
        voice = vocoder.voice(chelsie.cond, chelsie.ref_mel)
        wave = vocoder.offline(codes, voice, seed=SEED)
        vocoder.bigvgan.conv_post.weight.mul_(TARGET_RMS / wave.pow(2).mean().sqrt())
    ids = write_tokenizer_files(root, vocab_size=TOKENIZER_VOCAB, first_special_id=FIRST_SPECIAL_ID)
    write_demo_files(root, raw, model, weight_map(cfg, model), ids, PREPROCESSOR)
    assert all(voices[name]["bos_token"] == ids[f"speaker_{i}"] for i, name in enumerate(voices))
    torch.save(voices, root / "spk_dict.pt")


def is_demo(config_raw: dict) -> bool:
    return "omnidesk_demo" in config_raw
