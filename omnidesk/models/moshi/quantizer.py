"""Mimi's split residual vector quantizer: latent frames <-> codebook ids.

Each codebook stage picks the codeword nearest to what the previous stages left
(the residual); decoding sums the chosen codewords.  Mimi splits the stages in
two groups that quantize the same latent through their own projections: the
first (``n_q_semantic``, one codebook) was trained to carry semantic content,
the rest the acoustic detail; their decodings add up.  How many stages are
used is chosen per call (Moshi uses 8 of the 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class QuantizerConfig:
    """Split residual vector quantizer: the first ``n_q_semantic`` codebooks apart from the rest."""

    dimension: int = 256  # codebook vector width
    n_q: int = 32  # codebooks in the checkpoint
    bins: int = 2048  # entries per codebook
    n_q_semantic: int = 1
    input_dimension: int = 512
    output_dimension: int = 512


class Codebook(nn.Module):
    """One VQ codebook, stored as the checkpoint does (EMA sums and usage counts); the vectors
    themselves (``codewords`` = sum / usage) are derived by :meth:`refresh` after loading."""

    def __init__(self, bins: int, dim: int, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("codewords", torch.zeros(bins, dim), persistent=False)
        self.register_buffer("squared_norms", torch.zeros(bins), persistent=False)

    def refresh(self) -> None:
        self.codewords.copy_(self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None])
        self.squared_norms.copy_(self.codewords.pow(2).sum(dim=-1))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> index of the nearest codeword (Euclidean), [N]."""
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2, and |x|^2 is the same for every codeword: one matmul
        # instead of cdist's handful of ops (cdist was a fifth of the demo codec's frame time)
        return torch.addmm(self.squared_norms, x, self.codewords.t(), alpha=-2).argmin(dim=-1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.codewords)


class ResidualVQ(nn.Module):
    """Project in, quantize the residual stage by stage, sum the codewords, project out."""

    def __init__(self, n_q: int, cfg: QuantizerConfig):
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.input_dimension, cfg.dimension, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.dimension, cfg.output_dimension, 1, bias=False)
        self.codebooks = nn.ModuleList(Codebook(cfg.bins, cfg.dimension) for _ in range(n_q))

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [1, C, T] -> codes [n, T]."""
        residual = self.input_proj(x)[0].t()
        codes = []
        for codebook in self.codebooks[:n]:
            c = codebook.encode(residual)
            residual = residual - codebook.decode(c)
            codes.append(c)
        return torch.stack(codes)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [n, T] -> [1, C, T]."""
        vectors = self.codebooks[0].decode(codes[0])
        for codebook, c in zip(self.codebooks[1:], codes[1:]):
            vectors = vectors + codebook.decode(c)
        return self.output_proj(vectors.t()[None])


class SplitResidualVQ(nn.Module):
    """The semantic codebook(s) and the acoustic ones, quantizing the same latent through separate
    projections; their decodings add up."""

    def __init__(self, cfg: QuantizerConfig):
        super().__init__()
        self.n_q_semantic = cfg.n_q_semantic
        self.semantic = ResidualVQ(cfg.n_q_semantic, cfg)
        self.acoustic = ResidualVQ(cfg.n_q - cfg.n_q_semantic, cfg)

    def refresh(self) -> None:
        for m in self.modules():
            if isinstance(m, Codebook):
                m.refresh()

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [1, C, T] -> codes [n, T] (n >= n_q_semantic)."""
        codes = self.semantic.encode(x, self.n_q_semantic)
        if n > self.n_q_semantic:
            codes = torch.cat([codes, self.acoustic.encode(x, n - self.n_q_semantic)])
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [n, T] -> [1, C, T]."""
        out = self.semantic.decode(codes[:self.n_q_semantic])
        if codes.shape[0] > self.n_q_semantic:
            out = out + self.acoustic.decode(codes[self.n_q_semantic:])
        return out
