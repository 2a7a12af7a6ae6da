"""Tiny random Qwen2.5-Omni checkpoints written by transformers (the test oracle).

Each variant is a full ``Qwen2_5OmniForConditionalGeneration`` saved with
``save_pretrained`` plus ``spk_dict.pt`` and tokenizer files, i.e. exactly the
layout a user downloads, only small.  Our loader must read what transformers
wrote, so the tests never write these files through our own code paths except
for the tokenizer (transformers has no tokenizer *trainer*; the files are
checked against transformers' tokenizer separately).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Special token ids of the tiny test checkpoints: deliberately different from
# both the real model (151643+) and the demo model, so any id written in code
# would break one of them.
TEST_SPECIALS = {
    "vocab_size": 640,
    "first_special_id": 520,
}

VARIANTS = {
    # GQA 2:1, head_dim 16 -> mrope sections sum to 8.
    "a": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3], rope_theta=1000000.0, tie=False),
        audio=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64),
        talker=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=24, mrope_section=[4, 4, 4]),
    ),
    # GQA 4:1, head_dim 32, another mrope split, tied thinker embeddings.
    "b": dict(
        text=dict(hidden_size=128, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, mrope_section=[4, 6, 6], rope_theta=10000.0, tie=True),
        audio=dict(d_model=64, encoder_layers=3, encoder_attention_heads=4, encoder_ffn_dim=96),
        talker=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, mrope_section=[1, 1, 2]),
    ),
}

CODEC_VOCAB = 96  # codec ids; the last four are the codec specials


def special_ids() -> dict[str, int]:
    """Token ids the tiny checkpoints use, in tokenizer order."""
    from omnidesk.models.qwen2_5_omni.tokenizer import SPECIAL_TOKENS

    first = TEST_SPECIALS["first_special_id"]
    return {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}


def build_config(variant: str = "a"):
    from transformers import Qwen2_5OmniConfig

    v = VARIANTS[variant]
    ids = special_ids()
    t, a, k = v["text"], v["audio"], v["talker"]
    vocab = TEST_SPECIALS["vocab_size"]
    text_config = dict(
        vocab_size=vocab, hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"], rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"], "mrope_section": t["mrope_section"]},
        tie_word_embeddings=t["tie"],
    )
    if "head_dim" in t:
        text_config["head_dim"] = t["head_dim"]
    audio_config = dict(
        num_mel_bins=128, d_model=a["d_model"], encoder_layers=a["encoder_layers"],
        encoder_attention_heads=a["encoder_attention_heads"], encoder_ffn_dim=a["encoder_ffn_dim"],
        max_source_positions=1500, n_window=100, output_dim=t["hidden_size"],
    )
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=t["hidden_size"],
                         fullatt_block_indexes=[0], window_size=28, patch_size=14, spatial_merge_size=2,
                         temporal_patch_size=2, in_channels=3)
    thinker_config = dict(
        audio_config=audio_config, vision_config=vision_config, text_config=text_config,
        audio_token_index=ids["audio"], image_token_index=ids["image_pad"], video_token_index=ids["video_pad"],
        audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"],
        vision_start_token_id=ids["vision_bos"], vision_end_token_id=ids["vision_eos"],
        user_token_id=ids["im_start"], tie_word_embeddings=t["tie"],
    )
    talker_config = dict(
        vocab_size=CODEC_VOCAB, embedding_size=t["hidden_size"], hidden_size=k["hidden_size"],
        intermediate_size=k["intermediate_size"], num_hidden_layers=k["num_hidden_layers"],
        num_attention_heads=k["num_attention_heads"], num_key_value_heads=k["num_key_value_heads"],
        head_dim=k["head_dim"], rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": k["mrope_section"]},
        tts_codec_start_token_id=CODEC_VOCAB - 4, tts_codec_end_token_id=CODEC_VOCAB - 3,
        tts_codec_pad_token_id=CODEC_VOCAB - 5, tts_codec_mask_token_id=CODEC_VOCAB - 1,
        tts_text_start_token_id=ids["tts_text_bos"], tts_text_end_token_id=ids["tts_text_eod"],
        tts_text_pad_token_id=ids["tts_text_pad"],
        audio_token_index=ids["audio"], image_token_index=ids["image_pad"], video_token_index=ids["video_pad"],
        audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"],
        vision_start_token_id=ids["vision_bos"], vision_end_token_id=ids["vision_eos"],
    )
    token2wav_config = dict(
        dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2,
                        emb_dim=16, block_size=24, look_ahead_layers=[1], look_backward_layers=[0],
                        repeats=2, num_embeds=CODEC_VOCAB, mel_dim=80, enc_emb_dim=192, enc_dim=16,
                        enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
                        enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=2,
                        enc_se_channels=8, dropout=0.0),
        bigvgan_config=dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3, 7, 11],
                            resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                            upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]),
    )
    return Qwen2_5OmniConfig(thinker_config=thinker_config, talker_config=talker_config,
                             token2wav_config=token2wav_config, enable_audio_output=True)


def build_reference(variant: str = "a", seed: int = 0):
    """The transformers model for ``variant`` with seeded random weights (fp32, eval)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(seed)
    config = build_config(variant)
    config._attn_implementation = "eager"
    model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
    # transformers initialises some weights to exact zeros/ones (biases, norms); perturb every
    # floating parameter so a missed bias or norm weight shows up as a mismatch.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


