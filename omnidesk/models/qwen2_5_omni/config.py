"""Config dataclasses read from a Qwen2.5-Omni checkpoint's config.json.

Only what our modules need is kept; everything comes from the file (no token
id, rate or size is written in code).  Both spellings of the rotary settings
are accepted: the hub files (``rope_theta`` + ``rope_scaling.mrope_section``)
and what current transformers writes (``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import ConfigError, config_field, load_config_file

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
class DecoderConfig:
    """A Qwen2-style decoder (the thinker's LLM and the talker share it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    embedding_size: int  # width of embed_tokens (the talker's codec embedding lives in thinker space)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = "
                              f"{self.head_dim // 2}")

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
        return cls(
            num_mel_bins=int(config_field(d, "num_mel_bins", where)),
            d_model=int(config_field(d, "d_model", where)),
            num_layers=int(config_field(d, "encoder_layers", where)),
            num_heads=int(config_field(d, "encoder_attention_heads", where)),
            ffn_dim=int(config_field(d, "encoder_ffn_dim", where)),
            max_source_positions=int(config_field(d, "max_source_positions", where)),
            n_window=int(config_field(d, "n_window", where)),
            output_dim=int(config_field(d, "output_dim", where)),
        )


@dataclass(frozen=True)
class ThinkerConfig:
    text: DecoderConfig
    audio: AudioEncoderConfig
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    tie_word_embeddings: bool
    position_id_per_seconds: int
    seconds_per_chunk: int

    @classmethod
    def from_dict(cls, d: dict, where: str = "thinker_config") -> "ThinkerConfig":
        text = DecoderConfig.from_dict(config_field(d, "text_config", where), f"{where}.text_config")
        audio = AudioEncoderConfig.from_dict(config_field(d, "audio_config", where), f"{where}.audio_config")
        if audio.output_dim != text.hidden_size:
            raise ConfigError(f"{where}.audio_config.output_dim {audio.output_dim} != text hidden_size {text.hidden_size}")
        tie = d.get("tie_word_embeddings")
        if tie is None:
            tie = d["text_config"].get("tie_word_embeddings", False)
        return cls(
            text=text,
            audio=audio,
            audio_token_id=int(config_field(d, "audio_token_index", where)),
            audio_start_token_id=int(config_field(d, "audio_start_token_id", where)),
            audio_end_token_id=int(config_field(d, "audio_end_token_id", where)),
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
        return cls(
            decoder=DecoderConfig.from_dict(d, where),
            codec_bos_id=int(config_field(d, "tts_codec_start_token_id", where)),
            codec_eos_id=int(config_field(d, "tts_codec_end_token_id", where)),
            codec_pad_id=int(config_field(d, "tts_codec_pad_token_id", where)),
            codec_mask_id=int(config_field(d, "tts_codec_mask_token_id", where)),
            text_bos_id=int(config_field(d, "tts_text_start_token_id", where)),
            text_eos_id=int(config_field(d, "tts_text_end_token_id", where)),
            text_pad_id=int(config_field(d, "tts_text_pad_token_id", where)),
        )

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
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            what = model_type or "no model_type"
            arch = d.get("architectures")
            raise ConfigError(f"{where}: not a Qwen2.5-Omni checkpoint (model_type is '{what}'"
                              f"{', architectures ' + str(arch) if arch else ''}; expected '{MODEL_TYPE}')")
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
