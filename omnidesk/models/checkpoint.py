"""Checkpoint files, family-neutral: where they are, whether they are intact, and how tensors land.

* Errors every loader raises (:class:`CheckpointError`, :class:`ConfigError`,
  :class:`ModelTooLargeError`): the message names the file, tensor or field.
* The local Hugging Face cache (:func:`hf_hub_cache`, :func:`cached_snapshot`)
  and :func:`resolve_checkpoint` (a folder or a cached repo id; the registry adds the demo names).
  Nothing here touches the network.
* safetensors: :func:`read_safetensors_header` validates a header against the
  file size; :func:`weight_files` follows a sharded index.
* Name mapping: a family's ``weight_map`` says where each checkpoint tensor
  goes (:class:`Target`); :func:`match_tensors` compares that with a header
  (:class:`MappingReport`), :func:`materialize` gives meta modules storage and
  :func:`copy_tensors` fills them, so every checkpoint tensor has one
  destination and every parameter one source.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says which file / tensor and why."""


class ModelTooLargeError(CheckpointError):
    """The model would not fit the device's free memory (checked before loading anything)."""


DEFAULT_DEVICE_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8"}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


# ---------------------------------------------------------------- where checkpoints are

def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def repo_cache_dir(repo_id: str) -> Path:
    return hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))


def repo_id_of(repo_dir: Path) -> str:
    """``models--Org--Name`` -> ``Org/Name``."""
    return repo_dir.name.removeprefix("models--").replace("--", "/", 1)


def _has_checkpoint_files(snap: Path) -> bool:
    # Moshi's repos have no config.json: weights are what every family's snapshot holds
    return (snap / "config.json").is_file() or any(snap.glob("*.safetensors"))


def cached_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot a cached repo's ``refs/main`` points at, else its newest one with checkpoint files."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if snap.is_dir() and _has_checkpoint_files(snap):
            return snap
    if snapshots.is_dir():
        candidates = [p for p in snapshots.iterdir() if p.is_dir() and _has_checkpoint_files(p)]
        if candidates:
            return max(candidates, key=lambda p: p.stat().st_mtime)
    return None


def cached_repos() -> list[tuple[str, Path]]:
    """(repo id, snapshot) of every repo in the local HF cache that holds checkpoint files."""
    hub = hf_hub_cache()
    out = []
    if hub.is_dir():
        for repo_dir in sorted(hub.glob("models--*")):
            snap = cached_snapshot(repo_dir)
            if snap is not None:
                out.append((repo_id_of(repo_dir), snap))
    return out


def known_repos() -> list[str]:
    """The published repo ids OmniDesk knows (:mod:`omnidesk.models.catalog`), in the order users see them."""
    from .catalog import PUBLISHED

    return [repo for repos in PUBLISHED.values() for repo in repos]


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A directory as given, or a repo id ("Qwen/Qwen2.5-Omni-3B") found in the local HF cache.

    Demo names ("demo", "moshi-demo") belong to the family registry: its
    :func:`omnidesk.models.families.resolve_checkpoint` takes them too."""
    text = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        snap = cached_snapshot(repo_cache_dir(text))
        if snap is not None:
            return snap
        known = known_repos()
        where = f"'{text}' is not in the local Hugging Face cache ({hf_hub_cache()})"
        if text in known:
            raise CheckpointError(f"{where}; download it first with: omnidesk models download {text}")
        # never suggest downloading a name we do not know: "Qwen/Qwen2.5-Omni-14B" does not exist
        raise CheckpointError(f"{where}, and it is not a model repo OmniDesk knows. Known repos: "
                              f"{', '.join(known)} (get one with: omnidesk models download <repo>)")
    raise CheckpointError(f"checkpoint directory not found: {path}")


def require_file(root: Path, name: str) -> Path:
    p = root / name
    if not p.is_file():
        raise CheckpointError(f"{root}: missing file {name}")
    return p


def read_json(path: Path) -> dict:
    """A JSON object file; ConfigError naming the file otherwise."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(d).__name__}")
    return d


# ---------------------------------------------------------------- safetensors

