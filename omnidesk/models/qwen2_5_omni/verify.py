"""`models verify` for a Qwen2.5-Omni checkpoint: file by file, tensor by tensor, then a load test.

Never raises for a bad checkpoint: every problem goes into the report as a
message naming the file, voice or tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import CheckpointError, ConfigError, VerifyReport, check_values, check_weight_files, read_json
from .. import memory
from .config import OmniConfig
from . import loading
from .loading import check_mapping, checkpoint_quantization, load_voices
from .memory import estimate_memory

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


def _load_test(root: Path, cfg: OmniConfig, report: VerifyReport) -> None:
    skipped = memory.ram_too_small(estimate_memory(cfg, torch.float32, context_tokens=16, talker_codes=0).total)
    if skipped:
        report.notes.append(skipped)
        return
    try:
        stack = loading.load_stack(root, device="cpu", dtype=torch.float32)  # looked up now: tests swap it
        thinker = stack.thinker
        ids = torch.arange(min(4, cfg.thinker.text.vocab_size))
        with torch.inference_mode():
            cache = thinker.new_cache(len(ids) + 1)
            logits = thinker.logits(thinker(thinker.embed(ids), cache)[-1:])
            nxt = logits.argmax(-1)
            logits = thinker.logits(thinker(thinker.embed(nxt), cache))
        if not torch.isfinite(logits).all():
            report.problems.append(f"{root}: load test: the thinker decode step gave non-finite logits")
            return
        report.checked.append("load test: loaded on the CPU in float32, one thinker decode step")
    except Exception as e:  # a bad checkpoint must be reported, not raised
        report.problems.append(f"{root}: load test failed ({type(e).__name__}: {e})")


def verify(root: Path, report: VerifyReport, load_test: bool = True) -> None:
    """Check ``root`` into ``report``: config, side files, voices, tensor names and shapes, and
    (``load_test``, when nothing else is wrong) a CPU load with one thinker decode step."""
    cfg = quant = None
    if not (root / "config.json").is_file():
        report.problems.append(f"{root}: missing file config.json")
    else:
        try:
            cfg = OmniConfig.from_file(root / "config.json")
            report.checked.append("config.json")
        except (ConfigError, OSError) as e:
            report.problems.append(str(e))
    if cfg is not None:
        try:
            quant = checkpoint_quantization(root, cfg.raw)
            if quant is not None:
                report.checked.append(f"quantization_config ({quant.label}, group size {quant.group_size}"
                                      f"{', act-order' if quant.desc_act else ''})")
        except (ConfigError, CheckpointError) as e:
            report.problems.append(str(e))
    for name in SIDE_FILES:
        if (root / name).is_file():
            report.checked.append(name)
        else:
            report.problems.append(f"{root}: missing file {name}")
    if cfg is None or cfg.talker is not None:
        if not (root / "spk_dict.pt").is_file():
            report.problems.append(f"{root}: missing file spk_dict.pt")
        else:
            try:  # the loader's own check: shapes against the checkpoint's dims, naming voice and field
                voices = load_voices(root / "spk_dict.pt", cfg)
                report.checked.append(f"spk_dict.pt ({len(voices)} voices)")
            except (CheckpointError, ConfigError) as e:
                report.problems.append(str(e))
    shapes, headers, intact = check_weight_files(root, report)
    if cfg is not None and intact:
        if cfg.talker is None:
            shapes = {n: s for n, s in shapes.items() if not n.startswith(("talker.", "token2wav."))}
        mapping = check_mapping(cfg, shapes, quant=quant)
        if mapping.ok:
            report.checked.append(f"tensor names and shapes ({len(mapping.loaded)} tensors)")
        else:
            report.problems.append(mapping.error(str(root)))
    if intact:  # every value read once: a damaged file can hold NaN/Inf that no header shows
        check_values(headers, report, headers)
    if load_test and not report.problems:
        _load_test(root, cfg, report)


def voice_names(root: Path) -> list[str]:
    """The voices of spk_dict.pt ([] when unreadable: verify reports why)."""
    try:
        return list(load_voices(root / "spk_dict.pt", OmniConfig.from_dict(read_json(root / "config.json"))))
    except (CheckpointError, ConfigError, OSError):
        return []


def config_dtype(root: Path) -> str | None:
    """The dtype config.json declares (transformers writes ``torch_dtype`` or ``dtype``)."""
    try:
        raw = read_json(root / "config.json")
    except ConfigError:
        return None
    return raw.get("torch_dtype") or raw.get("dtype") or (raw.get("thinker_config") or {}).get("torch_dtype")


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
