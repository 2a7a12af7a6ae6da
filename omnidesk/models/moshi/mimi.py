"""Mimi, Kyutai's streaming speech codec: 24 kHz audio <-> 12.5 Hz frames of codebook ids.

One 80 ms frame (1920 samples) goes through::

    encode: SEANet encoder (960x down, 25 Hz) -> causal transformer -> conv /2 (12.5 Hz) -> split RVQ -> codes
    decode: codes -> split RVQ sum -> transposed conv x2 (25 Hz) -> causal transformer -> SEANet decoder

Everything is causal, so :class:`Mimi` streams frame by frame with explicit,
preallocated state (batch 1): each causal conv keeps its left context, each
transposed conv its overlap-add tail, each transformer a ring of the last
``context`` steps of keys and values.  The encoder and decoder streams are
independent (in a duplex call one carries the user, the other the model).

The transformer context is defined the way Kyutai's streaming code runs it: at
each frame, a step sees the steps of the ring as it stands after that frame is
written, i.e. the last ``context`` steps up to the frame's last step.  The
frame's first step therefore sees ``context - 1`` past steps once the ring is
full; Kyutai's one-shot (non-streaming) call differs from its own streaming
there, ours does not: one-shot and frame-by-frame give the same result.

The config and its presets are :mod:`omnidesk.models.moshi.mimi_config`, the transformers
:mod:`omnidesk.models.moshi.mimi_transformer`.  Weights load from the published checkpoint
(``tokenizer-e351c8d8-checkpoint125.safetensors`` in kyutai/moshiko-pytorch-bf16) by
:func:`load_mimi`, through :func:`weight_map`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import (CheckpointError, MappingReport, Target, copy_tensors, header_tensors, match_tensors,
                          read_safetensors_header)
from .mimi_config import DEMO, MIMI, MimiConfig
from .mimi_transformer import MimiTransformer, TransformerLayer
from .quantizer import Codebook, QuantizerConfig, SplitResidualVQ
from .seanet import CausalConv1d, CausalConvTranspose1d, SEANetConfig, SEANetDecoder, SEANetEncoder, reset_streaming

MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"


# ---------------------------------------------------------------- the codec

class Mimi(nn.Module):
    """The codec, with streaming state for one encoder stream and one decoder stream (batch 1).

    ``encode_frame`` / ``decode_frame`` advance a stream by one frame; ``encode`` /
    ``decode`` process a whole signal, restarting that stream first (its state
    afterwards is as if those frames had been streamed).  ``reset`` restarts both.
    ``num_codebooks`` (how many codes ``encode`` returns) can be changed at any time.
    """

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        self.num_codebooks = cfg.num_codebooks
        dim, stride = cfg.seanet.dimension, cfg.steps_per_frame
        self.encoder = SEANetEncoder(cfg.seanet)
        self.encoder_transformer = MimiTransformer(cfg.transformer, stride)
        # 25 Hz -> 12.5 Hz: a learnt strided conv; its first frame's left context repeats the first step
        self.downsample = (CausalConv1d(dim, dim, 2 * stride, stride=stride, bias=False, pad_mode="replicate")
                           if stride > 1 else None)
        self.quantizer = SplitResidualVQ(cfg.quantizer)
        # 12.5 Hz -> 25 Hz: depthwise (one filter per channel, as the published weights are)
        self.upsample = (CausalConvTranspose1d(dim, dim, 2 * stride, stride, groups=dim, bias=False)
                         if stride > 1 else None)
        self.decoder_transformer = MimiTransformer(cfg.transformer, stride)
        self.decoder = SEANetDecoder(cfg.seanet)

    @property
    def frame_size(self) -> int:
        return self.cfg.frame_size

    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    def _like(self) -> torch.Tensor:
        """A weight: inputs are moved to its device and dtype."""
        return self.quantizer.semantic.input_proj.weight

    # -- state
    def reset(self) -> None:
        """Restart both streams (zero left contexts and tails, empty KV rings, positions at 0)."""
        self.reset_encoder()
        self.reset_decoder()

    def reset_encoder(self) -> None:
        reset_streaming(self.encoder)
        self.encoder_transformer.reset()
        if self.downsample is not None:
            self.downsample.reset()

    def reset_decoder(self) -> None:
        if self.upsample is not None:
            self.upsample.reset()
        self.decoder_transformer.reset()
        reset_streaming(self.decoder)

    # -- encoder side
    def _encode(self, pcm: torch.Tensor) -> torch.Tensor:
        latent = self.encoder_transformer(self.encoder(pcm.to(self._like()).view(1, 1, -1)))
        if self.downsample is not None:
            latent = self.downsample(latent)
        return self.quantizer.encode(latent, self.num_codebooks)

    @torch.no_grad()
    def encode_frame(self, pcm: torch.Tensor) -> torch.Tensor:
        """Next frame of the encoder stream: pcm [frame_size] (float, -1..1) -> codes [num_codebooks] (int64)."""
        if pcm.shape != (self.frame_size,):
            raise ValueError(f"encode_frame takes one frame of {self.frame_size} samples, got {tuple(pcm.shape)}")
        return self._encode(pcm)[:, 0]

    @torch.no_grad()
    def encode(self, pcm: torch.Tensor, chunk_frames: int = 250) -> torch.Tensor:
        """A whole signal [T] -> codes [num_codebooks, ceil(T / frame_size)]; the last frame is zero-padded.

        Restarts the encoder stream.  Runs `chunk_frames` frames at a time to bound memory
        (activations and attention grow with the chunk); the codes do not depend on the chunking.
        """
        if pcm.dim() != 1 or pcm.shape[0] == 0:
            raise ValueError(f"encode takes a non-empty 1-D signal, got shape {tuple(pcm.shape)}")
        self.reset_encoder()
        pcm = F.pad(pcm, (0, -pcm.shape[0] % self.frame_size))
        return torch.cat([self._encode(chunk) for chunk in pcm.split(chunk_frames * self.frame_size)], dim=1)

    # -- decoder side
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        if not self.quantizer.n_q_semantic <= n <= self.cfg.quantizer.n_q:
            raise ValueError(f"decode needs between {self.quantizer.n_q_semantic} and {self.cfg.quantizer.n_q} "
                             f"codebooks, got {n}")
        latent = self.quantizer.decode(codes.to(self._like().device, torch.long))
        if self.upsample is not None:
            latent = self.upsample(latent)
        return self.decoder(self.decoder_transformer(latent)).view(-1).float()

    @torch.no_grad()
    def decode_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Next frame of the decoder stream: codes [K] -> pcm [frame_size] (float32)."""
        if codes.dim() != 1:
            raise ValueError(f"decode_frame takes the codes of one frame [K], got shape {tuple(codes.shape)}")
        return self._decode(codes[:, None])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, chunk_frames: int = 250) -> torch.Tensor:
        """codes [K, frames] -> pcm [frames * frame_size] (float32).

        Restarts the decoder stream; runs `chunk_frames` frames at a time, as :meth:`encode`.
        """
        if codes.dim() != 2:
            raise ValueError(f"decode takes codes [K, frames], got shape {tuple(codes.shape)}")
        self.reset_decoder()
        return torch.cat([self._decode(chunk) for chunk in codes.split(chunk_frames, dim=1)])


