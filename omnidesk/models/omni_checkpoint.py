"""The Qwen-Omni checkpoint layout both Qwen families publish, and what reads and writes it the same way.

A Qwen2.5-Omni or Qwen3-Omni repo is config.json, safetensors (sharded with an
index), the tokenizer files, preprocessor_config.json (Whisper features) and
generation_config.json.  Each family's loader, `models verify` and demo writer
differ in the model they build; the steps over that layout are here:

* config.json: the thinker's two parts;
* loading: the side files, the generation config, the refusal of a model too
  large for the device (before any weight is read), and the loaded stack
  (:class:`OmniStackBase`);
* `models verify`: config.json, side files, tensor names/shapes and values, and
  the load test (one thinker decode step on the CPU);
* the demo checkpoints: their safetensors, config.json, generation and
  preprocessor configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..features import FeatureConfig
from . import memory
from .checkpoint import (ConfigError, MappingReport, ModelTooLargeError, Target, VerifyReport, check_values,
                         check_weight_files, config_field, read_json, require_file)

# Read by the tokenizer and the feature extractor, next to config.json and the weights.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


# ---------------------------------------------------------------- config.json

@dataclass(frozen=True)
class ThinkerConfigBase:
    """What every Qwen-Omni ``thinker_config`` holds: the text model's and the audio tower's configs (the
    family's classes), the audio placeholder id (each one takes an audio token's row) and the id that
    opens an audio segment.  A family's ThinkerConfig adds its own fields after these."""

    text: Any
    audio: Any
    audio_token_id: int
    audio_start_token_id: int


def read_thinker_parts(d: dict, where: str, text_config: type, audio_config: type) -> tuple[Any, Any]:
    """The thinker's text model and audio tower configs (``thinker_config.text_config`` / ``.audio_config``,
    each read by the family's ``from_dict``); the tower's tokens fill the text model's input rows, so
    their widths must agree."""
    text = text_config.from_dict(config_field(d, "text_config", where), f"{where}.text_config")
    audio = audio_config.from_dict(config_field(d, "audio_config", where), f"{where}.audio_config")
    if audio.output_dim != text.hidden_size:
        raise ConfigError(f"{where}.audio_config.output_dim {audio.output_dim} != text_config.hidden_size "
                          f"{text.hidden_size}")
    return text, audio


# ---------------------------------------------------------------- loading

def require_side_files(root: Path) -> None:
    """CheckpointError naming the first side file ``root`` lacks."""
    for name in SIDE_FILES:
        require_file(root, name)


def read_generation_config(root: Path) -> dict:
    """generation_config.json ({} when the checkpoint has none; ConfigError naming the file when unreadable)."""
    path = root / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def refuse_if_too_large(root: Path, device: torch.device, dtype: torch.dtype,
                        estimate: Callable[[], memory.MemoryEstimate],
                        check_fits: Callable[[memory.MemoryEstimate, int], str | None],
                        smaller_on_cpu: Callable[[], str] = lambda: "") -> None:
    """ModelTooLargeError naming ``root`` when the model would not fit: on a GPU its free memory
    (``check_fits`` says what to do instead), on the CPU the RAM available now (``smaller_on_cpu``:
    the family's lighter way to run it, if any).  Said before anything is read, instead of dying of
    out-of-memory halfway through loading; ``estimate`` is only computed for those two devices."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = check_fits(estimate(), free)
    elif device.type == "cpu":
        problem = memory.cpu_ram_problem(estimate().total, dtype, smaller_on_cpu())
    else:
        return
    if problem:
        raise ModelTooLargeError(f"{root}: {problem}")


@dataclass
class OmniStackBase:
    """Everything needed to listen, think and talk with one checkpoint: the family's model (a thinker,
    a talker and what turns codes into audio), its tokenizer and features, on one device."""

    path: Path
    config: Any
    model: nn.Module
    tokenizer: Any
    features: FeatureConfig
    generation_config: dict
    dtype: torch.dtype
    device: torch.device

    @property
    def thinker(self):
        return self.model.thinker

    @property
    def talker(self):
        return self.model.talker


# ---------------------------------------------------------------- models verify

def verify_config(root: Path, report: VerifyReport, from_file: Callable[[Path], Any]) -> Any | None:
    """config.json read by the family's ``from_file`` (None, with the problem reported, when it cannot be)."""
    if not (root / "config.json").is_file():
        report.problems.append(f"{root}: missing file config.json")
        return None
    try:
        cfg = from_file(root / "config.json")
    except (ConfigError, OSError) as e:
        report.problems.append(str(e))
        return None
    report.checked.append("config.json")
    return cfg