# The published spk_dict.pt (Qwen2.5-Omni-3B/7B): per voice an int bos_token, cond [1, 192] and
# ref_mel [1, 400, 80] - batched.  Chelsie comes first (the reference's default speaker).
VOICE_NAMES = ("Chelsie", "Ethan")
VOICE_REF_FRAMES = 400


def speakers(bos_tokens: dict[str, int], seed: int = 0, cond_dim: int = 192, mel_dim: int = 80,
             batched: bool = True) -> dict:
    """spk_dict.pt contents in the published layout (``batched=False``: the unbatched shapes)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = {}
    for name, bos in bos_tokens.items():
        cond = torch.randn(1, cond_dim, generator=g)
        ref_mel = torch.randn(1, VOICE_REF_FRAMES, mel_dim, generator=g)
        out[name] = {"bos_token": int(bos), "cond": cond if batched else cond[0],
                     "ref_mel": ref_mel if batched else ref_mel[0]}
    return out


def write_speakers(path: Path, thinker_vocab_bos: int, seed: int = 0) -> None:
    """spk_dict.pt in the published layout; bos ids are thinker-vocabulary ids (the real ones:
    Chelsie 151872, Ethan 151870)."""
    bos = {name: thinker_vocab_bos + i for i, name in enumerate(VOICE_NAMES)}
    torch.save(speakers(bos, seed), Path(path) / "spk_dict.pt")


def write_checkpoint(path: Path, variant: str = "a", seed: int = 0, max_shard_size: str | None = None):
    """Write a tiny checkpoint with transformers' save_pretrained; returns the reference model."""
    from omnidesk.models.qwen2_5_omni.tokenizer import write_tokenizer_files

    path = Path(path)
    model = build_reference(variant, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    ids = special_ids()
    write_tokenizer_files(path, vocab_size=TEST_SPECIALS["vocab_size"], first_special_id=TEST_SPECIALS["first_special_id"])
    # Speaker bos tokens are thinker-vocabulary ids (the real ones are 151870/151871).
    write_speakers(path, ids["speaker_0"], seed)
    model.load_speakers(str(path / "spk_dict.pt"))
    (path / "preprocessor_config.json").write_text(json.dumps(WHISPER_PREPROCESSOR, indent=2))
    return model


WHISPER_PREPROCESSOR = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "processor_class": "Qwen2_5OmniProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
}