# ---------------------------------------------------------------- weights

# Checkpoint tensors recognised but not loaded, by name suffix, with the reason (for `models verify`).
UNUSED_SUFFIXES = {"._codebook._initialized": "codebook k-means initialisation flag (training only)"}


def _checkpoint_names(cfg: MimiConfig) -> tuple[dict[str, str], dict[str, str]]:
    """(checkpoint name -> our name, alias checkpoint name -> checkpoint name).

    Checkpoint names are Kyutai's MimiModel state-dict names, as published: SEANet layers
    are indexed in one ``nn.Sequential`` (ELUs take indices too), convs nest twice
    (``conv.conv``), and attention projections use the legacy ``in_proj_weight`` /
    ``out_proj.weight``.  The aliases are the spelling the moshi package's own
    ``state_dict()`` writes today (``in_projs.0.weight`` / ``out_projs.0.weight``).
    """
    s, q, t = cfg.seanet, cfg.quantizer, cfg.transformer
    names: dict[str, str] = {}
    aliases: dict[str, str] = {}

    def conv(ckpt: str, ours: str, kind: str = "conv") -> None:
        for p in ("weight", "bias"):
            names[f"{ckpt}.{kind}.{kind}.{p}"] = f"{ours}.{kind}.{p}"

    def residuals(ckpt: str, idx: int, ours: str) -> int:
        for j in range(s.n_residual_layers):
            conv(f"{ckpt}.{idx}.block.1", f"{ours}.residuals.{j}.conv1")
            conv(f"{ckpt}.{idx}.block.3", f"{ours}.residuals.{j}.conv2")
            idx += 1
        return idx

    # encoder: conv, [residuals, ELU, strided conv] per ratio, ELU, conv
    conv("encoder.model.0", "encoder.input_conv")
    idx = 1
    for i in range(len(s.ratios)):
        idx = residuals("encoder.model", idx, f"encoder.stages.{i}")
        conv(f"encoder.model.{idx + 1}", f"encoder.stages.{i}.downsample")
        idx += 2
    conv(f"encoder.model.{idx + 1}", "encoder.output_conv")
    # decoder: conv, [ELU, transposed conv, residuals] per ratio, ELU, conv
    conv("decoder.model.0", "decoder.input_conv")
    idx = 1
    for i in range(len(s.ratios)):
        conv(f"decoder.model.{idx + 1}", f"decoder.stages.{i}.upsample", kind="convtr")
        idx = residuals("decoder.model", idx + 2, f"decoder.stages.{i}")
    conv(f"decoder.model.{idx + 1}", "decoder.output_conv")

    for side in ("encoder", "decoder"):
        ckpt, ours = f"{side}_transformer", f"{side}_transformer"
        if t.input_dimension != t.d_model:
            names[f"{ckpt}.input_proj.weight"] = f"{ours}.input_proj.weight"
        if t.output_dimension != t.d_model:
            names[f"{ckpt}.output_projs.0.weight"] = f"{ours}.output_proj.weight"
        for i in range(t.num_layers):
            c, o = f"{ckpt}.transformer.layers.{i}", f"{ours}.layers.{i}"
            names[f"{c}.self_attn.in_proj_weight"] = f"{o}.wqkv.weight"
            names[f"{c}.self_attn.out_proj.weight"] = f"{o}.wo.weight"
            aliases[f"{c}.self_attn.in_projs.0.weight"] = f"{c}.self_attn.in_proj_weight"
            aliases[f"{c}.self_attn.out_projs.0.weight"] = f"{c}.self_attn.out_proj.weight"
            for norm, our_norm in (("norm1", "attn_norm"), ("norm2", "ffn_norm")):
                names[f"{c}.{norm}.weight"] = f"{o}.{our_norm}.weight"
                names[f"{c}.{norm}.bias"] = f"{o}.{our_norm}.bias"
            names[f"{c}.linear1.weight"] = f"{o}.w1.weight"
            names[f"{c}.linear2.weight"] = f"{o}.w2.weight"
            if t.layer_scale is not None:
                names[f"{c}.layer_scale_1.scale"] = f"{o}.attn_scale"
                names[f"{c}.layer_scale_2.scale"] = f"{o}.ffn_scale"

    if cfg.steps_per_frame > 1:
        names["downsample.conv.conv.conv.weight"] = "downsample.conv.weight"
        names["upsample.convtr.convtr.convtr.weight"] = "upsample.convtr.weight"

    for ckpt, ours, n in (("rvq_first", "semantic", q.n_q_semantic), ("rvq_rest", "acoustic", q.n_q - q.n_q_semantic)):
        for proj in ("input_proj", "output_proj"):
            names[f"quantizer.{ckpt}.{proj}.weight"] = f"quantizer.{ours}.{proj}.weight"
        for k in range(n):
            for buf in ("embedding_sum", "cluster_usage"):
                names[f"quantizer.{ckpt}.vq.layers.{k}._codebook.{buf}"] = f"quantizer.{ours}.codebooks.{k}.{buf}"
    return names, aliases


