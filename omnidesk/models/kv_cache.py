"""Preallocated KV cache with O(1) rollback.

One cache per decoder (thinker, talker).  Keys and values for every layer live
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
