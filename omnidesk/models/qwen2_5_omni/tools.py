"""The unstreamed one-turn tools of Qwen2.5-Omni, as the registry hands them to the CLI
(``omnidesk reply``, ``omnidesk bench``, the terminal check turn)."""

from .bench import run as run_bench
from .offline import generate_reply, speak
from .reply import talker_defaults

__all__ = ["generate_reply", "run_bench", "speak", "talker_defaults"]