def weight_map(cfg: MimiConfig, model: Mimi | None = None) -> dict[str, Target]:
    """Checkpoint tensor name -> destination, for every tensor we load (canonical published names)."""
    if model is None:
        with torch.device("meta"):
            model = Mimi(cfg)
    ours = model.state_dict()
    names, _ = _checkpoint_names(cfg)
    return {ckpt: Target(param, tuple(ours[param].shape)) for ckpt, param in names.items()}


def _unused(name: str) -> str | None:
    return next((r for suffix, r in UNUSED_SUFFIXES.items() if name.endswith(suffix)), None)


def check_mimi_tensors(cfg: MimiConfig, found: dict[str, tuple[tuple[int, ...], str | None]],
                       model: Mimi | None = None) -> MappingReport:
    """Compare a checkpoint's tensors (name -> (shape, safetensors dtype or None)) with what our modules expect."""
    _, aliases = _checkpoint_names(cfg)
    return match_tensors(weight_map(cfg, model), found, _unused, aliases)


def load_mimi(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              config: MimiConfig | None = None, num_codebooks: int | None = None) -> Mimi:
    """Load the codec from a Mimi safetensors file (or a directory holding ``MIMI_NAME``).

    ``config`` defaults to the published Mimi (:data:`MIMI`).  fp32 is the default, as Kyutai
    runs Mimi.  Raises :class:`CheckpointError` naming the file and tensor for a missing file,
    a damaged header, or a missing / unexpected / misshapen tensor.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MIMI_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file (the Mimi codec weights)")
    cfg = config or MIMI
    if num_codebooks is not None:
        cfg = replace(cfg, num_codebooks=num_codebooks)
    header = read_safetensors_header(path)
    with torch.device("meta"):
        model = Mimi(cfg)
    report = check_mimi_tensors(cfg, header_tensors(header), model)
    if not report.ok:
        raise CheckpointError(report.error(str(path)))
    model = model.to(dtype).to_empty(device=torch.device(device))
    _, aliases = _checkpoint_names(cfg)
    copy_tensors({name: path for name in report.loaded}, report.loaded, weight_map(cfg, model),
                 model.state_dict(keep_vars=True), aliases)
    with torch.no_grad():
        model.quantizer.refresh()
        model.reset()
    model.requires_grad_(False)
    return model.eval()


def checkpoint_state_dict(model: Mimi) -> dict[str, torch.Tensor]:
    """Our weights under the published checkpoint names (what a demo checkpoint writes), including
    the ``_initialized`` flags the reference's strict loader expects."""
    ours = model.state_dict()
    names, _ = _checkpoint_names(model.cfg)
    out = {ckpt: ours[param] for ckpt, param in names.items()}
    for ckpt in list(out):
        if ckpt.endswith("._codebook.cluster_usage"):
            out[ckpt.replace("cluster_usage", "_initialized")] = torch.ones(1, dtype=out[ckpt].dtype)
    return out


