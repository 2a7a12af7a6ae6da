"""Moshi language-model config: the checkpoint's config.json, or the 7B preset.

A Kyutai config.json is the LM's constructor kwargs plus a few file names
(``moshi_name``, ``mimi_name``, ``tokenizer_name``, ``mimi_config_name``),
``model_type`` and ``lm_gen_config`` (the generation defaults).  A key that
is missing takes the reference's default, exactly as the reference would read
the file; a value our modules do not implement (conditioners, LoRA, a second
text stream, layer scale, ...) is refused with a :class:`ConfigError` naming
the field, never silently ignored.  The published moshiko/moshika repos have
no config.json: :data:`MOSHI_7B` is their config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checkpoint import ConfigError

MODEL_TYPE = "moshi"
# File names in the published repos (kyutai/moshiko-pytorch-bf16, moshika-...).
MOSHI_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"


@dataclass(frozen=True)
class MoshiSampling:
    """How tokens are chosen each frame; a temperature <= 0 (or ``greedy``) takes the argmax,
    a top-k of 0 samples from the whole distribution (as the reference)."""

    greedy: bool = False
    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250

    def __post_init__(self):
        for name in ("text_top_k", "audio_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class MoshiConfig:
    # temporal transformer (one step per 80 ms frame)
    dim: int
    text_card: int  # text vocabulary; id text_card is the initial token
    n_q: int  # audio codebooks in the input: Moshi's dep_q + the user's n_q - dep_q
    dep_q: int  # codebooks the depformer generates (Moshi's voice)
    card: int  # audio codebook size; id card is the initial token
    num_heads: int
    num_layers: int
    hidden_scale: float
    context: int  # frames the temporal attention sees (ring KV cache capacity)
    delays: tuple[int, ...]  # per stream: text, Moshi's dep_q codebooks, the user's
    max_period: float = 10_000.0
    gating: str = "silu"
    norm: str = "rms_norm_f32"
    existing_text_padding_id: int = 3  # text "pad": Moshi is not saying a word this frame
    existing_text_end_padding_id: int = 0  # "end of padding": a word starts next frame
    # depth transformer (dep_q steps inside each frame)
    depformer_dim: int = 1024
    depformer_dim_feedforward: int | None = None  # None: hidden_scale * depformer_dim
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    depformer_multi_linear: bool = True  # one input projection per step (else one shared)
    depformer_weights_per_step: bool = True  # each layer holds dep_q weight sets (required)
    depformer_pos_emb: str = "none"
    depformer_context: int | None = None  # read but unused: the reference attends over the dep_q steps
    # checkpoint files and kind
    model_type: str = MODEL_TYPE
    moshi_name: str = MOSHI_NAME
    mimi_name: str = MIMI_NAME
    tokenizer_name: str = TOKENIZER_NAME
    mimi_config_name: str | None = None
    sampling: MoshiSampling = MoshiSampling()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        def bad(name: str, why: str):
            raise ConfigError(f"Moshi config: field '{name}' {why}")

        for name in ("dim", "text_card", "dep_q", "card", "num_heads", "num_layers", "context",
                     "depformer_dim", "depformer_num_heads", "depformer_num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                bad(name, f"is {value!r}, expected a positive integer")
        if not self.dep_q <= self.n_q:
            bad("n_q", f"is {self.n_q}, fewer than dep_q = {self.dep_q} (the user's codebooks are n_q - dep_q)")
        if len(self.delays) != self.n_q + 1 or any(d < 0 for d in self.delays):
            bad("delays", f"is {list(self.delays)}, expected {self.n_q + 1} values >= 0 (text + n_q codebooks)")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            bad("num_heads", f"is {self.num_heads}: dim {self.dim} must split into heads of even width (RoPE)")
        if self.depformer_dim % self.depformer_num_heads:
            bad("depformer_num_heads", f"is {self.depformer_num_heads}, not a divisor of depformer_dim "
                                       f"{self.depformer_dim}")
        if self.gating != "silu":
            bad("gating", f"is {self.gating!r}; only the gated SiLU FFN ('silu') is supported")
        if self.norm not in ("rms_norm_f32", "rms_norm"):
            bad("norm", f"is {self.norm!r}; only 'rms_norm_f32' and 'rms_norm' are supported")
        if not self.depformer_weights_per_step:
            # the reference sizes the depformer's streaming cache from it and cannot stream without
            bad("depformer_weights_per_step", "is false; only per-step depformer weights are supported")
        if self.depformer_pos_emb != "none":
            bad("depformer_pos_emb", f"is {self.depformer_pos_emb!r}; only 'none' is supported")
        if self.model_type != MODEL_TYPE:
            bad("model_type", f"is {self.model_type!r}; only '{MODEL_TYPE}' is supported")
        if not self.max_period > 0:
            bad("max_period", f"is {self.max_period}, expected > 0")
        for name in ("existing_text_padding_id", "existing_text_end_padding_id"):
            if not 0 <= getattr(self, name) < self.text_card:
                bad(name, f"is {getattr(self, name)}, outside the text vocabulary (0..{self.text_card - 1})")

    # ------------------------------------------------------------ derived sizes

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def ffn_hidden(self) -> int:
        return _gated_hidden(self.dim, int(self.hidden_scale * self.dim))

    @property
    def depformer_head_dim(self) -> int:
        return self.depformer_dim // self.depformer_num_heads

    @property
    def depformer_ffn_hidden(self) -> int:
        ff = self.depformer_dim_feedforward
        return _gated_hidden(self.depformer_dim, int(self.hidden_scale * self.depformer_dim) if ff is None else ff)

    @property
    def depformer_in_count(self) -> int:
        return self.dep_q if self.depformer_multi_linear else 1

    @property
    def user_codebooks(self) -> int:
        return self.n_q - self.dep_q

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def text_initial_id(self) -> int:
        return self.text_card

    @property
    def audio_initial_id(self) -> int:
        return self.card

    def is_text_padding(self, token: int) -> bool:
        """Whether a text token is padding (no word: "pad" or "end of padding"), not text to show."""
        return token in (self.existing_text_padding_id, self.existing_text_end_padding_id)

    @property
    def norm_eps(self) -> float:
        return 1e-8 if self.norm == "rms_norm_f32" else 1e-5

    # ------------------------------------------------------------ files

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "MoshiConfig":
        """Read a Kyutai config.json (LM kwargs + file names + lm_gen_config)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(d).__name__}")
        rest = dict(d)
        take = rest.pop

        def refuse(key: str, why: str):
            raise ConfigError(f"{where}: field '{key}' {why}")

        def number(key: str, default=None, kind=int):
            value = take(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                refuse(key, f"is {value!r}, expected a number")
            return kind(value)

        # Values that change the architecture into something we do not implement.
        for key, ok, why in _UNSUPPORTED:
            if key in rest and not ok(rest[key]):
                refuse(key, f"is {rest[key]!r}: {why} (not supported)")
            rest.pop(key, None)
        for key in ("tts_config", "stt_config"):
            if take(key, None):
                refuse(key, "is set: text-to-speech / speech-to-text variants are not supported")
        for key in _IGNORED:
            rest.pop(key, None)
        for key, why in (("num_layers", "is missing"), ("depformer_num_heads", "is missing"),
                         ("context", "is missing: streaming needs a finite attention context")):
            if rest.get(key) is None:
                refuse(key, why)
        num_layers = rest["num_layers"]
        if isinstance(rest.get("depformer_dim_feedforward"), list):
            refuse("depformer_dim_feedforward", "is a list: per-step FFN widths are not supported")
        dim_ff = None if rest.get("depformer_dim_feedforward") is None else number("depformer_dim_feedforward")
        rest.pop("depformer_dim_feedforward", None)
        sampling = _sampling(take("lm_gen_config", None) or {}, where)
        delays = take("delays", [0])
        if not isinstance(delays, list) or not all(isinstance(x, int) for x in delays):
            refuse("delays", f"is {delays!r}, expected a list of integers")
        gating = take("gating", "none")
        try:
            cfg = cls(
                dim=number("dim", 128),
                text_card=number("text_card", 32000),
                n_q=number("n_q", 8),
                dep_q=number("dep_q", 8),
                card=number("card", 1024),
                num_heads=number("num_heads", 8),
                num_layers=number("num_layers", num_layers),
                hidden_scale=number("hidden_scale", 4, float),
                context=number("context"),
                delays=tuple(delays),
                max_period=number("max_period", 10_000, float),
                gating=gating,
                norm=take("norm", "layer_norm"),
                existing_text_padding_id=number("existing_text_padding_id", 3),
                existing_text_end_padding_id=number("existing_text_end_padding_id", 0),
                depformer_dim=number("depformer_dim", 256),
                depformer_dim_feedforward=dim_ff,
                depformer_num_heads=number("depformer_num_heads"),
                depformer_num_layers=number("depformer_num_layers", num_layers),
                depformer_multi_linear=bool(take("depformer_multi_linear", False)),
                depformer_weights_per_step=bool(take("depformer_weights_per_step", False)),
                depformer_pos_emb=take("depformer_pos_emb", "sin"),
                depformer_context=take("depformer_context", None),
                model_type=take("model_type", MODEL_TYPE),
                moshi_name=take("moshi_name", MOSHI_NAME),
                mimi_name=take("mimi_name", MIMI_NAME),
                tokenizer_name=take("tokenizer_name", TOKENIZER_NAME),
                mimi_config_name=take("mimi_config_name", None),
                sampling=sampling,
                raw=dict(d),
            )
        except ConfigError as e:
            prefix = "Moshi config: "  # a value out of range, named by __post_init__: say which file
            if not str(e).startswith(prefix):
                raise
            raise ConfigError(f"{where}: {str(e)[len(prefix):]}") from None
        # The depformer inherits gating from the temporal transformer unless it names its own.
        dep_gating = take("depformer_gating", gating)
        if dep_gating != "silu":
            refuse("depformer_gating", f"is {dep_gating!r}; only 'silu' is supported")
        if rest:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(rest))} (not supported)")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "MoshiConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read ({e})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def for_checkpoint(cls, root: str | Path) -> "MoshiConfig":
        """The checkpoint directory's config.json, or the 7B preset when it has none (published repos)."""
        path = Path(root) / "config.json"
        return cls.from_file(path) if path.is_file() else MOSHI_7B

    def to_dict(self) -> dict[str, Any]:
        """config.json form: the reference's LM kwargs + file names + lm_gen_config."""
        d = asdict(self)
        for key in ("raw", "sampling"):
            d.pop(key)
        d["delays"] = list(self.delays)
        d.update(causal=True, positional_embedding="rope", layer_scale=None, depformer_gating=self.gating,
                 depformer_layer_scale=None)
        if d["mimi_config_name"] is None:
            d.pop("mimi_config_name")
        s = self.sampling
        d["lm_gen_config"] = {"use_sampling": not s.greedy, "temp": s.audio_temperature,
                              "temp_text": s.text_temperature, "top_k": s.audio_top_k, "top_k_text": s.text_top_k}
        return d

    def lm_kwargs(self) -> dict[str, Any]:
        """Only the LM constructor kwargs (what the reference's get_moshi_lm takes)."""
        d = self.to_dict()
        for key in ("model_type", "moshi_name", "mimi_name", "tokenizer_name", "mimi_config_name", "lm_gen_config"):
            d.pop(key, None)
        return d


