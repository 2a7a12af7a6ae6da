"""The Whisper encoder layer both Qwen audio towers stack (Qwen2.5-Omni's encoder, Qwen3-Omni's AuT).

How each tower cuts the mel frames, convolves and windows them is its own (its family's
``audio_encoder.py``); the transformer layer in between is Whisper's in both.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .layers import WindowAttention


class WhisperEncoderLayer(nn.Module):
    """Pre-norm layer: layer norm, attention inside each window, residual; layer norm, fc1,
    ``act``, fc2, residual.  ``key_bias``: Whisper's k_proj has none (Qwen2.5-Omni keeps that),
    Qwen3-Omni's AuT has one.  Parameter names are the checkpoints'."""

    def __init__(self, d_model: int, num_heads: int, ffn_dim: int,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.gelu, key_bias: bool = False):
        super().__init__()
        self.act = act
        self.self_attn = WindowAttention(d_model, num_heads, key_bias=key_bias)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [windows, T, d_model] -> the same shape."""
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as the reference: keep fp16 activations finite
            lim = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-lim, lim)
        return x


__all__ = ["WhisperEncoderLayer"]
