"""Qwen3-Omni AuT audio encoder (the thinker's ``audio_tower``): 128-bin log-mel -> thinker-width tokens.

Parameter names equal the checkpoint's after removing ``thinker.audio_tower.``.

What the reference (transformers' ``Qwen3OmniMoeAudioEncoder``) computes for one
utterance of ``L`` mel frames, with ``C = 2 * n_window`` (100 frames = 1 s):

1. **Conv chunks.**  The frames are cut into chunks of ``C`` frames, the last one
   possibly shorter.  Each chunk, as a one-channel image ``[mel, time]``, goes
   through three ``Conv2d(k3, stride 2, pad 1)`` + GELU on its own: a chunk of
   ``T`` frames gives ``f(T)`` frames, ``f`` = three times ``n -> (n - 1) // 2 + 1``
   (``f(100) = 13``).  The channels x remaining mel bins are flattened and
   ``conv_out`` maps them to ``d_model``; sinusoidal positions ``0 .. f(T) - 1``
   are added, restarting in every chunk.
2. **Padding of the last chunk.**  The reference zero-pads every chunk to the
   longest chunk of the call.  For one utterance of at least ``C`` frames the
   partial last chunk is therefore padded to ``C`` frames; for an utterance
   shorter than ``C`` it is not padded at all.  That is not neutral: a stride-2
   convolution over an even length reads one position past the end, which is a
   zero in the unpadded case but ``gelu(conv(0) + bias) != 0`` in the padded one,
   so the last token(s) of the partial chunk differ.  We reproduce both cases.
3. **Windowed attention.**  The valid tokens of all chunks are concatenated and
   run through pre-norm transformer layers whose attention is full inside
   windows of ``W = f(C) * (n_window_infer // C)`` tokens counted from the
   utterance's first token, and absent across windows (the last window holds
   the rest).  Published values: ``n_window_infer`` 800 -> 8 chunks -> ``W`` 104.
4. ``ln_post``, ``proj1``, activation, ``proj2`` per token -> ``output_dim``.

Incremental encoding (:meth:`AudioEncoder.encode_block`).  Frames interact only
inside a conv chunk (step 1) and inside an attention window (step 3).  Every full
chunk gives exactly ``f(C)`` tokens, so window ``k`` covers exactly the frames
``[k * B, (k + 1) * B)`` with ``B = C * (n_window_infer // C)``: a block of ``B``
frames is self-contained and encoding blocks of ``B`` frames one by one, then
the tail (fewer than ``B`` frames), gives the reference's tokens.  ``B`` is also
the smallest exact block: a block inside a window would have to attend to frames
not heard yet.  With the published config ``B`` = 800 frames = **8 s** of audio
(104 tokens), far more than the ~2 s of Qwen2.5-Omni; we keep the exact block.
While the user speaks, a block is encoded every 8 s; at the end of the turn the
tail (at most one window, <= 104 tokens) is encoded in one call.  Because of
step 2, the tail must know whether blocks of the same utterance came before it
(keyword ``first`` of :meth:`encode_block`).

Token count (:meth:`AudioEncoder.output_length`): ``(L // C) * f(C) + f(L % C)``,
13 tokens per second of audio with the published values (100 frames -> 13;
``position_id_per_seconds`` 13 in the thinker config agrees).  The reference's
``_get_feat_extract_output_lengths`` hard-codes the 13 (it is only right for
``f(2 * n_window) = 13``, i.e. ``n_window`` 49..52; the reference itself breaks
for other values); ours uses ``f(C)`` and equals it for the published 50.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ConfigError
from ..layers import sinusoid_table
from ..whisper_encoder import WhisperEncoderLayer

__all__ = ["AudioEncoderConfig", "AudioEncoder", "conv_frames"]

# activation_function values we implement (transformers' ACT2FN names).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

_INT_FIELDS = ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
               "max_source_positions", "n_window", "n_window_infer", "conv_chunksize",
               "downsample_hidden_size", "output_dim")


def conv_frames(n: int) -> int:
    """Frames left of ``n`` after the three stride-2 convolutions (k3, pad 1); ``conv_frames(0) == 0``."""
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


@dataclass(frozen=True)
class AudioEncoderConfig:
    """``thinker_config.audio_config`` as config.json spells it (every field required)."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    activation_function: str  # FFN and proj1->proj2 activation; the convolutions always use exact GELU
    max_source_positions: int  # size of the reference's position table: must cover one chunk
    n_window: int  # half a conv chunk, in mel frames
    n_window_infer: int  # attention window, in mel frames (rounded down to whole chunks)
    conv_chunksize: int  # conv chunks per convolution call: a memory bound, no effect on results
    downsample_hidden_size: int  # Conv2d channels
    output_dim: int  # thinker width

    def __post_init__(self):
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"field '{name}' must be a positive integer, got {v!r}")
        if self.activation_function not in _ACTIVATIONS:
            raise ConfigError(f"field 'activation_function' {self.activation_function!r} is not supported "
                              f"(known: {', '.join(sorted(_ACTIVATIONS))})")
        if self.d_model % self.encoder_attention_heads:
            raise ConfigError(f"field 'd_model' {self.d_model} is not a multiple of "
                              f"'encoder_attention_heads' {self.encoder_attention_heads}")
        if self.d_model % 2 or self.d_model < 4:
            raise ConfigError(f"field 'd_model' must be even and >= 4 for sinusoidal positions, got {self.d_model}")
        if self.n_window_infer < self.chunk_frames:
            raise ConfigError(f"field 'n_window_infer' {self.n_window_infer} is shorter than one conv chunk "
                              f"(2 * n_window = {self.chunk_frames} frames)")
        if self.chunk_tokens > self.max_source_positions:
            raise ConfigError(f"field 'max_source_positions' {self.max_source_positions} is smaller than the "
                              f"{self.chunk_tokens} positions of one conv chunk")

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "AudioEncoderConfig":
        """Read ``audio_config``; ConfigError names ``where`` and the field."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
        values = {}
        for f in fields(cls):
            if f.name not in d or d[f.name] is None:
                raise ConfigError(f"{where}: missing field '{f.name}'")
            v = d[f.name]
            if f.name == "activation_function":
                if not isinstance(v, str):
                    raise ConfigError(f"{where}: field 'activation_function' must be a string, got {v!r}")
            elif isinstance(v, float) and v.is_integer():
                v = int(v)
            values[f.name] = v
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    # Derived sizes -------------------------------------------------------------------------
    @property
    def chunk_frames(self) -> int:
        """Mel frames per conv chunk (``2 * n_window``)."""
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Tokens from one full conv chunk."""
        return conv_frames(self.chunk_frames)

    @property
    def window_frames(self) -> int:
        """Mel frames per attention window: whole chunks within ``n_window_infer``."""
        return (self.n_window_infer // self.chunk_frames) * self.chunk_frames

    @property
    def window_tokens(self) -> int:
        """Tokens per attention window."""
        return (self.n_window_infer // self.chunk_frames) * self.chunk_tokens

    @property
    def conv_out_features(self) -> int:
        """Channels x mel bins left after the convolutions (``conv_out``'s input width)."""
        return self.downsample_hidden_size * conv_frames(self.num_mel_bins)

    def output_length(self, frames: int) -> int:
        """Tokens for ``frames`` mel frames."""
        full, rest = divmod(int(frames), self.chunk_frames)
        return full * self.chunk_tokens + conv_frames(rest)


class AudioEncoder(nn.Module):
    """Log-mel ``[num_mel_bins, L]`` -> tokens ``[output_length(L), output_dim]``.

    ``forward`` encodes a whole utterance as the reference does.  Streaming: with
    ``B = block_frames``, ``encode_block(mel[:, 0:B], first=True)``,
    ``encode_block(mel[:, B:2B], first=False)``, ... and finally the tail (fewer
    than ``B`` frames, possibly none; ``first=True`` only if it is the whole
    utterance) concatenate to ``forward(mel)`` up to float rounding.  Each full
    block gives ``block_tokens`` tokens.

    Runs in the weights' dtype/device (the features are cast to it).  The
    position table is a non-persistent float32 buffer: a loader that builds the
    module on the meta device must call :meth:`reset_buffers`.
    """

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.block_frames = cfg.window_frames
        self.block_tokens = cfg.window_tokens
        d, ch = cfg.d_model, cfg.downsample_hidden_size
        self.act = _ACTIVATIONS[cfg.activation_function]
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(cfg.conv_out_features, d, bias=False)
        self.layers = nn.ModuleList(
            WhisperEncoderLayer(d, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, self.act, key_bias=True)
            for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(d)
        self.proj1 = nn.Linear(d, d)
        self.proj2 = nn.Linear(d, cfg.output_dim)
        # Only one chunk's positions are ever used (they restart in every chunk).
        self.register_buffer("positional_embedding", sinusoid_table(cfg.chunk_tokens, d), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the position table (non-persistent, float32) on the weights' device."""
        self.positional_embedding = sinusoid_table(self.cfg.chunk_tokens, self.cfg.d_model).to(
            self.conv_out.weight.device)

    def output_length(self, frames: int) -> int:
        """Tokens for ``frames`` mel frames (the reference's ``_get_feat_extract_output_lengths``)."""
        return self.cfg.output_length(frames)

    # -------------------------------------------------------------------------------- pieces
    def _check(self, mel: torch.Tensor) -> torch.Tensor:
        if mel.dim() != 2 or mel.shape[0] != self.cfg.num_mel_bins:
            raise ValueError(f"mel must be [{self.cfg.num_mel_bins}, frames], got {tuple(mel.shape)}")
        w = self.conv_out.weight
        return mel.to(device=w.device, dtype=w.dtype)

    def _embed(self, mel: torch.Tensor, pad_partial: bool) -> torch.Tensor:
        """mel [n_mels, L] -> chunk embeddings with positions, valid tokens only: [output_length(L), d_model].

        ``pad_partial``: zero-pad a partial last chunk to a full chunk before the convolutions,
        as the reference does whenever the utterance has a full chunk (module docstring, step 2).
        """
        n_mels, length = mel.shape
        c = self.cfg.chunk_frames
        full, rest = divmod(length, c)
        if full and rest:
            pad_partial = True  # a full chunk in this call: the reference pads to it as well
        padded = full + (1 if rest and pad_partial else 0)
        chunks = []
        if padded:
            x = mel[:, : full * c]
            if padded > full:
                x = F.pad(mel, (0, padded * c - length))
            chunks.append(x.reshape(n_mels, padded, c).transpose(0, 1))  # [padded, n_mels, c]
        if rest and not pad_partial:  # the whole utterance is one partial chunk
            chunks.append(mel[None, :, full * c:])
        out = []
        for batch in chunks:
            for part in batch[:, None].split(self.cfg.conv_chunksize):
                h = F.gelu(self.conv2d1(part))
                h = F.gelu(self.conv2d2(h))
                h = F.gelu(self.conv2d3(h))  # [n, ch, mel', t]
                n, ch, fr, t = h.shape
                h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, ch * fr))
                out.append(h + self.positional_embedding[:t].to(h.dtype))
        h = torch.cat(out) if len(out) > 1 else out[0]  # [chunks, t, d]
        tokens = h[:full].reshape(-1, h.shape[-1])
        if rest:
            tokens = torch.cat([tokens, h[full, : conv_frames(rest)]])
        return tokens

    def _transform(self, h: torch.Tensor) -> torch.Tensor:
        """h: [windows, T, d_model] -> layers (attention inside each window), head: [windows, T, output_dim]."""
        for layer in self.layers:
            h = layer(h)
        return self.proj2(self.act(self.proj1(self.ln_post(h))))

    # -------------------------------------------------------------------------------- API
    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [num_mel_bins, L] -> tokens [output_length(L), output_dim] for one whole utterance."""
        x = self._check(mel)
        if x.shape[1] == 0:
            return x.new_zeros(0, self.cfg.output_dim)
        h = self._embed(x, pad_partial=x.shape[1] >= self.cfg.chunk_frames)
        n, d = h.shape
        w = self.block_tokens
        windows, rest = divmod(n, w)
        parts = []
        if windows:  # equal windows run as one batch
            parts.append(self._transform(h[: windows * w].reshape(windows, w, d)).reshape(windows * w, -1))
        if rest:
            parts.append(self._transform(h[None, windows * w:])[0])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def encode_block(self, mel_block: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Encode one finished block of ``block_frames`` frames, or the utterance's final tail (fewer).

        ``first``: True when no earlier block of this utterance was encoded (the block starts the
        utterance).  It matters only for a tail shorter than one conv chunk, which the reference
        zero-pads to a full chunk when the utterance has earlier frames and leaves alone when it
        is the whole utterance.  Returns ``output_length(frames)`` tokens; concatenating every
        block's tokens in order equals :meth:`forward` on the whole utterance.
        """
        x = self._check(mel_block)
        if x.shape[1] > self.block_frames:
            raise ValueError(f"a block has at most {self.block_frames} frames, got {x.shape[1]}")
        if x.shape[1] == 0:
            return x.new_zeros(0, self.cfg.output_dim)
        h = self._embed(x, pad_partial=not first)
        return self._transform(h[None])[0]
