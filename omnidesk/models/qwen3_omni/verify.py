"""`models verify` for a Qwen3-Omni checkpoint: file by file, tensor by tensor, then a load test.

Never raises for a bad checkpoint: every problem goes into the report as a
message naming the file or tensor.  The load test needs the whole model in
fp32 RAM (about 130 GiB for the real one), so on a desktop it is skipped with a
note and the tensor-level checks are what verifies the download.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import ConfigError, VerifyReport, read_json
from ..omni_checkpoint import (SIDE_FILES, config_dtype, run_load_test, verify_config, verify_side_files,
                               verify_tensors)
from . import loading
from .config import Qwen3OmniConfig
from .loading import check_mapping
from .memory import estimate_memory


def verify(root: Path, report: VerifyReport, load_test: bool = True) -> None:
    """Check ``root`` into ``report``: config, side files, tensor names and shapes (experts one
    tensor each, vision listed as unused), and (``load_test``, when nothing else is wrong and
    the RAM allows) a CPU load with one thinker decode step."""
    cfg = verify_config(root, report, Qwen3OmniConfig.from_file)
    if cfg is not None:
        report.unsupported = _unsupported(cfg)
    verify_side_files(root, report)
    verify_tensors(root, report, (lambda shapes: check_mapping(cfg, shapes)) if cfg is not None else None,
                   unused_as="vision tensors")
    if load_test and report.usable:
        run_load_test(root, report, cfg, estimate_memory, loading.load_stack)


def _unsupported(cfg: Qwen3OmniConfig) -> str | None:
    if cfg.talker is None:  # intact, but it cannot answer in speech
        return ("text only, no speech output (enable_audio_output is false: a -Thinking or -Captioner model); "
                "use Qwen/Qwen3-Omni-30B-A3B-Instruct")
    return None


def unsupported(root: Path) -> str | None:
    """Why OmniDesk cannot run the checkpoint whose config.json is in ``root`` (None: it can, or the
    config is unreadable: verify says why)."""
    try:
        return _unsupported(Qwen3OmniConfig.from_dict(read_json(root / "config.json")))
    except (ConfigError, OSError):
        return None


def voice_names(root: Path) -> list[str]:
    """The speakers of config.json's talker_config.speaker_id ([] when unreadable: verify says why)."""
    try:
        talker = Qwen3OmniConfig.from_dict(read_json(root / "config.json")).talker
    except (ConfigError, OSError):
        return []
    return list(talker.voices) if talker is not None else []


__all__ = ["SIDE_FILES", "config_dtype", "unsupported", "verify", "voice_names"]
