"""`models verify` for a Moshi checkpoint (the published kyutai/moshiko|moshika-pytorch-bf16 layout).

Files (``model.safetensors``, the Mimi ``tokenizer-e351c8d8-checkpoint125.safetensors``,
``tokenizer_spm_32k_3.model``, an optional config.json), every tensor name,
shape and dtype of both safetensors files against our modules, then a CPU
load with one frame step when the RAM allows.  Never raises for a bad
checkpoint: every problem goes into the report naming the file or tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checkpoint import (CheckpointError, ConfigError, VerifyReport, check_values, header_tensors,
                          read_safetensors_header)
from .. import memory
from .executor import estimate_memory, load_moshi, read_config, read_mimi_config
from .lm import check_mapping
from .mimi import check_mimi_tensors


def verify(root: Path, report: VerifyReport, load_test: bool = True) -> None:
    try:
        cfg, raw = read_config(root)
        report.checked.append("config.json" if raw else "no config.json: the published Moshi 7B layout")
        mimi_cfg = read_mimi_config(root, cfg)
    except (ConfigError, CheckpointError) as e:
        report.problems.append(str(e))
        return
    checks = ((cfg.moshi_name, "the language model", lambda h: check_mapping(cfg, h)),
              (cfg.mimi_name, "the Mimi codec", lambda h: check_mimi_tensors(mimi_cfg, header_tensors(h))))
    weights: list[Path] = []
    for name, what, check in checks:
        path = root / name
        if not path.is_file():
            report.problems.append(f"{root}: missing file {name} ({what})")
            continue
        try:
            mapping = check(read_safetensors_header(path))
        except (CheckpointError, OSError) as e:
            report.problems.append(str(e))
            continue
        if mapping.ok:
            report.checked.append(f"{name}: tensor names, shapes and dtypes ({len(mapping.loaded)} tensors)")
            weights.append(path)
        else:
            report.problems.append(mapping.error(str(path)))
    if weights:  # every value read once: a damaged file can hold NaN/Inf that no header shows
        check_values(weights, report)
    if (root / cfg.tokenizer_name).is_file():
        report.checked.append(cfg.tokenizer_name)
    else:
        report.problems.append(f"{root}: missing file {cfg.tokenizer_name} (the text tokenizer)")
    if not load_test or report.problems:
        return
    skipped = memory.ram_too_small(estimate_memory(cfg, torch.float32, context=8, mimi_cfg=mimi_cfg).total)
    if skipped:
        report.notes.append(skipped)
        return
    try:
        # one frame: compiling the step first would only cost time
        ex = load_moshi(root, device="cpu", dtype=torch.float32, greedy=True, context=8, compile="off")
        out = ex.step(np.zeros(ex.frame_samples_in, dtype=np.float32))
        if not np.isfinite(out.audio).all():
            report.problems.append(f"{root}: load test: one frame step gave non-finite audio")
            return
        report.checked.append("load test: loaded on the CPU in float32, one frame step")
    except Exception as e:  # a bad checkpoint must be reported, not raised
        report.problems.append(f"{root}: load test failed ({type(e).__name__}: {e})")


__all__ = ["verify"]
