"""Preallocated KV caches: linear with O(1) rollback (:class:`KVCache`) and a ring (:class:`RingKVCache`).

A linear cache serves one turn-based decoder (a thinker, a talker).  Keys and values for every layer live
in two tensors allocated once at ``capacity`` positions; a step writes its new
positions in place and ``length`` says how many are valid.  ``truncate(n)``
only moves that pointer: the stale entries past ``n`` are never read again
because every attention reads ``[:length]`` (eager) or masks by position
(static shapes), and they are overwritten by the next write.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """The conversation no longer fits: the caller drops old turns and re-prefills."""


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def reserve(self, n: int) -> int:
        """Check that ``n`` more positions fit; returns the start position of the write."""
        if self.length + n > self.capacity:
            raise CacheFullError(f"KV cache full: {self.length} + {n} positions > capacity {self.capacity}")
        return self.length

    def truncate(self, n: int) -> None:
        """Forget every position from ``n`` on (a pointer move, O(1))."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.element_size() * self.k.numel() * 2


class RingKVCache:
    """Keys and values of the last ``capacity`` frames of every temporal layer.

    Frame ``pos`` is written in place at slot ``pos % capacity``; ``pos`` keeps
    growing past the capacity (RoPE angles use it), so the oldest frame is
    overwritten once the ring is full.  Keys are rotated before they are
    stored, which makes the slot order irrelevant to attention: a step attends
    to every written slot through an additive bias (0 or -inf) of fixed shape.
    ``pos`` is a device tensor so the step has no host value in it.
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.bias = torch.zeros(capacity, dtype=dtype, device=device)
        self._slots = torch.arange(capacity, device=device)

    def prepare(self) -> None:
        """Slot and attention bias of the frame at ``pos`` (written before it attends)."""
        torch.remainder(self.pos, self.capacity, out=self.slot)
        # slots above pos are unwritten only while the ring is not yet full
        self.bias.zero_().masked_fill_(self._slots > self.pos, float("-inf"))

    def advance(self) -> None:
        self.pos += 1

    def reset(self) -> None:
        """Forget everything (a pointer move: stale slots are masked until rewritten)."""
        self.pos.zero_()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
