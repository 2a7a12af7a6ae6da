"""`models verify` for a Qwen3-Omni checkpoint: file by file, tensor by tensor, then a load test.

Never raises for a bad checkpoint: every problem goes into the report as a
message naming the file or tensor.  The load test needs the whole model in
fp32 RAM (about 130 GiB for the real one), so on a desktop it is skipped with a
note and the tensor-level checks are what verifies the download.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import memory
from ..checkpoint import ConfigError, VerifyReport, check_values, check_weight_files, read_json
from ..qwen2_5_omni.verify import config_dtype
from . import loading
from .config import Qwen3OmniConfig
from .loading import check_mapping
from .memory import estimate_memory

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


def _load_test(root: Path, cfg: Qwen3OmniConfig, report: VerifyReport) -> None:
    skipped = memory.ram_too_small(estimate_memory(cfg, torch.float32, context_tokens=16, talker_codes=0).total)
    if skipped:
        report.notes.append(skipped)
        return
    try:
        stack = loading.load_stack(root, device="cpu", dtype=torch.float32)
        thinker = stack.thinker
        ids = torch.arange(min(4, cfg.thinker.text.vocab_size))
        with torch.inference_mode():
            cache = thinker.new_cache(len(ids) + 1)
            hidden, _ = thinker(thinker.embed(ids), cache, hidden_layer=0)
            nxt = thinker.logits(hidden[-1:]).argmax(-1)
            hidden, _ = thinker(thinker.embed(nxt), cache, hidden_layer=0)
            logits = thinker.logits(hidden)
        if not torch.isfinite(logits).all():
            report.problems.append(f"{root}: load test: the thinker decode step gave non-finite logits")
            return
        report.checked.append("load test: loaded on the CPU in float32, one thinker decode step")
    except Exception as e:  # a bad checkpoint must be reported, not raised
        report.problems.append(f"{root}: load test failed ({type(e).__name__}: {e})")


def verify(root: Path, report: VerifyReport, load_test: bool = True) -> None:
    """Check ``root`` into ``report``: config, side files, tensor names and shapes (experts one
    tensor each, vision listed as unused), and (``load_test``, when nothing else is wrong and
    the RAM allows) a CPU load with one thinker decode step."""
    cfg = None
    if not (root / "config.json").is_file():
        report.problems.append(f"{root}: missing file config.json")
    else:
        try:
            cfg = Qwen3OmniConfig.from_file(root / "config.json")
            report.checked.append("config.json")
            report.unsupported = _unsupported(cfg)
        except (ConfigError, OSError) as e:
            report.problems.append(str(e))
    for name in SIDE_FILES:
        if (root / name).is_file():
            report.checked.append(name)
        else:
            report.problems.append(f"{root}: missing file {name}")
    shapes, headers, intact = check_weight_files(root, report)
    if cfg is not None and intact:
        mapping = check_mapping(cfg, shapes)
        if mapping.ok:
            unused = sum(len(v) for v in mapping.unused.values())
            report.checked.append(f"tensor names and shapes ({len(mapping.loaded)} tensors"
                                  + (f"; {unused} vision tensors not used" if unused else "") + ")")
        else:
            report.problems.append(mapping.error(str(root)))
    if intact:  # every value read once: a damaged file can hold NaN/Inf that no header shows
        check_values(headers, report, headers)
    if load_test and report.usable:
        _load_test(root, cfg, report)


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
