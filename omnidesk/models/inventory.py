"""What Qwen2.5-Omni checkpoints are on this machine, are they intact, and do they fit.

* :func:`find_checkpoints` lists checkpoints in the local Hugging Face hub cache
  and in given folders (nothing touches the network).
* :func:`verify` checks one checkpoint file by file and tensor by tensor and,
  optionally, loads it on the CPU and runs one thinker decode step.  It never
  raises for a bad checkpoint: every problem is collected as a message naming
  the file or tensor.
* :func:`estimate_memory` / :func:`check_fits` estimate the memory a model
  needs for a given dtype and context and say what to do when it does not fit.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import MODEL_TYPE, ConfigError, OmniConfig
from .demo import is_demo
from .loading import (CheckpointError, OmniModel, check_mapping, hf_hub_cache, load_stack, load_voices,
                      read_safetensors_header, resolve_checkpoint)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8"}

# Working margin of the memory estimate: 10% on top of weights + caches (allocator rounding and
# fragmentation, temporary copies while loading), plus a fixed 512 MiB for activations (prefill
# chunk activations, logits over the ~152k vocabulary, vocoder activations, CUDA context).
MARGIN_FRACTION = 0.10
ACTIVATION_BYTES = 512 * 2**20
MIN_CONTEXT = 1024  # shorter contexts are not worth suggesting: a spoken turn alone takes hundreds of tokens
SMALLER_REPO = "Qwen/Qwen2.5-Omni-3B"


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory estimate needs from a config."""

    llm_params: int  # thinker (with audio encoder, without vision) + talker, stored in the run dtype
    vocoder_params: int  # token2wav, always fp32
    thinker_kv: tuple[int, int, int]  # layers, kv heads, head dim
    talker_kv: tuple[int, int, int] | None
    talker_row_width: int  # width of the thinker hidden rows the talker reads (0 without talker)
    max_positions: int  # the thinker's max_position_embeddings: no longer context is suggested


# Qwen/Qwen2.5-Omni-3B (tests/data/qwen2_5_omni_3b/config.json, checked in tests/test_inventory.py):
# used to tell a user whose 7B does not fit what the 3B would need.
SMALLER_SHAPE = ModelShape(llm_params=4_034_780_160 + 384_604_928, vocoder_params=449_051_264,
                           thinker_kv=(36, 2, 128), talker_kv=(24, 2, 64), talker_row_width=2048,
                           max_positions=32768)


@functools.lru_cache(maxsize=8)
def _shape_from_json(raw_json: str) -> ModelShape:
    cfg = OmniConfig.from_dict(json.loads(raw_json))
    with torch.device("meta"):
        model = OmniModel(cfg)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    t = cfg.thinker.text
    thinker = count(model.thinker)
    if cfg.thinker.tie_word_embeddings:  # lm_head shares the embedding's storage once loaded
        thinker -= model.thinker.lm_head.weight.numel()
    talker = None if cfg.talker is None else cfg.talker.decoder
    return ModelShape(
        llm_params=thinker + count(model.talker),
        vocoder_params=count(model.vocoder),
        thinker_kv=(t.num_layers, t.num_kv_heads, t.head_dim),
        talker_kv=None if talker is None else (talker.num_layers, talker.num_kv_heads, talker.head_dim),
        talker_row_width=0 if talker is None else talker.embedding_size,
        max_positions=t.max_position_embeddings,
    )