def _gated_hidden(dim: int, dim_feedforward: int) -> int:
    # The reference's gated FFN keeps ~the parameter count of a plain FFN of width
    # dim_feedforward: 21/8 * dim for the classic 4 * dim, else 2/3 of it.
    return (21 * dim) // 8 if dim_feedforward == 4 * dim else (2 * dim_feedforward) // 3


def _sampling(gen: dict, where: str) -> MoshiSampling:
    if not isinstance(gen, dict):
        raise ConfigError(f"{where}: field 'lm_gen_config' is {type(gen).__name__}, expected an object")
    if float(gen.get("cfg_coef", 1.0)) != 1.0:
        raise ConfigError(f"{where}: field 'lm_gen_config.cfg_coef' is {gen['cfg_coef']}: "
                          f"classifier-free guidance is not supported")
    d = MoshiSampling()
    try:
        return MoshiSampling(greedy=not bool(gen.get("use_sampling", True)),
                             text_temperature=float(gen.get("temp_text", d.text_temperature)),
                             text_top_k=int(gen.get("top_k_text", d.text_top_k)),
                             audio_temperature=float(gen.get("temp", d.audio_temperature)),
                             audio_top_k=int(gen.get("top_k", d.audio_top_k)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: field 'lm_gen_config': {e}") from None


# (key, accepted value?, what the value would mean) for LM kwargs we only accept at their plain value.
_UNSUPPORTED = (
    ("conditioners", lambda v: not v, "a conditioned model"),
    ("fuser", lambda v: v is None, "a conditioned model"),
    ("lora", lambda v: not v, "LoRA adapters"),
    ("lora_name", lambda v: not v, "LoRA adapters"),
    ("quantize", lambda v: not v, "an int8-quantized model"),
    ("demux_second_text_stream", lambda v: not v, "a second text stream"),
    ("demux_second_stream", lambda v: not v, "a second text stream"),
    ("text_card_out", lambda v: v is None, "a text output vocabulary apart from the input one"),
    ("depformer_weights_per_step_schedule", lambda v: v is None, "depformer weights shared between steps"),
    ("depformer_low_rank_embeddings", lambda v: v is None, "low-rank depformer embeddings"),
    ("depformer_norm", lambda v: v is None, "per-step depformer output norms"),
    ("norm_emb", lambda v: not v, "normalised embeddings"),
    ("bias_proj", lambda v: not v, "biased output heads"),
    ("extra_heads_num_heads", lambda v: not v, "extra output heads"),
    ("cross_attention", lambda v: not v, "cross-attention"),
    ("causal", lambda v: v is True, "non-causal attention"),
    ("positional_embedding", lambda v: v == "rope", "a positional embedding other than RoPE"),
    ("layer_scale", lambda v: v is None, "layer scale"),
    ("depformer_layer_scale", lambda v: v is None, "layer scale in the depformer"),
    ("kv_repeat", lambda v: v == 1, "grouped-query attention"),
    ("depformer_kv_repeat", lambda v: v == 1, "grouped-query attention in the depformer"),
)
# Keys that do not change inference: training switches, and values the reference itself ignores.
_IGNORED = ("gradient_checkpointing", "depformer_causal", "depformer_max_period", "extra_heads_dim", "model_id")


MOSHI_7B = MoshiConfig(
    # Published moshiko/moshika 7B (the reference loader's built-in kwargs; FACTS.md).
    dim=4096, text_card=32000, n_q=16, dep_q=8, card=2048, num_heads=32, num_layers=32, hidden_scale=4.125,
    context=3000, max_period=10_000.0, gating="silu", norm="rms_norm_f32",
    existing_text_padding_id=3, existing_text_end_padding_id=0,
    depformer_dim=1024, depformer_dim_feedforward=int(4.125 * 1024), depformer_num_heads=16, depformer_num_layers=6,
    depformer_multi_linear=True, depformer_weights_per_step=True, depformer_pos_emb="none", depformer_context=8,
    delays=(0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1),
)

# The built-in demo model: the 7B's structure (streams, delays, per-step depformer
# weights, Mimi's 2048-entry codebooks) at toy width, so one frame costs a few ms
# on a laptop CPU.  Its text vocabulary is small: the demo's tokenizer must have
# at most text_card pieces.  Random weights: its output is noise.
DEMO = replace(
    MOSHI_7B,
    dim=64, text_card=1000, num_heads=4, num_layers=2, context=250,
    depformer_dim=32, depformer_dim_feedforward=int(4.125 * 32), depformer_num_heads=2, depformer_num_layers=1,
)

PRESETS = {"moshi_7b": MOSHI_7B, "demo": DEMO}
