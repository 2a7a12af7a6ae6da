"""A Qwen2.5-Omni-3B checkpoint at the real shapes, with random weights, in the published file layout.

What :func:`ensure_checkpoint` writes (and what a user's download of Qwen/Qwen2.5-Omni-3B holds):

* ``config.json``: tests/data/qwen2_5_omni_3b/config.json, byte for byte;
* ``model-0000N-of-0000M.safetensors`` (shards of at most 5 GB, as the hub's) and
  ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map`` sorted by name);
  every tensor the published checkpoint has: the names and shapes transformers writes for this
  config (tests/data/dump_real_shapes.py, built on the meta device), vision tower included,
  plus the hub-only DiT buffer ``rotary_embed.inv_freq``; thinker and talker in BF16, token2wav
  in F32, as on the hub (tests/data/README.md);
* ``generation_config.json``, ``preprocessor_config.json`` (Whisper features + the Qwen2-VL image
  keys) and the tokenizer files with ``chat_template.json``: a byte-level BPE filling ids
  0..151642 (omnidesk.models.qwen2_5_omni.tokenizer.write_tokenizer_files) whose added tokens are then put at
  the real ids 151643..151664, in the real order, so config.json's ids (audio 151646-151648,
  vision 151652-151656) name the right tokens;
* ``spk_dict.pt`` in the published layout: Chelsie (bos 151872) and Ethan (bos 151870), each
  ``cond`` [1, 192] and ``ref_mel`` [1, 400, 80].

Weights come from omnidesk.models.random_init (the init of the demo and of
bench/random_stack.py).  The writer streams: each shard's safetensors header
is written first (all shapes are known), then each tensor is generated,
written and freed, so memory holds one tensor at a time (at most the 622 MB
embedding), never a shard or a second copy.

The checkpoint is cached between runs under
``$XDG_CACHE_HOME/omnidesk/test-checkpoints/qwen2_5_omni_3b-<recipe hash>/`` (default
``~/.cache``; ``OMNIDESK_TEST_CHECKPOINTS`` overrides the folder).  The hash covers the
recipe: this file, the init, the tokenizer writer, the voice writer
(tests/tiny.py ``speakers``), the config, the transformers version (the tensor
list) and the settings below; a changed recipe writes a new folder and
deletes the old ones.  It
is written to a temporary folder and renamed when complete, under a lock, so an
interrupted or concurrent run never leaves or reads half a checkpoint.

Not verified against the hub (no network): the exact text of the published
generation_config.json, preprocessor_config.json and chat template, and the
names of the added tokens the runtime never uses (box_end, quad_*, tool_call,
fim_*, repo_name, file_sep; the Qwen2.5 family's).  The chat template is
OmniDesk's rendition, which renders the same text as the published one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = HERE / "data" / "qwen2_5_omni_3b" / "config.json"
NAME = "qwen2_5_omni_3b"

RECIPE_VERSION = 1
SEED = 3
MAX_SHARD_BYTES = 5_000_000_000  # transformers' "5GB" shards, as the hub files were written
# The hub stores this computed buffer; transformers (and OmniDesk) recompute it.
HUB_ONLY = {"token2wav.code2wav_dit_model.rotary_embed.inv_freq": (32,)}
VOICES = {"Chelsie": 151872, "Ethan": 151870}  # the published bos ids (thinker vocabulary)

# Qwen2.5-Omni's added tokens from 151643 on, in id order.  The ones the model uses are checked
# against config.json below; the others keep the Qwen2.5 family's names.
ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>",
                "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
FIRST_ADDED_ID = 151643
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>"}

GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
                     "transformers_version": "4.50.0.dev0"}
PREPROCESSOR_CONFIG = {
    "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor", "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136, "n_fft": 400, "n_samples": 4800000,
    "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0, "patch_size": 14,
    "processor_class": "Qwen2_5OmniProcessor", "return_attention_mask": True, "sampling_rate": 16000,
    "temporal_patch_size": 2,
}
ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
DISK_BYTES = 14e9  # the files take 12 GB


class NoRoom(RuntimeError):
    """Not enough disk for the checkpoint."""


# ---------------------------------------------------------------- where, and the recipe

def cache_root() -> Path:
    if os.environ.get("OMNIDESK_TEST_CHECKPOINTS"):
        return Path(os.environ["OMNIDESK_TEST_CHECKPOINTS"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omnidesk" / "test-checkpoints"


def recipe() -> dict:
    """Everything the written files depend on; its hash names the cache folder."""
    import inspect
    from importlib.metadata import version

    import tiny

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    voices = inspect.getsource(tiny.speakers) + repr((tiny.VOICE_REF_FRAMES, VOICES))
    return {
        "version": RECIPE_VERSION, "seed": SEED, "max_shard_bytes": MAX_SHARD_BYTES,
        "config": sha(CONFIG.read_bytes()), "transformers": version("transformers"),  # source of the tensor list
        "writer": sha(Path(__file__).read_bytes()),
        "init": sha((ROOT / "omnidesk" / "models" / "random_init.py").read_bytes()),
        "tokenizer": sha((ROOT / "omnidesk" / "models" / "qwen2_5_omni" / "tokenizer.py").read_bytes()),
        "voices": sha(voices.encode()),
    }


def checkpoint_dir() -> Path:
    digest = hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"{NAME}-{digest}"


# ---------------------------------------------------------------- tensors

def published_tensors() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of the published checkpoint, in save order."""
    sys.path.insert(0, str(HERE / "data"))
    from dump_real_shapes import build_meta, saved_names

    _, model = build_meta(CONFIG.parent)
    out = {}
    for name, t in saved_names(model, model.state_dict()).items():
        out[name] = (tuple(t.shape), torch.float32 if name.startswith("token2wav.") else torch.bfloat16)
    for name, shape in HUB_ONLY.items():
        out[name] = (shape, torch.float32)
    return out


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def shard_plan(tensors: dict) -> list[list[str]]:
    """Consecutive tensors into shards of at most MAX_SHARD_BYTES (transformers' greedy split)."""
    shards, size = [[]], 0
    for name, (shape, dtype) in tensors.items():
        n = _nbytes(shape, dtype)
        if shards[-1] and size + n > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _tensor(name: str, shape, dtype, generator: torch.Generator, dit_theta: float) -> torch.Tensor:
    from omnidesk.models.random_init import random_tensor

    if name in HUB_ONLY:  # the real values of the recomputed rotary buffer
        dim = 2 * shape[0]
        return 1.0 / dit_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return random_tensor(name, shape, dtype, generator)


