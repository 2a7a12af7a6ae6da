"""`models verify` for a Qwen2.5-Omni checkpoint: file by file, tensor by tensor, then a load test.

Never raises for a bad checkpoint: every problem goes into the report as a
message naming the file, voice or tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import CheckpointError, ConfigError, VerifyReport, read_json
from ..omni_checkpoint import (SIDE_FILES, config_dtype, run_load_test, verify_config, verify_side_files,
                               verify_tensors)
from .config import OmniConfig
from . import loading
from .loading import check_mapping, checkpoint_quantization, load_voices, without_speech
from .memory import estimate_memory


def verify(root: Path, report: VerifyReport, load_test: bool = True) -> None:
    """Check ``root`` into ``report``: config, side files, voices, tensor names and shapes, and
    (``load_test``, when nothing else is wrong) a CPU load with one thinker decode step."""
    quant = None
    cfg = verify_config(root, report, OmniConfig.from_file)
    if cfg is not None:
        try:
            quant = checkpoint_quantization(root, cfg.raw)
            if quant is not None:
                report.checked.append(f"quantization_config ({quant.label}, group size {quant.group_size}"
                                      f"{', act-order' if quant.desc_act else ''})")
        except (ConfigError, CheckpointError) as e:
            report.problems.append(str(e))
    verify_side_files(root, report)
    if cfg is None or cfg.talker is not None:
        if not (root / "spk_dict.pt").is_file():
            report.problems.append(f"{root}: missing file spk_dict.pt")
        else:
            try:  # the loader's own check: shapes against the checkpoint's dims, naming voice and field
                voices = load_voices(root / "spk_dict.pt", cfg)
                report.checked.append(f"spk_dict.pt ({len(voices)} voices)")
            except (CheckpointError, ConfigError) as e:
                report.problems.append(str(e))

    def mapping(shapes):
        return check_mapping(cfg, shapes if cfg.talker is not None else without_speech(shapes), quant=quant)

    verify_tensors(root, report, mapping if cfg is not None else None)
    if load_test and not report.problems:
        # loading.load_stack looked up now: tests swap it
        run_load_test(root, report, cfg, estimate_memory, loading.load_stack)


def voice_names(root: Path) -> list[str]:
    """The voices of spk_dict.pt ([] when unreadable: verify reports why)."""
    try:
        return list(load_voices(root / "spk_dict.pt", OmniConfig.from_dict(read_json(root / "config.json"))))
    except (CheckpointError, ConfigError, OSError):
        return []


def quantization(root: Path) -> str | None:
    """What ``models list`` says of the checkpoint's 4-bit format ("GPTQ int4 (group 128)"); None for float
    weights (an unusable quantization_config is a problem `models verify` names)."""
    try:
        quant = checkpoint_quantization(root, read_json(root / "config.json"))
    except (ConfigError, CheckpointError):
        return "unsupported quantization_config"
    return None if quant is None else f"{quant.label} (group {quant.group_size})"


def memory_modes(root: Path, context_tokens: int = 8192) -> dict[str, int]:
    """GPU bytes (bfloat16, ``context_tokens`` of context) for each way the checkpoint can run: "int4" for a
    4-bit checkpoint; "bfloat16" and "int8" (--quantize int8) for a float one; {} when unreadable."""
    from .memory import memory_by_mode

    try:
        raw = read_json(root / "config.json")
        cfg = OmniConfig.from_dict(raw, str(root / "config.json"))
        quant = checkpoint_quantization(root, raw)
    except (ConfigError, CheckpointError):
        return {}
    modes = memory_by_mode(cfg, torch.bfloat16, context_tokens, four_bit=quant is not None,
                           group_size=quant.group_size if quant is not None else 128)
    return {mode: e.total for mode, e in modes.items()}


__all__ = ["SIDE_FILES", "config_dtype", "memory_modes", "quantization", "verify", "voice_names"]
