"""Config dataclasses read from a Qwen3-Omni checkpoint's config.json.

Every id and size comes from the file: transformers' class defaults differ from
the published checkpoint (accept_hidden_layer 18 vs 24, num_code_groups 32 vs
16, codec ids 4196+ vs 2148+), so nothing here has a default that could stand
in for a missing field.  Each stage's own sizes are read by its module
(:mod:`.decoder`, :mod:`.audio_encoder`, :mod:`.code2wav`); this file ties them
together with the token ids that connect the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import ConfigError, config_field, expect_model_type, load_config_file
from ..omni_checkpoint import ThinkerConfigBase, read_thinker_parts
from .audio_encoder import AudioEncoderConfig
from .code2wav import Code2WavConfig
from .decoder import DecoderConfig

MODEL_TYPE = "qwen3_omni_moe"


def _id(d: dict, key: str, where: str) -> int:
    v = config_field(d, key, where)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"{where}.{key}: expected a token id (non-negative integer), got {v!r}")
    return v


@dataclass(frozen=True)
class ThinkerConfig(ThinkerConfigBase):
    """``text``: a :class:`DecoderConfig`, ``audio``: an :class:`AudioEncoderConfig`; no tied lm_head."""

    @classmethod
    def from_dict(cls, d: dict, where: str = "thinker_config") -> "ThinkerConfig":
        text, audio = read_thinker_parts(d, where, DecoderConfig, AudioEncoderConfig)
        if config_field(d, "tie_word_embeddings", where, False) or config_field(d["text_config"], "tie_word_embeddings", where, False):
            raise ConfigError(f"{where}: tie_word_embeddings is true; Qwen3-Omni's thinker has its own lm_head")
        return cls(text=text, audio=audio, audio_token_id=_id(d, "audio_token_id", where),
                   audio_start_token_id=_id(d, "audio_start_token_id", where))


@dataclass(frozen=True)
class TalkerConfig:
    text: DecoderConfig
    code_predictor: DecoderConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int  # which thinker hidden state (0 = embeddings) feeds audio positions
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speakers: dict[str, int]  # lower-case name -> codec id

    @property
    def voices(self) -> dict[str, int]:
        """Speaker name as people write it ("Ethan") -> codec id.  config.json keys are lower case; the
        reference's generate() takes "Ethan" and lower-cases it, and Qwen2.5-Omni's voices are
        capitalised, so a voice remembered from one family names the same speaker in the other."""
        return {name.capitalize(): codec for name, codec in self.speakers.items()}

    @classmethod
    def from_dict(cls, d: dict, where: str = "talker_config") -> "TalkerConfig":
        text = DecoderConfig.from_dict(config_field(d, "text_config", where), f"{where}.text_config")
        cp = DecoderConfig.from_dict(config_field(d, "code_predictor_config", where), f"{where}.code_predictor_config")
        speakers = config_field(d, "speaker_id", where)
        if not isinstance(speakers, dict) or not speakers:
            raise ConfigError(f"{where}.speaker_id: expected a non-empty {{name: codec id}} object, got {speakers!r}")
        groups = config_field(d, "num_code_groups", where)
        if not isinstance(groups, int) or groups < 2:
            raise ConfigError(f"{where}.num_code_groups: expected an integer >= 2, got {groups!r}")
        cfg = cls(text=text, code_predictor=cp, num_code_groups=groups,
                  thinker_hidden_size=int(config_field(d, "thinker_hidden_size", where)),
                  accept_hidden_layer=int(config_field(d, "accept_hidden_layer", where)),
                  codec_eos_id=_id(d, "codec_eos_token_id", where), codec_pad_id=_id(d, "codec_pad_id", where),
                  codec_bos_id=_id(d, "codec_bos_id", where), codec_nothink_id=_id(d, "codec_nothink_id", where),
                  codec_think_bos_id=_id(d, "codec_think_bos_id", where),
                  codec_think_eos_id=_id(d, "codec_think_eos_id", where),
                  speakers={str(k).lower(): _id(speakers, k, f"{where}.speaker_id") for k in speakers})
        for name, v in [("codec_eos_token_id", cfg.codec_eos_id), ("codec_pad_id", cfg.codec_pad_id),
                        ("codec_bos_id", cfg.codec_bos_id)] + [(f"speaker_id.{k}", v) for k, v in cfg.speakers.items()]:
            if v >= text.vocab_size:
                raise ConfigError(f"{where}.{name} {v} is outside the talker vocabulary ({text.vocab_size})")
        return cfg

    @property
    def suppressed_ids(self) -> tuple[int, ...]:
        """Codec ids the reference never samples: the top 1024 of the vocabulary (control ids),
        except end-of-speech (Qwen3OmniMoeForConditionalGeneration.generate)."""
        v = self.text.vocab_size
        return tuple(i for i in range(max(0, v - 1024), v) if i != self.codec_eos_id)


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig | None
    code2wav: Code2WavConfig | None
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    system_id: int
    user_id: int
    assistant_id: int
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Qwen3OmniConfig":
        expect_model_type(d, where, MODEL_TYPE, "Qwen3-Omni")
        thinker = ThinkerConfig.from_dict(config_field(d, "thinker_config", where))
        audio_out = bool(d.get("enable_audio_output", True))
        talker = TalkerConfig.from_dict(config_field(d, "talker_config", where)) if audio_out else None
        code2wav = Code2WavConfig.from_dict(config_field(d, "code2wav_config", where), "code2wav_config") if audio_out else None
        if talker is not None:
            if talker.thinker_hidden_size != thinker.text.hidden_size:
                raise ConfigError(f"talker_config.thinker_hidden_size {talker.thinker_hidden_size} != thinker "
                                  f"hidden_size {thinker.text.hidden_size}")
            if not 0 <= talker.accept_hidden_layer <= thinker.text.num_layers:
                raise ConfigError(f"talker_config.accept_hidden_layer {talker.accept_hidden_layer} is not a layer of "
                                  f"the thinker (0..{thinker.text.num_layers})")
            if code2wav is not None and code2wav.num_quantizers != talker.num_code_groups:
                raise ConfigError(f"code2wav_config.num_quantizers {code2wav.num_quantizers} != "
                                  f"talker_config.num_code_groups {talker.num_code_groups}")
        return cls(thinker=thinker, talker=talker, code2wav=code2wav,
                   im_start_id=_id(d, "im_start_token_id", where), im_end_id=_id(d, "im_end_token_id", where),
                   tts_pad_id=_id(d, "tts_pad_token_id", where), tts_bos_id=_id(d, "tts_bos_token_id", where),
                   tts_eos_id=_id(d, "tts_eos_token_id", where), system_id=_id(d, "system_token_id", where),
                   user_id=_id(d, "user_token_id", where), assistant_id=_id(d, "assistant_token_id", where), raw=d)

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen3OmniConfig":
        return load_config_file(path, cls.from_dict)