@torch.no_grad()
def init_random_(model: Mimi, generator: torch.Generator | None = None) -> Mimi:
    """Seeded random weights for a demo or a benchmark: conv/linear weights ~ N(0, 1/fan_in)
    (the decoder's last conv 10x smaller), biases 0, norms 1, layer scales as configured,
    codewords ~ N(0, 1) with unit usage.
    Unit-variance layers keep the signal finite through the stack: the decoded noise is bounded.
    ``generator`` must be on the model's device."""
    for module in model.modules():
        if isinstance(module, nn.Conv1d):
            fan_in = module.in_channels // module.groups * module.kernel_size[0]
        elif isinstance(module, nn.ConvTranspose1d):  # each output sample sums kernel/stride input steps
            fan_in = module.in_channels // module.groups * module.kernel_size[0] // module.stride[0]
        elif isinstance(module, nn.Linear):
            fan_in = module.in_features
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
            continue
        elif isinstance(module, Codebook):
            module.embedding_sum.normal_(0.0, 1.0, generator=generator)
            module.cluster_usage.fill_(1.0)
            continue
        else:
            continue
        module.weight.normal_(0.0, fan_in ** -0.5, generator=generator)
        if module.bias is not None:
            module.bias.zero_()
    # the last conv 10x quieter: the decoded noise plays at about -20 dBFS instead of clipping
    model.decoder.output_conv.conv.weight.mul_(0.1)
    for layer in model.modules():
        if isinstance(layer, TransformerLayer) and layer.attn_scale is not None:
            layer.attn_scale.fill_(model.cfg.transformer.layer_scale)
            layer.ffn_scale.fill_(model.cfg.transformer.layer_scale)
    model.quantizer.refresh()
    model.reset()
    return model


__all__ = ["DEMO", "MIMI", "MIMI_NAME", "Mimi", "MimiConfig", "QuantizerConfig", "SEANetConfig", "UNUSED_SUFFIXES",
           "check_mimi_tensors", "checkpoint_state_dict", "init_random_", "load_mimi", "weight_map"]