def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets}, validating the header against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short, {size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n} > file size {size})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        try:
            end = int(info["data_offsets"][1])
            info["shape"] = [int(d) for d in info["shape"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header (bad entry for tensor '{name}')") from None
        if end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {end} of the data section "
                                  f"but the file holds only {data_size} bytes")
    return header


def weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded via the index, or a single file)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map_ = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = {name: root / shard for name, shard in weight_map_.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{root}: missing shard {shard.name} (listed in model.safetensors.index.json)")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return {name: single for name in read_safetensors_header(single)}
    raise CheckpointError(f"{root}: missing file model.safetensors (or model.safetensors.index.json with shards)")


def safetensors_summary(files: Iterable[Path]) -> tuple[int, str | None, list[str]]:
    """(parameter count, the first tensor's dtype name, problems) over safetensors files."""
    import math

    params, first, problems = 0, None, []
    for f in files:
        try:
            for info in read_safetensors_header(f).values():
                params += math.prod(info["shape"])
                first = first or info.get("dtype")
        except (CheckpointError, OSError) as e:
            problems.append(str(e))
    return params, (SAFETENSORS_DTYPES.get(first, first) if first else None), problems


# ---------------------------------------------------------------- verification

@dataclass
class VerifyReport:
    """What `models verify` found: never raised, every problem a message naming the file or tensor."""

    path: Path
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not problems: e.g. a skipped load test
    family: str | None = None  # the registry's name for it, once known
    demo: bool = False
    # Intact but not something OmniDesk can run (e.g. a text-only -Thinking model): why, in a few
    # words.  Not a problem with the download, so the picker and `models list` say this instead of
    # "damaged".
    unsupported: str | None = None
    # progress(done_bytes, total_bytes) while the tensor values are read (check_values): a front end's
    # progress line for a check that reads every byte of tens of GB
    progress: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def usable(self) -> bool:
        return not self.problems and self.unsupported is None


def check_weight_files(root: Path, report: VerifyReport) -> tuple[dict[str, tuple[int, ...]], dict[Path, dict], bool]:
    """`models verify` of ``model.safetensors`` (or an index and its shards): the tensor shapes over all
    files, the headers read, and whether every file was intact; problems go to ``report``."""
    headers: dict[Path, dict] = {}
    intact = True
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            if not isinstance(wmap, dict):
                raise KeyError("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            report.problems.append(f"{index}: unreadable index ({e})")
            return {}, headers, False
        files = {name: root / shard for name, shard in wmap.items()}
        report.checked.append(f"model.safetensors.index.json ({len(set(files.values()))} shards)")
    elif (root / "model.safetensors").is_file():
        files = None
    else:
        report.problems.append(f"{root}: missing file model.safetensors (or model.safetensors.index.json with shards)")
        return {}, headers, False
    for f in sorted(set(files.values())) if files is not None else [root / "model.safetensors"]:
        if not f.is_file():
            report.problems.append(f"{root}: missing shard {f.name} (listed in model.safetensors.index.json)")
            intact = False
            continue
        try:
            headers[f] = read_safetensors_header(f)
            report.checked.append(f"{f.name}: header ({len(headers[f])} tensors)")
        except (CheckpointError, OSError) as e:
            report.problems.append(str(e))
            intact = False
    if files is None:
        files = {name: root / "model.safetensors" for name in headers.get(root / "model.safetensors", {})}
    shapes = {}
    for name, f in files.items():
        if f in headers:
            if name not in headers[f]:
                report.problems.append(f"{f}: tensor '{name}' is listed in the index but not in the file")
                intact = False
            else:
                shapes[name] = tuple(headers[f][name]["shape"])
    return shapes, headers, intact


# Float dtypes as unsigned words and the exponent mask: a value is NaN or Inf exactly when all its exponent
# bits are set, so the check needs no conversion and runs over the file's bytes as they are.
_EXPONENT = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000),
             "F64": (np.uint64, 0x7FF0000000000000)}
CHECK_CHUNK_BYTES = 64 * 2**20


