"""The Qwen3-Omni modules as one model (kept apart from the loader: see qwen2_5_omni/model.py)."""

from __future__ import annotations

from torch import nn

from .code2wav import Code2Wav
from .config import Qwen3OmniConfig
from .talker import Talker
from .thinker import Thinker


class Qwen3OmniModel(nn.Module):
    """Thinker (with its audio encoder) + talker (with its code predictor) + code2wav."""

    def __init__(self, cfg: Qwen3OmniConfig):
        super().__init__()
        self.cfg = cfg
        self.thinker = Thinker(cfg.thinker)
        self.talker = Talker(cfg.talker) if cfg.talker is not None else None
        self.code2wav = Code2Wav(cfg.code2wav) if cfg.code2wav is not None else None


__all__ = ["Qwen3OmniModel"]
