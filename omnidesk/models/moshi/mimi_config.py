"""Mimi's config: the codec's sizes (SEANet, transformers, split RVQ), read from and written to the
reference's layout (Kyutai's ``loaders.get_mimi`` kwargs) with every unsupported value a ConfigError,
and the two presets: the published Mimi (:data:`MIMI`) and the toy demo codec (:data:`DEMO`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import ConfigError
from .quantizer import QuantizerConfig
from .seanet import SEANetConfig


@dataclass(frozen=True)
class MimiTransformerConfig:
    """The causal transformer on each side of the quantizer (Kyutai's ``transformer`` kwargs)."""

    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    layer_scale: float | None = 0.01
    context: int = 250  # steps (at 25 Hz: 10 s) each step attends to; the KV ring's capacity
    max_period: float = 10_000.0  # RoPE
    input_dimension: int = 512  # a projection to/from d_model exists only when these differ from it
    output_dimension: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24_000
    frame_rate: float = 12.5
    channels: int = 1
    seanet: SEANetConfig = SEANetConfig()
    transformer: MimiTransformerConfig = MimiTransformerConfig()
    quantizer: QuantizerConfig = QuantizerConfig()
    # Codebooks encode() returns: a runtime choice, not a weight shape (Moshi uses 8 of the 32).
    num_codebooks: int = 8

    def __post_init__(self):
        q, t, s = self.quantizer, self.transformer, self.seanet
        if self.channels != 1 or s.channels != 1:
            raise ConfigError(f"mimi config: only mono audio is supported (channels {self.channels})")
        if self.sample_rate % self.frame_rate:
            raise ConfigError(f"mimi config: sample_rate {self.sample_rate} is not a whole number of "
                              f"frames at frame_rate {self.frame_rate}")
        if self.frame_size % s.hop_length:
            raise ConfigError(f"mimi config: frame size {self.frame_size} is not a multiple of the SEANet hop "
                              f"{s.hop_length} (ratios {list(s.ratios)})")
        if t.d_model % t.num_heads or t.head_dim % 2:
            raise ConfigError(f"mimi config: transformer d_model {t.d_model} must split into {t.num_heads} heads "
                              f"of even width")
        for name, dim in (("transformer.input_dimension", t.input_dimension),
                          ("transformer.output_dimensions", t.output_dimension),
                          ("quantizer.input_dimension", q.input_dimension),
                          ("quantizer.output_dimension", q.output_dimension)):
            if dim != s.dimension:
                raise ConfigError(f"mimi config: {name} {dim} differs from seanet.dimension {s.dimension}")
        if not q.n_q_semantic < q.n_q:
            raise ConfigError(f"mimi config: quantizer n_q {q.n_q} must exceed n_q_semantic {q.n_q_semantic}")
        if not q.n_q_semantic <= self.num_codebooks <= q.n_q:
            raise ConfigError(f"mimi config: num_codebooks {self.num_codebooks} must be in "
                              f"[{q.n_q_semantic}, {q.n_q}]")
        if t.context < 1:
            raise ConfigError(f"mimi config: transformer context must be >= 1, got {t.context}")

    @property
    def frame_size(self) -> int:
        """Samples per frame (1920 = 80 ms at 24 kHz)."""
        return int(self.sample_rate / self.frame_rate)

    @property
    def steps_per_frame(self) -> int:
        """Latent (transformer) steps per frame: the stride of the conv down/upsampling (2 for Mimi)."""
        return self.frame_size // self.seanet.hop_length

    @classmethod
    def from_dict(cls, d: dict, where: str = "mimi config", num_codebooks: int = 8) -> "MimiConfig":
        """Read a mimi config as Kyutai's ``loaders.get_mimi`` does (``sample_rate``, ``channels``,
        ``frame_rate`` and the ``seanet`` / ``transformer`` / ``quantizer`` kwargs).

        A missing key takes the reference constructor's default, as the reference would; a value
        our modules do not implement, or a key the reference does not know, is a ConfigError.
        """
        top = _Keys(d, where)
        sample_rate, channels, frame_rate = top.need("sample_rate"), top.need("channels"), top.need("frame_rate")
        sd = _Keys(top.section("seanet"), f"{where}: seanet")
        td = _Keys(top.section("transformer"), f"{where}: transformer")
        qd = _Keys(top.section("quantizer"), f"{where}: quantizer")
        top.done()

        s_kw = dict(channels=sd.get("channels", 1), dimension=sd.get("dimension", 128),
                    n_filters=sd.get("n_filters", 32), n_residual_layers=sd.get("n_residual_layers", 3),
                    ratios=tuple(sd.get("ratios", [8, 5, 4, 2])), kernel_size=sd.get("kernel_size", 7),
                    last_kernel_size=sd.get("last_kernel_size", 7),
                    residual_kernel_size=sd.get("residual_kernel_size", 3),
                    dilation_base=sd.get("dilation_base", 2), compress=sd.get("compress", 2),
                    elu_alpha=float(sd.get("activation_params", {"alpha": 1.0}).get("alpha", 1.0)))
        sd.require("causal", False, lambda v: v is True, "non-causal convolutions")
        s_kw["pad_mode"] = sd.require("pad_mode", "reflect", lambda v: v in ("constant", "replicate"),
                                      "this pad_mode")
        sd.require("activation", "ELU", lambda v: v == "ELU", "an activation other than ELU")
        sd.require("norm", "none", lambda v: v == "none", "convolution norms (weights must be pre-folded)")
        sd.require("true_skip", True, lambda v: v is True, "convolutional skip connections")
        sd.require("final_activation", None, lambda v: v is None, "a final activation")
        sd.require("trim_right_ratio", 1.0, lambda v: v == 1.0, "trim_right_ratio other than 1")
        sd.require("mask_fn", None, lambda v: v is None, "mask_fn")
        sd.ignore("disable_norm_outer_blocks", "norm_params", "mask_position", "final_activation_params")
        sd.done()

        outs = td.need("output_dimensions")
        if not isinstance(outs, (list, tuple)) or len(outs) != 1:
            raise ConfigError(f"{where}: transformer: output_dimensions must hold one dimension, got {outs!r}")
        t_kw = dict(d_model=td.need("d_model"), num_heads=td.need("num_heads"), num_layers=td.need("num_layers"),
                    dim_feedforward=td.get("dim_feedforward", 2048), layer_scale=td.get("layer_scale", None),
                    context=td.require("context", None, lambda v: isinstance(v, int), "an unbounded context"),
                    max_period=float(td.get("max_period", 10_000)), input_dimension=td.need("input_dimension"),
                    output_dimension=outs[0])
        td.require("causal", False, lambda v: v is True, "a non-causal transformer")
        td.require("conv_layout", False, lambda v: v is True, "conv_layout false (Mimi feeds [B, C, T])")
        td.require("positional_embedding", "sin", lambda v: v == "rope", "positional embeddings other than rope")
        td.require("norm", "layer_norm", lambda v: v == "layer_norm", "norms other than layer_norm")
        td.require("gating", "none", lambda v: v == "none", "a gated feed-forward")
        td.require("kv_repeat", 1, lambda v: v == 1, "grouped-query attention")
        td.require("weights_per_step", 0, lambda v: not v, "weights per step")
        td.require("cross_attention", False, lambda v: not v, "cross attention")
        td.require("skip_self_attn", False, lambda v: not v, "skip_self_attn")
        td.ignore("positional_scale", "betas", "checkpointing", "quantize")  # no effect with rope / at inference
        td.done()

        dim = qd.get("dimension", 128)
        q_kw = dict(dimension=dim, n_q=qd.get("n_q", 8), bins=qd.get("bins", 1024),
                    n_q_semantic=qd.get("n_q_semantic", 1), input_dimension=qd.get("input_dimension") or dim,
                    output_dimension=qd.get("output_dimension") or dim)
        # training-only knobs of the RVQ (dropout, EMA decay, dead-code replacement)
        qd.ignore("q_dropout", "no_quantization_rate", "decay", "threshold_usage_ratio", "replaced_usage_ratio")
        qd.done()
        try:
            return cls(sample_rate=int(sample_rate), channels=int(channels), frame_rate=float(frame_rate),
                       seanet=SEANetConfig(**s_kw), transformer=MimiTransformerConfig(**t_kw),
                       quantizer=QuantizerConfig(**q_kw),
                       num_codebooks=min(num_codebooks, q_kw["n_q"]))
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """This config in the reference's layout (what :meth:`from_dict` and ``get_mimi`` read)."""
        s, t, q = self.seanet, self.transformer, self.quantizer
        seanet = dict(channels=s.channels, dimension=s.dimension, causal=True, n_filters=s.n_filters,
                      n_residual_layers=s.n_residual_layers, activation="ELU",
                      activation_params={"alpha": s.elu_alpha}, compress=s.compress, dilation_base=s.dilation_base,
                      disable_norm_outer_blocks=0, kernel_size=s.kernel_size,
                      residual_kernel_size=s.residual_kernel_size, last_kernel_size=s.last_kernel_size,
                      norm="none", pad_mode=s.pad_mode, ratios=list(s.ratios), true_skip=True)
        transformer = dict(d_model=t.d_model, num_heads=t.num_heads, num_layers=t.num_layers, causal=True,
                           layer_scale=t.layer_scale, context=t.context, conv_layout=True, max_period=t.max_period,
                           gating="none", norm="layer_norm", positional_embedding="rope",
                           dim_feedforward=t.dim_feedforward, input_dimension=t.input_dimension,
                           output_dimensions=[t.output_dimension])
        quantizer = dict(dimension=q.dimension, n_q=q.n_q, bins=q.bins, input_dimension=q.input_dimension,
                         output_dimension=q.output_dimension)
        if q.n_q_semantic != 1:
            quantizer["n_q_semantic"] = q.n_q_semantic
        return dict(sample_rate=self.sample_rate, channels=self.channels, frame_rate=self.frame_rate,
                    seanet=seanet, transformer=transformer, quantizer=quantizer)


class _Keys:
    """Reads one section of a config dict, tracking which keys were used (unknown keys are errors)."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, found {type(d).__name__}")
        self.d, self.where, self.seen = d, where, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.d.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.d:
            raise ConfigError(f"{self.where}: missing field '{key}'")
        return self.get(key)

    def section(self, key: str) -> dict:
        return self.need(key)

    def require(self, key: str, default: Any, ok, what: str) -> Any:
        value = self.get(key, default)
        if not ok(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not supported ({what})")
        return value

    def ignore(self, *keys: str) -> None:
        self.seen.update(keys)

    def done(self) -> None:
        unknown = sorted(set(self.d) - self.seen)
        if unknown:
            raise ConfigError(f"{self.where}: unknown field(s) {', '.join(map(repr, unknown))}")


# The published Mimi (kyutai/moshiko-pytorch-bf16 and the other Moshi repos; the reference's built-in config).
MIMI = MimiConfig()

# The built-in demo codec: Mimi's structure (24 kHz, 1920-sample frames, SEANet ratios 8,6,5,4,
# transformers with the 250-step ring, split RVQ of 2048-entry codebooks: the LM's card) at toy
# width: 0.41 M numbers (1.6 MB in fp32), two thirds of them codebooks.  A frame is ~160 small ops
# each way, so it costs what eager PyTorch costs per op: measured 2.4-4.5 ms to encode and as much
# to decode (p50, one intra-op thread, on the shared 2-core dev VM; `python tests/test_mimi.py`),
# which leaves most of the 20 ms duplex step to the LM.  Random weights: its output is noise.
DEMO = MimiConfig(
    seanet=SEANetConfig(dimension=32, n_filters=4, n_residual_layers=1),
    transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=1, dim_feedforward=64, context=250,
                                      input_dimension=32, output_dimension=32),
    quantizer=QuantizerConfig(dimension=16, n_q=8, bins=2048, input_dimension=32, output_dimension=32),
    num_codebooks=8,
)

PRESETS = {"mimi": MIMI, "demo": DEMO}
