"""The model families OmniDesk runs: the one place that names them.

A family knows how to recognise one of its checkpoints (config.json's
``model_type``, else the files present), the name of its built-in demo and how
to make it, and whether it is turn-based (Qwen2.5-Omni: the engine decides
when to reply) or full duplex (Moshi: one step per 80 ms frame, it decides).
Everything that must pick a family (the CLI, the window, the inventory) asks
:func:`family_of` / :func:`resolve_model` instead of testing names itself.

The Qwen2.5-Omni entry is a thin adapter over the existing functions in
``omnidesk.models`` (demo, loading), which stay where they are for now.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .loading import CheckpointError


@dataclass(frozen=True)
class Family:
    name: str  # "qwen2_5_omni", "moshi"
    title: str  # what a person calls it
    detect: Callable[[Path], bool]  # is this checkpoint directory one of ours?
    demo_name: str  # what names the built-in demo wherever a model is asked for
    make_demo: Callable[..., Path]  # (dir=None, force=False) -> the demo's directory
    demo_dir: Callable[[], Path]  # where the default demo lives (made or not)
    is_demo: Callable[[Path], bool]  # is this checkpoint directory the demo?
    demo_notice: str
    duplex: bool  # full duplex (DuplexExecutor) rather than turn-based (Executor)


def _config(root: Path) -> dict | None:
    try:
        d = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


# ---------------------------------------------------------------- Qwen2.5-Omni (adapter)

def _qwen_detect(root: Path) -> bool:
    d = _config(root)
    return d is not None and d.get("model_type") == "qwen2_5_omni"


def _qwen_make_demo(dir=None, force: bool = False) -> Path:
    from .demo import make_demo

    return make_demo(dir, force=force)


def _qwen_demo_dir() -> Path:
    from .demo import default_demo_dir

    return default_demo_dir()


def _qwen_is_demo(root: Path) -> bool:
    from .demo import is_demo

    return is_demo(_config(root) or {})


def _qwen_notice() -> str:
    from .demo import DEMO_NOTICE

    return DEMO_NOTICE


# ---------------------------------------------------------------- Moshi

def _moshi_detect(root: Path) -> bool:
    root = Path(root)
    d = _config(root)
    if d is not None and "model_type" in d:
        return d.get("model_type") == "moshi"
    if d is not None and d.get("moshi_name"):
        return True
    # the published moshiko/moshika repos have no config.json: the files say what they are
    from .moshi.config import MIMI_NAME, MOSHI_NAME, TOKENIZER_NAME

    return d is None and (root / MOSHI_NAME).is_file() and (root / MIMI_NAME).is_file() \
        and (root / TOKENIZER_NAME).is_file()


def _moshi_make_demo(dir=None, force: bool = False) -> Path:
    from .moshi.demo import make_moshi_demo

    return make_moshi_demo(dir, force=force)


def _moshi_demo_dir() -> Path:
    from .moshi.demo import default_demo_dir

    return default_demo_dir()


def _moshi_is_demo(root: Path) -> bool:
    from .moshi.demo import is_moshi_demo

    return is_moshi_demo(_config(root))


QWEN = Family(name="qwen2_5_omni", title="Qwen2.5-Omni", detect=_qwen_detect, demo_name="demo",
              make_demo=_qwen_make_demo, demo_dir=_qwen_demo_dir, is_demo=_qwen_is_demo,
              demo_notice=_qwen_notice(), duplex=False)


def _moshi_notice() -> str:
    from .moshi.demo import DEMO_NOTICE

    return DEMO_NOTICE


MOSHI = Family(name="moshi", title="Moshi", detect=_moshi_detect, demo_name="moshi-demo",
               make_demo=_moshi_make_demo, demo_dir=_moshi_demo_dir, is_demo=_moshi_is_demo,
               demo_notice=_moshi_notice(), duplex=True)

FAMILIES: tuple[Family, ...] = (QWEN, MOSHI)


def family_named(name: str) -> Family:
    """A family by its name, title or demo name ("qwen", "moshi", ... case-insensitive)."""
    key = name.strip().lower()
    for f in FAMILIES:
        if key in (f.name, f.title.lower(), f.demo_name) or f.name.startswith(key):
            return f
    raise ValueError(f"unknown model family '{name}'; known: {', '.join(f.name for f in FAMILIES)}")


def family_of(root: str | os.PathLike) -> Family:
    """The family of the checkpoint directory ``root``; CheckpointError when no family knows it."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    for f in FAMILIES:
        if f.detect(root):
            return f
    d = _config(root)
    what = (f"its config.json has model_type {d.get('model_type')!r}" if d is not None
            else "it has no config.json and not the files of a published Moshi repo")
    raise CheckpointError(f"{root}: not a checkpoint OmniDesk can run ({what}); supported: "
                          + ", ".join(f"{f.title} ({f.name})" for f in FAMILIES))


def demo_family(name: str) -> Family | None:
    """The family whose demo ``name`` names ("demo", "moshi-demo"), or None."""
    return next((f for f in FAMILIES if f.demo_name == name), None)


def resolve_model(name_or_path: str | os.PathLike) -> tuple[Path, Family]:
    """A model name as the user gives it (a demo name, a folder, a cached repo id) -> (directory, family).

    A demo name resolves to its demo, which must have been made (``omnidesk models make-demo``)."""
    from .loading import resolve_checkpoint

    root = resolve_checkpoint(name_or_path)
    return root, family_of(root)


__all__ = ["FAMILIES", "Family", "MOSHI", "QWEN", "demo_family", "family_named", "family_of", "resolve_model"]
