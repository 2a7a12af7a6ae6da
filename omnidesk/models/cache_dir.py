"""Checkpoints OmniDesk writes itself into the user's cache (the demo models): written whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/omnidesk`` (``~/.cache/omnidesk``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omnidesk"


def write_checkpoint_dir(path: str | os.PathLike | None, default: Path, write: Callable[[Path], None],
                         force: bool = False) -> Path:
    """Write a checkpoint folder with ``write(tmp_dir)`` and rename it into place; reuse a complete one.

    ``path`` None means ``default`` (a recipe-versioned folder in the user cache, e.g.
    ``demo-moshi-r1``): folders of older recipes next to it (same name up to the version) are
    removed, they are dead weight.  A folder counts as complete when its config.json exists,
    which the rename makes true only once everything is written."""
    target = Path(path) if path else default
    if (target / "config.json").is_file() and not force:
        return target
    if path is None:
        stem = default.name.rsplit("-r", 1)[0]
        for old in default.parent.glob(f"{stem}-r*"):
            if old != default and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
