"""The Qwen2.5-Omni modules as one model, and the decoder linears a checkpoint may store quantized.

Kept apart from the loader so that the memory estimate (:mod:`.memory`), which builds
this model on the meta device, and the loader, which asks the estimate first, do not
import each other.
"""

from __future__ import annotations

from torch import nn

from ..quant import FusedLinear, LinearPart
from .config import DecoderConfig, OmniConfig
from .talker import Talker
from .thinker import Thinker
from .vocoder import Token2Wav


class OmniModel(nn.Module):
    """Thinker + talker + vocoder; parameter names are ``thinker.*`` / ``talker.*`` / ``vocoder.*``."""

    def __init__(self, cfg: OmniConfig):
        super().__init__()
        self.cfg = cfg
        self.thinker = Thinker(cfg.thinker)
        self.talker = Talker(cfg.talker) if cfg.talker is not None else None
        self.vocoder = Token2Wav(cfg.token2wav) if cfg.talker is not None else None


def decoder_linears(ckpt: str, ours: str, cfg: DecoderConfig) -> list[FusedLinear]:
    """The decoder's linears, each with the checkpoint linears fused into it: q/k/v -> ``wqkv``,
    gate/up -> ``w13`` (row ranges along the output dimension), o_proj and down_proj alone."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    out = []
    for i in range(cfg.num_layers):
        c, o = f"{ckpt}.layers.{i}", f"{ours}.layers.{i}"
        out += [
            FusedLinear(f"{o}.self_attn.wqkv", h, (LinearPart(f"{c}.self_attn.q_proj", 0, q),
                                                  LinearPart(f"{c}.self_attn.k_proj", q, q + kv),
                                                  LinearPart(f"{c}.self_attn.v_proj", q + kv, q + 2 * kv))),
            FusedLinear(f"{o}.self_attn.o_proj", q, (LinearPart(f"{c}.self_attn.o_proj", 0, h),)),
            FusedLinear(f"{o}.mlp.w13", h, (LinearPart(f"{c}.mlp.gate_proj", 0, inter),
                                           LinearPart(f"{c}.mlp.up_proj", inter, 2 * inter))),
            FusedLinear(f"{o}.mlp.down_proj", inter, (LinearPart(f"{c}.mlp.down_proj", 0, h),)),
        ]
    return out


def quantizable_linears(cfg: OmniConfig, talker: bool = True) -> list[FusedLinear]:
    """The decoder linears a quantized checkpoint may store 4-bit (the thinker's; the talker's too when
    ``talker`` and the config has one); ``--quantize int8`` takes the thinker's."""
    out = decoder_linears("thinker.model", "thinker.decoder", cfg.thinker.text)
    if talker and cfg.talker is not None:
        out += decoder_linears("talker.model", "talker.decoder", cfg.talker.decoder)
    return out


__all__ = ["OmniModel", "decoder_linears", "quantizable_linears"]
