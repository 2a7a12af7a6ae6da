"""Moshi as a full-duplex executor: one 80 ms frame in, one 80 ms frame and a text token out.

Per frame (the reference server's loop)::

    user pcm [1920] @24 kHz --Mimi encode--> user codes [8] --LMGen.step--> text token + Moshi's codes [8]
                                                                         --Mimi decode--> Moshi's pcm [1920]

While the LM's delays fill (the first ``max_delay`` frames) it returns nothing
and the executor plays silence, as the reference does.  The Mimi encoder and
decoder streams and the LM's state all restart in ``reset_conversation``
(the sampling generator is re-seeded, so a conversation replays exactly).

The LM's whole frame is one step of a :class:`~omnidesk.models.runner.DecodeRunner`
(``compile``: the user's auto / off / on; one CUDA graph per frame on a GPU,
torch.compile on the CPU where that pays, compiled in the background on a
scratch state while the conversation starts eagerly).  Mimi's encode and
decode are captured as CUDA graphs too (their state lives in the codec's
buffers, at fixed addresses) but never compiled: that would need a second,
scratch codec to compile on, so on the CPU they run eagerly.

:func:`load_moshi` reads a checkpoint directory in the published layout
(``model.safetensors``, ``tokenizer-e351c8d8-checkpoint125.safetensors``,
``tokenizer_spm_32k_3.model``; ``config.json`` optional).  config.json is
the reference's (LM kwargs + ``moshi_name`` / ``mimi_name`` /
``tokenizer_name`` / ``lm_gen_config`` ...); a codec other than the published
Mimi is given as the reference does it: ``mimi_config_name`` names a JSON file
in the checkpoint holding the codec's config (``get_mimi``'s layout; the demo
writes ``mimi_config.json``).  OmniDesk's own marks live in ``model_id``, the
reference's free-form provenance dict, so the reference can load the same
folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...engine.duplex import DuplexExecutor, DuplexStep
from ...engine.executor import stage
from ..checkpoint import DEFAULT_DEVICE_DTYPE, CheckpointError, ConfigError, ModelTooLargeError
from ..memory import cpu_ram_problem
from ..runner import DecodeRunner, resolve_mode
from .config import MoshiConfig, MoshiSampling
from .lm import MoshiLM, MoshiLMGen, load_moshi_lm, weight_map
from .mimi import Mimi, load_mimi
from .mimi import weight_map as mimi_weight_map
from .mimi_config import MIMI, MimiConfig
from .tokenizer import MoshiTokenizer

# Below this many LM parameters the per-frame step is a few hundred tiny ops: on the CPU each
# costs its fixed overhead, and with several intra-op threads every op also pays a fork/join
# barrier (which a busy machine stalls).  One thread measured several times faster for the
# demo sizes; a real 7B on the CPU uses all cores but one for its large matmuls.
SMALL_MODEL_PARAMS = 50_000_000


class MoshiExecutor(DuplexExecutor):
    """Mimi + Moshi's LM behind the :class:`DuplexExecutor` interface (batch 1, one conversation).

    ``step`` takes float32 pcm of ``frame_samples_in`` samples at ``sample_rate_in`` (24 kHz, 1920
    samples for Mimi) and returns the same amount of Moshi's voice plus the frame's text token (None
    while the LM's delays fill).  State: Mimi's two streams and the LM's caches; ``reset_conversation``
    restarts all of them in place (nothing compiled or captured is redone).

    ``compile`` is the user's setting for the LM's frame step (auto / off / on, or a runner mode named
    outright: see :func:`~omnidesk.models.runner.resolve_mode`); ``runner`` runs the step, and its
    background compile starts here."""

    duplex = True

    def __init__(self, lm: MoshiLM, mimi: Mimi, tokenizer: MoshiTokenizer, sampling: MoshiSampling | None = None,
                 seed: int = 0, context: int | None = None, path: Path | None = None,
                 raw_config: dict | None = None, compile: str | None = None):
        cfg = self.cfg = lm.cfg
        if mimi.cfg.quantizer.bins != cfg.card:
            raise ConfigError(f"Mimi's codebooks have {mimi.cfg.quantizer.bins} entries but the LM's card is "
                              f"{cfg.card}")
        if mimi.cfg.quantizer.n_q < max(cfg.dep_q, cfg.user_codebooks):
            raise ConfigError(f"Mimi has {mimi.cfg.quantizer.n_q} codebooks; the LM needs "
                              f"{max(cfg.dep_q, cfg.user_codebooks)}")
        self.lm, self.mimi, self.tokenizer = lm, mimi, tokenizer
        self.mimi.num_codebooks = cfg.user_codebooks  # the user's stream: what the LM reads
        self.device = lm.text_head.weight.device
        self.runner = DecodeRunner(resolve_mode(compile, self.device, "moshi"), self.device)
        self.gen = MoshiLMGen(lm, sampling, seed=seed, context=context, runner=self.runner)
        self.path = path
        self.raw_config = raw_config or {}
        self.dtype = lm.text_head.weight.dtype
        self.sample_rate_in = self.sample_rate_out = mimi.sample_rate
        self.frame_samples_in = self.frame_samples_out = mimi.frame_size
        self._silence = np.zeros(self.frame_samples_out, np.float32)
        self.threads = torch.get_num_threads()
        # Mimi's streams keep their state in the codec's own buffers, at fixed addresses: a CUDA graph
        # per frame captures them as they are.  Compiling them would need a scratch codec to compile on
        # (a second Mimi), so outside graphs mode they run eagerly, as plain calls.
        if self.runner.mode == "graphs":
            self._encode = self.runner.step("mimi_encode", mimi.encode_frame)
            self._decode = self.runner.step("mimi_decode", mimi.decode_frame)
        else:
            self._encode, self._decode = mimi.encode_frame, mimi.decode_frame
        self.reset_conversation()
        self.runner.warm_up()  # compile mode: in the background, on a scratch state (MoshiLMGen.scratch)

    @property
    def sampling(self) -> MoshiSampling:
        return self.gen.sampling

    @property
    def seed(self) -> int:
        return self.gen.seed

    def reset_conversation(self) -> None:
        """A new conversation: Mimi's encoder/decoder streams and the LM restart; the sampler is re-seeded."""
        self.mimi.reset()
        self.gen.reset()

    def encode_audio(self, frame: np.ndarray) -> torch.Tensor:
        """The next frame of the user's voice (float32 pcm [frame_samples_in]) -> its codes
        [user_codebooks] on the device (Mimi's encoder stream advances)."""
        pcm = torch.from_numpy(np.ascontiguousarray(frame, dtype=np.float32).reshape(-1))
        if pcm.shape != (self.frame_samples_in,):  # checked here: a bad frame never reaches a captured graph
            raise ValueError(f"a frame is {self.frame_samples_in} samples, got {pcm.shape[0]}")
        return self._encode(pcm.to(self.device))

    def decode_audio(self, codes: torch.Tensor) -> torch.Tensor:
        """Moshi's codes of the next frame [dep_q] -> its voice (float32 pcm [frame_samples_out], on the
        device; Mimi's decoder stream advances)."""
        return self._decode(codes)

    def step(self, frame: np.ndarray) -> DuplexStep:
        with stage("encoder"):
            codes = self.encode_audio(frame)
        # the depformer (Moshi's audio codes) runs inside the LM step: no separate "talker" stage
        with stage("thinker"):
            out = self.gen.step(codes)
            text = None if out is None else out.text_id  # the one host sync per frame
        if out is None:
            return DuplexStep(self._silence.copy(), None)
        with stage("vocoder"):
            audio = self.decode_audio(out.audio).cpu().numpy()
        return DuplexStep(audio, text)

    def decode(self, text_ids: list[int]) -> str:
        return self.tokenizer.decode(text_ids)

    def is_silent_text(self, token: int | None) -> bool:
        return token is None or self.cfg.is_text_padding(int(token))

    def model_info(self) -> dict:
        """What a timeline records about the model."""
        from .demo import is_moshi_demo

        return {"path": str(self.path) if self.path else None, "family": "moshi",
                "demo": is_moshi_demo(self.raw_config), "dtype": str(self.dtype).replace("torch.", ""),
                "mimi_dtype": str(self.mimi._like().dtype).replace("torch.", ""),
                "greedy": self.sampling.greedy, "seed": self.seed, "context_frames": self.gen.cache.capacity,
                "threads": self.threads, "decode": self.runner.describe()}


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class MoshiMemoryEstimate:
    """Bytes needed to run Moshi on one device."""

    dtype: torch.dtype
    context: int  # frames of temporal attention (ring KV cache capacity)
    lm_params: int
    mimi_params: int
    weights: int  # the LM in dtype
    kv_cache: int  # the temporal transformer's ring cache (the depformer's is negligible)
    mimi: int  # the codec in fp32 (as the reference runs it)
    margin: int  # one frame's activations, allocator slack, CUDA workspaces
    total: int


MARGIN_BYTES = 256 * 2**20


def estimate_memory(cfg: MoshiConfig, dtype: torch.dtype = torch.bfloat16, context: int | None = None,
                    mimi_cfg: MimiConfig | None = None) -> MoshiMemoryEstimate:
    """Weights + ring KV cache (``context`` frames, default the config's) + Mimi in fp32 + a margin.
    The published 7B in bf16 at 3000 frames: about 17.6 GB."""
    import math

    context = context or cfg.context
    lm_params = sum(math.prod(t.shape) for t in weight_map(cfg).values())
    mimi_params = sum(math.prod(s.shape) for s in mimi_weight_map(mimi_cfg or MIMI).values())
    b = dtype.itemsize
    weights = lm_params * b
    kv = 2 * cfg.num_layers * context * cfg.dim * b
    mimi = mimi_params * 4
    total = weights + kv + mimi + MARGIN_BYTES
    return MoshiMemoryEstimate(dtype, context, lm_params, mimi_params, weights, kv, mimi, MARGIN_BYTES, total)


def check_fits(estimate: MoshiMemoryEstimate, free_bytes: int) -> str | None:
    """None if it fits in ``free_bytes``; else what is missing and what to try."""
    if estimate.total <= free_bytes:
        return None
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    fixed = estimate.weights + estimate.mimi + estimate.margin
    per_frame = estimate.kv_cache / estimate.context
    fit = int((free_bytes - fixed) // per_frame) if free_bytes > fixed else 0
    tips = []
    if fit >= 125:  # 10 s of conversation: less is no conversation
        tips.append(f"a shorter context: at most {fit} frames ({fit * 0.08:.0f} s) fit")
    tips.append("a quantized build of Moshi (not supported by OmniDesk yet), or a GPU with more memory")
    return (f"Moshi ({estimate.lm_params / 1e9:.1f}B parameters) in {str(estimate.dtype).removeprefix('torch.')} "
            f"with a context of {estimate.context} frames needs about {gib(estimate.total)} but only "
            f"{gib(free_bytes)} is free. Try " + "; or ".join(tips) + ".")


# ---------------------------------------------------------------- loading

def read_config(root: Path) -> tuple[MoshiConfig, dict]:
    """The checkpoint's MoshiConfig and its raw config.json ({} for the published repos, which have none)."""
    path = root / "config.json"
    if not path.is_file():
        return MoshiConfig.for_checkpoint(root), {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    return MoshiConfig.from_dict(raw, str(path)), raw


def read_mimi_config(root: Path, cfg: MoshiConfig) -> MimiConfig:
    """The codec's config: the file ``mimi_config_name`` names, else the published Mimi."""
    if not cfg.mimi_config_name:
        return MIMI
    path = root / cfg.mimi_config_name
    if not path.is_file():
        raise CheckpointError(f"{root}: missing file {cfg.mimi_config_name} (the Mimi config that config.json's "
                              f"mimi_config_name names)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    return MimiConfig.from_dict(d, str(path), num_codebooks=max(cfg.dep_q, cfg.user_codebooks))


def load_moshi(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               greedy: bool = False, seed: int = 0, context: int | None = None,
               compile: str | None = None) -> MoshiExecutor:
    """Load a Moshi checkpoint directory as a ready :class:`MoshiExecutor`.

    ``dtype`` of the LM defaults to fp32 on the CPU and bf16 on CUDA (Mimi always runs in fp32);
    sampling comes from the config (text 0.7 / top-k 25, audio 0.8 / top-k 250 by default), or the
    argmax with ``greedy``; ``seed`` seeds it; ``context`` (frames) shortens the attention span;
    ``compile`` (auto / off / on) says how the frame step runs (:class:`MoshiExecutor`).
    Raises :class:`CheckpointError` naming a missing or damaged file, :class:`ModelTooLargeError`
    before loading anything on a GPU that cannot hold it."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    device = torch.device(device)
    dtype = dtype or DEFAULT_DEVICE_DTYPE.get(device.type, torch.float32)
    cfg, raw = read_config(root)
    mimi_cfg = read_mimi_config(root, cfg)
    if context is not None and not 0 < context:
        raise ConfigError(f"context must be a positive number of frames, got {context}")
    # every file is checked before the large ones are read
    for name, what in ((cfg.moshi_name, "the language model"), (cfg.mimi_name, "the Mimi codec"),
                       (cfg.tokenizer_name, "the text tokenizer")):
        if not (root / name).is_file():
            raise CheckpointError(f"{root}: missing file {name} ({what})")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = check_fits(estimate_memory(cfg, dtype, context, mimi_cfg), free)
        if problem:
            raise ModelTooLargeError(f"{root}: {problem}")
    elif device.type == "cpu":  # the 7B is ~30 GiB in fp32: say so before reading a weight
        problem = cpu_ram_problem(estimate_memory(cfg, dtype, context, mimi_cfg).total, dtype)
        if problem:
            raise ModelTooLargeError(f"{root}: {problem}")
    tokenizer = MoshiTokenizer.from_file(root / cfg.tokenizer_name)
    lm = load_moshi_lm(root / cfg.moshi_name, cfg, device=device, dtype=dtype)
    mimi = load_mimi(root / cfg.mimi_name, device=device, dtype=torch.float32, config=mimi_cfg)
    if device.type == "cpu":
        # torch's thread count is process-wide: set it for this model whatever a model loaded before
        # set (the window switches models).  Tiny ops run fastest on one thread (SMALL_MODEL_PARAMS);
        # large ones leave a core to the event loop and the audio thread, as the Qwen executor does.
        small = sum(p.numel() for p in lm.parameters()) < SMALL_MODEL_PARAMS
        torch.set_num_threads(1 if small else max(1, (os.cpu_count() or 2) - 1))
    sampling = cfg.sampling if not greedy else MoshiSampling(
        greedy=True, text_temperature=cfg.sampling.text_temperature, text_top_k=cfg.sampling.text_top_k,
        audio_temperature=cfg.sampling.audio_temperature, audio_top_k=cfg.sampling.audio_top_k)
    return MoshiExecutor(lm, mimi, tokenizer, sampling, seed=seed, context=context, path=root, raw_config=raw,
                         compile=compile)


__all__ = ["MoshiExecutor", "MoshiMemoryEstimate", "check_fits", "estimate_memory", "load_moshi", "read_config",
           "read_mimi_config"]
