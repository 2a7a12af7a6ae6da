"""What the random-weight stack benches (bench/moshi_stack.py, bench/qwen3_stack.py) share: the
product's memory check before a stack is built, the device's name and the memory peaks after."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omnidesk.models.memory import available_ram  # noqa: E402
from report import processor  # noqa: E402

GB = 1e9


def check_fits_or_exit(estimate, dev: torch.device, check_fits: Callable, on_the_cpu: str) -> None:
    """The family's own ``check_fits`` of ``estimate`` against the free device memory on CUDA (as its
    loader does), the estimate's total against the host's free memory on the CPU; SystemExit saying
    why when it does not fit (``on_the_cpu``: what to do instead there)."""
    if dev.type == "cuda":
        problem = check_fits(estimate, torch.cuda.mem_get_info(dev)[0])
        if problem:
            raise SystemExit(problem)
    elif dev.type == "cpu" and 0 < available_ram() < estimate.total:
        raise SystemExit(f"this stack needs about {estimate.total / GB:.1f} GB but the host has "
                         f"{available_ram() / GB:.1f} GB free: {on_the_cpu}")


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else processor()


def memory_peaks(dev: torch.device, after_build: int | None) -> dict:
    """The whole process's peak resident memory (on CUDA: the host side only), and on CUDA the
    memory allocated after the build (``after_build`` bytes) and the allocator's peaks."""
    peaks = {"host_max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3)}
    if dev.type == "cuda":
        peaks.update(allocated_after_build_gb=round(after_build / GB, 3),
                     max_allocated_gb=round(torch.cuda.max_memory_allocated(dev) / GB, 3),
                     max_reserved_gb=round(torch.cuda.max_memory_reserved(dev) / GB, 3))
    return peaks
