"""Qwen2.5-Omni audio encoder (the thinker's ``audio_tower``): log-mel frames -> LLM-width tokens.

Parameter names equal the checkpoint's after removing ``thinker.audio_tower.``.

The mel frames are cut into blocks of ``2 * n_window`` frames (2 s; the last
block may be shorter) and every block is encoded on its own:

    conv1 (k3, p1) + gelu  ->  conv2 (k3, stride 2, p1) + gelu
    + sinusoidal positions counted from 0 in each block
    -> pre-norm transformer layers, attention restricted to the block
    (block-diagonal over the utterance)

then neighbouring frames are averaged in pairs over the concatenated sequence
and ``ln_post`` + ``proj`` map them to the LLM width.  For ``L`` frames the
encoder gives ``a = (L - 1) // 2 + 1`` frames after conv2 and
``(a - 2) // 2 + 1`` output tokens (:meth:`AudioEncoder.output_length`).

Incremental use: since blocks never see each other and ``n_window`` is even
(100 in the released model), pairs never straddle two blocks, so encoding every
finished full block with :meth:`AudioEncoder.encode_block` while the user
speaks, then the tail, and concatenating gives the tokens of encoding the whole
utterance with :meth:`AudioEncoder.forward` up to float rounding (each full block gives exactly
``2 * n_window / 4`` tokens).  Only the log-mel dynamic-range floor is global
(see ``features.py``).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..layers import sinusoid_table
from ..whisper_encoder import WhisperEncoderLayer
from .config import AudioEncoderConfig

__all__ = ["AudioEncoder"]


class AudioEncoder(nn.Module):
    """Log-mel ``[n_mels, L]`` -> audio tokens ``[output_length(L), output_dim]``.

    Guarantee for streaming: with ``B = 2 * n_window`` frames per block, encoding
    ``features[:, 0:B]``, ``features[:, B:2B]``, ... and finally the tail (fewer than
    ``B`` frames, possibly none) with :meth:`encode_block`, then concatenating,
    gives the same tokens as :meth:`forward` on the whole ``features``: the same
    arithmetic, up to float rounding only where a matmul over a different number
    of rows rounds differently (fp32 CPU tests: ≤ 1e-6 asserted, measured ≤ 2.4e-7,
    mostly bit-identical).  Each full block yields exactly ``B / 4`` tokens.
    Requires an even ``n_window`` (checked).

    Runs in whatever dtype/device the weights have (fp32, bf16, fp16); the
    features are cast to it.  ``audio_bos_eos_token`` is a checkpoint tensor that
    the encoder itself does not use.  The positional table is a non-persistent
    buffer: a loader that materialises the module from the meta device must call
    :meth:`reset_buffers`.
    """

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        if cfg.n_window <= 0 or cfg.n_window % 2:
            raise ValueError(f"n_window must be a positive even number, got {cfg.n_window}")
        if cfg.n_window > cfg.max_source_positions:
            raise ValueError(f"n_window {cfg.n_window} exceeds max_source_positions {cfg.max_source_positions}")
        self.cfg = cfg
        self.block_frames = 2 * cfg.n_window
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(WhisperEncoderLayer(d, cfg.num_heads, cfg.ffn_dim)
                                    for _ in range(cfg.num_layers))
        self.ln_post = nn.LayerNorm(d)
        self.proj = nn.Linear(d, cfg.output_dim)
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim)
        self.register_buffer("positional_embedding", sinusoid_table(cfg.max_source_positions, d), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the positional table (non-persistent) on the weights' device and dtype."""
        w = self.conv1.weight
        self.positional_embedding = sinusoid_table(self.cfg.max_source_positions, self.cfg.d_model).to(w.device, w.dtype)

    @staticmethod
    def output_length(num_frames: int) -> int:
        after_conv = (num_frames - 1) // 2 + 1
        return max((after_conv - 2) // 2 + 1, 0)

    def _check(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() != 2 or features.shape[0] != self.cfg.num_mel_bins:
            raise ValueError(f"features must be [{self.cfg.num_mel_bins}, frames], got {tuple(features.shape)}")
        return features.to(device=self.conv1.weight.device, dtype=self.conv1.weight.dtype)

    def _encode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: [n, n_mels, T] of equal length T <= 2*n_window -> [n, (T-1)//2+1, d_model]."""
        x = F.gelu(self.conv1(blocks))  # [n, d, T]
        # conv2 (k3, stride 2, zero pad 1) as one matmul over the 3-frame windows: the same sum as
        # the convolution, but a batched Conv1d may pick another algorithm than a single block's
        # (seen on CPU), so this keeps encode_block and forward closer (see the class docstring).
        n, d, _ = x.shape
        win = F.pad(x, (1, 1)).unfold(2, 3, 2)  # [n, d, (T-1)//2+1, 3]
        win = win.permute(0, 2, 1, 3).reshape(n, win.shape[2], d * 3)
        x = F.gelu(F.linear(win, self.conv2.weight.reshape(d, d * 3), self.conv2.bias))  # [n, T', d]
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """h: [a, d_model] after the layers -> pair-averaged, ln_post, proj: [a // 2, output_dim]."""
        pairs = h.shape[0] // 2
        h = h[: 2 * pairs].reshape(pairs, 2, h.shape[-1])  # a 1-frame tail has no pair: 0 tokens
        h = (h[:, 0] + h[:, 1]) / 2
        return self.proj(self.ln_post(h))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [n_mels, L] -> tokens [output_length(L), output_dim]."""
        x = self._check(features)
        n_mels, length = x.shape
        bsz = self.block_frames
        full, tail = divmod(length, bsz)
        parts = []
        if full:  # equal-length blocks run as one batch
            blocks = x[:, : full * bsz].reshape(n_mels, full, bsz).transpose(0, 1)
            parts.append(self._encode_blocks(blocks).reshape(-1, self.cfg.d_model))
        if tail:
            parts.append(self._encode_blocks(x[None, :, full * bsz:])[0])
        if not parts:
            return x.new_zeros(0, self.cfg.output_dim)
        return self._head(torch.cat(parts) if len(parts) > 1 else parts[0])

    def encode_block(self, features_block: torch.Tensor, *, first: bool = False) -> torch.Tensor:
        """Encode one block (a finished ``2 * n_window``-frame block or the final tail).

        ``first`` (whether the block starts the utterance) is part of the shared interface and
        changes nothing here: every block of this encoder is encoded the same way.

        Returns ``output_length(T)`` tokens; concatenating the blocks' tokens in order equals
        :meth:`forward` on the whole utterance (see the class docstring).
        """
        x = self._check(features_block)
        if x.shape[1] > self.block_frames:
            raise ValueError(f"a block has at most {self.block_frames} frames, got {x.shape[1]}")
        if x.shape[1] == 0:
            return x.new_zeros(0, self.cfg.output_dim)
        return self._head(self._encode_blocks(x[None])[0])