def verify_side_files(root: Path, report: VerifyReport) -> None:
    for name in SIDE_FILES:
        if (root / name).is_file():
            report.checked.append(name)
        else:
            report.problems.append(f"{root}: missing file {name}")


def verify_tensors(root: Path, report: VerifyReport,
                   check_mapping: Callable[[dict[str, tuple[int, ...]]], MappingReport] | None,
                   unused_as: str | None = None) -> None:
    """The weight files, every tensor's name and shape against the family's mapping (None: no config to
    map with), and every value.  ``unused_as`` names the recognised tensors that are not loaded in the
    summary line ("vision tensors"); None leaves them out of it."""
    shapes, headers, intact = check_weight_files(root, report)
    if check_mapping is not None and intact:
        mapping = check_mapping(shapes)
        if mapping.ok:
            unused = sum(len(v) for v in mapping.unused.values()) if unused_as else 0
            report.checked.append(f"tensor names and shapes ({len(mapping.loaded)} tensors"
                                  + (f"; {unused} {unused_as} not used" if unused else "") + ")")
        else:
            report.problems.append(mapping.error(str(root)))
    if intact:  # every value read once: a damaged file can hold NaN/Inf that no header shows
        check_values(headers, report, headers)


def run_load_test(root: Path, report: VerifyReport, cfg, estimate_memory: Callable[..., memory.MemoryEstimate],
              load_stack: Callable[..., OmniStackBase]) -> None:
    """Load the checkpoint on the CPU in float32 and run one thinker decode step: its logits must be
    finite.  Skipped, with a note, when the RAM available now is too small for it."""
    skipped = memory.ram_too_small(estimate_memory(cfg, torch.float32, context_tokens=16, talker_codes=0).total)
    if skipped:
        report.notes.append(skipped)
        return
    try:
        thinker = load_stack(root, device="cpu", dtype=torch.float32).thinker
        ids = torch.arange(min(4, cfg.thinker.text.vocab_size))
        with torch.inference_mode():
            cache = thinker.new_cache(len(ids) + 1)
            nxt = thinker.logits(thinker(thinker.embed(ids), cache)[-1:]).argmax(-1)
            logits = thinker.logits(thinker(thinker.embed(nxt), cache))
        if not torch.isfinite(logits).all():
            report.problems.append(f"{root}: load test: the thinker decode step gave non-finite logits")
            return
        report.checked.append("load test: loaded on the CPU in float32, one thinker decode step")
    except Exception as e:  # a bad checkpoint must be reported, not raised
        report.problems.append(f"{root}: load test failed ({type(e).__name__}: {e})")


def config_dtype(root: Path) -> str | None:
    """The dtype config.json declares (transformers writes ``torch_dtype`` or ``dtype``)."""
    try:
        raw = read_json(root / "config.json")
    except ConfigError:
        return None
    return raw.get("torch_dtype") or raw.get("dtype") or (raw.get("thinker_config") or {}).get("torch_dtype")


# ---------------------------------------------------------------- demo checkpoints

def whisper_preprocessor(processor_class: str) -> dict:
    """preprocessor_config.json of a demo: the published Whisper features (128 mel bins, 16 kHz, 10 ms hop)."""
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
            "hop_length": 160, "n_fft": 400, "chunk_length": 300, "n_samples": 4800000, "nb_max_frames": 30000,
            "padding_side": "right", "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True,
            "processor_class": processor_class}


def write_demo_files(root: Path, raw: dict, model: nn.Module, wmap: dict[str, Target], ids: dict[str, int],
                     preprocessor: dict) -> None:
    """A demo's model.safetensors (every tensor of ``wmap``, read back from ``model``), config.json
    (``raw``), generation_config.json (the thinker stops at <|im_end|> or <|endoftext|>, ``ids`` as
    the demo tokenizer has them) and preprocessor_config.json."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    tensors = {name: target.destination(params).detach().contiguous().clone() for name, target in wmap.items()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["im_end"], ids["endoftext"]],
                                                             "pad_token_id": ids["endoftext"]}, indent=2))
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))


__all__ = ["OmniStackBase", "SIDE_FILES", "ThinkerConfigBase", "config_dtype", "read_generation_config",
           "read_thinker_parts", "refuse_if_too_large", "require_side_files", "run_load_test", "verify_config",
           "verify_side_files", "verify_tensors", "whisper_preprocessor", "write_demo_files"]
