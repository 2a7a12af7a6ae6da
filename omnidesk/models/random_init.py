"""Seeded random weights: the one initialisation of every random-weight model we make.

Used by the demo checkpoint (omnidesk/models/qwen2_5_omni/demo.py), by bench/random_stack.py
(real 3B/7B shapes built in memory) and by the real-size test checkpoint
(tests/real_checkpoint.py, written to disk tensor by tensor).  The rule goes by
the tensor's name, and reads the same in the checkpoint's names and in ours:

* norm weights (``...norm.weight``, ``...layer_norm.weight``, ``...ln_post.weight``) = 1;
* biases = 0;
* everything else ~ N(0, INIT_STD).

Why this keeps a deep bf16 stack finite: with unit RMSNorm gains every layer
normalises its input, and std-0.02 projections make each layer add only a small
update to the residual stream, so the stream neither vanishes nor blows up
through the 36 thinker layers of the 3B (28 of the 7B) or the talker's 24.
The logits stay small, so sampling is close to uniform: the weights are noise.
"""

from __future__ import annotations

from typing import Iterable

import torch

INIT_STD = 0.02


def is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith("ln_post.weight") or "layer_norm.weight" in name


@torch.no_grad()
def init_tensor_(name: str, tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``tensor`` (any dtype and device; ``generator`` on the same device) by the rule above."""
    if is_norm_weight(name):
        tensor.fill_(1.0)
    elif name.endswith(".bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, INIT_STD, generator=generator)
    return tensor


def random_tensor(name: str, shape: Iterable[int], dtype: torch.dtype,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A new CPU tensor for checkpoint tensor ``name``, filled by :func:`init_tensor_`."""
    return init_tensor_(name, torch.empty(tuple(shape), dtype=dtype), generator)


def init_module_(module: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """Every parameter of ``module``, in ``named_parameters`` order (so a seed gives the same weights)."""
    for name, p in module.named_parameters():
        init_tensor_(name, p, generator)
