"""Load a Qwen2.5-Omni checkpoint directory (or a repo id in the local HF cache).

Shared file handling (HF cache, safetensors, name mapping) is in :mod:`omnidesk.models.checkpoint`.

The checkpoint is read as users download it: config.json, (sharded)
safetensors + index, spk_dict.pt, tokenizer files, preprocessor_config.json.
Nothing touches the network.  Checkpoint names are mapped onto our modules by
:func:`weight_map`; fused projections (q/k/v, gate/up) are filled row-slice by
row-slice, so every checkpoint tensor has exactly one destination and every
parameter of ours exactly one source.  Problems are reported by file and
tensor name.

Low VRAM (omnidesk/models/quant.py): a GPTQ / AWQ 4-bit checkpoint (``quantization_config``)
stores its decoder linears as qweight/qzeros/scales(/g_idx); those linears become
:class:`~omnidesk.models.quant.QuantLinear` on the meta model, their parts are unpacked, checked
and fused (q/k/v, gate/up) along the output dimension, then packed once for torch's int4 kernel.
``quantize="int8"`` does the same for a float checkpoint's thinker linears, each tensor quantized
as it is read.  The float weights of quantized linears are never allocated.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import (DEFAULT_DEVICE_DTYPE, CheckpointError, ConfigError, MappingReport, Target, copy_tensors,
                          match_tensors, materialize, checkpoint_shapes, module_targets, require_file, read_json,
                          resolve_checkpoint, unused_by_prefix, weight_files)
from ...features import FeatureConfig
from ..memory import cpu_ram_problem, gib
from ..omni_checkpoint import OmniStackBase, read_generation_config, refuse_if_too_large, require_side_files
from ..quant import (QUANTIZE_CHOICES, QuantConfig, describe_paths, load_linears,
                     path_summary, quant_targets, quantized_in_checkpoint, read_quant_config, replace_linears)
from .config import DecoderConfig, OmniConfig
from .model import OmniModel, decoder_linears, quantizable_linears
from .tokenizer import Tokenizer
from .vocoder import Token2Wav


log = logging.getLogger("omnidesk.models.qwen2_5_omni")

# Checkpoint prefixes we recognise but do not load, with the reason (shown by `models verify`).
UNUSED_PREFIXES = {
    "thinker.visual.": "vision encoder (OmniDesk takes audio only)",
    # hub files store this computed buffer; transformers and we recompute it from the config
    "token2wav.code2wav_dit_model.rotary_embed.inv_freq": "vocoder rotary frequencies (recomputed)",
}
# Checkpoint prefix -> our module prefix for the vocoder, whose names otherwise mirror the checkpoint's.
VOCODER_PREFIXES = {
    "token2wav.code2wav_dit_model.": "vocoder.dit.",
    "token2wav.code2wav_bigvgan_model.": "vocoder.bigvgan.",
}


def _decoder_map(ckpt: str, ours: str, cfg: DecoderConfig, quant: QuantConfig | None = None,
                 quantized: set[str] = frozenset()) -> dict[str, Target]:
    h = cfg.hidden_size
    out: dict[str, Target] = {f"{ckpt}.norm.weight": Target(f"{ours}.norm.weight", (h,))}
    linears = {lin.module: lin for lin in decoder_linears(ckpt, ours, cfg)}
    for i in range(cfg.num_layers):
        c, o = f"{ckpt}.layers.{i}", f"{ours}.layers.{i}"
        for lin in (linears[f"{o}.self_attn.wqkv"], linears[f"{o}.self_attn.o_proj"], linears[f"{o}.mlp.w13"],
                    linears[f"{o}.mlp.down_proj"]):
            if lin.module in quantized:
                out.update(quant_targets(lin, quant))
            else:
                whole = len(lin.parts) == 1
                for p in lin.parts:
                    out[f"{p.prefix}.weight"] = Target(f"{lin.module}.weight", (p.out_features, lin.in_features),
                                                       rows=None if whole else (p.lo, p.hi))
        for p in linears[f"{o}.self_attn.wqkv"].parts:  # q/k/v biases stay float, quantized or not
            out[f"{p.prefix}.bias"] = Target(f"{o}.self_attn.wqkv.bias", (p.out_features,), rows=(p.lo, p.hi))
        out[f"{c}.input_layernorm.weight"] = Target(f"{o}.input_layernorm.weight", (h,))
        out[f"{c}.post_attention_layernorm.weight"] = Target(f"{o}.post_attention_layernorm.weight", (h,))
    return out


def weight_map(cfg: OmniConfig, model: OmniModel | None = None, quant: QuantConfig | None = None,
               quantized: set[str] = frozenset()) -> dict[str, Target]:
    """Checkpoint tensor name -> destination, for every tensor we load; the linears named in ``quantized``
    (our module names) are read as ``quant``'s 4-bit tensors instead of a float ``.weight``."""
    if model is None:
        with torch.device("meta"):
            model = OmniModel(cfg)
    t = cfg.thinker.text
    out = module_targets(model.thinker.audio_encoder, "thinker.audio_tower.", "thinker.audio_encoder.")
    out["thinker.model.embed_tokens.weight"] = Target("thinker.embed_tokens.weight", (t.vocab_size, t.hidden_size))
    out["thinker.lm_head.weight"] = Target("thinker.lm_head.weight", (t.vocab_size, t.hidden_size))
    out.update(_decoder_map("thinker.model", "thinker.decoder", t, quant, quantized))
    if cfg.talker is not None:
        k = cfg.talker.decoder
        out["talker.model.embed_tokens.weight"] = Target("talker.embed_tokens.weight", (k.vocab_size, k.embedding_size))
        out["talker.thinker_to_talker_proj.weight"] = Target("talker.thinker_to_talker_proj.weight",
                                                            (k.hidden_size, k.embedding_size))
        out["talker.thinker_to_talker_proj.bias"] = Target("talker.thinker_to_talker_proj.bias", (k.hidden_size,))
        out["talker.codec_head.weight"] = Target("talker.codec_head.weight", (k.vocab_size, k.hidden_size))
        out.update(_decoder_map("talker.model", "talker.decoder", k, quant, quantized))
    if model.vocoder is not None:
        for ckpt, ours in VOCODER_PREFIXES.items():
            out.update(module_targets(model.get_submodule(ours.rstrip(".")), ckpt, ours))
    return out


