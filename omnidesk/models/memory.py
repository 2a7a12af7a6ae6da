"""Memory arithmetic every family's estimate shares (each family computes its own needs)."""

from __future__ import annotations

import os

import torch


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def available_ram() -> int:
    """Bytes of physical memory available now (os.sysconf; 0 where unknown)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def ram_too_small(need: int) -> str | None:
    """Why a CPU load test of ``need`` bytes is skipped (too little RAM available now), else None."""
    free = available_ram()
    if need <= free:
        return None
    return f"load test skipped: the checkpoint needs about {gib(need)} in float32 but only {gib(free)} of RAM is available"


def torch_dtype(dtype) -> torch.dtype:
    """A torch.dtype from itself or its name ("bfloat16", "torch.float16")."""
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(d, torch.dtype):
            raise ValueError(f"unknown dtype '{dtype}'")
        return d
    return dtype


__all__ = ["available_ram", "gib", "ram_too_small", "torch_dtype"]
