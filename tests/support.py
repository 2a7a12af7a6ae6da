"""Helpers and fixtures several test files share (tests/ is on sys.path: ``from support import ...``).

A fixture is used by importing it into the test module (``from support import demo_dir, stack  #
noqa: F401  (fixtures)``), so a module that does not import it cannot pick it up by its name.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch


def speech_like_wave(seconds: float, seed: int = 0) -> torch.Tensor:
    """A deterministic 16 kHz test utterance: voiced harmonics with a moving pitch plus noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000
    f0 = 140 + 40 * torch.sin(2 * torch.pi * 0.7 * t)
    phase = 2 * torch.pi * torch.cumsum(f0, 0) / 16000
    wave = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 6))
    return (wave * (0.6 + 0.4 * torch.sin(2 * torch.pi * 3 * t)) + 0.01 * torch.randn(t.shape, generator=g)).float()


class ReadyStep:
    """A decode-runner step stand-in that is ready (compiled) and runs its function as written, eager:
    for checking what a model does with a ready step without compiling it.  Counts its calls."""

    def __init__(self, fn):
        self.fn, self.ready, self.calls = fn, True, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def damageable_copy(src: Path, dst: Path) -> Path:
    """A private copy of a shared (session-scoped) checkpoint at ``dst``, for a test to damage."""
    shutil.copytree(src, dst)
    return dst


@contextlib.contextmanager
def private_cache(root: Path):
    """``root`` as the XDG cache and state homes and HF_HOME while inside (so demos are made there and
    the user's cache is never touched); torch's thread count restored after."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        mp.setenv("XDG_STATE_HOME", str(root / "state"))
        mp.setenv("HF_HOME", str(root / "hf"))
        yield root
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private XDG cache for the module (:func:`private_cache`): a demo made by default is made there."""
    with private_cache(tmp_path_factory.mktemp("xdg")) as root:
        yield root


# ---------------------------------------------------------------- the Qwen2.5-Omni demo, once per module


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from omnidesk.models.qwen2_5_omni.demo import make_demo

    return make_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture(scope="module")
def stack(demo_dir):
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    return load_stack(demo_dir)