def write_shard(path: Path, names: list[str], tensors: dict, make) -> None:
    """A safetensors file written as it is generated: header first, then one tensor at a time."""
    header, offset = {}, 0
    for name in names:
        shape, dtype = tensors[name]
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            shape, dtype = tensors[name]
            t = make(name, shape, dtype)
            assert t.dtype == dtype and tuple(t.shape) == tuple(shape) and t.is_contiguous(), name
            f.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
            del t
        if f.tell() != 8 + len(raw) + offset:
            raise RuntimeError(f"{path}: wrote {f.tell()} bytes, expected {8 + len(raw) + offset}")


# ---------------------------------------------------------------- side files

def write_tokenizer(root: Path) -> dict[str, int]:
    """A BPE over ids 0..151642 with the added tokens at their real ids; returns token -> id."""
    from omnidesk.models.qwen2_5_omni.tokenizer import SPECIAL_TOKENS, write_tokenizer_files

    vocab = json.loads(CONFIG.read_text())["thinker_config"]["text_config"]["vocab_size"]
    write_tokenizer_files(root, vocab_size=vocab, first_special_id=FIRST_ADDED_ID)
    ids = {tok: FIRST_ADDED_ID + i for i, tok in enumerate(ADDED_TOKENS)}

    def entry(tok: str) -> dict:
        return {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": tok not in NOT_SPECIAL}

    tok_file = root / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    data["added_tokens"] = [{"id": ids[t], **entry(t)} for t in ADDED_TOKENS]
    tok_file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

    extra = [t for t in ADDED_TOKENS[:14] if t not in ("<|endoftext|>", "<|im_end|>")]
    cfg_file = root / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["added_tokens_decoder"] = {str(ids[t]): entry(t) for t in ADDED_TOKENS}
    cfg["additional_special_tokens"] = extra
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    smap_file = root / "special_tokens_map.json"
    smap = json.loads(smap_file.read_text())
    smap["additional_special_tokens"] = extra
    smap_file.write_text(json.dumps(smap, indent=2, ensure_ascii=False) + "\n")
    (root / "added_tokens.json").write_text(json.dumps(dict(sorted(ids.items())), indent=2, ensure_ascii=False)
                                            + "\n")

    # the ids the model uses must name the tokens the runtime looks up by string
    th = json.loads(CONFIG.read_text())["thinker_config"]
    t = SPECIAL_TOKENS
    for key, name in (("audio_token_index", "audio"), ("audio_start_token_id", "audio_bos"),
                      ("audio_end_token_id", "audio_eos"), ("image_token_index", "image_pad"),
                      ("video_token_index", "video_pad"), ("vision_start_token_id", "vision_bos"),
                      ("vision_end_token_id", "vision_eos")):
        if ids[t[name]] != th[key]:
            raise AssertionError(f"config.json {key} {th[key]} != id {ids[t[name]]} of {t[name]}")
    return ids


def write_side_files(root: Path) -> None:
    import tiny

    shutil.copyfile(CONFIG, root / "config.json")
    (root / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (root / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    write_tokenizer(root)
    torch.save(tiny.speakers(VOICES, seed=SEED), root / "spk_dict.pt")


# ---------------------------------------------------------------- the checkpoint

def write_checkpoint(root: Path, log=print) -> None:
    """Write the whole checkpoint into the (empty) folder ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tensors = published_tensors()
    raw = json.loads(CONFIG.read_text())
    theta = float(raw["token2wav_config"]["dit_config"].get("rope_theta", 10000.0))
    plan = shard_plan(tensors)
    g = torch.Generator().manual_seed(SEED)
    weight_map = {}
    for i, names in enumerate(plan, 1):
        shard = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        write_shard(root / shard, names, tensors, lambda n, s, d: _tensor(n, s, d, g, theta))
        weight_map.update(dict.fromkeys(names, shard))
        log(f"  {shard}: {len(names)} tensors, {(root / shard).stat().st_size / 1e9:.2f} GB "
            f"({time.perf_counter() - t0:.0f} s)")
    total = sum(_nbytes(*tensors[n]) for n in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_side_files(root)


@contextlib.contextmanager
def _lock(path: Path):
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_checkpoint(log=print) -> tuple[Path, float]:
    """The cached checkpoint folder, written first if needed; returns (folder, seconds spent writing)."""
    final = checkpoint_dir()
    if (final / "model.safetensors.index.json").is_file():
        return final, 0.0
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _lock(parent / f".{NAME}.lock"):
        if (final / "model.safetensors.index.json").is_file():  # another run finished it meanwhile
            return final, 0.0
        for old in parent.glob(f"{NAME}-*"):  # other recipes: 12 GB each
            shutil.rmtree(old, ignore_errors=True)
        for tmp in parent.glob(f".{NAME}-*.tmp*"):  # left by an interrupted run
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(parent).free
        if free < DISK_BYTES:
            raise NoRoom(f"{parent}: the real-size test checkpoint needs about {DISK_BYTES / 1e9:.0f} GB of disk, "
                         f"only {free / 1e9:.1f} GB is free")
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=parent))
        try:
            log(f"writing the real-size test checkpoint to {final}")
            write_checkpoint(tmp, log)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final, time.perf_counter() - t0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    path, seconds = ensure_checkpoint()
    print(f"{path} ({'written in %.0f s' % seconds if seconds else 'cached'})")
