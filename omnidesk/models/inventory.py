"""What checkpoints are on this machine, of every family the registry knows, and are they intact.

:func:`find_checkpoints` lists checkpoints in the local Hugging Face hub cache
and in given folders (nothing touches the network), each checked by its
family's verifier without a load test.  ``models verify`` is
:func:`omnidesk.models.families.verify`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import VerifyReport, cached_repos, safetensors_summary
from .families import FAMILIES, Family, detect_family, verify


@dataclass
class CheckpointInfo:
    name: str  # "Org/Name" for the HF cache, the demo's name, else the folder path
    path: Path
    size_bytes: int
    dtype: str | None
    voices: list[str]
    params: int
    loads: bool  # intact and supported: the picker and the best-model choice may offer it
    problems: list[str]
    demo: bool = False
    family: str = ""  # the registry's name
    title: str = ""  # what a person calls the family
    duplex: bool = False
    quantization: str | None = None  # e.g. "GPTQ int4 (group 128)"; None: float weights
    memory: dict[str, int] = field(default_factory=dict)  # GPU bytes per way to run it ("bfloat16", "int8", "int4")
    unsupported: str | None = None  # intact, but OmniDesk cannot run it: why (VerifyReport.unsupported)

    @property
    def state(self) -> str:
        """A few words for lists: "ok", "damaged" or "not supported: <why>"."""
        if self.problems:
            return "damaged"
        return f"not supported: {self.unsupported}" if self.unsupported else "ok"


def describe(name: str, root: Path, family: Family) -> CheckpointInfo:
    """Metadata and a verification without load test (cheap: headers, not tensors)."""
    report: VerifyReport = verify(root, load_test=False)
    files = sorted(root.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files if f.is_file())  # stat follows the hub's symlinks
    params, first_dtype, _ = safetensors_summary(files)  # unreadable files: verify reported them
    return CheckpointInfo(name=name, path=root, size_bytes=size, dtype=family.declared_dtype(root) or first_dtype,
                          voices=family.voices(root), params=params, loads=report.usable,
                          problems=list(report.problems), demo=family.is_demo(root), family=family.name,
                          title=family.title, duplex=family.duplex, quantization=family.quantization(root),
                          memory=family.memory_modes(root), unsupported=report.unsupported)


def find_checkpoints(extra_dirs=(), include_demo: bool = False) -> list[CheckpointInfo]:
    """Checkpoints of every known family in the HF hub cache, then in ``extra_dirs`` (a checkpoint
    folder, or a folder whose direct subfolders are checkpoints), then (``include_demo``) each
    family's demo under its demo name if it has been made.  Metadata checks only (no load test)."""
    found: list[tuple[str, Path]] = list(cached_repos())
    for d in extra_dirs:
        d = Path(d).expanduser()
        if detect_family(d) is not None:
            found.append((str(d), d))
        elif d.is_dir():
            found += [(str(sub), sub) for sub in sorted(p for p in d.iterdir() if p.is_dir())]
    if include_demo:
        found += [(f.demo_name, f.demo_dir()) for f in FAMILIES]
    seen, out = set(), []
    for name, root in found:
        family = detect_family(root)
        if family is None or root.resolve() in seen:
            continue
        seen.add(root.resolve())
        out.append(describe(name, root, family))
    return out


__all__ = ["CheckpointInfo", "describe", "find_checkpoints"]
