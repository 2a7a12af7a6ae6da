"""Preallocated KV caches: linear with O(1) rollback (:class:`KVCache`) and a ring (:class:`RingKVCache`).

A linear cache serves one turn-based decoder (a thinker, a talker).  Keys and values live in one
tensor per layer (``k[i]``, ``v[i]``), allocated once at ``capacity`` positions; a step writes its new
positions in place and ``length`` says how many are valid.  One tensor per layer rather than one for
all layers: a compiled step that writes into a slice of a shared base tensor makes inductor copy the
whole base on every write (measured 40x slower on the CPU); separate tensors are written in place.  ``truncate(n)``
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
        shape = (1, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
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

    def span(self, n: int, dynamic: bool = False) -> "KVSpan":
        """The first ``n`` positions of every layer (views, written through), for a static-shape step
        that attends over them instead of the whole capacity.  ``dynamic`` marks their length as a
        dynamic dimension for torch.compile, so one compiled step serves every length."""
        return KVSpan(self, n, dynamic)

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.numel() for t in (*self.k, *self.v))


class KVSpan:
    """A prefix of a :class:`KVCache` that a static-shape decode step reads and writes like the cache
    itself (``k``, ``v``: per-layer views; ``capacity``: the cache's).  On the CPU, attention over
    exactly the used positions costs a fraction of attention over the whole capacity; a CUDA graph
    needs one fixed shape and takes the whole cache instead."""

    def __init__(self, cache: KVCache, n: int, dynamic: bool = False):
        n = max(n, 2)  # torch.compile specialises a dimension of size 1; the step's mask hides the extra slot
        if n > cache.capacity:
            raise CacheFullError(f"KV cache full: a span of {n} positions > capacity {cache.capacity}")
        self.k = [t[:, :, :n] for t in cache.k]
        self.v = [t[:, :, :n] for t in cache.v]
        self.capacity = cache.capacity
        if dynamic:
            self._mark_dynamic()

    def _mark_dynamic(self) -> None:
        for t in (*self.k, *self.v):
            torch._dynamo.mark_dynamic(t, 2)

    @classmethod
    def scratch(cls, cache: KVCache, n: int, dynamic: bool = True) -> "KVSpan":
        """A span shaped (and strided) like ``cache``'s first ``n`` positions but on a private zeroed
        cache of the same size: what a step is compiled on in the background while the conversation
        goes on in ``cache``.  Held only while compiling."""
        layers, (_, heads, capacity, head_dim) = len(cache.k), cache.k[0].shape
        with torch.inference_mode(False):
            private = KVCache(layers, heads, head_dim, capacity, cache.k[0].dtype, cache.k[0].device)
        return cls(private, n, dynamic)


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
        shape = (num_heads, capacity, head_dim)  # one tensor per layer, as KVCache (see the module docstring)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
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
        return sum(t.element_size() * t.numel() for t in (*self.k, *self.v))