def model_shape(config: OmniConfig) -> ModelShape:
    """Parameter counts (from our modules built on the meta device) and cache dimensions."""
    return _shape_from_json(json.dumps(config.raw, sort_keys=True))


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(d, torch.dtype):
            raise ValueError(f"unknown dtype '{dtype}'")
        return d
    return dtype


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to run a model; ``total`` includes the working margin."""

    shape: ModelShape = field(repr=False)
    dtype: torch.dtype
    context_tokens: int
    talker_codes: int
    weights: int  # thinker (+ audio encoder) and talker, in dtype
    vocoder: int  # fp32
    thinker_kv: int
    talker_kv: int
    talker_rows: int  # thinker hidden rows kept for the talker
    margin: int
    total: int

    @property
    def params(self) -> int:
        return self.shape.llm_params + self.shape.vocoder_params


def _estimate(shape: ModelShape, dtype: torch.dtype, context_tokens: int, talker_codes: int) -> MemoryEstimate:
    b = dtype.itemsize
    weights = shape.llm_params * b
    vocoder = shape.vocoder_params * 4
    layers, heads, dim = shape.thinker_kv
    thinker_kv = layers * 2 * heads * dim * context_tokens * b
    talker_kv = talker_rows = 0
    if shape.talker_kv is not None:
        layers, heads, dim = shape.talker_kv
        talker_kv = layers * 2 * heads * dim * (context_tokens + talker_codes) * b
        talker_rows = context_tokens * shape.talker_row_width * b
    base = weights + vocoder + thinker_kv + talker_kv + talker_rows
    margin = math.ceil(base * MARGIN_FRACTION) + ACTIVATION_BYTES
    return MemoryEstimate(shape, dtype, context_tokens, talker_codes, weights, vocoder, thinker_kv, talker_kv,
                          talker_rows, margin, base + margin)


def estimate_memory(config: OmniConfig, dtype, context_tokens: int, talker_codes: int = 4096) -> MemoryEstimate:
    """Memory (bytes) to run ``config`` in ``dtype`` (torch.dtype or name) with ``context_tokens`` of context.

    weights: thinker + audio encoder + talker in dtype (vision weights are not loaded), vocoder in
    fp32; KV caches: thinker ``layers*2*kv_heads*head_dim*context*bytes``, talker the same for
    ``context + talker_codes``; talker rows ``context*hidden*bytes``; margin: see MARGIN_FRACTION.
    """
    return _estimate(model_shape(config), _dtype(dtype), context_tokens, talker_codes)


def max_context(shape: ModelShape, dtype, free_bytes: int, talker_codes: int = 4096) -> int:
    """The largest context (a multiple of 256 tokens, at most the model's maximum) that fits in
    ``free_bytes``; 0 if none does."""
    dtype = _dtype(dtype)
    at0 = _estimate(shape, dtype, 0, talker_codes)
    per_token = _estimate(shape, dtype, 1, talker_codes).total - at0.total + 1  # +1: ceil rounding
    if at0.total > free_bytes:
        return 0
    n = min((free_bytes - at0.total) // per_token, shape.max_positions) // 256 * 256
    while n > 0 and _estimate(shape, dtype, n, talker_codes).total > free_bytes:
        n -= 256
    return n


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(estimate: MemoryEstimate, free_bytes: int) -> str | None:
    """None if ``estimate`` fits in ``free_bytes``; else what is missing and what to do instead."""
    if estimate.total <= free_bytes:
        return None
    dtype_name = str(estimate.dtype).removeprefix("torch.")
    ctx, codes = estimate.context_tokens, estimate.talker_codes
    msg = (f"the model ({estimate.params / 1e9:.1f}B parameters) in {dtype_name} with a context of {ctx} tokens "
           f"needs about {_gib(estimate.total)} but only {_gib(free_bytes)} is free.")
    tips = []
    fit = max_context(estimate.shape, estimate.dtype, free_bytes, codes)
    if fit >= MIN_CONTEXT:
        tips.append(f"a shorter context: at most {fit} tokens fit")
    if estimate.shape.llm_params > SMALLER_SHAPE.llm_params * 1.2:
        small = _estimate(SMALLER_SHAPE, estimate.dtype, ctx, codes)
        small_fit = max_context(SMALLER_SHAPE, estimate.dtype, free_bytes, codes)
        if small.total <= free_bytes:
            tips.append(f"the smaller model {SMALLER_REPO} (about {_gib(small.total)} with {ctx} tokens of context; "
                        f"up to {small_fit} tokens fit)")
        elif small_fit >= MIN_CONTEXT:
            tips.append(f"the smaller model {SMALLER_REPO} with a context of at most {small_fit} tokens")
    tips.append("running on the CPU (slower)")
    return msg[0].upper() + msg[1:] + " Try " + "; or ".join(tips) + "."


# ---------------------------------------------------------------- verify

@dataclass
class VerifyReport:
    path: Path
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not problems: e.g. a skipped load test

    @property
    def ok(self) -> bool:
        return not self.problems


def available_ram() -> int:
    """Bytes of physical memory available now (os.sysconf; 0 where unknown)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _weight_headers(root: Path, report: VerifyReport) -> tuple[dict[str, tuple[int, ...]], dict[Path, dict], bool]:
    """Tensor shapes over all weight files, the headers read, and whether every file was intact."""
    headers: dict[Path, dict] = {}
    intact = True
    index = root / INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            if not isinstance(wmap, dict):
                raise KeyError("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            report.problems.append(f"{index}: unreadable index ({e})")
            return {}, headers, False
        files = {name: root / shard for name, shard in wmap.items()}
        report.checked.append(f"{INDEX} ({len(set(files.values()))} shards)")
    elif (root / SINGLE).is_file():
        files = None
    else:
        report.problems.append(f"{root}: missing file {SINGLE} (or {INDEX} with shards)")
        return {}, headers, False
    for f in sorted(set(files.values())) if files is not None else [root / SINGLE]:
        if not f.is_file():
            report.problems.append(f"{root}: missing shard {f.name} (listed in {INDEX})")
            intact = False
            continue
        try:
            headers[f] = read_safetensors_header(f)
            report.checked.append(f"{f.name}: header ({len(headers[f])} tensors)")
        except (CheckpointError, OSError) as e:
            report.problems.append(str(e))
            intact = False
    if files is None:
        files = {name: root / SINGLE for name in headers.get(root / SINGLE, {})}
    shapes = {}
    for name, f in files.items():
        if f in headers:
            if name not in headers[f]:
                report.problems.append(f"{f}: tensor '{name}' is listed in the index but not in the file")
                intact = False
            else:
                shapes[name] = tuple(headers[f][name]["shape"])
    return shapes, headers, intact


def _load_test(root: Path, cfg: OmniConfig, report: VerifyReport) -> None:
    need = estimate_memory(cfg, torch.float32, context_tokens=16, talker_codes=0).total
    free = available_ram()
    if need > free:
        report.notes.append(f"load test skipped: the checkpoint needs about {_gib(need)} in float32 "
                            f"but only {_gib(free)} of RAM is available")
        return
    try:
        stack = load_stack(root, device="cpu", dtype=torch.float32)
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


def verify(path: str | os.PathLike, load_test: bool = True) -> VerifyReport:
    """Check a checkpoint (directory or cached repo id) without raising; see :class:`VerifyReport`."""
    try:
        root = resolve_checkpoint(path)
    except CheckpointError as e:
        report = VerifyReport(Path(path))
        report.problems.append(str(e))
        return report
    report = VerifyReport(root)
    cfg = None
    if not (root / "config.json").is_file():
        report.problems.append(f"{root}: missing file config.json")
    else:
        try:
            cfg = OmniConfig.from_file(root / "config.json")
            report.checked.append("config.json")
        except (ConfigError, OSError) as e:
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
    shapes, _, intact = _weight_headers(root, report)
    if cfg is not None and intact:
        if cfg.talker is None:
            shapes = {n: s for n, s in shapes.items() if not n.startswith(("talker.", "token2wav."))}
        mapping = check_mapping(cfg, shapes)
        if mapping.ok:
            report.checked.append(f"tensor names and shapes ({len(mapping.loaded)} tensors)")
        else:
            report.problems.append(mapping.error(str(root)))
    if load_test and not report.problems:
        _load_test(root, cfg, report)
    return report


# ---------------------------------------------------------------- inventory

@dataclass
class CheckpointInfo:
    name: str  # "Org/Name" for the HF cache, else the folder path
    path: Path
    size_bytes: int
    dtype: str | None
    voices: list[str]
    params: int
    loads: bool
    problems: list[str]
    demo: bool = False


def _read_config(root: Path) -> dict | None:
    try:
        d = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("model_type") == MODEL_TYPE else None


def _info(name: str, root: Path, raw: dict) -> CheckpointInfo:
    report = verify(root, load_test=False)
    problems = list(report.problems)
    files = sorted(set(root.glob("*.safetensors")))
    size = sum(f.stat().st_size for f in files if f.is_file())  # stat follows the hub's symlinks
    params, first_dtype = 0, None
    for f in files:
        try:
            header = read_safetensors_header(f)
        except (CheckpointError, OSError):
            continue
        for info in header.values():
            params += math.prod(info["shape"])
            first_dtype = first_dtype or info.get("dtype")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or (raw.get("thinker_config") or {}).get("torch_dtype")
    if dtype is None and first_dtype is not None:
        dtype = SAFETENSORS_DTYPES.get(first_dtype, first_dtype)
    voices: list[str] = []
    if (root / "spk_dict.pt").is_file():
        try:
            voices = list(load_voices(root / "spk_dict.pt", OmniConfig.from_dict(raw)))
        except (CheckpointError, ConfigError):
            pass  # verify() already reported it
    return CheckpointInfo(name=name, path=root, size_bytes=size, dtype=dtype, voices=voices, params=params,
                          loads=report.ok, problems=problems, demo=is_demo(raw))


def _snapshot(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    if snapshots.is_dir():
        candidates = [p for p in snapshots.iterdir() if (p / "config.json").is_file()]
        if candidates:
            return max(candidates, key=lambda p: p.stat().st_mtime)
    return None


def find_checkpoints(extra_dirs=(), include_demo: bool = False) -> list[CheckpointInfo]:
    """Qwen2.5-Omni checkpoints in the HF hub cache, then in ``extra_dirs`` (a checkpoint folder,
    or a folder whose direct subfolders are checkpoints), then (``include_demo``) the demo model
    under the name "demo" if it has been made.  Metadata checks only (no load test)."""
    found: list[tuple[str, Path, dict]] = []
    hub = hf_hub_cache()
    if hub.is_dir():
        for repo_dir in sorted(hub.glob("models--*")):
            snap = _snapshot(repo_dir)
            raw = _read_config(snap) if snap is not None else None
            if raw is not None:
                found.append((repo_dir.name.removeprefix("models--").replace("--", "/", 1), snap, raw))
    for d in extra_dirs:
        d = Path(d).expanduser()
        raw = _read_config(d)
        if raw is not None:
            found.append((str(d), d, raw))
        elif d.is_dir():
            for sub in sorted(p for p in d.iterdir() if p.is_dir()):
                raw = _read_config(sub)
                if raw is not None:
                    found.append((str(sub), sub, raw))
    if include_demo:
        from .demo import default_demo_dir

        demo = default_demo_dir()
        raw = _read_config(demo)
        if raw is not None:
            found.append(("demo", demo, raw))
    seen, out = set(), []
    for name, root, raw in found:
        key = root.resolve()
        if key not in seen:
            seen.add(key)
            out.append(_info(name, root, raw))
    if include_demo:  # the Moshi demo (another family: metadata only, its files and tensor count)
        from .moshi.demo import NAME, default_demo_dir as moshi_demo_dir

        root = moshi_demo_dir()
        if (root / "config.json").is_file() and root.resolve() not in seen:
            from .moshi.executor import read_config

            problems, params, first_dtype, size = [], 0, None, 0
            try:
                cfg, _ = read_config(root)
                names = (cfg.moshi_name, cfg.mimi_name, cfg.tokenizer_name)
            except ConfigError as e:
                problems.append(str(e))
                names = ()
            for name in names:
                f = root / name
                if not f.is_file():
                    problems.append(f"missing file {name}")
                    continue
                size += f.stat().st_size
                if name.endswith(".safetensors"):
                    try:
                        for info in read_safetensors_header(f).values():
                            params += math.prod(info["shape"])
                            first_dtype = first_dtype or info.get("dtype")
                    except (CheckpointError, OSError) as e:
                        problems.append(str(e))
            out.append(CheckpointInfo(name=NAME, path=root, size_bytes=size,
                                      dtype=SAFETENSORS_DTYPES.get(first_dtype, first_dtype), voices=[],
                                      params=params, loads=not problems, problems=problems, demo=True))
    return out


__all__ = ["CheckpointInfo", "MemoryEstimate", "ModelShape", "VerifyReport", "available_ram", "check_fits",
           "estimate_memory", "find_checkpoints", "max_context", "model_shape", "verify"]