def nonfinite_values(path: Path, header: dict | None = None,
                     progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Tensor name -> how many NaN/Inf values it holds, for every float tensor of one safetensors file
    with any (empty: all finite).  Streams the file in chunks through a memory map, so it costs about
    one read of the file; ``progress(bytes)`` is called with the bytes of each chunk checked."""
    header = header if header is not None else read_safetensors_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    base = 8 + n
    bad: dict[str, int] = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        lo, hi = (int(x) for x in info["data_offsets"])
        spec = _EXPONENT.get(info.get("dtype"))
        if spec is None or hi <= lo:
            if progress is not None:
                progress(hi - lo)
            continue
        word, mask = spec
        size = np.dtype(word).itemsize
        count = 0
        for start in range(lo, hi, CHECK_CHUNK_BYTES):
            end = min(hi, start + CHECK_CHUNK_BYTES)
            words = np.frombuffer(data[base + start:base + end], dtype=word, count=(end - start) // size)
            count += int(np.count_nonzero((words & word(mask)) == word(mask)))
            if progress is not None:
                progress(end - start)
        if count:
            bad[name] = count
    del data
    return bad


def check_values(files: Iterable[Path], report: VerifyReport, headers: dict[Path, dict] | None = None) -> bool:
    """`models verify`'s value check: every float tensor of ``files`` is read once and must hold no NaN or
    Inf (a damaged download or disk).  Problems name the file and tensors; True when all are finite."""
    files = sorted(set(files))
    headers = headers or {}
    total = sum(f.stat().st_size for f in files)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if report.progress is not None:
            report.progress(done, total)

    ok, tensors = True, 0
    for f in files:
        try:
            header = headers.get(f) or read_safetensors_header(f)
            bad = nonfinite_values(f, header, advance)
        except (CheckpointError, OSError, ValueError) as e:
            report.problems.append(f"{f}: cannot read its values ({e})")
            ok = False
            continue
        tensors += len(header)
        if bad:
            ok = False
            names = sorted(bad, key=bad.get, reverse=True)
            listed = ", ".join(f"'{name}' ({bad[name]} values)" for name in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            report.problems.append(f"{f}: {len(names)} tensor(s) hold NaN or Inf values: {listed}{more}; the file "
                                   f"is damaged: download it again")
    if ok:
        report.checked.append(f"values: no NaN or Inf in {tensors} tensors ({total / 1e9:.2f} GB read)")
    return ok


# ---------------------------------------------------------------- name mapping

@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: our parameter (or buffer), the checkpoint tensor's
    shape, and which part of ours it fills: rows of a fused weight (q/k/v, gate/up), one
    entry of a stacked per-codebook / per-step / per-expert parameter, or rows of one entry."""

    param: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = field(default=None, kw_only=True)
    index: int | None = field(default=None, kw_only=True)

    def destination(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        dest = tensors[self.param]
        if self.index is not None:  # the entry first (one expert, one step), then rows within it
            dest = dest[self.index]
        if self.rows is not None:
            dest = dest[self.rows[0]:self.rows[1]]
        return dest


@dataclass
class MappingReport:
    """How a set of checkpoint tensors lines up with our modules."""

    loaded: list[str] = field(default_factory=list)
    unused: dict[str, list[str]] = field(default_factory=dict)  # reason -> names
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # name, expected, found
    bad_dtype: list[tuple[str, str]] = field(default_factory=list)
    tied_lm_head: bool = False

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.bad_dtype)

    def error(self, where: str) -> str:
        def listing(names, n=12):
            more = f" (and {len(names) - n} more)" if len(names) > n else ""
            return ", ".join(names[:n]) + more
        parts = [f"tensor '{name}' has shape {list(found)}, expected {list(expected)}"
                 for name, expected, found in self.mismatched[:12]]
        if len(self.mismatched) > 12:
            parts.append(f"(and {len(self.mismatched) - 12} more shape mismatches)")
        parts += [f"tensor '{n}' has dtype {dt}, expected a float type" for n, dt in self.bad_dtype[:12]]
        if self.missing:
            parts.append(f"missing weights: {listing(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected weights: {listing(self.unexpected)}")
        return f"{where}: " + "; ".join(parts)


def module_targets(module: nn.Module, ckpt_prefix: str, ours_prefix: str) -> dict[str, Target]:
    """Every state_dict tensor of ``module`` (ours: ``ours_prefix`` + its name) under the checkpoint name
    ``ckpt_prefix`` + the same name: a part whose names mirror the checkpoint's (an audio tower, a vocoder)."""
    return {ckpt_prefix + name: Target(ours_prefix + name, tuple(t.shape)) for name, t in module.state_dict().items()}


def unused_by_prefix(prefixes: dict[str, str]) -> Callable[[str], str | None]:
    """:func:`match_tensors`' ``unused`` from {checkpoint name prefix: why those tensors are not loaded}."""
    return lambda name: next((reason for p, reason in prefixes.items() if name.startswith(p)), None)


def match_tensors(wmap: dict[str, Target], found: dict[str, tuple[tuple[int, ...], str | None]],
                  unused: Callable[[str], str | None] = lambda name: None,
                  aliases: dict[str, str] | None = None) -> MappingReport:
    """Compare checkpoint tensors (name -> (shape, safetensors dtype or None)) with ``wmap``.

    ``unused(name)`` gives the reason a recognised tensor is not loaded (None: unexpected);
    ``aliases`` maps another spelling of a name onto the canonical one in ``wmap`` (both
    present = two sources for one weight: the alias is unexpected)."""
    aliases = aliases or {}
    report = MappingReport()
    for name, (shape, dtype) in found.items():
        canonical = aliases.get(name, name)
        target = wmap.get(canonical)
        if target is None:
            reason = unused(name)
            if reason is None:
                report.unexpected.append(name)
            else:
                report.unused.setdefault(reason, []).append(name)
        elif canonical != name and canonical in found:
            report.unexpected.append(name)
        elif tuple(shape) != target.shape:
            report.mismatched.append((name, target.shape, tuple(shape)))
        elif dtype is not None and dtype not in FLOAT_DTYPES:
            report.bad_dtype.append((name, dtype))
        else:
            report.loaded.append(name)
    by_alias = {c: a for a, c in aliases.items()}
    report.missing = [n for n in wmap if n not in found and by_alias.get(n) not in found]
    return report


def config_field(d: dict, key: str, where: str, default: Any = ...):
    """``d[key]`` of a config.json section named ``where``; ConfigError naming both when it is
    missing or null and there is no ``default``."""
    if key in d and d[key] is not None:
        return d[key]
    if default is ...:
        raise ConfigError(f"{where}: missing field '{key}'")
    return default


def expect_model_type(d: dict, where: str, model_type: str, title: str, name_architectures: bool = False) -> None:
    """ConfigError unless config.json ``d`` (named ``where``) is a ``title`` checkpoint: its ``model_type`` is
    ``model_type``.  ``name_architectures``: the message also names the architectures the file declares."""
    found = d.get("model_type")
    if found != model_type:
        what = found or "no model_type"
        arch = d.get("architectures") if name_architectures else None
        raise ConfigError(f"{where}: not a {title} checkpoint (model_type is '{what}'"
                          f"{', architectures ' + str(arch) if arch else ''}; expected '{model_type}')")


def int_fields(d: dict, where: str, keys: dict[str, str]) -> dict[str, int]:
    """{our field: int(``d[key]``)} for each our field -> config.json key of a section named ``where``,
    read in that order (ConfigError naming the first missing key)."""
    return {name: int(config_field(d, key, where)) for name, key in keys.items()}


def load_config_file(path: str | Path, from_dict: Callable[[dict, str], Any]) -> Any:
    """Read a config.json and parse it with ``from_dict(d, where)``; every error names the file."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return from_dict(d, str(path))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


def checkpoint_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers of ``files`` (name -> file, as
    :func:`weight_files` gives it); each header is read once.  CheckpointError when an index names
    a tensor its file lacks."""
    headers: dict[Path, dict] = {f: read_safetensors_header(f) for f in sorted(set(files.values()))}
    shapes = {}
    for name, f in files.items():
        if name not in headers[f]:
            raise CheckpointError(f"{f}: tensor '{name}' is listed in the index but not in the file")
        shapes[name] = tuple(headers[f][name]["shape"])
    return shapes


def header_tensors(header: dict[str, dict]) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """A safetensors header as :func:`match_tensors` takes it."""
    return {name: (tuple(info["shape"]), info.get("dtype")) for name, info in header.items()}


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give meta parameters real (uninitialised) storage in ``dtype`` and move buffers.

    Buffers built on the CPU are moved as they are; modules whose buffers were built on the
    meta device recompute them in ``reset_buffers()``."""
    device = torch.device(device)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                                        requires_grad=False)
    to_reset = []
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None:
                if b.is_meta:
                    to_reset.append(module)
                module._buffers[name] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)
    for module in dict.fromkeys(to_reset):  # after all parameters exist: reset may read their dtype
        module.reset_buffers()


def copy_tensors(files: dict[str, Path], names: Iterable[str], wmap: dict[str, Target],
                 tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> None:
    """Fill our tensors (name -> parameter/buffer) from checkpoint tensors ``names`` (each read
    from ``files[name]``; cast to the destination's dtype).  CheckpointError names the file
    when safetensors cannot read it."""
    from safetensors import safe_open

    aliases = aliases or {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for f, file_names in by_file.items():
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for name in file_names:
                        dest = wmap[aliases.get(name, name)].destination(tensors)
                        dest.copy_(st.get_tensor(name).view(dest.shape))
                        if dest.is_floating_point() and not bool(torch.isfinite(dest).all()):
                            raise CheckpointError(f"{f}: tensor '{name}' holds NaN or Inf values: the file is "
                                                  f"damaged; download it again (omnidesk models verify checks "
                                                  f"every tensor)")
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CheckpointError(f"{f}: cannot read tensors ({type(e).__name__}: {e})") from None


__all__ = ["CheckpointError", "ConfigError", "DEFAULT_DEVICE_DTYPE", "FLOAT_DTYPES", "MappingReport",
           "ModelTooLargeError", "SAFETENSORS_DTYPES", "Target", "VerifyReport", "cached_repos", "cached_snapshot",
           "check_values", "check_weight_files", "checkpoint_shapes", "config_field", "copy_tensors",
           "expect_model_type", "header_tensors", "int_fields", "load_config_file", "hf_hub_cache", "match_tensors",
           "materialize", "nonfinite_values", "read_json", "read_safetensors_header", "known_repos", "module_targets",
           "repo_cache_dir", "repo_id_of", "require_file", "resolve_checkpoint", "safetensors_summary",
           "unused_by_prefix", "weight_files"]
