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

import torch

from ..checkpoint import (DEFAULT_DEVICE_DTYPE, CheckpointError, MappingReport, Target, copy_tensors, match_tensors,
                          materialize, checkpoint_shapes, module_targets, require_file, resolve_checkpoint,
                          unused_by_prefix, weight_files)
from ...features import FeatureConfig
from ..omni_checkpoint import OmniStackBase, read_generation_config, refuse_if_too_large, require_side_files
from ..qwen2_5_omni.tokenizer import Tokenizer
from .config import Qwen3OmniConfig
from .code2wav import Code2Wav
from .model import Qwen3OmniModel
from .talker import talker_weight_map
from .thinker import thinker_weight_map

# Checkpoint prefixes we recognise but do not load, with the reason (shown by `models verify`).
UNUSED_PREFIXES = {
    "thinker.visual.": "vision encoder (OmniDesk takes audio only)",
}


def weight_map(cfg: Qwen3OmniConfig, model: Qwen3OmniModel | None = None) -> dict[str, Target]:
    """Checkpoint tensor name -> destination, for every tensor we load."""
    if model is None:
        with torch.device("meta"):
            model = Qwen3OmniModel(cfg)
    out = module_targets(model.thinker.audio_encoder, "thinker.audio_tower.", "thinker.audio_encoder.")
    out.update(thinker_weight_map(cfg.thinker))
    if model.talker is not None:
        out.update(talker_weight_map(cfg.talker))
    if model.code2wav is not None:
        out.update(module_targets(model.code2wav, "code2wav.", "code2wav."))
    return out


_unused = unused_by_prefix(UNUSED_PREFIXES)


def check_mapping(cfg: Qwen3OmniConfig, shapes: dict[str, tuple[int, ...]],
                  model: Qwen3OmniModel | None = None) -> MappingReport:
    """Compare checkpoint tensor names/shapes with what our modules expect."""
    return match_tensors(weight_map(cfg, model), {n: (s, None) for n, s in shapes.items()}, _unused)


@dataclass
class Qwen3OmniStack(OmniStackBase):
    """Everything needed to listen, think and talk with one Qwen3-Omni checkpoint: a
    :class:`Qwen3OmniModel`, its tokenizer, the speakers of config.json."""

    config: Qwen3OmniConfig
    model: Qwen3OmniModel
    tokenizer: Tokenizer

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

    # the real model is ~130 GiB in fp32
    refuse_if_too_large(root, device, dtype, lambda: estimate_memory(cfg, dtype, context_tokens), check_fits)
    require_side_files(root)
    tokenizer = Tokenizer.from_dir(root)
    # The Qwen3-Omni processor pads an utterance to the longest of its batch (itself), not to 30 s
    # (Qwen3OmniMoeProcessor: padding=True): floor(n / hop) frames, the end reflected.
    features = dataclasses.replace(FeatureConfig.from_preprocessor_config(root / "preprocessor_config.json"),
                                   pad_to_longest=True)
    generation_config = read_generation_config(root)

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
