"""The published checkpoints OmniDesk knows by name, family by family: plain data.

It sits below the loaders and the registry (:mod:`omnidesk.models.families`): a loader
asked for a repo id that is not in the local cache says whether the name is one
OmniDesk knows (and so may be downloaded) without importing the registry above it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recommendation:
    """What a published repo needs, said before a download."""

    download_gb: float  # approximate size of the files fetched
    # GPU memory (GB, 1e9 bytes) the loader's own estimate gives for the published config in bf16 at the
    # loader's default context (estimate_memory in omnidesk/models/<family>/memory.py, moshi/executor.py),
    # the figure the loader refuses by: `omnidesk doctor` and the README quote it; tests/test_doctor.py
    # recomputes it from the published configs in tests/data, so it cannot drift from the estimate
    gpu_memory_gb: float
    guidance: str  # what it needs to run (the size is download_gb: say it once, see summary())

    def summary(self) -> str:
        """One line for the user before a download: size, then what it needs."""
        return f"about {self.download_gb:g} GB to download; {self.guidance}"


_MOSHI_GUIDANCE = ("in bf16 it wants an NVIDIA GPU with 24 GB (about 18 GB at the full 3000-frame context); "
                   "full duplex: it listens and talks at once")

# family name (omnidesk.models.families.Family.name) -> the repos `models download` knows; in the registry's
# order of families, which is the order users see them listed in
PUBLISHED: dict[str, dict[str, Recommendation]] = {
    "qwen2_5_omni": {
        "Qwen/Qwen2.5-Omni-3B": Recommendation(11, 12.8, "in bf16 it fits a 16 GB NVIDIA GPU"),
        "Qwen/Qwen2.5-Omni-7B": Recommendation(22, 24.9, "in bf16 it wants an NVIDIA GPU with 24 GB or more"),
        # estimated from the 7B's tensors with the thinker's decoder linears at 4 bits (the rest as published;
        # vision included in the download): no public figure for the files
        "Qwen/Qwen2.5-Omni-7B-GPTQ-Int4": Recommendation(11, 14.4, "the 7B with a 4-bit thinker: fits a 16 GB "
                                                                 "NVIDIA GPU (about 13 GiB at an 8k context)"),
        "Qwen/Qwen2.5-Omni-7B-AWQ": Recommendation(11, 14.4, "the 7B with a 4-bit thinker (AWQ): fits a 16 GB "
                                                           "NVIDIA GPU (about 13 GiB at an 8k context)"),
    },
    "moshi": {
        "kyutai/moshiko-pytorch-bf16": Recommendation(16, 17.6, "Moshiko (male voice); " + _MOSHI_GUIDANCE),
        "kyutai/moshika-pytorch-bf16": Recommendation(16, 17.6, "Moshika (female voice); " + _MOSHI_GUIDANCE),
    },
    "qwen3_omni": {
        "Qwen/Qwen3-Omni-30B-A3B-Instruct": Recommendation(
            71, 78.5, "a 30B mixture-of-experts model: in bf16 it wants about 79 GB of GPU memory at an 8k context "
                      "(an 80 GB GPU, or two GPUs through a vLLM-Omni server)"),
    },
}

__all__ = ["PUBLISHED", "Recommendation"]