# ---------------------------------------------------------------- checks

_unused = unused_by_prefix(UNUSED_PREFIXES)


def without_speech(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint without speech output loads: talker and vocoder tensors are neither
    loaded nor unexpected."""
    return {n: s for n, s in shapes.items() if not n.startswith(("talker.", "token2wav."))}


def check_mapping(cfg: OmniConfig, shapes: dict[str, tuple[int, ...]], model: OmniModel | None = None,
                  quant: QuantConfig | None = None) -> MappingReport:
    """Compare checkpoint tensor names/shapes with what our modules expect (``quant``: the checkpoint's
    quantization_config; its decoder linears with 4-bit tensors are expected in that format)."""
    quantized = quantized_in_checkpoint(quantizable_linears(cfg), shapes, quant)
    report = match_tensors(weight_map(cfg, model, quant, quantized), {n: (s, None) for n, s in shapes.items()},
                           _unused)
    if "thinker.lm_head.weight" in report.missing and cfg.thinker.tie_word_embeddings:
        report.missing.remove("thinker.lm_head.weight")
        report.tied_lm_head = True
    return report


# ---------------------------------------------------------------- the stack

@dataclass
class Voice:
    """One voice of spk_dict.pt, normalised by :func:`voice_from_entry` (unbatched, float32)."""

    name: str
    bos_token: int  # thinker-vocabulary id that starts the talker's text stream
    cond: torch.Tensor  # speaker embedding for the vocoder, [enc_emb_dim]
    ref_mel: torch.Tensor  # reference mel for the vocoder's speaker encoder, [T, mel_dim]


@dataclass
class OmniStack(OmniStackBase):
    """Everything needed to listen, think and talk with one Qwen2.5-Omni checkpoint: an
    :class:`OmniModel`, its :class:`Tokenizer`, the voices of spk_dict.pt."""

    config: OmniConfig
    model: OmniModel
    tokenizer: Tokenizer
    voices: dict[str, Voice]
    # None: float weights; else what is quantized and how it runs: {"format": "gptq-int4" | "awq-int4" | "int8",
    # "label", "group_size", "desc_act", "linears", "paths": {path: count}, "summary"} (see omnidesk.models.quant)
    quantization: dict | None = None

    @property
    def vocoder(self) -> Token2Wav | None:
        return self.model.vocoder

    @property
    def default_voice(self) -> str | None:
        return next(iter(self.voices), None)


@dataclass(frozen=True)
class VoiceDims:
    """What the vocoder needs of a voice: ``cond`` width (the DiT's enc_emb_dim, 192 in the real
    models) and mel bins of ``ref_mel`` (its mel_dim, 80); and the thinker vocabulary, where
    ``bos_token`` must lie."""

    cond: int
    mel: int
    thinker_vocab: int

    @classmethod
    def of(cls, cfg: OmniConfig) -> "VoiceDims":
        from .dit import DiTConfig

        dit = (cfg.token2wav or {}).get("dit_config")
        if not isinstance(dit, dict):
            raise ConfigError("token2wav_config: missing field 'dit_config'")
        d = DiTConfig.from_dict(dit)
        return cls(cond=d.enc_emb_dim, mel=d.mel_dim, thinker_vocab=cfg.thinker.text.vocab_size)


def voice_from_entry(name: str, entry, dims: VoiceDims | None, where: str) -> Voice:
    """One spk_dict.pt entry -> :class:`Voice`, the one place voice shapes are read.

    Accepts the published layout (``cond`` [1, enc_emb_dim], ``ref_mel`` [1, T, mel_dim]) and the
    unbatched one ([enc_emb_dim], [T, mel_dim]); returns the unbatched float32 form.  Raises
    :class:`CheckpointError` naming ``where`` (the file), the voice and the field: a missing field,
    a batch of more than one voice, a width other than the checkpoint's (``dims``; None checks
    everything but the widths), an empty reference mel, NaN or infinite values.
    """
    def fail(field_: str, why: str):
        raise CheckpointError(f"{where}: voice '{name}' field '{field_}' {why}")

    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: voice '{name}' is a {type(entry).__name__}, expected a dict with "
                              f"bos_token, cond and ref_mel")
    missing = [k for k in ("bos_token", "cond", "ref_mel") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: voice '{name}' lacks {', '.join(missing)}")
    bos = entry["bos_token"]
    if isinstance(bos, torch.Tensor) and bos.numel() == 1 and not bos.is_floating_point():
        bos = bos.item()
    if isinstance(bos, bool) or not isinstance(bos, int):
        fail("bos_token", f"is {bos!r}, expected an integer token id")
    if dims is not None and not 0 <= bos < dims.thinker_vocab:
        fail("bos_token", f"is {bos}, outside the thinker vocabulary (0..{dims.thinker_vocab - 1})")

    def tensor(field_: str, width: int | None, rank: int, layout: str) -> torch.Tensor:
        t = entry[field_]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            fail(field_, f"is {type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}, "
                         f"expected a float tensor")
        shape = list(t.shape)
        expected = f"expected {layout} or [1, {layout[1:]}"
        if t.dim() == rank + 1:
            if shape[0] != 1:
                fail(field_, f"has shape {shape}: a batch of {shape[0]} voices; {expected} (one voice)")
            t = t[0]
        elif t.dim() != rank:
            fail(field_, f"has shape {shape}, {expected}")
        if width is not None and t.shape[-1] != width:
            fail(field_, f"has shape {shape}, {expected}")
        if t.numel() == 0:
            fail(field_, f"is empty (shape {shape}), {expected}")
        if not torch.isfinite(t).all():
            fail(field_, f"holds NaN or infinite values (shape {shape})")
        return t.detach().to(torch.float32).contiguous()

    cond_w = dims.cond if dims is not None else None
    mel_w = dims.mel if dims is not None else None
    cond = tensor("cond", cond_w, 1, f"[{cond_w if cond_w is not None else 'enc_emb_dim'}]")
    ref_mel = tensor("ref_mel", mel_w, 2, f"[T, {mel_w if mel_w is not None else 'mel_dim'}]")
    return Voice(name, int(bos), cond, ref_mel)


def load_voices(path: Path, config: OmniConfig | None) -> dict[str, Voice]:
    """Read spk_dict.pt; every voice is checked and normalised by :func:`voice_from_entry`
    against ``config``'s vocoder dims (None: only what needs no config, e.g. when config.json
    itself is broken)."""
    dims = VoiceDims.of(config) if config is not None and config.talker is not None else None
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad pickle
        raise CheckpointError(f"{path}: cannot read voices ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{path}: expected a dict of voices, found {type(raw).__name__}")
    return {str(name): voice_from_entry(str(name), v, dims, str(path)) for name, v in raw.items()}


def checkpoint_quantization(root: Path, raw: dict) -> QuantConfig | None:
    """The checkpoint's 4-bit format: config.json's ``quantization_config`` (top level or the thinker's),
    else a quantize_config.json beside it (older GPTQ tools); None for float weights."""

    extra = root / "quantize_config.json"
    return read_quant_config(raw, str(root / "config.json"), read_json(extra) if extra.is_file() else None, str(extra))


def check_quantize(quantize: str | None) -> str | None:
    """``--quantize`` as given -> None (weights as stored) or "int8"; ConfigError for anything else."""
    if quantize in (None, "", "none"):
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"--quantize '{quantize}': expected one of {', '.join(QUANTIZE_CHOICES)} (4-bit weights "
                          f"come from a GPTQ or AWQ checkpoint)")
    return quantize


def _smaller_on_cpu(cfg: OmniConfig, dtype: torch.dtype, context_tokens: int, mode: str | None) -> str:
    """The refusal's lighter option on the CPU: int8 weights, when they would fit the RAM free now."""
    from .memory import estimate_memory

    if mode is not None:
        return ""
    need = estimate_memory(cfg, dtype, context_tokens, quantization="int8").total
    return "" if cpu_ram_problem(need, dtype) else f"load it with --quantize int8 (about {gib(need)}) or "


def load_stack(model: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               enable_talker: bool = True, context_tokens: int = 8192, quantize: str | None = None,
               force_dequant: bool = False, kernel_dtype: torch.dtype | None = None) -> OmniStack:
    """Load a checkpoint directory or cached repo id into a ready :class:`OmniStack`.

    dtype defaults to fp32 on the CPU and bf16 on CUDA.  A GPTQ/AWQ 4-bit checkpoint loads its
    decoder linears as 4-bit :class:`~omnidesk.models.quant.QuantLinear`; ``quantize="int8"``
    quantizes a float checkpoint's thinker decoder linears to int8 as they are read (ignored, with a
    log line, for a checkpoint that is already 4-bit).  ``force_dequant`` makes 4-bit layers take the
    dequantize-then-matmul path, ``kernel_dtype=torch.float32`` runs the CPU kernels in float32 instead
    of bfloat16 (both for checks and benchmarks; see omnidesk/models/quant.py).  Raises :class:`CheckpointError` /
    :class:`ConfigError` naming the file, field or tensor.
    """
    root = resolve_checkpoint(model)
    device = torch.device(device)
    dtype = dtype or DEFAULT_DEVICE_DTYPE.get(device.type, torch.float32)
    int8 = check_quantize(quantize) == "int8"
    cfg = OmniConfig.from_file(require_file(root, "config.json"))
    quant = checkpoint_quantization(root, cfg.raw)
    if quant is not None and int8:
        log.info("%s is already %s: --quantize int8 ignored", root, quant.label)
        int8 = False
    if not enable_talker and cfg.talker is not None:
        cfg = OmniConfig(thinker=cfg.thinker, talker=None, token2wav=None, raw=cfg.raw)
    from .memory import check_fits, estimate_memory

    mode = "int4" if quant is not None else "int8" if int8 else None
    group = quant.group_size if quant else 128
    # the 7B is ~36 GiB in fp32: more than most desktops have
    refuse_if_too_large(root, device, dtype,
                        lambda: estimate_memory(cfg, dtype, context_tokens, quantization=mode, group_size=group),
                        check_fits, lambda: _smaller_on_cpu(cfg, dtype, context_tokens, mode))
    require_side_files(root)
    voices = load_voices(require_file(root, "spk_dict.pt"), cfg) if cfg.talker is not None else {}
    tokenizer = Tokenizer.from_dir(root)
    features = FeatureConfig.from_preprocessor_config(root / "preprocessor_config.json")
    generation_config = read_generation_config(root)

    files = weight_files(root)
    shapes = checkpoint_shapes(files)
    if cfg.talker is None:  # no speech output
        shapes = without_speech(shapes)

    with torch.device("meta"):
        omni = OmniModel(cfg)
    report = check_mapping(cfg, shapes, omni, quant)
    if not report.ok:
        raise CheckpointError(report.error(str(root)))
    linears = quantizable_linears(cfg)
    four_bit = quantized_in_checkpoint(linears, shapes, quant)
    int8_modules = {lin.module for lin in linears if lin.module.startswith("thinker.")} if int8 else set()
    if quant is not None and not four_bit:
        log.info("%s: quantization_config says %s but no decoder linear is stored quantized: loading float weights",
                 root, quant.label)
    # quantized linears are swapped in on the meta model: their float weights are never allocated
    qmodules = replace_linears(omni, sorted(four_bit | int8_modules))
    materialize(omni.thinker, device, dtype)
    if omni.talker is not None:
        materialize(omni.talker, device, dtype)
        # The reference keeps token2wav in fp32 whatever the LLM dtype: flow matching needs it.
        materialize(omni.vocoder, device, torch.float32)
    params = dict(omni.named_parameters())
    wmap = weight_map(cfg, omni, quant, four_bit)

    special = {n for n in report.loaded if wmap[n].param.rpartition(".")[0] in qmodules
               and not wmap[n].param.endswith(".bias")}
    copy_tensors(files, [n for n in report.loaded if n not in special], wmap, params)
    load_linears(files, linears, qmodules, device, dtype, quant, four_bit, int8_modules, force_dequant=force_dequant,
                 kernel_dtype=kernel_dtype)
    with torch.no_grad():
        if report.tied_lm_head:
            omni.thinker.lm_head.weight = omni.thinker.embed_tokens.weight
    omni.eval()
    quantization = None
    if qmodules:
        paths = path_summary(omni)
        fmt = f"{quant.method}-int{quant.bits}" if four_bit else "int8"
        label = quant.label if four_bit else "int8 (made on load, per output channel)"
        summary = f"{label}: {describe_paths(paths)}"
        quantization = {"format": fmt, "label": label, "group_size": quant.group_size if four_bit else None,
                        "desc_act": quant.desc_act if four_bit else None, "linears": len(qmodules), "paths": paths,
                        "summary": summary}
        dequant = sorted({m.reason for m in qmodules.values() if m.reason})
        log.info("%s on %s: %s%s", root, device, summary, f" (dequantized because: {'; '.join(dequant)})"
                 if dequant else "")
    return OmniStack(path=root, config=cfg, model=omni, tokenizer=tokenizer, features=features, voices=voices,
                     generation_config=generation_config, dtype=dtype,
                     device=device, quantization=quantization)


__all__ = ["OmniModel", "OmniStack", "Voice", "VoiceDims", "check_mapping", "check_quantize", "checkpoint_quantization",
           "decoder_linears", "load_stack", "load_voices", "quantizable_linears", "voice_from_entry", "weight_map"]
