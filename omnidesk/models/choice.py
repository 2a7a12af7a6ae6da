"""Which model and device to use when the user did not say (Qt-free: the CLI and the window share it).

The model: the one configured (``--model``), else the one remembered from the
window (its model picker), else the smallest intact checkpoint (of any family) in
the local Hugging Face cache, else the demo model (random weights: its replies
are noise).  The device: ``cuda`` when torch can use a GPU, else ``cpu``; a
device the user names is checked by :func:`check_device` before anything loads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("omnidesk.models")

DEMO = "demo"

WHY_CONFIGURED = "configured"
WHY_REMEMBERED = "remembered from the window's model picker"
WHY_CACHED = "found in the Hugging Face cache"
WHY_NO_REAL = "no real model found"


@dataclass(frozen=True)
class ModelChoice:
    source: str  # checkpoint folder, cached repo id, or "demo"
    name: str  # what the window calls it
    why: str  # one of the WHY_* phrases


def choose_model(configured: str | None, find=None, remembered: str | None = None) -> ModelChoice:
    """The model to open: ``configured`` if set, else ``remembered`` (the window's last pick), else
    the smallest intact cached checkpoint (the real model most likely to fit), else the demo.

    ``find`` lists checkpoints (default :func:`omnidesk.models.inventory.find_checkpoints`)."""
    for source, why in ((configured, WHY_CONFIGURED), (remembered, WHY_REMEMBERED)):
        if source == DEMO:
            return ModelChoice(DEMO, "Demo model", why)
        if source:
            return ModelChoice(source, _short_name(source), why)
    if find is None:
        from .inventory import find_checkpoints as find
    try:
        found = find()
    except Exception:  # a strange cache must not stop the app from starting on the demo
        log.exception("looking for checkpoints failed")
        found = []
    real = sorted((c for c in found if c.loads and not c.demo), key=lambda c: c.size_bytes)
    if real:
        return ModelChoice(real[0].name, _short_name(real[0].name), WHY_CACHED)
    return ModelChoice(DEMO, "Demo model", WHY_NO_REAL)


def _short_name(source: str) -> str:
    p = Path(source)
    if p.is_absolute() or source.startswith((".", "~")):
        return p.name or source
    return source


# ---------------------------------------------------------------- device

class DeviceError(ValueError):
    """A device that cannot be used; the message says what to do instead."""


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def why_default_device() -> str:
    """Why :func:`default_device` picked what it picked (a few words)."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA GPU is available"
    if not getattr(torch.version, "cuda", None) and not getattr(torch.version, "hip", None):
        return "this torch build is CPU-only"
    return "no usable CUDA GPU found"


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def check_device(device: str) -> str:
    """``device`` normalised ("cpu", "cuda", "cuda:N") if this machine can run on it; else
    :class:`DeviceError` with a one-line message saying what to do."""
    spec = str(device).strip().lower()
    m = _DEVICE.fullmatch(spec)
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise DeviceError(f"unknown device '{device}'; use cpu or cuda[:N]")
    if m.group(1) == "cpu":
        return "cpu"
    import torch

    if not getattr(torch.version, "cuda", None) and not getattr(torch.version, "hip", None):
        raise DeviceError(f"--device {spec}: this torch build has no CUDA support (CPU-only); "
                          "install a CUDA build of torch or use --device cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {spec}: no usable CUDA GPU (none found, or its driver is not loaded; "
                          "`nvidia-smi` shows which); use --device cpu")
    if m.group(2) is not None:
        count = torch.cuda.device_count()
        if int(m.group(2)) >= count:
            raise DeviceError(f"--device {spec}: this machine has {count} CUDA GPU(s) "
                              f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of those")
    return spec


__all__ = ["DEMO", "DeviceError", "ModelChoice", "check_device", "choose_model", "default_device",
           "why_default_device"]
