"""Config dataclasses read from a Qwen2.5-Omni checkpoint's config.json.

Only what our modules need is kept; everything comes from the file (no token
id, rate or size is written in code).  Both spellings of the rotary settings
are accepted: the hub files (``rope_theta`` + ``rope_scaling.mrope_section``)
and what current transformers writes (``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import ConfigError, config_field, expect_model_type, int_fields, load_config_file
from ..decoder_layers import DecoderShape
from ..omni_checkpoint import ThinkerConfigBase, read_thinker_parts

MODEL_TYPE = "qwen2_5_omni"


def _rope(d: dict, where: str) -> tuple[float, tuple[int, ...]]:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{where}: missing field 'rope_theta' (or rope_parameters.rope_theta)")
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{where}: rope type '{rope_type}' is not supported (only default/mrope)")
    section = params.get("mrope_section", scaling.get("mrope_section"))
    if section is None:
        raise ConfigError(f"{where}: missing field 'mrope_section' (rope_scaling or rope_parameters)")
    return float(theta), tuple(int(s) for s in section)


@dataclass(frozen=True)
class DecoderConfig(DecoderShape):
    """A Qwen2-style decoder (the thinker's LLM and the talker share it); TMRoPE always, so
    ``mrope_section`` is required."""

    max_position_embeddings: int
    embedding_size: int  # width of embed_tokens (the talker's codec embedding lives in thinker space)

    def __post_init__(self):
        super().__post_init__()
        self.check_mrope_section()

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "DecoderConfig":
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (Qwen2.5-Omni uses silu)")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported")
        hidden = int(config_field(d, "hidden_size", where))
        heads = int(config_field(d, "num_attention_heads", where))
        theta, section = _rope(d, where)
        return cls(
            vocab_size=int(config_field(d, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(config_field(d, "intermediate_size", where)),
            num_layers=int(config_field(d, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(config_field(d, "num_key_value_heads", where, heads)),
            head_dim=int(config_field(d, "head_dim", where, hidden // heads)),
            rms_norm_eps=float(config_field(d, "rms_norm_eps", where, 1e-6)),
            rope_theta=theta,
            mrope_section=section,
            max_position_embeddings=int(config_field(d, "max_position_embeddings", where, 32768)),
            embedding_size=int(config_field(d, "embedding_size", where, hidden)),
        )


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_source_positions: int
    n_window: int  # half a block, in mel frames: blocks are 2 * n_window frames (2 s)
    output_dim: int

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "AudioEncoderConfig":
        act = d.get("activation_function", "gelu")
        if act != "gelu":
            raise ConfigError(f"{where}: activation_function '{act}' is not supported (expected gelu)")
        return cls(**int_fields(d, where, {
            "num_mel_bins": "num_mel_bins", "d_model": "d_model", "num_layers": "encoder_layers",
            "num_heads": "encoder_attention_heads", "ffn_dim": "encoder_ffn_dim",
            "max_source_positions": "max_source_positions", "n_window": "n_window", "output_dim": "output_dim"}))


@dataclass(frozen=True)
class ThinkerConfig(ThinkerConfigBase):
    """``text``: a :class:`DecoderConfig`, ``audio``: an :class:`AudioEncoderConfig`."""

    audio_end_token_id: int
    tie_word_embeddings: bool
    position_id_per_seconds: int
    seconds_per_chunk: int

    @classmethod
    def from_dict(cls, d: dict, where: str = "thinker_config") -> "ThinkerConfig":
        text, audio = read_thinker_parts(d, where, DecoderConfig, AudioEncoderConfig)
        tie = d.get("tie_word_embeddings")
        if tie is None:
            tie = d["text_config"].get("tie_word_embeddings", False)
        return cls(
            text=text,
            audio=audio,
            **int_fields(d, where, {"audio_token_id": "audio_token_index",
                                    "audio_start_token_id": "audio_start_token_id",
                                    "audio_end_token_id": "audio_end_token_id"}),
            tie_word_embeddings=bool(tie),
            position_id_per_seconds=int(config_field(d, "position_id_per_seconds", where, 25)),
            seconds_per_chunk=int(config_field(d, "seconds_per_chunk", where, 2)),
        )


@dataclass(frozen=True)
class TalkerConfig:
    decoder: DecoderConfig
    codec_bos_id: int
    codec_eos_id: int
    codec_pad_id: int
    codec_mask_id: int
    text_bos_id: int  # thinker-vocabulary ids fed to the talker around the reply
    text_eos_id: int
    text_pad_id: int

    @classmethod
    def from_dict(cls, d: dict, where: str = "talker_config") -> "TalkerConfig":
        return cls(decoder=DecoderConfig.from_dict(d, where), **int_fields(d, where, {
            "codec_bos_id": "tts_codec_start_token_id", "codec_eos_id": "tts_codec_end_token_id",
            "codec_pad_id": "tts_codec_pad_token_id", "codec_mask_id": "tts_codec_mask_token_id",
            "text_bos_id": "tts_text_start_token_id", "text_eos_id": "tts_text_end_token_id",
            "text_pad_id": "tts_text_pad_token_id"}))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Codec ids that end a reply (the reference stops on pad and end)."""
        return (self.codec_pad_id, self.codec_eos_id)


@dataclass(frozen=True)
class OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig | None
    token2wav: dict | None  # read by the vocoder
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "OmniConfig":
        expect_model_type(d, where, MODEL_TYPE, "Qwen2.5-Omni", name_architectures=True)
        thinker = ThinkerConfig.from_dict(config_field(d, "thinker_config", where), "thinker_config")
        audio_out = d.get("enable_audio_output", True)
        talker = TalkerConfig.from_dict(config_field(d, "talker_config", where)) if audio_out else None
        if talker is not None and talker.decoder.embedding_size != thinker.text.hidden_size:
            raise ConfigError(f"talker_config.embedding_size {talker.decoder.embedding_size} != thinker hidden_size "
                              f"{thinker.text.hidden_size}")
        token2wav = d.get("token2wav_config") if audio_out else None
        return cls(thinker=thinker, talker=talker, token2wav=token2wav, raw=d)

    @classmethod
    def from_file(cls, path: str | Path) -> "OmniConfig":
        return load_config_file(path, cls.from_dict)
