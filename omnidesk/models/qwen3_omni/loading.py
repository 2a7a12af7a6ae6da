"""Load a Qwen3-Omni checkpoint directory (or a repo id in the local HF cache).

The published layout: config.json, 15 safetensors shards + index, tokenizer
files, preprocessor_config.json and generation_config.json; no voice file (the
three speakers are codec ids in config.json).  Experts are stored one tensor
per expert; each is copied into its row of our stacked expert weights
(``Target(index=expert, rows=...)``), so fusing costs nothing extra.

Peak memory stays near one copy of the model: our modules are built on the
meta device, given their final storage once (:func:`materialize`), and filled
shard by shard, one tensor at a time (:func:`copy_tensors`).  The vision
encoder is recognised and not loaded (OmniDesk takes audio only).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import (DEFAULT_DEVICE_DTYPE, CheckpointError, MappingReport, ModelTooLargeError, Target,
                          copy_tensors, match_tensors, materialize, checkpoint_shapes, require_file,
                          read_json, resolve_checkpoint, weight_files)
from ...features import FeatureConfig
from ..memory import cpu_ram_problem
from ..qwen2_5_omni.tokenizer import Tokenizer
from .config import Qwen3OmniConfig
from .code2wav import Code2Wav
from .model import Qwen3OmniModel
from .talker import Talker, talker_weight_map
from .thinker import Thinker, thinker_weight_map

# Checkpoint prefixes we recognise but do not load, with the reason (shown by `models verify`).
UNUSED_PREFIXES = {
    "thinker.visual.": "vision encoder (OmniDesk takes audio only)",
}


def weight_map(cfg: Qwen3OmniConfig, model: Qwen3OmniModel | None = None) -> dict[str, Target]:
    """Checkpoint tensor name -> destination, for every tensor we load."""
    if model is None:
        with torch.device("meta"):
            model = Qwen3OmniModel(cfg)
    out: dict[str, Target] = {}
    for name, p in model.thinker.audio_encoder.state_dict().items():
        out[f"thinker.audio_tower.{name}"] = Target(f"thinker.audio_encoder.{name}", tuple(p.shape))
    out.update(thinker_weight_map(cfg.thinker))
    if model.talker is not None:
        out.update(talker_weight_map(cfg.talker))
    if model.code2wav is not None:
        for name, p in model.code2wav.state_dict().items():
            out[f"code2wav.{name}"] = Target(f"code2wav.{name}", tuple(p.shape))
    return out


def _unused(name: str) -> str | None:
    return next((r for p, r in UNUSED_PREFIXES.items() if name.startswith(p)), None)


def check_mapping(cfg: Qwen3OmniConfig, shapes: dict[str, tuple[int, ...]],
                  model: Qwen3OmniModel | None = None) -> MappingReport:
    """Compare checkpoint tensor names/shapes with what our modules expect."""
    return match_tensors(weight_map(cfg, model), {n: (s, None) for n, s in shapes.items()}, _unused)


@dataclass
class Qwen3OmniStack:
    """Everything needed to listen, think and talk with one Qwen3-Omni checkpoint."""

    path: Path
    config: Qwen3OmniConfig
    model: Qwen3OmniModel
    tokenizer: Tokenizer
    features: FeatureConfig
    generation_config: dict
    dtype: torch.dtype
    device: torch.device

    @property
    def thinker(self) -> Thinker:
        return self.model.thinker

    @property
    def talker(self) -> Talker | None:
        return self.model.talker

    @property
    def code2wav(self) -> Code2Wav | None:
        return self.model.code2wav

    @property
    def voices(self) -> dict[str, int]:
        """Speaker name ("Ethan") -> codec id, from config.json."""
        return self.config.talker.voices if self.config.talker is not None else {}

    @property
    def default_voice(self) -> str | None:
        # the reference's generate() speaks as Ethan unless told otherwise
        return "Ethan" if "Ethan" in self.voices else next(iter(self.voices), None)

    def voice_named(self, name: str | None) -> str | None:
        """The voice ``name`` names, in any case as the reference's generate() takes it ("ethan" ->
        "Ethan"); the default voice for None; None when the config has no such speaker."""
        wanted = (name or self.default_voice or "").lower()
        return next((v for v in self.voices if v.lower() == wanted), None)


def load_stack(model: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               context_tokens: int = 8192) -> Qwen3OmniStack:
    """Load a checkpoint directory or cached repo id into a ready :class:`Qwen3OmniStack`.

    dtype defaults to fp32 on the CPU and bf16 on CUDA; code2wav always runs in fp32 (a small
    convolutional net whose output is the audio itself).  Raises :class:`CheckpointError` /
    :class:`ConfigError` naming the file or tensor, :class:`ModelTooLargeError` before loading
    when the GPU is too small."""
    root = resolve_checkpoint(model)
    device = torch.device(device)
    dtype = dtype or DEFAULT_DEVICE_DTYPE.get(device.type, torch.float32)
    cfg = Qwen3OmniConfig.from_file(require_file(root, "config.json"))
    if cfg.talker is None:
        raise CheckpointError(f"{root}: this checkpoint has no talker (enable_audio_output is false: a -Thinking "
                              f"or -Captioner model); OmniDesk needs one that speaks")
    from .memory import check_fits, estimate_memory

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = check_fits(estimate_memory(cfg, dtype, context_tokens), free)
        if problem:
            raise ModelTooLargeError(f"{root}: {problem}")
    elif device.type == "cpu":  # the real model is ~130 GiB in fp32
        problem = cpu_ram_problem(estimate_memory(cfg, dtype, context_tokens).total, dtype)
        if problem:
            raise ModelTooLargeError(f"{root}: {problem}")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        require_file(root, name)
    tokenizer = Tokenizer.from_dir(root)
    # The Qwen3-Omni processor pads an utterance to the longest of its batch (itself), not to 30 s
    # (Qwen3OmniMoeProcessor: padding=True): floor(n / hop) frames, the end reflected.
    features = dataclasses.replace(FeatureConfig.from_preprocessor_config(root / "preprocessor_config.json"),
                                   pad_to_longest=True)
    gen_path = root / "generation_config.json"
    generation_config = read_json(gen_path) if gen_path.is_file() else {}  # ConfigError naming the file

    files = weight_files(root)
    shapes = checkpoint_shapes(files)

    with torch.device("meta"):
        omni = Qwen3OmniModel(cfg)
    report = check_mapping(cfg, shapes, omni)
    if not report.ok:
        raise CheckpointError(report.error(str(root)))
    materialize(omni.thinker, device, dtype)
    materialize(omni.talker, device, dtype)
    materialize(omni.code2wav, device, torch.float32)
    params = dict(omni.named_parameters())
    params.update(dict(omni.named_buffers()))
    copy_tensors(files, report.loaded, weight_map(cfg, omni), params)
    omni.eval()
    return Qwen3OmniStack(path=root, config=cfg, model=omni, tokenizer=tokenizer, features=features,
                          generation_config=generation_config, dtype=dtype, device=device)


__all__ = ["Qwen3OmniModel", "Qwen3OmniStack", "UNUSED_PREFIXES", "check_mapping", "load_stack", "weight_map"]
